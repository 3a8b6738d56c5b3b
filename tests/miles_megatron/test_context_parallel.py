"""Context parallelism (``--context-parallel-size``, miles_megatron.context_parallel).

Without ranks: the zig-zag split against its definition, and the shard's attention mask, which
(with keys in the all-gathered order) reproduces the rows of full block-causal attention.

With ranks (gloo, the CPU shim), one 2-rank spawn in the default suite:

* CP = 2 trains GRPO like HF + AdamW (grad norms, weights) and publishes the whole model under
  the checkpoint's names from rank 0 and to every rank (test_layouts.check);
* the RL recipe (reference model + KL loss, entropy bonus, two steps per rollout: the actor's
  old log-prob pass and clipped ratios) at CP = 2 equals TP = 2 (the same data per step, DP = 1)
  metric for metric, weight for weight; the reference log-probs gathered over CP equal HF's;
* a checkpoint saved at CP = 2 loads at CP = 1 bit for bit.

``extended``: CP = 2 x TP = 2 and CP = 2 x PP = 2 (4 ranks) against HF + AdamW and against
TP = 2 x PP = 2 on the RL recipe.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from miles_core.packing import block_causal_mask, pack_thd
from miles_megatron.context_parallel import (
    PackedShard,
    gathered_order,
    pad_multiple,
    zigzag_positions,
)
from tolerances import FP32_EPS, GRAD_REL_ERR

#: log-probs, entropies and the loss terms built from them are at most ~8 in magnitude on the
#: tiny models (log 96 ~ 4.6 plus logit spread); 8 fp32 ulps there bound a reordered sum's error
VALUE_ATOL = 8 * FP32_EPS * 8


def test_the_documented_example():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert gathered_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_positions_follow_the_definition_and_cover_the_row_once(cp):
    total = 2 * cp * 5
    every = []
    for rank in range(cp):
        chunk = total // (2 * cp)
        want = [*range(rank * chunk, (rank + 1) * chunk)]
        want += [*range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]
        got = zigzag_positions(total, cp, rank).tolist()
        assert got == want
        every += got
    assert sorted(every) == list(range(total))
    assert gathered_order(total, cp).tolist() == every


def test_pad_multiple_splits_over_cp_and_tp():
    assert pad_multiple(1, 1) == 128
    assert pad_multiple(2, 2) == 128
    assert pad_multiple(16, 8) == 256  # 2 x 16 chunks whose halves split over 8 TP ranks


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="context-parallel-size"):
        zigzag_positions(8, 0, 0)
    with pytest.raises(ValueError, match="cp_rank 2"):
        zigzag_positions(8, 2, 2)
    with pytest.raises(ValueError, match="does not split into 2 x 3"):
        zigzag_positions(8, 3, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_shards_attending_to_gathered_keys_reproduce_full_attention(cp):
    """Each rank's queries against every rank's keys in the gathered order, masked by
    ``attention_mask``, give full block-causal attention's rows at the rank's positions (the
    same SDPA call over a permutation of the keys: equal up to the sum's order)."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch

    packed = pack_thd(RolloutBatch(samples()), pad_multiple=pad_multiple(cp, 1))
    total, heads, dim = packed.num_tokens, 2, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, total, dim, generator=gen, dtype=torch.float64) for _ in "qkv")
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(packed))
    order = gathered_order(total, cp)
    for rank in range(cp):
        shard = PackedShard.of(packed, cp, rank, group=None)
        mask = shard.attention_mask()
        assert mask.shape == (1, 1, total // cp, total)
        got = F.scaled_dot_product_attention(
            q[:, :, shard.positions], k[:, :, order], v[:, :, order], attn_mask=mask
        )
        torch.testing.assert_close(got, full[:, :, shard.positions], rtol=0, atol=1e-12)
        assert torch.equal(shard.targets, packed.targets[:, shard.positions])
        assert torch.equal(shard.loss_mask, packed.loss_mask[:, shard.positions])
        assert shard.num_samples == packed.num_samples


def test_cp_flag_combinations_not_covered_are_refused_at_parse_time(layout_hf_dirs):
    from megatron_ranks import parse
    from miles_core.args import ArgumentError

    base = ["--hf-checkpoint", layout_hf_dirs["llama"], "--context-parallel-size", "2"]
    for extra, match in (
        (["--advantage-estimator", "gspo"], "--advantage-estimator gspo"),
        (["--use-lora"], "--use-lora"),
        (["--spec", "mod", "fn"], "--spec"),
    ):
        with pytest.raises(ArgumentError, match=f"--context-parallel-size 2 with {match}"):
            parse(base + extra)


# ---------------------------------------------------------------------------- with ranks
def check_rl(result: dict, baseline: str, label: str, hf_dir: str) -> None:
    """``label``'s RL run equals ``baseline``'s; its reference log-probs equal HF's."""
    from backend_reference import samples
    from lora_ranks import hf_log_probs

    base, got = result[baseline], result[label]
    for step, (a, b) in enumerate(zip(base["metrics"], got["metrics"], strict=True)):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_REL_ERR), (label, step)
        for key in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss"):
            assert abs(a[key] - b[key]) <= VALUE_ATOL, (label, step, key, a[key], b[key])
    worst = max(np.abs(base["weights"][k] - got["weights"][k]).max() for k in base["weights"])
    assert worst < 1e-4, (label, worst)  # Adam moves each weight ~lr = 1e-3 per step
    want = hf_log_probs(hf_dir, samples())
    assert sorted(got["ref_log_probs"]) == list(range(len(want)))
    for src, values in got["ref_log_probs"].items():
        diff = (torch.tensor(values) - want[src]).abs().max().item()
        assert diff <= VALUE_ATOL, (label, src, diff)


