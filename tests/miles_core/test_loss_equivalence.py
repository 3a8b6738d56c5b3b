"""The step loss and its gradient do not depend on packing, micro-batch split or DP size.

A tiny Qwen3 (sdpa) scores a rollout batch two ways: a float64 reference written here, one
sample at a time without packing; and the real pipeline (partition -> advantages ->
normalization across DP -> denominators -> micro-batches -> THD packing -> packed forward ->
compute_policy_loss), with 1 or 4 micro-batches in-process and with 2 gloo ranks spawned.
The spawned ranks also reduce the train/rollout mismatch's extremes (maxima and minima over
ranks, the worst sample's mean with each sample's tokens split over the two ranks as context
parallelism splits them) and --tis-batch-normalize's mean weight of the step over both ranks'
samples, against float64 formulas.
"""

from __future__ import annotations

import math
import os
import statistics
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from miles_core import mismatch
from miles_core.advantages import compute_advantages, normalize_advantages
from miles_core.aggregation import loss_denominator
from miles_core.batch import RolloutBatch, Sample
from miles_core.log_probs import entropy_from_logits, token_log_probs
from miles_core.losses import LossConfig, compute_policy_loss
from miles_core.metric_reduction import StepMetrics
from miles_core.micro_batch import agree_num_micro_batches, count_micro_batches, make_micro_batches
from miles_core.packing import pack_thd, packed_attention_kwargs
from miles_core.partition import partition_for_dp
from miles_core.ports import free_port
from miles_core.rollout_correction import batch_mean
from rank_context import in_environ, rank_context

pytestmark = pytest.mark.numeric

VOCAB = 48
CONFIGS = {
    "grpo_seq_mean": dict(
        advantage_estimator="grpo", calculate_per_token_loss=False, eps_clip=0.2, eps_clip_high=0.28,
        eps_clip_c=3.0, use_tis=True, tis_clip=1.5, tis_clip_low=0.5, use_kl_loss=True,
        kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01, temperature=0.8,
    ),
    "gspo_seq_mean": dict(
        advantage_estimator="gspo", calculate_per_token_loss=False, eps_clip=0.1, use_kl_loss=True,
        kl_loss_coef=0.05, kl_loss_type="k2", entropy_coef=0.0,
    ),
    "rpp_baseline_token_mean": dict(
        advantage_estimator="reinforce_plus_plus_baseline", calculate_per_token_loss=True,
        eps_clip=0.2, eps_clip_c=2.0,
    ),
}  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread avoids oversubscription stalls on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def _batch() -> RolloutBatch:
    """14 samples in prompt groups of 4, 4, 3, 2 and 1, one sample all-masked."""
    g = torch.Generator().manual_seed(1)
    groups = [0] * 4 + [1] * 4 + [2] * 3 + [3] * 2 + [4]
    samples = []
    for i, gi in enumerate(groups):
        length = int(torch.randint(5, 30, (1,), generator=g))
        resp = int(torch.randint(1, length, (1,), generator=g))
        mask = (torch.rand(resp, generator=g) > 0.2).float()
        if i == 5:
            mask.zero_()
        base = -torch.rand(resp, generator=g) * 3
        samples.append(
            Sample(
                tokens=torch.randint(0, VOCAB, (length,), generator=g),
                response_length=resp,
                reward=float(torch.randint(0, 3, (1,), generator=g)) / 2,
                loss_mask=mask,
                rollout_log_probs=base + 0.3 * torch.randn(resp, generator=g),
                group_index=gi,
                fields={
                    "old_log_probs": base,
                    "ref_log_probs": base + 0.3 * torch.randn(resp, generator=g),
                },
            )
        )
    return RolloutBatch(samples)


