"""The adaptation hooks without a shipped user, each on a tiny model that needs it: the model
built by the backend equals the float64 HF reference with the hook and differs without it.

* ``register_post_load_fixup``: a checkpoint whose config unties the head but stores only the
  embedding (saved tied); ``from_pretrained`` initialises ``lm_head`` at random, the fixup ties
  it back;
* ``register_model_patch``: an MLP class with a ``down_proj`` bias, patched into transformers
  before construction; without it the checkpoint's biases are dropped at load;
* ``register_precision_policy``: a per-module policy keeping the MoE router in fp32 under a
  bf16 run (its inputs and weights reach ``F.linear`` in fp32; without it, in bf16).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from dense_reference import dense_logits
from miles_fsdp.backend import FSDPBackend
from run_args import make_args
from tiny_models import arch_config, qwen3_config, save_tiny_model
from torch import nn

pytestmark = pytest.mark.slow  # transformers' model classes import in seconds


@pytest.fixture
def registry(monkeypatch):
    """An empty hook registry for the test (the shipped specs come back after it)."""
    from miles_fsdp.adaptations import registry, specs  # noqa: F401  (registered first)

    monkeypatch.setattr(registry, "_REGISTRY", {})
    return registry


def backend_logits(hf_dir, data, **flags):
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir), attn_implementation="eager", **flags))
    with torch.no_grad():
        logits = backend.model(input_ids=data).logits.double()
    backend.close()
    return logits


DATA = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))
#: fp32 forward of a 2-layer model against float64: O(1) logits to within ~100 fp32 ulps
FP32_ATOL = 2e-5


def test_post_load_fixup_repairs_a_clobbered_tied_head(one_rank_group, tmp_path, registry):
    hf_dir = save_tiny_model(tmp_path / "tied", qwen3_config(tie_word_embeddings=True))
    want = dense_logits(hf_dir, DATA)
    config_file = hf_dir / "config.json"
    config_file.write_text(
        json.dumps(json.loads(config_file.read_text()) | {"tie_word_embeddings": False})
    )

    clobbered = backend_logits(hf_dir, DATA)
    assert (clobbered - want).abs().max() > 1e-2  # lm_head initialised at random

    @registry.register_post_load_fixup("qwen3")
    def tie_head(model, config):
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)

    torch.testing.assert_close(backend_logits(hf_dir, DATA), want, rtol=0, atol=FP32_ATOL)


class BiasedMLP(nn.Module):
    """Qwen3's gated MLP with a bias on ``down_proj`` (a class transformers does not have)."""

    def __init__(self, config):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=True)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def test_model_patch_replaces_a_class_before_construction(
    one_rank_group, tmp_path, registry, monkeypatch
):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    with monkeypatch.context() as patched:
        patched.setattr(modeling_qwen3, "Qwen3MLP", BiasedMLP)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(qwen3_config(), dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.down_proj.bias.normal_(0.0, 1.0)
        hf_dir = save_tiny_model(tmp_path / "biased", model.config)
        model.save_pretrained(str(hf_dir))
        want = dense_logits(model, DATA)

    dropped = backend_logits(hf_dir, DATA)  # stock Qwen3MLP: the biases are not loaded
    assert (dropped - want).abs().max() > 1e-2

    @registry.register_model_patch("qwen3")
    def biased_mlp(config):
        monkeypatch.setattr(modeling_qwen3, "Qwen3MLP", BiasedMLP)

    torch.testing.assert_close(backend_logits(hf_dir, DATA), want, rtol=0, atol=FP32_ATOL)


def router_inputs(model) -> list[tuple[torch.dtype, torch.dtype]]:
    """(input dtype, weight dtype) of every router call in the next forwards."""
    seen = []
    for layer in model.model.layers:
        gate = layer.mlp.gate

        def hook(module, args, seen=seen):
            seen.append((args[0].dtype, module.weight.dtype))

        gate.register_forward_pre_hook(hook)
    return seen


def test_precision_policy_keeps_the_router_in_fp32(one_rank_group, tmp_path, registry):
    hf_dir = save_tiny_model(tmp_path / "moe", arch_config("qwen3_moe"))
    bf16 = dict(fsdp_compute_dtype="bf16", moe_kernel="eager")

    def run():
        backend = FSDPBackend()
        backend.init(make_args(hf_checkpoint=str(hf_dir), attn_implementation="eager", **bf16))
        seen = router_inputs(backend.model)
        logits = backend.model(input_ids=DATA).logits
        logits.float().sum().backward()  # the fp32 unit inside the bf16 layer trains too
        grads = [p.grad is not None for p in backend.model.parameters()]
        backend.close()
        return seen, logits.dtype, all(grads)

    seen, dtype, grads = run()
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}

    @registry.register_precision_policy("qwen3_moe")
    def fp32_router(config, precision):
        return replace(precision, module_compute_dtypes={"Qwen3MoeTopKRouter": torch.float32})

    seen, dtype, grads = run()
    assert len(seen) == 2 and set(seen) == {(torch.float32, torch.float32)}
    assert dtype == torch.bfloat16 and grads  # the rest of the model still computes in bf16
