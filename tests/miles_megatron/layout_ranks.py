"""Test support: train and publish at one parallel layout after another in one spawn
(tests/miles_megatron/test_layouts.py): the metrics of each rollout, and what a publish
delivers on each rank for both kinds of transport (rank 0 only / every rank)."""

from __future__ import annotations

from typing import Any

#: the training flags of every case; forced_reference.forced_reference runs the same math in HF
TRAIN_FLAGS = ["--weight-decay", "0", "--micro-batch-size", "2", "--advantage-estimator", "grpo"]

#: rollouts per case (test_layouts.py)
LAYOUT_ROLLOUTS = 3

#: --use-lora's flags of the LoRA case (TP=2, merged publish)
LORA_FLAGS = ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8"]


def argv_of(tp: int = 1, ep: int = 1, pp: int = 1, etp: int | None = None, a2a: bool = False):
    """The parallel flags of one layout (and the MoE token dispatcher)."""
    from megatron_ranks import layout_argv

    argv = layout_argv(tp=tp, ep=ep, pp=pp)
    if etp is not None:
        argv += ["--expert-tensor-parallel-size", str(etp)]
    return argv + ["--moe-token-dispatcher-type", "alltoall" if a2a else "allgather"]


def eight_rank_cases(hf_dirs: dict[str, str]) -> list:
    """The ``extended`` 8-rank layouts: the dense kinds of three dimensions, and the MoE kinds
    with TP or PP beside DP (test_layouts.py)."""
    from cp_ranks import cp_argv

    moe, llama = hf_dirs["qwen3_moe"], hf_dirs["llama"]
    return [
        ("llama tp2 pp2 dp2", llama, argv_of(tp=2, pp=2)),
        ("llama tp2 cp2 dp2", llama, cp_argv(cp=2, tp=2)),
        ("llama pp2 cp2 dp2", llama, cp_argv(cp=2, pp=2)),
        ("llama tp2 pp2 cp2", llama, cp_argv(cp=2, tp=2, pp=2)),
        ("moe tp2 dp4", moe, argv_of(tp=2)),  # TP without EP: the experts split by TP
        ("moe pp2 dp4", moe, argv_of(pp=2, a2a=True)),
        ("moe tp2 pp2 dp2", moe, argv_of(tp=2, pp=2, a2a=True)),
        ("moe tp2 pp2 ep2 dp2", moe, argv_of(tp=2, pp=2, ep=2, a2a=True)),
    ]


def sixteen_rank_cases(hf_dirs: dict[str, str]) -> list:
    """The ``extended`` 16-rank layout: the dense kind of all four dimensions (test_layouts.py)."""
    from cp_ranks import cp_argv

    return [("llama tp2 pp2 cp2 dp2", hf_dirs["llama"], cp_argv(cp=2, tp=2, pp=2))]


def spans_cp(argv: list[str]) -> bool:
    """Whether a case's layout has CP > 1: it trains on backend_reference's long samples (a
    short sample packed at CP = 2 lies on one CP rank), the others on its masked samples."""
    flag = "--context-parallel-size"
    return flag in argv and int(argv[argv.index(flag) + 1]) > 1


def case_samples(hf_dir: str, argv: list[str]) -> list:
    """The samples a case trains on: at CP > 1 backend_reference's long ones (:func:`spans_cp`),
    else its masked ones; every loss mask has a hole either way."""
    from backend_reference import long_samples, samples

    return long_samples() if spans_cp(argv) else samples(masked=True)


def _numpy(source) -> dict[str, Any]:
    return {k: v.detach().cpu().numpy().copy() for k, v in source}


def train_and_publish(rank: int, world: int, cases: list, rollouts: int) -> dict:
    """For each ``(label, hf_dir, argv)``: :func:`train_then_publish` (errors name the case)."""
    out: dict[str, Any] = {}
    for label, hf_dir, argv in cases:
        try:
            out[label] = train_then_publish(hf_dir, argv, rollouts)
        except Exception as error:
            raise RuntimeError(f"case {label!r}") from error
    return out


def train_then_publish(hf_dir: str, argv: list[str], rollouts: int) -> dict:
    """``rollouts`` rollouts on this rank's DP shard of the case's samples
    (:func:`case_samples`), each step's log-probs and entropies recorded
    (score_capture.captured_scores) and, as ``starts``, the weights each step starts from
    (``publish_weights()``: whole on rank 0; forced_reference steps from them), then
    ``publish_weights`` for a rank-0 transport and for an every-rank one; and the error a
    publish raises when one checkpoint name is not expected."""
    from backend_reference import LR
    from megatron_ranks import parse
    from miles_core.batch import RolloutBatch
    from miles_core.partition import partition_for_dp
    from miles_megatron.backend import MegatronBackend
    from miles_megatron.publish_source import PublishNamesError, model_weights
    from score_capture import captured_scores, last_stage

    backend = MegatronBackend()
    backend.init(parse(["--hf-checkpoint", hf_dir, "--lr", str(LR), *TRAIN_FLAGS, *argv]))
    layout = backend.data_layout()
    data = case_samples(hf_dir, argv)
    shards = partition_for_dp(RolloutBatch(data), layout.dp_size, keep_groups=True)
    batch = shards[layout.dp_rank] if layout.consumes_data else None
    result: dict[str, Any] = {"dp_size": layout.dp_size}
    # ranks that must score trained tokens: the last stage's, of a DP rank holding samples
    result["scores_tokens"] = last_stage() and len(shards[layout.dp_rank]) > 0
    result["metrics"], result["scores"], result["starts"] = [], [], []
    with captured_scores(data) as scores:
        for r in range(rollouts):
            result["starts"].append(_numpy(backend.publish_weights()))
            result["metrics"].append(backend.train(r, batch))
            result["scores"].append(scores.take())  # one optimizer step a rollout
    result["to_first"] = _numpy(backend.publish_weights())
    result["to_all"] = _numpy(backend.publish_weights(to_all=True))
    try:
        expected = backend._checkpoint_names[1:]
        for _ in model_weights(backend.hf_weights, backend.device, True, expected):
            pass
    except PublishNamesError as error:
        result["names_error"] = str(error)
    backend.close()
    return result


