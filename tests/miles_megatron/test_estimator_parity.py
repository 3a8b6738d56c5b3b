"""Every actor advantage estimator without a critic (grpo, gspo, dr_grpo, rloo, REINFORCE++ and
its baseline), the CISPO objective and the SFT loss, on Megatron (TP 1) and FSDP, each against
a float64 reference written from the papers (tests/miles_megatron/estimator_reference.py: HF
transformers and torch's AdamW, no miles code). One rollout of 2 optimizer steps on masked
samples (tool spans with holes) that carry engine log-probs, in fp32, the LR decaying (cosine)
from 1e-3 to 1e-4 over the 2 steps.

Each step of each backend's run is compared with the float64 step taken from the weights that
run had before it (the first: the checkpoint's, bit for bit) and with the old policy's
log-probs its loss read (teacher forcing, tests/forced_adam.py; those log-probs are held to
the float64 ones of the checkpoint at every trained token, score_capture.check_inputs). For
each configuration and backend, at each step (read from the backend's step function) and for
the rollout (``train()``'s metrics: step means, the last step's gradient norm and LR): the
loss and its parts, the entropy, ``ppo_kl``, the old policy's mismatch against the engine, the
gradient norm and the LR; at each step the log-prob and the entropy of every trained token, as
the step handed them to its loss (score_capture.py; every trained token of the step's samples
compared, no other sample scored, every sample in some step), and every weight after it; and
every response token's log-prob after the rollout; all equal the float64 values within the
bounds :mod:`tolerances` derives for one step (the reference computes them value by value;
the weights element by element with ``adam_forced_step_atol``). A step that moved no weight,
a step compared with the next one's weights, weights off by a relative 1e-6 and a gradient
off by 8 times its rounding bound are caught. The two backends equal each other within the
fp32 bound of test_backends_agree. Coverage: every mask has a hole; both backends took 2
steps, and the log-probs after the rollout are told apart from those after one step; the
configurations' losses all differ, on the backends and in the reference (so each flag
reached the step)."""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from estimator_ranks import CONFIGS, estimator_rollouts
from estimator_reference import OBJECTIVES, STEPS, reference
from forced_adam import assert_wrong_steps_caught, caught_steps, check_updates
from megatron_tiny_models import make_tiny_hf
from score_capture import check_inputs, check_scores
from tolerances import GRAD_REL_ERR, assert_within

pytest.importorskip("miles_fsdp")

pytestmark = [pytest.mark.extended, pytest.mark.numeric]

#: reported as the last step's value; every other metric is the mean over the rollout's steps
LAST_STEP = ("grad_norm", "lr")


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(a))


def rollout_values(ref: dict) -> tuple[dict[str, float], dict[str, float]]:
    """The reference's rollout metrics as the backends report them, and their bounds."""
    steps, tol = ref["steps"], ref["tol"]
    want, bound = {}, {}
    for key in steps[0]:
        if key in LAST_STEP:
            want[key], bound[key] = steps[-1][key], tol[-1][key]
        else:
            want[key] = sum(s[key] for s in steps) / len(steps)
            bound[key] = sum(t[key] for t in tol) / len(tol)
    return want, bound


def test_every_estimator_and_loss_equals_float64_on_both_backends(tmp_path):
    from backend_reference import samples

    data = samples(masked=True, engine_log_probs=True)
    assert all(0 < s.loss_mask.sum() < s.response_length for s in data)  # masks with holes
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    names = [name for name, _ in CONFIGS]
    assert sorted(OBJECTIVES) == sorted(names)
    (megatron,) = spawn_ranks(estimator_rollouts, 1, "megatron", hf_dir, timeout=600)
    (fsdp,) = spawn_ranks(estimator_rollouts, 1, "fsdp", hf_dir, timeout=600, shim=False)
    assert list(megatron) == list(fsdp) == names
    ref_losses = []
    for name in names:
        m, f = megatron[name], fsdp[name]
        extra = {"steps", "scores", "scores_tokens", "log_probs", "weights", "starts"}
        for backend, got in (("megatron", m), ("fsdp", f)):
            what = f"{name} {backend}"
            ref = reference(hf_dir, name, data, [got])
            want, bound = rollout_values(ref)
            # the second step moved some log-prob by more than twice its bound: a backend within
            # the bound of the reference took both steps
            moved = [
                float(((a - b).abs() - 2 * t).max())
                for a, b, t in zip(ref["log_probs"], ref["after_one"], ref["log_probs_tol"])
            ]
            assert max(moved) > 0, (what, moved)
            assert set(got) == {*want, *extra}, (what, sorted(got), sorted(want))
            assert len(got["steps"]) == STEPS, what  # both optimizer steps ran
            check_scores([got], ref, data, what, holes=True)
            inputs = check_inputs([got], ref["old"], data, what)
            assert inputs > 0 or name == "sft_loss", what  # SFT reads no old policy
            for k, (step, ref_step, tol) in enumerate(zip(got["steps"], ref["steps"], ref["tol"])):
                assert set(step) == set(ref_step), (what, k, sorted(step))
                for key, value in ref_step.items():
                    assert abs(step[key] - value) <= tol[key], (
                        what, f"step {k}", key, step[key], value, tol[key]
                    )  # fmt: skip
            for key, value in want.items():  # the rollout's metrics, as train() reports them
                assert abs(got[key] - value) <= bound[key], (
                    what, key, got[key], value, bound[key]
                )  # fmt: skip
            assert sorted(got["weights"]) == sorted(ref["updates"][-1]), what
            check_updates(ref["updates"], what)
            for i, (lp, t) in enumerate(zip(ref["log_probs"], ref["log_probs_tol"])):
                where = f"{what}: log-probs of sample {i} after the rollout"
                assert_within(torch.tensor(got["log_probs"][i]), lp, t, where)
            if backend == "fsdp":
                ref_losses.append(want["loss"])
            if name == "grpo":
                check_wrong_steps_caught(hf_dir, data, got, ref, what)
        for key in want:
            assert close(m[key], f[key]), (name, key, m[key], f[key])
        for k, (a, b) in enumerate(zip(m["steps"], f["steps"])):
            assert all(close(a[key], b[key]) for key in a), (name, k, a, b)
        for a, b in zip(m["log_probs"], f["log_probs"], strict=True):
            assert all(close(x, y) for x, y in zip(a, b, strict=True)), (name, a, b)
    losses = [round(fsdp[name]["loss"], 6) for name in names]
    assert len(set(losses)) == len(losses), losses  # every configuration changed the step
    assert len({round(x, 6) for x in ref_losses}) == len(ref_losses), ref_losses


def check_wrong_steps_caught(hf_dir: str, data, got: dict, ref: dict, what: str) -> None:
    """The per-step bounds tell a wrong step from the right one at both steps (no update, the
    next step's weights, weights off by a relative 1e-6), and a float64 gradient off by 8 times
    its rounding bound at the second step (``8 GRAD_REL_ERR max|g|`` on every element of one
    tensor) leaves that tensor's bound at that step and not before."""
    assert_wrong_steps_caught(ref["updates"], what)
    tensor = "model.layers.0.self_attn.o_proj.weight"

    def perturb(k, grads):
        if k == 1:
            grads[tensor] += 8 * GRAD_REL_ERR * grads[tensor].abs().max()

    wrong = reference(hf_dir, "grpo", data, [got], perturb=perturb)
    assert caught_steps(wrong["updates"], tensor) == [1], (what, tensor)
