"""FSDP2 units of a HF causal LM: every decoder layer (``_no_split_modules``), the input
embedding and the output head when untied, then the root; a tied head stays in the root.
One gloo rank, real ``fully_shard``."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from miles_fsdp.mesh import MeshShape, build_mesh
from miles_fsdp.precision import resolve_precision
from miles_fsdp.wrapping import apply_fsdp, decoder_layers
from tiny_models import qwen3_config
from torch import nn
from torch.distributed.fsdp import FSDPModule

pytestmark = pytest.mark.slow  # transformers' model classes import in seconds


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield build_mesh(MeshShape(1, 1), "cpu")
    dist.destroy_process_group()


def units(tie: bool, mesh) -> tuple[nn.Module, set[str]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(qwen3_config(tie_word_embeddings=tie))
    apply_fsdp(model, mesh, resolve_precision("fp32"))
    return model, {name for name, m in model.named_modules() if isinstance(m, FSDPModule)}


def test_untied_layers_embedding_head_then_root(mesh):
    model, found = units(False, mesh)
    layers = {f"model.layers.{i}" for i in range(model.config.num_hidden_layers)}
    assert found == layers | {"model.embed_tokens", "lm_head", ""}


def test_tied_embedding_stays_in_the_root(mesh):
    model, found = units(True, mesh)
    layers = {f"model.layers.{i}" for i in range(model.config.num_hidden_layers)}
    assert found == layers | {""}
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_model_without_no_split_modules_is_refused():
    class Plain(nn.Module):
        _no_split_modules = None

    with pytest.raises(ValueError, match="Plain declares no _no_split_modules"):
        decoder_layers(Plain())