def reference_step(model, batch, cfg: dict) -> torch.Tensor:
    """The step loss in float64, sample by sample (no packing, no library loss code)."""
    est, temp = cfg["advantage_estimator"], cfg.get("temperature", 1.0)
    rewards, groups = [s.reward for s in batch], [s.group_index for s in batch]
    masks = [s.loss_mask.double() for s in batch]
    adv = []
    for i, s in enumerate(batch):
        members = [rewards[j] for j in range(len(batch)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        if est == "reinforce_plus_plus_baseline":  # gamma = 1, no KL: the return is constant
            a = rewards[i] - mean
        else:
            std = statistics.stdev(members) if len(members) > 1 else 0.0
            a = (rewards[i] - mean) / (std + 1e-6)
        adv.append(torch.full((s.response_length,), a, dtype=torch.float64))
    # --normalize-advantages over every loss token of the step
    flat = [(x, m) for a, mk in zip(adv, masks) for x, m in zip(a.tolist(), mk.tolist()) if m]
    mu = sum(x for x, _ in flat) / len(flat)
    var = sum((x - mu) ** 2 for x, _ in flat) / len(flat)
    adv = [(a - mu) / math.sqrt(var + 1e-8) * m for a, m in zip(adv, masks)]

    n_tokens, n_samples = sum(float(m.sum()) for m in masks), len(batch)
    lo, hi = cfg["eps_clip"], cfg.get("eps_clip_high") or cfg["eps_clip"]
    total = torch.zeros((), dtype=torch.float64)
    for i, s in enumerate(batch):
        p, m, A = s.prompt_length, masks[i], adv[i]
        z = model(input_ids=s.tokens[None]).logits[0, p - 1 : -1].double() / temp
        logp = torch.log_softmax(z, -1)
        lp = logp.gather(-1, s.tokens[p:, None])[:, 0]
        old, ref = s.fields["old_log_probs"].double(), s.fields["ref_log_probs"].double()
        if est == "gspo":
            seq = ((lp - old) * m).sum() / max(float(m.sum()), 1.0)
            log_ratio = seq.detach() + lp - lp.detach()
        else:
            log_ratio = lp - old
        r = log_ratio.clamp(-20, 20).exp()
        pg = torch.maximum(-A * r, -A * r.clamp(1 - lo, 1 + hi))
        if cfg.get("eps_clip_c"):
            pg = torch.where(A < 0, torch.minimum(pg, -A * cfg["eps_clip_c"]), pg)
        if cfg.get("use_tis"):
            w = (old - s.rollout_log_probs.double()).exp()
            pg = pg * w.clamp(cfg["tis_clip_low"], cfg["tis_clip"])
        tok = pg
        if cfg.get("entropy_coef"):
            tok = tok - cfg["entropy_coef"] * -(logp.exp() * logp).sum(-1)
        if cfg.get("use_kl_loss"):
            d = lp - ref
            kl = {"k2": 0.5 * d * d, "low_var_kl": ((-d).exp() - 1 + d).clamp(-10, 10)}[
                cfg["kl_loss_type"]
            ]
            tok = tok + cfg["kl_loss_coef"] * kl
        if cfg["calculate_per_token_loss"]:
            total = total + (tok * m).sum() / n_tokens
        else:
            total = total + (tok * m).sum() / max(float(m.sum()), 1.0) / n_samples
    return total


def pipeline_step(
    model, batch, cfg: dict, dp_rank, dp_size, max_tokens, min_micro=1, group=None, metrics=None
) -> tuple[torch.Tensor, int]:
    """This rank's share of the step loss through the library, with backward per micro-batch;
    also returns the number of micro-batches it ran. ``metrics``: a StepMetrics that collects
    the micro-batches' metrics."""
    config = LossConfig(**cfg)
    shard = partition_for_dp(batch, dp_size, keep_groups=True)[dp_rank]
    adv = compute_advantages(shard, config.advantage_estimator)
    adv = normalize_advantages(adv.advantages, [s.mask for s in shard], group=group)
    shard = shard.with_fields(advantages=adv)
    denominator = loss_denominator(shard, config.calculate_per_token_loss, group=group)
    local = max(count_micro_batches(shard, max_tokens), min_micro)
    num = agree_num_micro_batches(local, group=group)
    total = torch.zeros(())
    for mb in make_micro_batches(shard, max_tokens, num=num):
        p = pack_thd(mb, pad_multiple=16)
        logits = model(input_ids=p.input_ids, **packed_attention_kwargs(p, "sdpa")).logits
        lp = token_log_probs(logits, p.targets, config.temperature)
        loss, metrics_of_mb = compute_policy_loss(
            lp,
            old_log_probs=p.fields["old_log_probs"],
            advantages=p.fields["advantages"],
            loss_mask=p.loss_mask,
            config=config,
            denominator=denominator,
            sample_ids=p.sample_ids,
            num_samples=p.num_samples,
            ref_log_probs=p.fields["ref_log_probs"],
            rollout_log_probs=p.fields["rollout_log_probs"],
            entropy=entropy_from_logits(logits, config.temperature),
        )
        loss.backward()
        total += loss.detach()
        if metrics is not None:
            metrics.add(metrics_of_mb)
    return total, num


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _reference(cfg):
    model = _model()
    loss = reference_step(model, _batch(), cfg)
    loss.backward()
    return loss.item(), _grads(model)


def _assert_same(loss, grads, ref_loss, ref_grads):
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_micro_batched_equals_per_sample(name):
    cfg = CONFIGS[name]
    ref_loss, ref_grads = _reference(cfg)
    for max_tokens, min_micro, expected in ((4096, 1, 1), (256, 4, 4)):
        model = _model()
        loss, num = pipeline_step(model, _batch(), cfg, 0, 1, max_tokens, min_micro)
        assert num == expected
        _assert_same(loss.item(), _grads(model), ref_loss, ref_grads)


def _dp_worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    try:
        group = dist.new_group(backend="gloo")
        out = {}
        for name, cfg in CONFIGS.items():
            model = _model()
            acc = StepMetrics()
            loss, num = pipeline_step(
                model, _batch(), cfg, rank, world, 64, group=group, metrics=acc
            )
            out[name] = (loss.item(), _grads(model), num, acc.reduce(group)[0])
        out["split_samples"] = _split_sample_metrics(rank, world, group)
        shard = partition_for_dp(_batch(), world, keep_groups=True)[rank]
        out["batch_mean"] = {
            level: batch_mean(shard, LossConfig(**BATCH_MEAN_CONFIG, tis_level=level), group)
            for level in ("token", "sequence")
        }
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _split_sample_metrics(rank, world, group) -> dict[str, float]:
    """The mismatch metrics of the whole batch packed in one row, rank ``r`` holding its
    positions ``t`` with ``t % world == r`` (as context parallelism splits each sample over the
    ranks), reduced over ``group`` as Megatron reduces them at CP = ``world``: each sample's
    mean from the ranks' shares."""
    p = pack_thd(_batch(), pad_multiple=16)
    mine = (torch.arange(p.num_tokens) % world == rank).float()[None]
    old = p.fields["old_log_probs"]
    _, metrics = compute_policy_loss(
        old.clone(), old_log_probs=old, advantages=torch.ones_like(old),
        loss_mask=p.loss_mask * mine, config=LossConfig(), denominator=float(p.num_samples),
        sample_ids=p.sample_ids, num_samples=p.num_samples,
        rollout_log_probs=p.fields["rollout_log_probs"], sample_loss_tokens=p.sample_loss_tokens,
    )  # fmt: skip
    acc = StepMetrics()
    acc.add(metrics)
    return mismatch.finish(acc.reduce(group, sample_group=group)[0])


BATCH_MEAN_CONFIG = dict(use_tis=True, tis_clip=1.5, tis_clip_low=0.5, tis_batch_normalize=True)


def batch_mean_reference(batch, level: str) -> float:
    """float64: w = clamp(exp(d), 0.5, 1.5) with d = log pi_old - log pi_rollout per token
    (token level) or summed over the sample's trained tokens (sequence level); the mean over
    the trained tokens, or over the samples with trained tokens."""
    weights = []
    for s in batch:
        d = (s.fields["old_log_probs"].double() - s.rollout_log_probs.double()).tolist()
        kept = [x for x, m in zip(d, s.loss_mask.tolist()) if m]
        if level == "token":
            weights += [min(max(math.exp(x), 0.5), 1.5) for x in kept]
        elif kept:
            weights.append(min(max(math.exp(sum(kept)), 0.5), 1.5))
    return sum(weights) / len(weights)


def mismatch_reference(batch) -> dict[str, float]:
    """float64 from the definitions, d = log pi_old - log pi_rollout over the trained tokens:
    the sequence mean of |d|, the token max of |d|, min and max of exp(d), and the largest
    sample mean of |d| and of exp(d) - 1 - d (a sample without trained tokens counts 0)."""
    tokens, sample_abs, sample_k3 = [], [], []
    for s in batch:
        d = (s.fields["old_log_probs"].double() - s.rollout_log_probs.double()).tolist()
        kept = [x for x, m in zip(d, s.loss_mask.tolist()) if m]
        tokens += kept
        n = max(len(kept), 1)
        sample_abs.append(sum(abs(x) for x in kept) / n)
        sample_k3.append(sum(math.exp(x) - 1 - x for x in kept) / n)
    return {
        mismatch.ABS_DIFF: sum(sample_abs) / len(sample_abs),
        mismatch.ABS_DIFF_MAX: max(abs(x) for x in tokens),
        mismatch.RATIO_MIN: min(math.exp(x) for x in tokens),
        mismatch.RATIO_MAX: max(math.exp(x) for x in tokens),
        mismatch.ABS_DIFF_SAMPLE_MAX: max(sample_abs),
        mismatch.K3_SAMPLE_MAX: max(sample_k3),
    }


@pytest.mark.slow
def test_two_dp_ranks_equal_per_sample(tmp_path):
    ctx = rank_context()
    port = free_port()
    procs = [
        ctx.Process(target=in_environ(_dp_worker), args=(r, 2, port, str(tmp_path)))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
        assert p.exitcode == 0
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for name, cfg in CONFIGS.items():
        ref_loss, ref_grads = _reference(cfg)
        # the step gradient is the sum over ranks (what an all-reduce SUM would give)
        loss = sum(r[name][0] for r in ranks)
        grads = {n: ranks[0][name][1][n] + ranks[1][name][1][n] for n in ref_grads}
        assert all(r[name][0] != 0 for r in ranks)  # both ranks really carried data
        assert ranks[0][name][2] == ranks[1][name][2] > 1  # same, agreed micro-batch count
        _assert_same(loss, grads, ref_loss, ref_grads)
    # the mismatch extremes: maxima / minima over the two ranks' micro-batches, the same on both
    want = mismatch_reference(_batch())
    extremes = [k for k in want if k != mismatch.ABS_DIFF]
    for name in CONFIGS:
        assert ranks[0][name][3] == ranks[1][name][3]
        for key in extremes:  # fp32 subtractions (and exp) of values ~1; sample means of <= 30
            assert ranks[0][name][3][key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
    # each sample split over the ranks: its mean is the sum of the ranks' shares
    split = [r["split_samples"] for r in ranks]
    assert split[0] == split[1]
    for key, value in want.items():
        assert split[0][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    # --tis-batch-normalize: one mean over both ranks' samples, the same on both
    for level in ("token", "sequence"):
        assert ranks[0]["batch_mean"][level] == ranks[1]["batch_mean"][level]
        want_mean = batch_mean_reference(_batch(), level)
        assert ranks[0]["batch_mean"][level] == pytest.approx(want_mean, rel=1e-12), level