def two_rank_cases(hf_dirs: dict[str, str]) -> list:
    """The default suite's 2-rank layouts (test_layouts.py checks them)."""
    moe, llama = hf_dirs["qwen3_moe"], hf_dirs["llama"]
    return [
        ("moe ep2 allgather", moe, argv_of(ep=2)),
        ("moe ep2 alltoall", moe, argv_of(ep=2, a2a=True)),
        ("moe pp2", moe, argv_of(pp=2, a2a=True)),  # PP > 1 needs the all-to-all
        ("llama dp2", llama, argv_of()),
        ("llama pp2", llama, argv_of(pp=2)),
        ("llama tp2 lora", llama, [*argv_of(tp=2), *LORA_FLAGS]),
        ("moe dp2", moe, argv_of()),  # the experts' gradients averaged over DP, no EP
        ("moe tp2", moe, argv_of(tp=2)),  # TP without EP: the experts split by TP
        ("moe tp2 ep2 etp1", moe, argv_of(tp=2, ep=2, etp=1)),  # EP over the TP ranks, DP 1
    ]


def four_rank_cases(hf_dirs: dict[str, str]) -> list:
    """The ``extended`` 4-rank layouts (test_layouts.py checks them)."""
    moe, llama = hf_dirs["qwen3_moe"], hf_dirs["llama"]
    return [
        ("moe tp2 ep2 etp1 allgather", moe, argv_of(tp=2, ep=2, etp=1)),
        ("moe tp2 ep2 etp1 alltoall", moe, argv_of(tp=2, ep=2, etp=1, a2a=True)),
        ("moe tp2 ep2 etp2 allgather", moe, argv_of(tp=2, ep=2, etp=2)),
        ("moe tp2 ep2 etp2 alltoall", moe, argv_of(tp=2, ep=2, etp=2, a2a=True)),
        ("moe pp2 ep2", moe, argv_of(pp=2, ep=2, a2a=True)),
        ("llama tp2 dp2", llama, argv_of(tp=2)),
        ("llama pp2 tp2", llama, argv_of(pp=2, tp=2)),
        ("llama pp2 dp2", llama, argv_of(pp=2)),  # each stage's gradients averaged over DP
        ("moe tp2 pp2", moe, argv_of(tp=2, pp=2, a2a=True)),
        ("moe tp2 pp2 ep2 etp1", moe, argv_of(tp=2, pp=2, ep=2, etp=1, a2a=True)),  # DP 1
    ]


def layouts_then_pipeline(
    rank: int, world: int, cases: list, rollouts: int, pipeline_hf: str, save: str
) -> dict:
    """:func:`train_and_publish`, then megatron_ranks.pipeline_run, recompute_ranks.recompute_run
    and custom_spec_ranks.custom_spec_run, in the same ranks: one spawn for test_layouts.py, test_pipeline.py,
    test_recompute.py and test_custom_spec.py (megatron's import dominates a spawn)."""
    from custom_spec_ranks import custom_spec_run
    from megatron_ranks import pipeline_run
    from recompute_ranks import RECOMPUTE_CASES, recompute_run

    return {
        "layouts": train_and_publish(rank, world, cases, rollouts),
        "pipeline": pipeline_run(rank, world, pipeline_hf, save),
        "recompute": recompute_run(rank, world, pipeline_hf, RECOMPUTE_CASES),
        "custom_spec": custom_spec_run(rank, world, pipeline_hf, save + "_spec"),
    }


def fsdp_train(rank: int, world: int, hf_dir: str, rollouts: int) -> dict:
    """The layout suites' GRPO job on the FSDP backend (DP = ``world``, fp32, SDPA): per
    rollout the metrics, the step's recorded scores and the weights it starts from (as
    :func:`train_then_publish`), then the trained weights under the checkpoint's names (every
    rank)."""
    from backend_reference import LR
    from miles_core.args import core_groups, parse_args
    from miles_core.backends import load
    from miles_core.batch import RolloutBatch
    from miles_core.partition import partition_for_dp
    from score_capture import captured_scores

    cls = load("fsdp")
    argv = ["--hf-checkpoint", hf_dir, "--lr", str(LR), *TRAIN_FLAGS, "--no-bf16"]
    backend = cls()
    backend.init(
        parse_args([*argv, "--attn-implementation", "sdpa"], [*core_groups(), *cls.arg_groups()])
    )
    layout = backend.data_layout()
    data = case_samples(hf_dir, [])
    shards = partition_for_dp(RolloutBatch(data), layout.dp_size, keep_groups=True)
    batch = shards[layout.dp_rank]
    result: dict[str, Any] = {"dp_size": layout.dp_size, "scores_tokens": len(batch) > 0}
    result["metrics"], result["scores"], result["starts"] = [], [], []
    with captured_scores(data, "fsdp") as scores:
        for r in range(rollouts):
            result["starts"].append(_numpy(backend.weight_source()))
            result["metrics"].append(backend.train(r, batch))
            result["scores"].append(scores.take())
    result["optimizer_steps"] = backend.state.global_step
    result["weights"] = _numpy(backend.weight_source())
    backend.close()
    return result
