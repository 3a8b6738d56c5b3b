"""Context parallelism (``--context-parallel-size``, miles_megatron.context_parallel).

Without ranks: the zig-zag split against its definition, and the shard's attention mask, which
(with keys in the all-gathered order) reproduces the rows of full block-causal attention.

With ranks (gloo, the CPU shim), one 2-rank spawn in the default suite:

* CP = 2 trains GRPO like HF + AdamW, step by step from its own weights (loss, grad norm,
  per-token scores, weights: test_layouts.check) and publishes the whole model under the
  checkpoint's names from rank 0 and to every rank;
* the RL recipe (reference model + KL loss, entropy bonus, two steps per rollout: the actor's
  old log-prob pass and clipped ratios) at CP = 2 equals TP = 2 (the same data per step, DP = 1)
  metric for metric (the train/rollout mismatch's extremes and worst sample included), weight
  for weight; the reference log-probs gathered over CP equal HF's;
* a checkpoint saved at CP = 2 loads at CP = 1 bit for bit;
* ``--loss-type sft_loss`` (sequence mean) at CP = 2 on samples whose loss tokens reach both CP
  ranks equals HF's float64 loss and gradient norm (without ranks: every sequence-mean share
  of the CP ranks adds up to the whole samples' mean).

``extended``: CP = 2 x TP = 2 and CP = 2 x PP = 2 (4 ranks) against HF + AdamW and against
TP = 2 x PP = 2 on the RL recipe; the critic at CP = 2 x TP = 2 and CP = 2 x PP = 2 against the
float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from miles_core import mismatch
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
MISMATCH_KEYS = (
    mismatch.ABS_DIFF,
    mismatch.ABS_DIFF_MAX,
    mismatch.RATIO_MIN,
    mismatch.RATIO_MAX,
    mismatch.ABS_DIFF_SAMPLE_MAX,
    mismatch.K3_SAMPLE_MAX,
)


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


def cp_shards_of_long_samples(cp: int = 2):
    """Each of backend_reference's long samples packed alone (micro-batch size 1), split over
    ``cp`` ranks; asserts the coverage: every rank holds loss tokens of every sample."""
    from backend_reference import long_samples
    from miles_core.batch import RolloutBatch

    rows = []
    for sample in long_samples():
        packed = pack_thd(RolloutBatch([sample]), pad_multiple=pad_multiple(cp, 1))
        shards = [PackedShard.of(packed, cp, r, group=None) for r in range(cp)]
        assert all(shard.loss_mask.sum() > 0 for shard in shards), packed.num_tokens
        assert packed.loss_mask.sum() < sample.response_length  # the mask has a hole
        rows.append((packed, shards))
    return rows


@pytest.mark.parametrize("loss", ["sft_loss", "value_loss"])
def test_sequence_mean_shares_of_cp_ranks_add_up_to_the_whole_samples_mean(loss):
    """``(1/S) sum_i (1/n_i) sum_t m_t x_t`` in float64 (``n_i`` the whole sample's loss
    tokens) equals the sum over rows and CP ranks of each rank's share: a rank counts the
    sample's tokens on every rank, not its own."""
    from miles_core.losses import LossConfig, packed_score_loss, packed_value_loss

    config = LossConfig(value_clip=0.2)
    gen = torch.Generator().manual_seed(3)
    rows = cp_shards_of_long_samples()
    num_samples = len(rows)
    want, got = 0.0, torch.zeros((), dtype=torch.float64)
    for packed, shards in rows:
        x = torch.randn(packed.loss_mask.shape, generator=gen, dtype=torch.float64)
        old, returns = (torch.randn_like(x) for _ in range(2)) if loss == "value_loss" else (x, x)
        if loss == "sft_loss":
            per_token = -x
        else:  # 0.5 * max((v - R)^2, (v_old + clip(v - v_old) - R)^2)
            clipped = old + (x - old).clamp(-0.2, 0.2)
            per_token = 0.5 * torch.maximum((x - returns) ** 2, (clipped - returns) ** 2)
        mask = packed.loss_mask.double()
        want += float((per_token * mask).sum() / mask.sum()) / num_samples
        packed.fields.update(values=old, returns=returns)  # float64: the formula's operands
        for shard in shards:
            mine = x[:, shard.positions]
            if loss == "sft_loss":
                entropy = torch.zeros_like(mine)
                share, _ = packed_score_loss(
                    "sft_loss", mine, entropy, shard, config, num_samples, detach_old=True
                )
            else:
                share, _ = packed_value_loss(mine, shard, config, num_samples)
            got = got + share
    assert abs(got.item() - want) <= 1e-12 * abs(want), (got.item(), want)


