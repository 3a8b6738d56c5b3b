"""Test support: per-rank bodies for the spawned megatron tests (importable by spawn children)."""

from __future__ import annotations

from typing import Any

import torch

#: the tests' default precision: fp32 on the CPU (the CLI's default is bf16)
PRECISION_FLAGS = ("--bf16", "--no-bf16", "--fp16")


def parse(argv: list[str]):
    """The core and megatron groups' parse of ``argv``, in fp32 (``--no-bf16``) unless
    ``argv`` names a precision."""
    from miles_core.args import core_groups, parse_args
    from miles_megatron.args import megatron_groups

    if not set(PRECISION_FLAGS) & set(argv):
        argv = ["--no-bf16", *argv]
    return parse_args(argv, [*core_groups(), *megatron_groups()])


def layout_argv(tp: int = 1, ep: int = 1, pp: int = 1) -> list[str]:
    argv = ["--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep)]
    argv += ["--pipeline-model-parallel-size", str(pp)]
    return argv + (["--sequence-parallel"] if tp > 1 else [])


def build_from_hf(hf_dir: str, argv: list[str]):
    """Parallel state + model loaded from ``hf_dir``; returns (args, margs, model, bridge)."""
    from miles_megatron.arch_args import resolve_model_args
    from miles_megatron.bridge import bridge_for
    from miles_megatron.hf_weights import HFCheckpoint, load_hf_into_model
    from miles_megatron.model_config import build_gpt_model
    from miles_megatron.parallel import initialize_parallel

    args = parse(["--hf-checkpoint", hf_dir, *argv])
    margs = resolve_model_args(args)
    initialize_parallel(args, margs)
    model = build_gpt_model(margs, args)
    bridge = bridge_for(margs["model_type"])
    load_hf_into_model(model, HFCheckpoint(hf_dir), bridge, margs, args.tensor_model_parallel_size)
    return args, margs, model, bridge


def causal_logits(model, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    s = input_ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    positions = torch.arange(s)[None].expand_as(input_ids)
    with torch.no_grad():
        out = model(input_ids, positions, attention_mask=mask)
    return out[..., :vocab_size]


def logits_and_roundtrip(
    rank: int,
    world: int,
    cases: list[tuple[str, str, list[str]]],
    input_ids: torch.Tensor,
    references: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """For each (label, hf_dir, layout argv): max |megatron - HF| logits and HF->meg->HF exactness."""
    from miles_megatron.hf_weights import iter_hf_weights
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for label, hf_dir, argv in cases:
        _, margs, model, bridge = build_from_hf(hf_dir, argv)
        logits = causal_logits(model, input_ids, margs["vocab_size"])
        original = load_file(f"{hf_dir}/model.safetensors")
        exported = dict(iter_hf_weights(model, bridge, margs))
        exact = sorted(exported) == sorted(original) and all(
            torch.equal(exported[k], original[k]) for k in original
        )
        out[label] = {
            "max_diff": (logits - references[label]).abs().max().item(),
            "roundtrip_exact": exact,
            "missing": sorted(set(original) - set(exported)),
        }
    return out


def save_then_reload(
    rank: int,
    world: int,
    hf_dir: str,
    save_dir: str,
    save_argv: list[str],
    load_argv: list[str],
    input_ids: torch.Tensor,
) -> dict[str, float]:
    """Save torch_dist at one layout, reload at another into a freshly initialised model."""
    import torch.distributed as dist
    from miles_megatron.arch_args import resolve_model_args
    from miles_megatron.model_config import build_gpt_model
    from miles_megatron.parallel import initialize_parallel
    from miles_megatron.torch_dist import load_model_weights, save_model_weights

    _, margs, model, _ = build_from_hf(hf_dir, save_argv)
    before = causal_logits(model, input_ids, margs["vocab_size"])
    save_model_weights(model, save_dir)
    dist.barrier()
    args = parse(["--hf-checkpoint", hf_dir, *load_argv])
    initialize_parallel(args, margs)
    fresh = build_gpt_model(resolve_model_args(args), args)  # random init
    random_logits = causal_logits(fresh, input_ids, margs["vocab_size"])
    load_model_weights(fresh, save_dir)
    after = causal_logits(fresh, input_ids, margs["vocab_size"])
    return {
        "reload_diff": (after - before).abs().max().item(),
        "random_diff": (random_logits - before).abs().max().item(),
    }


def convert_both_ways(rank: int, world: int, hf_dir: str, ckpt: str, out: str) -> None:
    """hf-to-torch-dist at TP=2, then torch-dist-to-hf at TP=1 (DP=2), as the CLI would: no
    precision flag, so each direction keeps its source's dtype (fp32 here, not the bf16 a
    training run defaults to)."""
    from miles_core.args import core_groups, parse_args
    from miles_megatron.args import megatron_groups
    from miles_megatron.convert import hf_to_torch_dist, torch_dist_to_hf

    def cli(argv):
        return parse_args(argv, [*core_groups(), *megatron_groups()])

    hf_to_torch_dist(cli(["--hf-checkpoint", hf_dir, "--save", ckpt, *layout_argv(tp=2)]))
    torch_dist_to_hf(
        cli(["--hf-checkpoint", hf_dir, "--load", ckpt, "--save", out, *layout_argv(tp=1)])
    )


def packed_log_probs_match(
    rank: int, world: int, hf_dir: str, samples: list, references: list[torch.Tensor]
) -> float:
    """Response log-probs of a THD-packed micro-batch at TP=2 vs per-sample HF references."""
    from miles_core.batch import RolloutBatch
    from miles_megatron.packed_forward import rollout_log_probs

    _, margs, model, _ = build_from_hf(hf_dir, layout_argv(tp=2))
    batch = RolloutBatch(samples)
    out = rollout_log_probs(
        model,
        [batch],
        len(batch),
        {i: i for i in range(len(batch))},
        margs["vocab_size"],
        0.7,
        torch.device("cpu"),
    )
    return max((a - b).abs().max().item() for a, b in zip(out, references, strict=True))


def backend_run(rank: int, world: int, hf_dir: str, save: str, tp: int) -> dict:
    from backend_reference import run_backend

    return run_backend(hf_dir, save, tp)


# fp32 on both backends (--no-bf16): their agreement is checked at 1e-5
BOTH_BACKENDS_FLAGS = [
    "--lr", "1e-3", "--weight-decay", "0", "--entropy-coef", "0.01", "--micro-batch-size", "2",
    "--advantage-estimator", "grpo", "--num-steps-per-rollout", "2", "--no-bf16",
]  # fmt: skip

HOOK_CALLS: list[tuple] = []


def init_hook(args, model, optimizer) -> None:
    HOOK_CALLS.append(("init", type(optimizer).__name__))


def log_prob_hook(args, model, batch) -> None:
    HOOK_CALLS.append(("log_prob", len(batch)))


def train_step_hook(args, rollout_id, step, model, optimizer) -> None:
    HOOK_CALLS.append(("train_step", rollout_id, step))


HOOK_FLAGS = [
    "--custom-megatron-init-path", "megatron_ranks:init_hook",
    "--custom-megatron-before-log-prob-hook-path", "megatron_ranks:log_prob_hook",
    "--custom-megatron-before-train-step-hook-path", "megatron_ranks:train_step_hook",
]  # fmt: skip


def both_backends_backend(world: int, backend_name: str, hf_dir: str, *extra: str):
    """``backend_name`` ("megatron" at TP=world with the hooks, or "fsdp") initialised from
    ``hf_dir`` with :data:`BOTH_BACKENDS_FLAGS` and ``extra``."""
    from miles_core.args import core_groups, parse_args
    from miles_core.backends import load

    cls = load(backend_name)
    argv = ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *extra]
    if backend_name == "megatron":
        argv += layout_argv(tp=world) + HOOK_FLAGS
    else:
        argv += ["--attn-implementation", "sdpa"]
    backend = cls()
    backend.init(parse_args(argv, [*core_groups(), *cls.arg_groups()]))
    return backend


def rollout_losses(rank: int, world: int, backend_name: str, hf_dir: str, rollouts: int):
    """Per-rollout loss, train/rollout mismatch, importance-ratio std and extremes, and the
    step's mean TIS weight of ``backend_name`` ("megatron" at TP=world, or "fsdp") on one batch
    that carries engine log-probs, with token-level TIS normalised over each step's batch."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch

    tis = ["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5", "--tis-batch-normalize"]
    backend = both_backends_backend(world, backend_name, hf_dir, *tis)
    batch = RolloutBatch(samples(engine_log_probs=True))
    metrics = [backend.train(r, batch) for r in range(rollouts)]
    backend.close()
    keys = (
        "loss",
        "train_rollout_logprob_abs_diff",
        "train_rollout_is_ratio_std",
        "train_rollout_logprob_abs_diff_max",
        "train_rollout_is_ratio_min",
        "train_rollout_logprob_abs_diff_sample_max",
        "tis_batch_mean",
    )
    return [[m[k] for k in keys] for m in metrics], list(HOOK_CALLS)


def rollout_logprob_run(rank: int, world: int, backend_name: str, hf_dir: str, steps: int):
    """One rollout of ``backend_name`` with ``--use-rollout-logprobs`` (and ``--use-opsm``
    against the engine's log-probs) and ``steps`` optimizer steps on the masked samples
    carrying engine log-probs: its metrics and the hooks called."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch

    backend = both_backends_backend(
        world, backend_name, hf_dir, "--use-rollout-logprobs", "--num-steps-per-rollout",
        str(steps), "--use-opsm", "--opsm-delta", "0",
    )  # fmt: skip
    metrics = backend.train(0, RolloutBatch(samples(masked=True, engine_log_probs=True)))
    backend.close()
    return metrics, list(HOOK_CALLS)


def reference_pass(rank: int, world: int, hf_dir: str) -> dict:
    """Train 2 rollouts with --ref-load + KL loss, then the reference log-prob pass."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    argv = ["--hf-checkpoint", hf_dir, "--ref-load", hf_dir, "--use-kl-loss"]
    argv += ["--kl-loss-coef", "0.5", *BOTH_BACKENDS_FLAGS, *layout_argv(tp=world)]
    argv += ["--num-steps-per-rollout", "1"]  # rollout 0's only step: actor == reference
    backend = MegatronBackend()
    backend.init(parse(argv))
    batch = RolloutBatch(samples())
    metrics = [backend.train(r, batch) for r in range(2)]
    before = {k: v.clone() for k, v in backend.hf_weights()}
    ref = backend.reference_log_probs(batch)
    after = dict(backend.hf_weights())
    backend.close()
    return {
        "kl": [m["kl_loss"] for m in metrics],
        "ref": [t.tolist() for t in ref],  # plain lists: no shared-memory handles to the parent
        "actor_restored": all(torch.equal(before[k], after[k]) for k in before),
    }


SPEC_CALLS: list[tuple] = []


def custom_spec(args, config, vp_stage):
    """A ``--spec`` function for the tests: records its arguments, returns a marker."""
    SPEC_CALLS.append((args.spec, config, vp_stage))
    return "custom-spec"


def sleep_between_rollouts(rank: int, world: int, hf_dir: str) -> list[dict]:
    """Two runs of 2 rollouts: sleeping (twice: idempotence) and waking in between, and not."""
    return [_two_rollouts(hf_dir, world, sleep=True), _two_rollouts(hf_dir, world, sleep=False)]


def _two_rollouts(hf_dir: str, world: int, sleep: bool) -> dict:
    from backend_reference import samples
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    backend = MegatronBackend()
    backend.init(parse(["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *layout_argv(tp=world)]))
    batch = RolloutBatch(samples())
    losses = [backend.train(0, batch)["loss"]]
    awake_bytes = backend.sleeper.device_bytes()
    asleep_bytes = None
    if sleep:
        backend.sleep()
        backend.sleep()
        asleep_bytes = backend.sleeper.device_bytes()
        backend.wake_up()
        backend.wake_up()
    losses.append(backend.train(1, batch)["loss"])
    weights = {k: v.tolist() for k, v in backend.hf_weights()}
    backend.close()
    return {"losses": losses, "awake": awake_bytes, "asleep": asleep_bytes, "weights": weights}


def pipeline_run(rank: int, world: int, hf_dir: str, save: str) -> dict:
    """PP=2 for 2 rollouts and a save; PP=1 (TP=2) on the same data; the PP=2 save at PP=1."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    flags = ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS]
    out: dict[str, Any] = {}
    for label, pp, load in (("pp2", 2, None), ("pp1", 1, None), ("pp1_from_pp2", 1, save)):
        argv = flags + layout_argv(pp=pp, tp=world // pp)
        argv += ["--load", load, "--save", save + "_2"] if load else ["--save", save]
        backend = MegatronBackend()
        out[label + "_next_id"] = backend.init(parse(argv))
        layout = backend.data_layout()
        out[label + "_consumes"] = layout.consumes_data
        batch = RolloutBatch(samples()) if layout.consumes_data else None
        if not load:
            out[label] = [backend.train(r, batch) for r in range(2)]
        if label == "pp2":
            backend.save_model(1)
        out[label + "_weights"] = {k: v.tolist() for k, v in backend.hf_weights()}
        backend.close()
    return out


def _draws() -> list[float]:
    import random

    import numpy as np

    return [random.random(), float(np.random.rand()), *torch.rand(2).tolist()]


def async_then_sync_saves(rank: int, world: int, hf_dir: str, root: str) -> dict:
    """The same 3 rollouts saving after rollouts 0 (forced sync) and 1, with and without
    --async-save; then each save of rollout 1 resumed (weights, RNG draws, the next loss)."""
    from pathlib import Path

    import torch.distributed as dist
    from backend_reference import samples
    from miles_core.batch import RolloutBatch
    from miles_core.checkpoint_layout import read_tracker
    from miles_core.save_trigger import SaveTrigger, agree_on_all_ranks, should_save
    from miles_megatron.backend import MegatronBackend

    flags = ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *layout_argv(tp=world)]
    batch = RolloutBatch(samples())
    out: dict[str, Any] = {}
    for mode in ("async", "sync"):
        save = f"{root}/{mode}"
        backend = MegatronBackend()
        backend.init(
            parse([*flags, "--save", save] + (["--async-save"] if mode == "async" else []))
        )
        backend.train(0, batch)
        # a --save-trigger-sentinel request at the launcher's save point: a forced sync save
        sentinel = Path(f"{root}/{mode}_save_now")
        if rank == 0:
            sentinel.touch()
        dist.barrier()
        trigger = SaveTrigger(sentinel)
        if agree_on_all_ranks(should_save(0, None, trigger)):
            backend.save_model(0, force_sync=trigger.armed)
        out[mode + "_tracker_forced"] = read_tracker(save)  # durable on return
        if rank == 0:
            trigger.consume()
        dist.barrier()
        out[mode + "_sentinel_left"] = sentinel.exists()
        backend.train(1, batch)
        for _ in range(rank + 1):  # each rank's streams away from the seed, and from its peer's
            _draws()
        backend.save_model(1)
        out[mode + "_tracker_in_flight"] = read_tracker(save)
        out[mode + "_draws"] = _draws()
        out[mode + "_weights"] = {k: v.tolist() for k, v in backend.hf_weights()}
        out[mode + "_loss_2"] = backend.train(2, batch)["loss"]
        backend.close()
        out[mode + "_tracker_closed"] = read_tracker(save)
    for mode in ("async", "sync"):
        backend = MegatronBackend()
        load = ["--load", f"{root}/{mode}", "--save", f"{root}/{mode}_resumed"]
        out[mode + "_resumed_id"] = backend.init(parse([*flags, *load]))
        out[mode + "_resumed_draws"] = _draws()
        out[mode + "_resumed_weights"] = {k: v.tolist() for k, v in backend.hf_weights()}
        out[mode + "_resumed_loss_2"] = backend.train(2, batch)["loss"]
        backend.close()
    return out


def kl_in_reward_loss(rank: int, world: int, hf_dir: str, ref_dir: str, kl_coef: float) -> float:
    """One rollout of reinforce_plus_plus with --kl-coef against the reference ``ref_dir``."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    argv = ["--hf-checkpoint", hf_dir, "--ref-load", ref_dir, "--kl-coef", str(kl_coef)]
    argv += ["--advantage-estimator", "reinforce_plus_plus", "--micro-batch-size", "2"]
    backend = MegatronBackend()
    backend.init(parse(argv))
    loss = backend.train(0, RolloutBatch(samples()))["loss"]
    backend.close()
    return loss


def check_pipeline(r0: dict, r1: dict) -> None:
    """The assertions on :func:`pipeline_run`'s two ranks (CPU gloo and GPU NCCL tests)."""
    assert [r0["pp2_consumes"], r1["pp2_consumes"]] == [True, False]  # stage 0 reads the data
    for m0, m1 in zip(r0["pp2"], r1["pp2"], strict=True):  # the last stage's, on both stages
        m0.pop("tokens_per_s"), m1.pop("tokens_per_s")  # timed per rank
        assert m0 == m1
    for pp2, pp1 in zip(r0["pp2"], r0["pp1"], strict=True):
        assert abs(pp2["loss"] - pp1["loss"]) < 1e-5, (pp2, pp1)
        assert abs(pp2["grad_norm"] - pp1["grad_norm"]) < 1e-5, (pp2, pp1)
        assert abs(pp2["entropy"] - pp1["entropy"]) < 1e-5, (pp2, pp1)
    assert r0["pp2"][0]["loss"] != r0["pp2"][1]["loss"]

    # each stage publishes its own layers; together they are the whole model
    stage0, stage1 = r0["pp2_weights"], r1["pp2_weights"]
    assert not set(stage0) & set(stage1)
    assert "model.embed_tokens.weight" in stage0 and "lm_head.weight" in stage1
    assert "model.layers.0.mlp.up_proj.weight" in stage0
    assert "model.layers.1.mlp.up_proj.weight" in stage1
    pp2 = {k: torch.tensor(v) for k, v in {**stage0, **stage1}.items()}
    pp1 = {k: torch.tensor(v) for k, v in r0["pp1_weights"].items()}
    assert sorted(pp2) == sorted(pp1)
    assert max((pp2[k] - pp1[k]).abs().max().item() for k in pp1) < 1e-5

    assert r0["pp1_from_pp2_next_id"] == 2
    resumed = {k: torch.tensor(v) for k, v in r0["pp1_from_pp2_weights"].items()}
    assert sorted(resumed) == sorted(pp2)
    assert all(torch.equal(resumed[k], pp2[k]) for k in pp2)


def head_scores_and_grads(
    rank: int, world: int, cases: list[tuple[str, str, float, bool]], samples: list, out_dir: str
) -> None:
    """Per case ``(label, hf_dir, temperature, fused)`` at TP=2 with sequence parallelism: the
    response log-probs/entropies of one THD-packed micro-batch through megatron's schedule and
    the gradients (this rank's shards) of ``sum(a * log_prob + b * entropy)``, saved to
    ``out_dir/rank{rank}.pt`` (tensors do not travel through the result queue)."""
    from miles_core.batch import RolloutBatch
    from miles_core.packing import pack_thd, unpack_response
    from miles_megatron.output_head import ScoreHead
    from miles_megatron.schedule import run_schedule

    out: dict[str, Any] = {}
    for label, hf_dir, temperature, fused in cases:
        _, margs, model, _ = build_from_hf(hf_dir, layout_argv(tp=2))
        packed = pack_thd(RolloutBatch(samples))
        values: dict[str, list] = {}

        def on_scores(index, shard, lp, ent, values=values):
            packed = shard.full  # CP = 1: the shard is the whole row
            loss = lp.new_zeros(())
            values["lp"] = [v.detach().clone() for v in unpack_response(packed, lp)]
            values["ent"] = [v.detach().clone() for v in unpack_response(packed, ent)]
            for i, (lp_i, ent_i) in enumerate(
                zip(unpack_response(packed, lp), unpack_response(packed, ent), strict=True)
            ):
                a, b = head_token_weights(i, lp_i.numel())
                loss = loss + (a * lp_i).sum() + (b * ent_i).sum()
            return loss

        head = ScoreHead(margs["vocab_size"], temperature, fused, entropy_grad=True)
        run_schedule(model, [packed], head, on_scores, forward_only=False)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out[label] = {**values, "grads": grads}
    torch.save(out, f"{out_dir}/rank{rank}.pt")


def head_token_weights(sample_index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(n, dtype=torch.float32)
    return torch.sin(7.0 * sample_index + t), torch.cos(3.0 * sample_index + 0.5 * t)