@pytest.fixture(scope="module")
def cp_two_rank_run(layout_hf_dirs, tmp_path_factory) -> list[dict]:
    from cp_ranks import cp_default_run
    from dist_ranks import spawn_ranks
    from layout_ranks import LAYOUT_ROLLOUTS

    save = str(tmp_path_factory.mktemp("cp") / "ckpt")
    hf = layout_hf_dirs["llama"]
    return spawn_ranks(cp_default_run, 2, hf, LAYOUT_ROLLOUTS, save, timeout=900)


@pytest.mark.slow
def test_cp2_trains_like_hf_and_publishes_the_whole_model(cp_two_rank_run, layout_hf_dirs):
    from cp_ranks import cp_argv
    from test_layouts import check

    cases = [("llama cp2", layout_hf_dirs["llama"], cp_argv(cp=2))]
    check([r["layouts"] for r in cp_two_rank_run], cases, layout_hf_dirs)


@pytest.mark.slow
@pytest.mark.numeric
def test_cp2_rl_recipe_equals_cp1_and_its_checkpoint_loads_at_cp1(cp_two_rank_run, layout_hf_dirs):
    for rank, r in enumerate(cp_two_rank_run):
        check_rl(r["rl"], "tp2", "cp2", layout_hf_dirs["llama"])
        saved, reloaded = r["rl"]["cp2"]["weights"], r["rl"]["reloaded"]
        assert sorted(saved) == sorted(reloaded), rank
        assert all(np.array_equal(saved[k], reloaded[k]) for k in saved), rank


@pytest.mark.extended
def test_four_rank_cp_layouts_train_like_hf_and_equal_cp1(layout_hf_dirs):
    from cp_ranks import cp_argv, rl_layouts
    from dist_ranks import spawn_ranks
    from layout_ranks import LAYOUT_ROLLOUTS, train_and_publish
    from test_layouts import check

    llama = layout_hf_dirs["llama"]
    cases = [
        ("llama cp2 tp2", llama, cp_argv(cp=2, tp=2)),
        ("llama cp2 pp2", llama, cp_argv(cp=2, pp=2)),
    ]
    results = spawn_ranks(train_and_publish, 4, cases, LAYOUT_ROLLOUTS, timeout=1200)
    check(results, cases, layout_hf_dirs)
    layouts = [
        ("tp2 pp2", cp_argv(tp=2, pp=2)),
        ("cp2 tp2", cp_argv(cp=2, tp=2)),
        ("cp2 pp2", cp_argv(cp=2, pp=2)),
    ]
    rl = spawn_ranks(rl_layouts, 4, llama, layouts, None, timeout=1200)
    for r in rl:
        check_rl(r, "tp2 pp2", "cp2 tp2", llama)
        check_rl(r, "tp2 pp2", "cp2 pp2", llama)