def test_cp_flag_combinations_not_covered_are_refused_at_parse_time(layout_hf_dirs):
    from megatron_ranks import parse
    from miles_core.args import ArgumentError

    base = ["--hf-checkpoint", layout_hf_dirs["llama"], "--context-parallel-size", "2"]
    for extra, match in (
        (["--advantage-estimator", "gspo"], "--advantage-estimator gspo"),
        (["--use-lora"], "--use-lora"),
        (["--spec", "mod", "fn"], "--spec"),
        (["--use-tis", "--tis-level", "geometric"], "--tis-level geometric"),
        (["--use-tis", "--tis-level", "sequence"], "--tis-level sequence"),
        (["--use-opsm", "--num-steps-per-rollout", "2"], "--use-opsm"),
        (["--custom-loss-function-path", "m:f"], "--custom-loss-function-path"),
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
        # maxima and minima over the tokens of all ranks; each sample's mean summed over the CP
        # ranks that hold parts of it before the worst sample is taken
        for key in MISMATCH_KEYS:
            tol = VALUE_ATOL * max(1.0, abs(a[key]))
            assert abs(a[key] - b[key]) <= tol, (label, step, key, a[key], b[key])
    worst = max(np.abs(base["weights"][k] - got["weights"][k]).max() for k in base["weights"])
    assert worst < 1e-4, (label, worst)  # Adam moves each weight ~lr = 1e-3 per step
    want = hf_log_probs(hf_dir, samples(engine_log_probs=True))  # cp_ranks trains on these
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
    from cp_ranks import cp_two_rank_cases
    from test_layouts import check

    cases = cp_two_rank_cases(layout_hf_dirs["llama"])
    check([r["layouts"] for r in cp_two_rank_run], cases)


@pytest.mark.slow
@pytest.mark.numeric
def test_cp2_rl_recipe_equals_cp1_and_its_checkpoint_loads_at_cp1(cp_two_rank_run, layout_hf_dirs):
    for rank, r in enumerate(cp_two_rank_run):
        check_rl(r["rl"], "tp2", "cp2", layout_hf_dirs["llama"])
        saved, reloaded = r["rl"]["cp2"]["weights"], r["rl"]["reloaded"]
        assert sorted(saved) == sorted(reloaded), rank
        assert all(np.array_equal(saved[k], reloaded[k]) for k in saved), rank


def reference_sft(hf_dir: str, samples) -> tuple[float, float]:
    """(loss, grad norm) in float64 of the sequence-mean NLL ``-(1/S) sum_i (1/n_i) sum_t
    m_it log pi_t`` (``n_i = sum_t m_it``, the whole sample's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager"
    )
    terms = []
    for s in samples:
        logits = model(input_ids=s.tokens[None], use_cache=False).logits[0, :-1]
        log_p = logits.log_softmax(-1).gather(-1, s.tokens[1:, None])[-s.response_length :, 0]
        terms.append(-(log_p * s.mask.double()).sum() / s.mask.sum())
    loss = sum(terms) / len(terms)
    loss.backward()
    norm = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters() if p.grad is not None))
    return loss.item(), norm.item()


@pytest.mark.slow
@pytest.mark.numeric
def test_cp2_sft_loss_on_samples_spanning_both_ranks_matches_float64(
    cp_two_rank_run, layout_hf_dirs
):
    """``--loss-type sft_loss`` (sequence mean) at CP = 2, every CP rank holding loss tokens of
    every sample: the loss and gradient norm are HF float64's (a rank dividing by its own part
    of each sample's tokens gave a larger loss and other gradients)."""
    from backend_reference import long_samples

    cp_shards_of_long_samples()  # asserts the coverage of the samples the ranks trained on
    loss, norm = reference_sft(layout_hf_dirs["llama"], long_samples())
    for r in cp_two_rank_run:
        m = r["sft"]
        assert abs(m["sft_loss"] - loss) <= 1e-5 * loss, (m["sft_loss"], loss)
        assert abs(m["grad_norm"] - norm) <= 2 * GRAD_REL_ERR * norm, (m["grad_norm"], norm)


def masked_gae_returns(reward: float, values: torch.Tensor, mask: torch.Tensor, gamma, lambd):
    """float64 GAE over the trained tokens only (papers' recursion on the masked-out sequence:
    values and the reward, on the last trained token, only where ``mask`` is 1; discounting
    steps over trained tokens); returns ``A + V`` at those tokens, 0 elsewhere."""
    idx = mask.nonzero()[:, 0].tolist()
    v = [float(values[i]) for i in idx]
    n = len(v)
    returns = torch.zeros(len(mask), dtype=torch.float64)
    running = 0.0
    for k in reversed(range(n)):
        r = reward if k == n - 1 else 0.0
        next_v = v[k + 1] if k + 1 < n else 0.0
        running = r + gamma * next_v - v[k] + gamma * lambd * running
        returns[idx[k]] = running + v[k]
    return returns


def reference_critic_step(hf_dir: str, samples):
    """(values, loss, grad norm) in float64 of the critic's first step: the HF model with the
    documented value head, loss ``(1/S) sum_i (1/n_i) sum_t m_it 0.5 (V_t - R_t)^2`` (``v_old =
    V``: no clipping; ``R`` the masked GAE returns of those values)."""
    from critic_ranks import GAMMA, LAMBD
    from test_megatron_critic import reference_critic

    model = reference_critic(hf_dir)
    values, terms = [], []
    for s in samples:
        v = model(input_ids=s.tokens[None], use_cache=False).logits[0, :-1, 0]
        v = v[-s.response_length :]
        m = s.mask.double()
        returns = masked_gae_returns(s.reward, v.detach(), m, GAMMA, LAMBD)
        values.append(v.detach())
        terms.append((0.5 * (v - returns).square() * m).sum() / m.sum())
    loss = sum(terms) / len(terms)
    loss.backward()
    norm = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters() if p.grad is not None))
    return values, loss.item(), norm.item()


