"""Test support: context parallelism (tests/miles_megatron/test_context_parallel.py).

:func:`rl_layouts` trains the same RL recipe (reference model and KL loss, entropy bonus, two
optimizer steps per rollout, so the old log-prob pass runs) at one layout after another in one
spawn and returns each layout's metrics, final weights and the reference's log-probs (the
log-prob pass, gathered over CP) of its samples (which carry engine log-probs: the train/rollout
mismatch metrics, extremes included, are among the metrics); with a
``save`` directory the last layout saves and a CP = 1 backend loads that checkpoint.
"""

from __future__ import annotations

from typing import Any

#: the RL recipe every layout trains (backend_reference's samples, 4 per rollout)
RL_FLAGS = [
    "--lr", "1e-3", "--weight-decay", "0", "--micro-batch-size", "2",
    "--advantage-estimator", "grpo", "--num-steps-per-rollout", "2",
    "--entropy-coef", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.5",
    "--kl-loss-type", "low_var_kl", "--eps-clip", "0.1",
]  # fmt: skip

RL_ROLLOUTS = 2


def cp_argv(cp: int = 1, tp: int = 1, pp: int = 1) -> list[str]:
    from megatron_ranks import layout_argv

    return [*layout_argv(tp=tp, pp=pp), "--context-parallel-size", str(cp)]


def cp_two_rank_cases(llama: str) -> list:
    """The default suite's 2-rank CP case against HF + AdamW (layout_ranks.train_and_publish)."""
    return [("llama cp2", llama, cp_argv(cp=2))]


def four_rank_cp_cases(llama: str) -> list:
    """The ``extended`` 4-rank CP cases against HF + AdamW (test_context_parallel.py)."""
    return [
        ("llama cp2 tp2", llama, cp_argv(cp=2, tp=2)),
        ("llama cp2 pp2", llama, cp_argv(cp=2, pp=2)),
        ("llama cp2 dp2", llama, cp_argv(cp=2)),  # two CP groups, each on its DP shard
    ]


#: the RL recipe's 2-rank layouts (cp_default_run): CP = 2 against TP = 2 (DP = 1)
CP_TWO_RANK_RL_LAYOUTS = [("tp2", cp_argv(tp=2)), ("cp2", cp_argv(cp=2))]


def _one_layout(hf_dir: str, argv: list[str], save: str | None) -> dict[str, Any]:
    from backend_reference import samples
    from megatron_ranks import parse
    from miles_core.batch import RolloutBatch
    from miles_core.partition import partition_for_dp
    from miles_megatron.backend import MegatronBackend

    full = ["--hf-checkpoint", hf_dir, "--ref-load", hf_dir, *RL_FLAGS, *argv]
    backend = MegatronBackend()
    backend.init(parse(full + (["--save", save] if save else [])))
    layout = backend.data_layout()
    batch = RolloutBatch(samples(engine_log_probs=True))  # the mismatch metrics are reported
    shards = partition_for_dp(batch, layout.dp_size, keep_groups=True)
    batch = shards[layout.dp_rank] if layout.consumes_data else None
    metrics = [backend.train(r, batch) for r in range(RL_ROLLOUTS)]
    weights = {k: v.detach().cpu().numpy().copy() for k, v in backend.hf_weights()}
    mine = backend._share_with_model_parallel_peers(batch)
    ref = backend.reference_log_probs(mine)  # the log-prob pass, at --ref-load's weights
    if save:
        backend.save_model(RL_ROLLOUTS - 1)
    backend.close()
    return {
        "metrics": metrics,
        "weights": weights,
        "ref_log_probs": {s: v.tolist() for s, v in zip(mine.source_indices, ref, strict=True)},
    }


def _reload_at_cp1(hf_dir: str, save: str) -> dict:
    from megatron_ranks import parse
    from miles_megatron.backend import MegatronBackend

    backend = MegatronBackend()
    argv = ["--hf-checkpoint", hf_dir, *RL_FLAGS[:4], "--load", save, *cp_argv(cp=1)]
    backend.init(parse(argv))
    weights = {k: v.detach().cpu().numpy().copy() for k, v in backend.hf_weights()}
    backend.close()
    return weights


def rl_layouts(rank: int, world: int, hf_dir: str, layouts: list, save: str | None) -> dict:
    """For each ``(label, argv)``: the RL recipe's results (module docstring); with ``save``,
    the last layout's checkpoint reloaded at CP = 1 (``"reloaded"``: its weights)."""
    out: dict[str, Any] = {}
    for i, (label, argv) in enumerate(layouts):
        last = i == len(layouts) - 1
        try:
            out[label] = _one_layout(hf_dir, argv, save if last else None)
        except Exception as error:
            raise RuntimeError(f"layout {label!r}") from error
    if save:
        out["reloaded"] = _reload_at_cp1(hf_dir, save)
    return out


def sft_step(hf_dir: str, argv: list[str]) -> dict[str, float]:
    """One ``--loss-type sft_loss`` step (sequence mean, lr 0, no clipping) on
    backend_reference's long samples, one per micro-batch: its metrics."""
    from backend_reference import long_samples
    from megatron_ranks import parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    flags = ["--hf-checkpoint", hf_dir, "--loss-type", "sft_loss", "--lr", "0"]
    flags += ["--clip-grad", "1e6", "--micro-batch-size", "1", "--advantage-estimator", "grpo"]
    backend = MegatronBackend()
    backend.init(parse([*flags, *argv]))
    metrics = backend.train(0, RolloutBatch(long_samples()))
    backend.close()
    return metrics


def critic_step(hf_dir: str, argv: list[str]) -> dict[str, Any]:
    """The critic's values of backend_reference's long samples (one per micro-batch) and its
    first value-loss step's metrics, at the layout of ``argv``."""
    from backend_reference import long_samples
    from critic_ranks import _critic, _scored_batch, critic_argv

    backend, _ = _critic(critic_argv(hf_dir, 1, "--micro-batch-size", "1", *argv))
    batch = _scored_batch(backend, long_samples())
    metrics = backend.train(0, batch)
    # plain lists: a tensor would reach the parent as a shared-memory handle of an exited rank
    values = [v.tolist() for v in batch.response_field("values")]
    backend.close()
    return {"values": values, "metrics": metrics}


def critic_layout(rank: int, world: int, hf_dir: str, argv: list[str]) -> dict[str, Any]:
    """:func:`critic_step` on every rank of a spawn (test_context_parallel.py, CP = 2 x TP = 2)."""
    return critic_step(hf_dir, argv)


def cp_default_run(rank: int, world: int, hf_dir: str, rollouts: int, save: str) -> dict:
    """The default suite's one 2-rank spawn: CP = 2 against HF + AdamW (GRPO) with both
    publishes (layout_ranks.train_and_publish), then the RL recipe at CP = 1 (DP = 2) and
    CP = 2 with the CP = 2 checkpoint reloaded at CP = 1, then an sft step and a critic step at
    CP = 2 on samples whose loss tokens reach both CP ranks."""
    from layout_ranks import train_and_publish

    return {
        "layouts": train_and_publish(rank, world, cp_two_rank_cases(hf_dir), rollouts),
        "rl": rl_layouts(rank, world, hf_dir, CP_TWO_RANK_RL_LAYOUTS, save),
        "sft": sft_step(hf_dir, cp_argv(cp=2)),
        "critic": critic_step(hf_dir, cp_argv(cp=2)),
    }
