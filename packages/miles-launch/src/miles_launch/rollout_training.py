"""One rollout's training, the same in every loop (synchronous, fully async, replay): the
critic's phase, then the actor's.

With ``--use-critic`` the critic scores the batch with its pre-update values (the ``values``
field the actor's GAE reads) and trains on it. Where it lives decides the order:

* in the trainer's ranks (the default): scoring and training run before the actor wakes, and
  under ``--offload-train`` the critic is awake for this phase only, so the critic and the
  actor never hold the device at once;
* on its own ranks (``--critic-num-nodes`` / ``--critic-num-gpus-per-node``): it scores the
  batch (sharded by its own data-parallel degree, the values put back in batch order), then
  trains on its own GPUs while the actor trains on the trainer's; the rollout's training ends
  when both have. It never sleeps: no engine shares its GPUs.
"""

from __future__ import annotations

from typing import Any

from miles_launch.reporting import rank0_metrics


def critic_phase(job: Any, rollout_id: int, batch: Any) -> tuple[Any, dict[str, float]]:
    """The critic in the trainer's ranks (``--use-critic``; awake only for this phase under
    ``--offload-train``) scores the batch with its pre-update values and trains on it; returns
    the batch with its ``values`` field and the critic's metrics (``critic/<name>``).
    Without a critic: the batch unchanged and no metrics."""
    args, trainer = job.args, job.trainer
    if not args.use_critic:
        return batch, {}
    if args.offload_train:
        trainer.wake_up("critic")
    batch = trainer.critic_values(batch)
    metrics = rank0_metrics(trainer.train_critic(rollout_id, batch))
    if args.offload_train:
        trainer.sleep("critic")
    return batch, critic_names(metrics)


def critic_names(metrics: dict[str, float]) -> dict[str, float]:
    return {f"critic/{k}": v for k, v in metrics.items()}


class RolloutTraining:
    """One rollout's training in the cycle's two slots: :meth:`critic` (before the actor
    wakes) and :meth:`actor` (the actor's train, skipped during the first
    ``--num-critic-only-steps`` rollouts, with the critic's metrics)."""

    def __init__(self, job: Any, rollout_id: int, batch: Any) -> None:
        self.job, self.rollout_id, self.batch = job, rollout_id, batch
        self.critic_metrics: dict[str, float] = {}
        self.critic_training: Any = None  # a critic on its own ranks, training meanwhile

    def critic(self) -> None:
        own = getattr(self.job, "critic", None)  # a critic on its own ranks
        if own is None:
            self.batch, self.critic_metrics = critic_phase(self.job, self.rollout_id, self.batch)
            return
        self.batch = own.critic_values(self.batch)
        self.critic_training = own.start_train_critic(self.rollout_id, self.batch)

    def actor(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.rollout_id >= self.job.args.num_critic_only_steps:
            metrics = rank0_metrics(self.job.trainer.train(self.rollout_id, self.batch))
        if self.critic_training is not None:
            self.critic_metrics = critic_names(rank0_metrics(self.critic_training.result()))
            self.critic_training = None
        return {**metrics, **self.critic_metrics}
