"""Test support: the spawned body of test_estimator_parity.py (one rollout per advantage
estimator and loss on one backend, in one process)."""

from __future__ import annotations

#: (name, extra flags): every actor estimator without a critic, both policy objectives, and
#: the SFT loss (whose entropy bonus must be 0). REINFORCE++ and its baseline normalise the
#: advantages over the batch as the paper does; CISPO normalises by the step's token count as
#: its paper does.
CONFIGS = (
    ("grpo", ("--advantage-estimator", "grpo")),
    ("gspo", ("--advantage-estimator", "gspo")),
    ("dr_grpo", ("--advantage-estimator", "dr_grpo")),
    ("rloo", ("--advantage-estimator", "rloo")),
    (
        "reinforce_plus_plus",
        ("--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages"),
    ),
    (
        "reinforce_plus_plus_baseline",
        ("--advantage-estimator", "reinforce_plus_plus_baseline", "--normalize-advantages"),
    ),
    ("cispo", ("--policy-loss", "cispo", "--calculate-per-token-loss")),
    ("sft_loss", ("--loss-type", "sft_loss", "--entropy-coef", "0")),
)

#: the rollout metrics compared: step means of the loss and its parts, the last step's
#: gradient norm and LR, the mean train/rollout mismatch of the old policy
KEYS = (
    "loss",
    "pg_loss",
    "sft_loss",
    "grad_norm",
    "lr",
    "entropy",
    "ppo_kl",
    "train_rollout_logprob_abs_diff",
)


def estimator_rollouts(rank: int, world: int, backend_name: str, hf_dir: str) -> dict:
    """For each of :data:`CONFIGS`, a fresh ``backend_name`` trains one rollout (2 optimizer
    steps, the LR decaying as ``estimator_reference.SCHEDULE_FLAGS`` say) on the masked samples carrying engine log-probs; its :data:`KEYS` metrics, as
    ``log_probs`` each sample's response log-probs after the rollout (plain lists) and as
    ``weights`` the trained weights in the HF checkpoint's names."""
    from backend_reference import samples
    from estimator_reference import SCHEDULE_FLAGS
    from megatron_ranks import both_backends_backend
    from miles_core.batch import RolloutBatch

    out = {}
    for name, flags in CONFIGS:
        backend = both_backends_backend(world, backend_name, hf_dir, *flags, *SCHEDULE_FLAGS)
        batch = RolloutBatch(samples(masked=True, engine_log_probs=True))
        metrics = backend.train(0, batch)
        if backend_name == "megatron":  # no reference model: the actor's own log-probs
            after = backend.reference_log_probs(batch)
            weights = backend.hf_weights()
        else:
            after = backend.eval_log_probs(batch)
            weights = backend.weight_source()
        # copies: no shared-memory handles to the parent
        weights = {k: v.detach().cpu().numpy().copy() for k, v in weights}
        backend.close()
        out[name] = {k: metrics[k] for k in KEYS if k in metrics}
        out[name]["log_probs"] = [t.tolist() for t in after]
        out[name]["weights"] = weights
    return out