@pytest.mark.slow
@pytest.mark.numeric
def test_cp2_critic_on_samples_spanning_both_ranks_matches_float64(cp_two_rank_run, layout_hf_dirs):
    """The critic at CP = 2 (values gathered over the CP ranks, the value loss's sequence mean
    over whole samples), every CP rank holding loss tokens of every sample and every mask with a
    hole: its values, first-step value loss and gradient norm are HF float64's."""
    check_critic([r["critic"] for r in cp_two_rank_run], layout_hf_dirs["llama"])


@pytest.mark.extended
@pytest.mark.numeric
def test_cp2_x_tp2_critic_matches_float64(layout_hf_dirs):
    """The critic in a layout of two dimensions (4 ranks): CP = 2 x TP = 2 (sequence parallel),
    against the same float64 reference as at CP = 2."""
    from cp_ranks import cp_argv, critic_layout
    from dist_ranks import spawn_ranks

    llama = layout_hf_dirs["llama"]
    results = spawn_ranks(critic_layout, 4, llama, cp_argv(cp=2, tp=2), timeout=900)
    check_critic(results, llama)


@pytest.mark.extended
@pytest.mark.numeric
def test_cp2_x_pp2_critic_matches_float64(layout_hf_dirs):
    """The critic at CP = 2 x PP = 2 (4 ranks): the value head on the last stage, each of its
    CP ranks scoring its shard of every long sample; the values reach the first stage's ranks.
    Against the same float64 reference as at CP = 2."""
    from cp_ranks import cp_argv, critic_layout
    from dist_ranks import spawn_ranks

    llama = layout_hf_dirs["llama"]
    results = spawn_ranks(critic_layout, 4, llama, cp_argv(cp=2, pp=2), timeout=900)
    check_critic(results, llama)


def check_critic(results: list[dict], hf_dir: str) -> None:
    """Every rank's critic values of the long samples, its first value loss and gradient norm
    equal :func:`reference_critic_step`'s."""
    from backend_reference import long_samples

    cp_shards_of_long_samples()  # asserts the coverage of the samples the ranks trained on
    values, loss, norm = reference_critic_step(hf_dir, long_samples())
    assert loss > 1e-2 and max(float(v.abs().max()) for v in values) > 1e-2
    for got in results:
        for i, v in enumerate(values):
            # fp32 forward of a 2-layer model, values ~0.1: 1e-5 absolute, as at TP (critic test)
            value = torch.tensor(got["values"][i], dtype=torch.float64)
            assert value.shape == v.shape
            assert (value - v).abs().max() < 1e-5, i
        m = got["metrics"]
        assert abs(m["value_loss"] - loss) <= 1e-5 * max(loss, 1.0), (m["value_loss"], loss)
        assert abs(m["grad_norm"] - norm) <= 2 * GRAD_REL_ERR * norm, (m["grad_norm"], norm)


@pytest.mark.extended
def test_four_rank_cp_layouts_train_like_hf_and_equal_cp1(layout_hf_dirs):
    from cp_ranks import cp_argv, four_rank_cp_cases, rl_layouts
    from dist_ranks import spawn_ranks
    from layout_ranks import LAYOUT_ROLLOUTS, train_and_publish
    from test_layouts import check

    llama = layout_hf_dirs["llama"]
    cases = four_rank_cp_cases(llama)
    results = spawn_ranks(train_and_publish, 4, cases, LAYOUT_ROLLOUTS, timeout=1200)
    check(results, cases)
    layouts = [
        ("tp2 pp2", cp_argv(tp=2, pp=2)),
        ("cp2 tp2", cp_argv(cp=2, tp=2)),
        ("cp2 pp2", cp_argv(cp=2, pp=2)),
    ]
    rl = spawn_ranks(rl_layouts, 4, llama, layouts, None, timeout=1200)
    for r in rl:
        check_rl(r, "tp2 pp2", "cp2 tp2", llama)
        check_rl(r, "tp2 pp2", "cp2 pp2", llama)
