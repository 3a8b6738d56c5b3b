"""Test support: the spawned body of test_estimator_parity.py (one rollout per advantage
estimator and loss on one backend, in one process)."""

from __future__ import annotations

#: (name, extra flags): every actor estimator without a critic, both policy objectives, and
#: the SFT loss (whose entropy bonus must be 0)
CONFIGS = (
    ("grpo", ("--advantage-estimator", "grpo")),
    ("gspo", ("--advantage-estimator", "gspo")),
    ("dr_grpo", ("--advantage-estimator", "dr_grpo")),
    ("rloo", ("--advantage-estimator", "rloo")),
    ("reinforce_plus_plus", ("--advantage-estimator", "reinforce_plus_plus")),
    ("reinforce_plus_plus_baseline", ("--advantage-estimator", "reinforce_plus_plus_baseline")),
    ("cispo", ("--policy-loss", "cispo")),
    ("sft_loss", ("--loss-type", "sft_loss", "--entropy-coef", "0")),
)

KEYS = ("loss", "grad_norm", "lr", "entropy")


def estimator_rollouts(rank: int, world: int, backend_name: str, hf_dir: str) -> dict:
    """For each of :data:`CONFIGS`, a fresh ``backend_name`` trains one rollout (2 optimizer
    steps) on the masked samples carrying engine log-probs; its :data:`KEYS` metrics."""
    from backend_reference import samples
    from megatron_ranks import both_backends_backend
    from miles_core.batch import RolloutBatch

    out = {}
    for name, flags in CONFIGS:
        backend = both_backends_backend(world, backend_name, hf_dir, *flags)
        metrics = backend.train(0, RolloutBatch(samples(masked=True, engine_log_probs=True)))
        backend.close()
        out[name] = {k: metrics[k] for k in KEYS if k in metrics}
    return out
