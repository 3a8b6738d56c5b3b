"""``--compile-decoder-layers`` on the Megatron backend: its ``TransformerLayer`` forwards through
inductor, trained in lockstep with the eager backend on one rank.

Before each of two optimizer steps the compiled backend gets the eager one's weights, so each
step's gradients, their norm and the loss differ only by how inductor's kernels order and fuse
the fp32 arithmetic (``REORDERED_REL_ERR`` in tests/tolerances.py), through megatron's full
recompute (the layers run compiled under no-grad in the forward and again with grad in the
backward's recomputation) and several micro-batches of different lengths per step. The eager
layers themselves are held to HF float64 references elsewhere (test_estimator_parity.py,
test_layouts.py). The guard's fallback and the flag's parsing are FSDP's tests
(tests/miles_fsdp/test_compiled_layers.py): one module, shared by both backends.
"""

from __future__ import annotations

import pytest
import torch
from backend_reference import GROUPS, REWARDS, samples
from dist_ranks import spawn_ranks
from megatron_tiny_models import make_tiny_hf
from tolerances import FP32_EPS, REORDERED_REL_ERR, assert_within, grad_atol, norm_atol


def grpo_advantages() -> torch.Tensor:
    """float64 GRPO (DeepSeekMath): each reward less its group's mean, over the group's unbiased
    std (+1e-6), one per sample."""
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    groups = torch.tensor(GROUPS)
    out = torch.empty_like(rewards)
    for g in groups.unique():
        r = rewards[groups == g]
        out[groups == g] = (r - r.mean()) / (r.std() + 1e-6)
    return out


@pytest.mark.extended
@pytest.mark.numeric
def test_compiled_megatron_layers_train_as_the_eager_ones(tmp_path):
    from compiled_ranks import lockstep

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    (out,) = spawn_ranks(lockstep, 1, hf_dir, 2, timeout=600)
    assert out["eager_guarded"] == 0
    for index, step in enumerate(out["steps"]):
        want, got = step["want"], step["got"]
        assert want["grad_norm"] > 0
        want_grads = {n: torch.from_numpy(g) for n, g in step["want_grads"].items()}
        for name, g in step["got_grads"].items():
            g, ref = torch.from_numpy(g), want_grads[name]
            assert_within(g, ref, grad_atol(ref, REORDERED_REL_ERR), f"step {index} {name} grad")
        bound = norm_atol(list(want_grads.values()), REORDERED_REL_ERR)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= bound, (index, got, want, bound)
        # the loss: token terms -A_i * ratio weighted by at most 1 in all, the ratio moving by at
        # most each log-prob's reordering error, relative to the largest |log-prob| (the engine's
        # log-probs' largest plus the reported largest distance from them)
        engine = max(float(s.rollout_log_probs.abs().max()) for s in samples(engine_log_probs=True))
        scale = engine + want["train_rollout_logprob_abs_diff_max"]
        loss_bound = float(grpo_advantages().abs().max()) * REORDERED_REL_ERR * scale
        loss_bound += 8 * FP32_EPS * abs(want["loss"])
        assert abs(got["loss"] - want["loss"]) <= loss_bound, (index, got, want, loss_bound)
    # coverage: every layer ran compiled (no fallback) in every forward, more than once per step
    # (several micro-batches, and the recompute's second forward), and inductor made graphs
    assert out["layers"] == 2 and out["failures"] == [None, None], out["failures"]
    assert out["calls"][0] >= 2 * 2 * 2 and len(set(out["calls"])) == 1, out["calls"]
    assert out["graphs"] > 0 and out["inductor"]
