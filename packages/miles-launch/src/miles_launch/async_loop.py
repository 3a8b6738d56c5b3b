"""The fully asynchronous loop (``--fully-async``, ``train_async`` in the seeds).

Generation never waits for a training step: a producer thread keeps ``--rollout-batch-size``
(``--over-sampling-batch-size`` when set) prompt groups in flight on the engines and queues
each group as it completes, unless ``--dynamic-filter`` drops it (it holds back while a
whole rollout of completed groups is already queued, so samples are at most about one
publication stale). The driver takes the next ``--rollout-batch-size`` completed groups,
trains on them while the producer keeps generating, and publishes weights every
``--update-weights-interval`` rollouts (the publisher pauses the engines around the swap;
requests in flight resume on the new weights).

Each sample records the weight version it was generated with; its *staleness* is the
engines' version at training time minus that version (0 = on-policy). Each rollout logs the
mean and max staleness and the *overlap*: the seconds of its training during which at least
one generation request was running, out of the training time. ``--max-weight-staleness N``
bounds it: a group with a sample more than N versions stale is dropped before training (its
prompt is not drawn again), counted in ``stale_groups_dropped``.

With ``--use-critic`` (PPO), each rollout's critic phase runs as in the synchronous loop
(:mod:`miles_launch.rollout_training`): the critic scores the batch with its current values
(GAE reads them), then trains on it, before the actor's training or, on its own ranks, during
it.

Disaggregated only (``--colocate`` is rejected at argument validation). On resume, groups that
were in flight when the checkpoint was written are skipped (their prompts were drawn).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

from miles_core.save_trigger import SaveTrigger

from miles_launch.engine_launch.watch_timing import WATCH_INTERVAL_S
from miles_launch.job import Job
from miles_launch.loop import (
    add_eval,
    eval_before_training,
    make_generator,
    publish,
    recovery_metrics,
    rollout_stats,
    sampling_config,
    save_debug_rollout,
    save_point,
)
from miles_launch.rollout.filtering import group_filter, groups_in_flight
from miles_launch.rollout.generate import GeneratedSample, all_or_cancel, to_rollout_batch
from miles_launch.rollout_training import RolloutTraining

logger = logging.getLogger(__name__)


def union_overlap(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """Seconds of ``window`` covered by the union of ``intervals``."""
    lo, hi = window
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    covered, end = 0.0, lo
    for a, b in clipped:
        a = max(a, end)
        if b > a:
            covered += b - a
            end = b
    return covered


class Producer:
    """The generation thread: its own asyncio loop, a fixed number of groups in flight."""

    def __init__(self, job: Job):
        self.job = job
        self.out: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.request_intervals: list[tuple[float, float]] = []
        self.in_flight_since: dict[int, float] = {}
        self.group_filter = group_filter(job.args)
        self.thread = threading.Thread(target=self._run, name="miles-producer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _next_item(self):
        state = self.job.state
        position = state.data_position
        state.data_position += 1
        return self.job.prompts[self.job.order.index_at(position)], position

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # handed to the driver
            self.out.put(error)

    async def _main(self) -> None:
        args = self.job.args
        cfg = sampling_config(args)
        gen = make_generator(self.job, self._explain_failure)
        counter = 0

        async def one_group() -> None:
            nonlocal counter
            while not self.stop.is_set():
                # Backpressure: at most one rollout of completed groups waits for the trainer.
                while self.out.qsize() >= args.rollout_batch_size and not self.stop.is_set():
                    await asyncio.sleep(0.05)
                if self.stop.is_set():
                    return
                prompt, position = self._next_item()
                key = counter
                counter += 1
                start = time.monotonic()
                with self.lock:
                    self.in_flight_since[key] = start
                try:
                    group = await gen.group(prompt, position, args.n_samples_per_prompt, cfg)
                finally:
                    with self.lock:
                        del self.in_flight_since[key]
                        self.request_intervals.append((start, time.monotonic()))
                if self.group_filter.keep(group):
                    self.out.put(group)

        try:
            work = asyncio.ensure_future(
                all_or_cancel(one_group() for _ in range(groups_in_flight(args)))
            )
            watcher = asyncio.ensure_future(self._watch())
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            for task in (work, watcher):
                if not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            for task in done:
                task.result()  # raise what failed
        finally:
            await gen.aclose()

    async def _explain_failure(self, when: str) -> None:
        """Failed requests are explained by :meth:`_watch` (the engine death it finds)."""
        await self.job.engines.acheck_alive(when)

    async def _watch(self) -> None:
        recovery = self.job.recovery  # with engine restarts: restarts rather than raising
        check = self.job.engines.acheck_alive if recovery is None else recovery.acheck
        while not self.stop.is_set():
            await check("during generation")
            await asyncio.sleep(WATCH_INTERVAL_S)

    def take(self, count: int) -> list[list[GeneratedSample]]:
        """The next ``count`` completed groups (raises what the producer raised)."""
        groups = []
        while len(groups) < count:
            item = self.out.get()
            if isinstance(item, BaseException):
                raise item
            groups.append(item)
        return groups

    def busy_seconds(self, window: tuple[float, float]) -> float:
        """Seconds of ``window`` during which some group was being generated."""
        now = time.monotonic()
        with self.lock:
            intervals = list(self.request_intervals) + [
                (s, now) for s in self.in_flight_since.values()
            ]
        return union_overlap(intervals, window)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def group_staleness(group: list[GeneratedSample], version: int) -> int:
    """How many versions behind ``version`` the group's oldest sample's weights are."""
    return max(
        (version - s.weight_version for s in group if s.weight_version is not None), default=0
    )


def take_fresh(
    producer: Producer, count: int, version: int, bound: int | None
) -> tuple[list[list[GeneratedSample]], int]:
    """The next ``count`` completed groups none of whose samples is more than ``bound``
    versions stale at ``version`` (``--max-weight-staleness``; None: any), and how many stale
    groups were dropped on the way."""
    kept: list[list[GeneratedSample]] = []
    dropped = 0
    while len(kept) < count:
        for group in producer.take(count - len(kept)):
            if bound is not None and group_staleness(group, version) > bound:
                dropped += 1
            else:
                kept.append(group)
    return kept, dropped


def run_async(job: Job) -> list[dict[str, Any]]:
    """The fully asynchronous loop (module docstring); returns the per-rollout records."""
    args, engines = job.args, job.engines
    trigger = SaveTrigger(args.save_trigger_sentinel) if args.save_trigger_sentinel else None
    publish(job)
    version = int(engines.weight_versions()[0])
    job.reporter.print(f"engines ready, weight version {version} (fully async)")
    eval_before_training(job)
    producer = Producer(job)
    producer.start()
    records = []
    try:
        for rollout_id in range(job.state.next_rollout_id, args.num_rollout):
            times: dict[str, float] = {}
            t = time.monotonic()
            groups, stale_dropped = take_fresh(
                producer, args.rollout_batch_size, version, args.max_weight_staleness
            )
            times["wait"] = time.monotonic() - t
            batch = to_rollout_batch(groups)
            save_debug_rollout(job, rollout_id, batch, groups, {})
            staleness = [
                version - s.weight_version
                for g in groups
                for s in g
                if s.weight_version is not None
            ]
            t_train = time.monotonic()
            # with --use-critic, the critic scores the batch (its values for the actor's GAE)
            # and trains on it, as in the synchronous loop
            training = RolloutTraining(job, rollout_id, batch)
            training.critic()
            train_metrics = training.actor()
            window = (t_train, time.monotonic())
            times["train"] = window[1] - window[0]
            overlap = producer.busy_seconds(window)

            t = time.monotonic()
            saved = save_point(job, rollout_id, trigger)
            times["save"] = time.monotonic() - t
            job.state.next_rollout_id = rollout_id + 1
            t = time.monotonic()
            if (rollout_id + 1) % args.update_weights_interval == 0:
                publish(job)
                version = int(engines.weight_versions()[0])
            times["update"] = time.monotonic() - t
            stats = rollout_stats(groups, args.pass_threshold)
            stats.update(
                staleness_mean=sum(staleness) / max(len(staleness), 1),
                staleness_max=max(staleness, default=0),
                overlap_s=overlap,
                groups_dropped=producer.group_filter.dropped,
            )
            if args.max_weight_staleness is not None:
                stats["stale_groups_dropped"] = stale_dropped
            if args.rollout_max_prompt_len is not None:
                stats["prompts_too_long"] = job.prompts_too_long
            stats.update(recovery_metrics(job))
            record = {
                "rollout_id": rollout_id,
                "prompt_ids": [g[0].prompt.index for g in groups],
                "rollout": stats,
                "train": train_metrics,
                "time": times,
                "weight_version": version,
                "saved": saved,
            }
            add_eval(job, record)
            job.reporter.rollout(record)
            logger.info(
                "rollout %d: generation overlapped %.2fs of %.2fs training",
                rollout_id,
                overlap,
                times["train"],
            )
            records.append(record)
    finally:
        producer.close()
    return records
