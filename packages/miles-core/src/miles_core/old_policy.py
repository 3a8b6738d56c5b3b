"""Where a rollout's old-policy log-probs (``pi_old`` of the PPO ratio) come from: one rule for
both backends.

- ``rollout`` (``--use-rollout-logprobs``): the log-probs the engine sampled with. No forward
  pass computes them; the ratio ``pi / pi_old`` then also corrects the train/rollout mismatch
  (:mod:`miles_core.mismatch`), which is why ``--use-tis`` is refused with it (its weight
  ``pi_old / pi_rollout`` would be exactly 1).
- ``forward``: a forward pass over the whole rollout before its first optimizer step: more than
  one step per rollout (each later step's ratio is against the pre-update policy), the EMA
  policy (``--old-policy ema``), or ``--tis-batch-normalize`` (the step's mean importance
  weight is needed before the step's first micro-batch:
  :func:`miles_core.rollout_correction.with_batch_mean`).
- ``current``: one step per rollout: the old policy *is* the current one, so its log-probs are
  the training forward's, detached (no extra pass; the ratio is 1 and its gradient the policy
  gradient). ``--kl-coef``'s KL in the reward still needs the pre-update log-probs before the
  step: :func:`needs_forward` says so.
"""

from __future__ import annotations

from miles_core.args.groups import AlgorithmArgs, RolesArgs
from miles_core.batch import BatchError, RolloutBatch

ROLLOUT, FORWARD, CURRENT = "rollout", "forward", "current"


def source(algorithm: AlgorithmArgs, roles: RolesArgs) -> str:
    """:data:`ROLLOUT`, :data:`FORWARD` or :data:`CURRENT` for this run's flags (the groups of
    ``args.run_config``)."""
    if algorithm.use_rollout_logprobs:
        return ROLLOUT
    if (
        algorithm.num_steps_per_rollout > 1
        or roles.old_policy == "ema"
        or algorithm.tis_batch_normalize
    ):
        return FORWARD
    return CURRENT


def needs_forward(algorithm: AlgorithmArgs, roles: RolesArgs) -> bool:
    """Whether a forward pass computes ``old_log_probs`` before the first step."""
    kind = source(algorithm, roles)
    return kind == FORWARD or (kind == CURRENT and algorithm.kl_coef != 0.0)


def with_rollout_log_probs(batch: RolloutBatch) -> RolloutBatch:
    """``--use-rollout-logprobs``: the batch with ``old_log_probs`` = the engine's log-probs."""
    try:
        values = batch.response_field("rollout_log_probs")
    except BatchError:
        raise BatchError(
            "--use-rollout-logprobs: a sample of this rollout carries no engine log-probs (the "
            "engine returned none, or a replayed file was saved without them)"
        ) from None
    return batch.with_fields(old_log_probs=[v.float() for v in values])
