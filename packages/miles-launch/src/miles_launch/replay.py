"""``--load-debug-rollout-data``: the loop without engines. Each rollout's batch is read from
the file a ``--save-debug-rollout-data`` run wrote (:mod:`miles_launch.rollout.debug_data`)
and trained as the synchronous loop trains it (:class:`~miles_launch.loop.RolloutTraining`:
with ``--use-critic`` the critic scores the batch and trains on it, then the actor trains on
the batch with the critic's values, after the first ``--num-critic-only-steps`` rollouts);
checkpoints are saved as in the synchronous loop. Nothing is generated, published or
evaluated, so a replay isolates the trainer: started from the saving run's checkpoint (or
``--hf-checkpoint``) with its seeds and layout, each step is bitwise the saving run's, the
critic's included.
"""

from __future__ import annotations

import time
from typing import Any

from miles_core.save_trigger import SaveTrigger

from miles_launch.job import Job
from miles_launch.loop import RolloutTraining, save_point
from miles_launch.rollout.debug_data import data_path, load_rollout_data


def run_replay(job: Job) -> list[dict[str, Any]]:
    """Train on the saved rollouts ``next_rollout_id .. --num-rollout - 1``; the records."""
    args = job.args
    template = args.load_debug_rollout_data
    trigger = SaveTrigger(args.save_trigger_sentinel) if args.save_trigger_sentinel else None
    job.reporter.print(f"replaying rollouts from {template} (no engines)")
    records = []
    for rollout_id in range(job.state.next_rollout_id, args.num_rollout):
        times: dict[str, float] = {}
        position = job.state.data_position
        t = time.monotonic()
        batch, info = load_rollout_data(template, rollout_id)
        times["load"] = time.monotonic() - t
        job.state.data_position = int(info.get("data_position", position))

        t = time.monotonic()
        training = RolloutTraining(job, rollout_id, batch)
        training.critic()
        train_metrics = training.actor()
        times["train"] = time.monotonic() - t

        t = time.monotonic()
        saved = save_point(job, rollout_id, trigger)
        times["save"] = time.monotonic() - t
        job.state.next_rollout_id = rollout_id + 1

        record = {
            "rollout_id": rollout_id,
            "data_position": position,
            "prompt_ids": info.get("prompt_ids", []),
            "rollout": info["rollout"],
            "train": train_metrics,
            "time": times,
            "weight_version": None,
            "saved": saved,
            "replayed_from": str(data_path(template, rollout_id)),
        }
        job.reporter.rollout(record)
        records.append(record)
    return records
