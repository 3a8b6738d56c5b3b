"""``--compile-decoder-layers``: the flag on the command line, the guard that runs a layer eagerly
when its compilation fails, and compiled layers training as the eager ones do.

The numeric test (extended: inductor compiles C++ kernels on CPU) runs two backends on one rank,
the eager one and the compiled one, in lockstep: before each of two optimizer steps the compiled
backend gets the eager one's weights, so each step's log-probs, gradients, gradient norm and loss
differ only by how the kernels order and fuse the fp32 arithmetic (``REORDERED_REL_ERR`` in
tests/tolerances.py). The eager layers themselves are held to float64 references elsewhere
(test_train.py, test_varlen_attention.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from miles_core.args import ArgumentError
from run_args import make_args, parse
from samples import make_samples
from tiny_models import qwen3_config, save_tiny_model
from tolerances import FP32_EPS, REORDERED_REL_ERR, assert_within, grad_atol, norm_atol

#: 2 decoder layers at hidden 64: the layers share one compiled code object, so the compile time
#: does not grow with them
CONFIG = dict(hidden_size=64, intermediate_size=128, head_dim=16, num_hidden_layers=2)
#: the benchmark's attention and recompute, several micro-batches of varying length per step
FLAGS = dict(
    attn_implementation="varlen",
    gradient_checkpointing=True,
    advantage_estimator="grpo",
    use_dynamic_batch_size=True,
    max_tokens_per_gpu=40,
    clip_grad=0.0,
)


def test_the_flag_is_off_by_default_and_refused_with_true_on_policy():
    assert parse().compile_decoder_layers is False
    assert parse("--compile-decoder-layers").compile_decoder_layers is True
    with pytest.raises(ArgumentError, match="^--compile-decoder-layers with --true-on-policy"):
        parse("--compile-decoder-layers", "--true-on-policy", "--fsdp-compute-dtype", "fp32")


def test_both_backends_accept_the_flag():
    """One flag of miles-core's, honoured by both backends (Megatron's numeric test:
    tests/miles_megatron/test_compiled_layers_megatron.py)."""
    from miles_core import backends
    from miles_core.args import entry_point_groups, parse_args

    for name in backends.available():
        argv = ["--train-backend", name, "--compile-decoder-layers"]
        assert parse_args(argv, entry_point_groups("core", name)).compile_decoder_layers, name


def _backend(hf_dir, compiled: bool, **flags):
    from miles_fsdp.backend import FSDPBackend

    backend = FSDPBackend()
    backend.init(
        make_args(hf_checkpoint=str(hf_dir), compile_decoder_layers=compiled, **FLAGS | flags)
    )
    return backend


@pytest.mark.slow
def test_a_failing_compiler_leaves_the_layers_eager_with_one_warning_each(
    one_rank_group, tmp_path, monkeypatch, caplog
):
    """The compiler (inductor's entry point, which dynamo calls with each captured graph) is
    replaced by one that raises: every layer warns once, naming itself and the reason, and
    computes what the eager backend computes, bit for bit (both run the eager kernels)."""
    import torch._inductor.compile_fx as inductor
    from miles_core.batch import RolloutBatch
    from miles_core.compiled_layers import guarded_forwards

    def broken_compiler(*args, **kwargs):
        raise RuntimeError("this compiler is broken on purpose")

    monkeypatch.setattr(inductor, "compile_fx", broken_compiler)
    torch._dynamo.reset()  # no graph compiled by an earlier test answers for this one
    hf_dir = save_tiny_model(tmp_path / "m", qwen3_config(**CONFIG))
    batch = RolloutBatch(make_samples(8, group_size=4, masked=True))
    eager = _backend(hf_dir, compiled=False)
    want_lp = eager.eval_log_probs(batch)
    want = eager.train(0, batch)
    eager.close()

    backend = _backend(hf_dir, compiled=True)
    guarded = guarded_forwards(backend.model)
    assert len(guarded) == CONFIG["num_hidden_layers"]
    with caplog.at_level(logging.WARNING, logger="miles_core.compiled_layers"):
        got_lp = backend.eval_log_probs(batch)
        got = backend.train(0, batch)
    backend.close()
    warnings = [r.getMessage() for r in caplog.records if "--compile-decoder-layers" in r.message]
    assert warnings == [
        f"--compile-decoder-layers: decoder layer {i} (Qwen3DecoderLayer) runs eagerly, its "
        "compilation failed (RuntimeError: this compiler is broken on purpose)"
        for i in range(CONFIG["num_hidden_layers"])
    ], warnings
    assert all(g.failure is not None and g.compiled_calls == 0 for g in guarded)
    for a, b in zip(got_lp, want_lp, strict=True):
        assert torch.equal(a, b)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"], (got, want)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


@pytest.mark.extended
@pytest.mark.numeric
def test_compiled_layers_train_as_the_eager_ones(one_rank_group, tmp_path):
    from miles_core.batch import RolloutBatch
    from miles_core.compiled_layers import guarded_forwards
    from test_train import grpo_advantages  # the float64 GRPO formula
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    hf_dir = save_tiny_model(tmp_path / "m", qwen3_config(**CONFIG))
    eager, compiled = _backend(hf_dir, compiled=False), _backend(hf_dir, compiled=True)
    assert guarded_forwards(eager.model) == []
    guarded = guarded_forwards(compiled.model)
    assert len(guarded) == CONFIG["num_hidden_layers"]
    for step in range(2):
        with torch.no_grad():  # the same weights going into this step
            for (name, mine), (other, theirs) in zip(
                compiled.model.named_parameters(), eager.model.named_parameters(), strict=True
            ):
                assert name == other
                _local(mine).copy_(_local(theirs))
        samples = make_samples(8, group_size=4, masked=True, seed=step)
        batch = RolloutBatch(samples)
        # the no-grad forward (eval mode): each token's log-prob
        want_lp, got_lp = eager.eval_log_probs(batch), compiled.eval_log_probs(batch)
        scale = max(float(lp.abs().max()) for lp in want_lp)
        for i, (got, want) in enumerate(zip(got_lp, want_lp, strict=True)):
            atol = torch.full_like(want, REORDERED_REL_ERR * scale, dtype=torch.float64)
            assert_within(got, want, atol, f"step {step} sample {i} log-probs")
        # one optimizer step (forward with recompute, backward): gradients, their norm, the loss
        want, got = eager.train(step, batch), compiled.train(step, batch)
        want_grads = {n: _local(p.grad).detach() for n, p in eager.model.named_parameters()}
        for name, p in compiled.model.named_parameters():
            g, ref = _local(p.grad).detach(), want_grads[name]
            assert_within(g, ref, grad_atol(ref, REORDERED_REL_ERR), f"step {step} {name} grad")
        bound = norm_atol(list(want_grads.values()), REORDERED_REL_ERR)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= bound, (step, got, want, bound)
        # the loss: token terms -A_i * ratio weighted by at most 1 in all, the ratio moving by at
        # most each log-prob's difference (a training forward's, held to the same bound)
        loss_bound = float(grpo_advantages(samples).abs().max()) * REORDERED_REL_ERR * scale
        loss_bound += 8 * FP32_EPS * abs(want["loss"])
        assert abs(got["loss"] - want["loss"]) <= loss_bound, (step, got, want, loss_bound)
    # coverage: the layers ran compiled (no fallback) in every forward, inductor made graphs
    assert all(g.failure is None for g in guarded), [g.failure for g in guarded]
    calls = [g.compiled_calls for g in guarded]
    assert calls[0] > 0 and len(set(calls)) == 1, calls
    assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])
    assert counters["inductor"], "inductor compiled nothing"
    eager.close()
    compiled.close()


def test_checkpointing_early_stop_passes_through_the_guard(monkeypatch):
    """Non-reentrant checkpointing stops a recomputation by raising its own exception from a
    saved-tensor hook, here from inside the compiled call: the guard lets it through (no
    warning, the layer stays compiled) and the gradients are the eager layer's. Seen on a GPU
    node at the Qwen3-4B shape: the guard had taken it for a compiler failure and rerun the
    layer eagerly inside the stopped recomputation, which torch's checkpoint rejects. The
    compiler here is dynamo + AOT autograd without inductor (the same autograd Function and
    saved-tensor hooks, no C++ build)."""
    from miles_core import compiled_layers
    from torch.utils.checkpoint import checkpoint

    assert compiled_layers.PASS_THROUGH, "this torch has no early-stop exception to pass"
    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    torch._dynamo.reset()

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)

        def forward(self, x):
            return torch.tanh(self.proj(x)) * x  # saves several tensors for backward

    torch.manual_seed(0)
    eager, layer = Layer(), Layer()
    layer.load_state_dict(eager.state_dict())
    guarded = compiled_layers.GuardedForward(layer.forward, "layer 0")
    layer.forward = guarded
    x = torch.randn(4, 8, dtype=torch.float64)
    checkpoint(layer, x.clone().requires_grad_(), use_reentrant=False).square().sum().backward()
    eager(x.clone().requires_grad_()).square().sum().backward()
    assert guarded.failure is None and guarded.compiled_calls >= 1, guarded.failure
    for a, b in zip(layer.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
