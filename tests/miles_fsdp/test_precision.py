"""Precision and attention flags of the FSDP backend: under bf16 / --fp16 /
--no-keep-fp32-master the sharded modules forward in the compute dtype, hold parameters and
AdamW state in the master dtype and reduce-scatter gradients in fp32 (observed on the modules
and the collectives); --fp16's loss scaling skips an overflowing step and halves the scale; --attn-implementation passes explicit values through and falls back to sdpa with one
notice line where flash_attn is unavailable."""

from __future__ import annotations

import math

import pytest
import torch
from miles_fsdp.loading import ATTN_IMPLEMENTATIONS, resolve_attn_implementation
from miles_fsdp.optimizer_step import optimizer_step
from miles_fsdp.precision import resolve_precision
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


class ReduceDtypes:
    """(gradient dtype, reduce dtype) of FSDP's gradient reductions: the unsharded gradients
    as they are copied into the reduce-scatter buffer (with one rank the buffer is the
    result; with more it is what the collective reduces)."""

    def __init__(self, monkeypatch):
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        self.seen: set[tuple[torch.dtype, torch.dtype]] = set()
        original = _fsdp_collectives.foreach_reduce_scatter_copy_in

        def spy(grads, reduce_input, *args, **kwargs):
            self.seen |= {(g.dtype, reduce_input.dtype) for g in grads}
            return original(grads, reduce_input, *args, **kwargs)

        monkeypatch.setattr(_fsdp_collectives, "foreach_reduce_scatter_copy_in", spy)


def linear_dtypes(model) -> set[tuple[torch.dtype, torch.dtype]]:
    """(input, weight) dtypes of every ``nn.Linear`` call in the next forwards."""
    seen = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(
                lambda m, args, seen=seen: seen.add((args[0].dtype, m.weight.dtype))
            )
    return seen


@pytest.mark.slow  # a backend per case
@pytest.mark.parametrize(
    "flags, compute, master",
    [
        ({}, torch.bfloat16, torch.float32),
        ({"fp16": True, "loss_scale": 1.0}, torch.float16, torch.float32),
        ({"keep_fp32_master": False}, torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtypes_on_the_sharded_modules(
    one_rank_group, tmp_path, monkeypatch, flags, compute, master
):
    """Forward in the compute dtype, parameters (shards) and AdamW state in the master dtype,
    gradients reduce-scattered in fp32 on the way to master-dtype gradient shards."""
    from miles_fsdp.backend import FSDPBackend
    from rank_programs import nll_contribution
    from run_args import make_args
    from tiny_models import save_tiny_model

    hf_dir = save_tiny_model(tmp_path / "m")
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir), fsdp_compute_dtype=None, **flags))
    model = backend.model
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(units) == model.config.num_hidden_layers + 3  # layers, embedding, head, root
    seen = linear_dtypes(model)
    reduced = ReduceDtypes(monkeypatch)
    data = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    optimizer_step(
        model,
        backend.optimizer,
        backend.scheduler,
        [data],
        nll_contribution(14),
        1,
        0.0,
        loss_scaler=backend.loss_scaler,
    )
    assert seen == {(compute, compute)}
    assert reduced.seen == {(compute, torch.float32)}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.dtype == master, name
        assert param.grad.dtype == master, name
        state = backend.optimizer.state[param]
        assert state["exp_avg"].dtype == master and state["exp_avg_sq"].dtype == master, name
    backend.close()


@pytest.mark.slow
def test_fp16_overflowing_step_is_skipped_and_the_scale_halved(one_rank_group, tmp_path):
    """--fp16 through the backend: at loss scale 2^40 the fp16 backward overflows; the step is
    skipped (no parameter moves) and the scale halves (hysteresis 1). At scale 1 the same
    rollout steps."""
    from miles_core.batch import RolloutBatch
    from miles_fsdp.backend import FSDPBackend
    from rank_programs import full_params
    from run_args import make_args
    from samples import make_samples
    from tiny_models import save_tiny_model

    hf_dir = save_tiny_model(tmp_path / "m")
    fp16 = dict(hf_checkpoint=str(hf_dir), fsdp_compute_dtype=None, fp16=True)
    batch = RolloutBatch(make_samples(seed=1))
    backend = FSDPBackend()
    backend.init(make_args(initial_loss_scale=2.0**40, hysteresis=1, **fp16))
    before = full_params(backend.model)
    metrics = backend.train(0, batch)
    assert metrics["loss_scale"] == 2.0**39 and backend.loss_scaler.scale == 2.0**39
    assert not math.isfinite(metrics["grad_norm"])
    after = full_params(backend.model)
    assert all(torch.equal(after[n], v) for n, v in before.items())
    backend.close()

    backend = FSDPBackend()
    backend.init(make_args(loss_scale=1.0, **fp16))
    metrics = backend.train(0, batch)
    assert math.isfinite(metrics["grad_norm"]) and metrics["loss_scale"] == 1.0
    after = full_params(backend.model)
    assert any(not torch.equal(after[n], v) for n, v in before.items())
    backend.close()


def test_unknown_compute_dtype_names_the_flag():
    with pytest.raises(ValueError, match="--fsdp-compute-dtype must be one of"):
        resolve_precision("bf16", "fp8")


@pytest.mark.parametrize("name", ATTN_IMPLEMENTATIONS)
def test_explicit_attention_passes_through(name, capsys):
    # varlen is built as the name it is registered under with transformers
    expected = "miles_varlen" if name == "varlen" else name
    assert resolve_attn_implementation(name) == expected
    assert capsys.readouterr().out == ""


def test_unknown_attention_names_the_flag():
    with pytest.raises(ValueError, match="--attn-implementation must be one of"):
        resolve_attn_implementation("flex")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback")
def test_unset_attention_on_cpu_is_sdpa_with_one_notice(capsys):
    assert resolve_attn_implementation(None) == "sdpa"
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["miles-fsdp: flash_attn unavailable, using --attn-implementation sdpa"]
