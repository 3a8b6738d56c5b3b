"""Every parallel layout the megatron backend accepts trains like HF + AdamW and publishes the
whole model under the HF checkpoint's names.

Per case (one backend after another in one spawn): 3 rollouts of GRPO on the DP shards of
the case's samples (layout_ranks.case_samples: every loss mask with a hole; long enough to
reach every CP rank at CP > 1), one optimizer step each. Each step is compared with the
float64 HF + AdamW step taken from the weights the fp32 step started from
(forced_reference.py: the first step's are the checkpoint's, bit for bit; each later one's
as ``publish_weights()`` delivered them): its loss and gradient norm, its log-probs and
entropies at every trained token (as the training step hands them to its loss:
score_capture.py; every token compared on some rank, every last-stage rank comparing some)
and every weight after it, element by element, within the bounds tests/tolerances.py derives
for one step's fp32 arithmetic (``SCORE_ATOL``, ``step_norm_atol``,
``adam_forced_step_atol``); a step that moved no weight, a step compared with the next one's
weights and a gradient error of a few times the rounding bound are caught
(:func:`test_forced_bounds_catch_a_wrong_step`). ``publish_weights()`` (the rank-0
transports: broadcast, disk-delta) holds every pipeline stage's tensors on rank 0,
``publish_weights(to_all=True)`` (ipc, p2p) on every rank, bit for bit the same; a publish
whose names are not the checkpoint's raises.

qwen3_moe trains with the all-gather and the all-to-all token dispatchers (the all-to-all on
gloo through the CPU shim's split-size adapter, megatron_shim.py); llama is the dense control.
The default suite runs the 2-rank layouts (EP=2, PP=2, TP=2 with LoRA merged, MoE at DP=2, TP=2
and TP=2 x EP=2; in the spawn test_pipeline.py shares, conftest.py); the 4-rank ones (EP=2 x
TP=2 at ETP=1 and ETP=TP, PP=2 x TP=2, PP=2 x EP=2, TP=2 x DP=2, PP=2 x DP=2, MoE TP x PP with
and without EP), the 8-rank ones (the dense kinds of three dimensions, MoE TP or PP beside DP)
and the 16-rank dense TP x PP x CP x DP are ``extended``: with test_context_parallel.py and
test_backend.py they prove every layout kind miles_megatron.layout_kinds accepts
(test_layout_kinds.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_ranks import spawn_ranks
from forced_adam import assert_wrong_steps_caught, caught_steps
from forced_reference import check_forced, forced_reference
from layout_ranks import (
    LAYOUT_ROLLOUTS,
    eight_rank_cases,
    four_rank_cases,
    sixteen_rank_cases,
    spans_cp,
    train_and_publish,
    two_rank_cases,
)
from safetensors.torch import load_file


def check(results: list[dict], cases: list) -> None:
    for label, hf_dir, argv in cases:
        first = results[0][label]["to_first"]
        names = sorted(load_file(f"{hf_dir}/model.safetensors"))
        assert sorted(first) == names, (label, sorted(set(names) ^ set(first)))
        dp = next((int(w[2:]) for w in label.split() if w.startswith("dp")), None)
        for rank, r in enumerate(results):
            result = r[label]
            assert dp is None or result["dp_size"] == dp, (label, rank, result["dp_size"])
            assert sorted(result["to_all"]) == names, (label, rank)
            assert all(np.array_equal(result["to_all"][k], first[k]) for k in names), (label, rank)
            assert f"not in it ['{names[0]}']" in result["names_error"], (label, rank)
        if lora(argv):  # adapters trained, merged into the published base
            base = load_file(f"{hf_dir}/model.safetensors")
            moved = [k for k in names if not torch.equal(torch.from_numpy(first[k]), base[k])]
            assert "model.layers.0.self_attn.q_proj.weight" in moved, (label, moved)
            continue
        assert all(m["steps"] == 1 for m in results[0][label]["metrics"]), label
        check_run([r[label] for r in results], hf_dir, argv, first, label, every_rank=False)


def check_run(ranks: list[dict], hf_dir: str, argv: list[str], final: dict, what: str, **kw):
    """One run (every rank's result) against the float64 reference stepped from its own
    weights (forced_reference.check_forced: ``starts`` on rank 0, one per rollout, then
    ``final``), on the case's samples (layout_ranks.case_samples)."""
    starts = ranks[0]["starts"]
    assert len(starts) == LAYOUT_ROLLOUTS, what
    return check_forced(ranks, hf_dir, starts, final, what, long=spans_cp(argv), **kw)


def lora(argv: list[str]) -> bool:
    return "--use-lora" in argv


@pytest.mark.slow
def test_two_rank_layouts_train_like_hf_and_publish_every_stage(two_rank_run, layout_hf_dirs):
    layouts = [r["layouts"] for r in two_rank_run]
    check(layouts, two_rank_cases(layout_hf_dirs))


@pytest.mark.slow
def test_forced_bounds_catch_a_wrong_step(two_rank_run, layout_hf_dirs):
    """The per-step bounds of :func:`check_run` tell a wrong step from a right one, on the
    dense and the MoE model (the default 2-rank run's fp32 weights), at every step: a step that
    moved no weight, a step compared with the next step's weights, the weights after a step off
    by a relative 1e-6 (about 17 ulps); and a gradient error of 8 times its rounding bound
    (``8 GRAD_REL_ERR max|g|`` on every element of one tensor) at the second step."""
    from tolerances import GRAD_REL_ERR

    cases = {label: (hf_dir, argv) for label, hf_dir, argv in two_rank_cases(layout_hf_dirs)}
    for label in ("llama dp2", "moe ep2 alltoall"):
        hf_dir, argv = cases[label]
        run = two_rank_run[0]["layouts"][label]
        snapshots = [*run["starts"], run["to_first"]]
        updates = forced_reference(hf_dir, snapshots, long=spans_cp(argv))["updates"]
        assert_wrong_steps_caught(updates, label)
        for tensor in ("lm_head.weight", "model.layers.0.self_attn.o_proj.weight"):

            def perturb(k, grads, tensor=tensor):
                if k == 1:
                    grads[tensor] += 8 * GRAD_REL_ERR * grads[tensor].abs().max()

            ref = forced_reference(hf_dir, snapshots, long=spans_cp(argv), perturb=perturb)
            caught = caught_steps(ref["updates"], tensor)
            assert caught and caught[0] == 1, (label, tensor, caught)  # step 0 is untouched


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_trains_like_hf(world, layout_hf_dirs):
    """The layout suites' job on the FSDP backend at 1 and 2 ranks (DP), on the tiny qwen3
    (masked samples): each step against the float64 step from its own weights with the bounds
    of the Megatron layouts (:func:`check_run`: loss and gradient norm each rollout on every
    rank, each step's log-probs and entropies at every trained token, every weight after each
    step). Megatron at TP = 2 on the same model and samples meets the same per-step reference
    and bounds (test_backend.py)."""
    pytest.importorskip("miles_fsdp")
    from layout_ranks import fsdp_train

    hf = layout_hf_dirs["qwen3"]  # FSDP loads a tokenizer; qwen3's builds without files
    results = spawn_ranks(fsdp_train, world, hf, LAYOUT_ROLLOUTS, timeout=600, shim=False)
    for rank, r in enumerate(results):
        assert r["dp_size"] == world, rank
        assert r["optimizer_steps"] == LAYOUT_ROLLOUTS, rank  # one a rollout
        assert sorted(r["weights"]) == sorted(results[0]["weights"]), rank
        for name, value in r["weights"].items():  # every rank holds the same weights
            assert np.array_equal(value, results[0]["weights"][name]), (rank, name)
    check_run(results, hf, [], results[0]["weights"], f"fsdp x{world}")


@pytest.mark.extended
def test_four_rank_layouts_train_like_hf_and_publish_every_stage(layout_hf_dirs):
    cases = four_rank_cases(layout_hf_dirs)
    results = spawn_ranks(train_and_publish, 4, cases, LAYOUT_ROLLOUTS, timeout=900)
    check(results, cases)


@pytest.mark.extended
def test_eight_rank_layouts_train_like_hf_and_publish_every_stage(layout_hf_dirs):
    cases = eight_rank_cases(layout_hf_dirs)
    results = spawn_ranks(train_and_publish, 8, cases, LAYOUT_ROLLOUTS, timeout=1800)
    check(results, cases)


@pytest.mark.extended
def test_sixteen_rank_layout_trains_like_hf_and_publishes_every_stage(layout_hf_dirs):
    cases = sixteen_rank_cases(layout_hf_dirs)
    results = spawn_ranks(train_and_publish, 16, cases, LAYOUT_ROLLOUTS, timeout=1800)
    check(results, cases)


def test_publish_name_check_names_missing_extra_and_repeated():
    from miles_megatron.publish_source import PublishNamesError, check_names

    check_names(["b", "a"], ["a", "b"], "ckpt")  # order is free
    for sent, part in (
        (["a"], "missing ['b']"),
        (["a", "b", "c"], "not in it ['c']"),
        (["a", "b", "a"], "repeated ['a']"),
    ):
        with pytest.raises(PublishNamesError, match=part.replace("[", r"\[")) as error:
            check_names(sent, ["a", "b"], "ckpt")
        assert "ckpt's names" in str(error.value)
