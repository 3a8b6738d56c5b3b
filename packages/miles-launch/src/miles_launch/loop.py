"""The synchronous RL loop (``train.py`` in the seeds): phases alternate.

::

    update_weights                                   (engines start from the trainer's weights)
    for rollout_id in range(next_rollout_id, --num-rollout):
        generate --rollout-batch-size prompts x --n-samples-per-prompt, score, filter
        [--offload-rollout: release engine memory]   [--offload-train: wake the trainer]
        train
        save_model on --save-interval, the last rollout, or the sentinel
        [--offload-train: sleep]                     [--offload-rollout: resume engine memory]
        update_weights                               (engine weight version + 1)
        eval every --eval-interval
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from miles_core.save_trigger import SaveTrigger, should_save

from miles_launch.job import Job, LauncherState, write_launcher_state
from miles_launch.reporting import rank0_metrics
from miles_launch.rollout.debug_data import save_rollout_data
from miles_launch.rollout.evaluation import eval_metrics
from miles_launch.rollout.filtering import has_signal
from miles_launch.rollout.generate import (
    GeneratedSample,
    Generator,
    SamplingConfig,
    to_rollout_batch,
)
from miles_launch.rollout.routed_experts import routed_experts_layout
from miles_launch.trainer_group import TrainerFailure

logger = logging.getLogger(__name__)


def sampling_config(args: Any) -> SamplingConfig:
    """Sampling of training rollouts."""
    return SamplingConfig(
        max_new_tokens=args.rollout_max_response_len,
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        seed=args.seed,
    )


def eval_sampling_config(args: Any) -> SamplingConfig:
    """Sampling of evaluation: each ``--eval-*`` value given, else the rollout's."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return SamplingConfig(
        max_new_tokens=pick(args.eval_max_response_len, args.rollout_max_response_len),
        temperature=pick(args.eval_temperature, args.rollout_temperature),
        top_p=pick(args.eval_top_p, args.rollout_top_p),
        top_k=args.rollout_top_k,
        seed=args.seed,
    )


def generate_groups(
    job: Job,
    items: list[tuple[Any, int]],
    n: int,
    desc: str,
    cfg: SamplingConfig | None = None,
) -> list[list[GeneratedSample]]:
    """Generate and score ``n`` samples of each (prompt, position), with a progress bar
    (``cfg``: the rollout's sampling unless given)."""
    cfg = cfg or sampling_config(job.args)

    async def run() -> list[list[GeneratedSample]]:
        gen = Generator(
            job.engines.generation_urls,
            job.reward,
            job.engines.acheck_alive,
            routed_experts=routed_experts_layout(job.args),
            api_key=job.engines.api_key,
        )
        try:
            with job.reporter.progress(desc, len(items) * n) as bar:
                return await gen.groups(items, n, cfg, on_sample=lambda: bar.update(1))
        finally:
            await gen.aclose()

    return asyncio.run(run())


def collect_rollout(job: Job, rollout_id: int) -> tuple[list[list[GeneratedSample]], dict]:
    """The groups of one rollout (see :func:`draw_groups`), generated on the engines."""
    args = job.args
    return draw_groups(
        job.state,
        lambda start, count: [
            (job.prompts[i], start + j) for j, i in enumerate(job.order.take(start, count))
        ],
        lambda items: generate_groups(
            job, items, args.n_samples_per_prompt, f"generate {rollout_id + 1}"
        ),
        want=args.rollout_batch_size,
        max_draws=args.dynamic_filter_max_draws if args.dynamic_filter else 1,
        dynamic_filter=args.dynamic_filter,
    )


def draw_groups(
    state: LauncherState,
    items_at: Callable[[int, int], list[tuple[Any, int]]],
    generate: Callable[[list[tuple[Any, int]]], list[list[GeneratedSample]]],
    *,
    want: int,
    max_draws: int,
    dynamic_filter: bool,
) -> tuple[list[list[GeneratedSample]], dict]:
    """Draw prompt groups from the stream at ``state.data_position`` (advanced by every prompt
    drawn) until ``want`` are kept.

    Without ``dynamic_filter``: the next ``want`` prompts, once. With it: groups whose rewards
    are all equal are dropped and the missing number of prompts is drawn again, at most
    ``max_draws`` times in all; when nothing survived, the last draw is used unfiltered (its
    advantages are zero, the step is a no-op for the policy loss).
    """
    kept: list[list[GeneratedSample]] = []
    dropped = draws = 0
    last: list[list[GeneratedSample]] = []
    while len(kept) < want and draws < max_draws:
        count = want - len(kept)
        items = items_at(state.data_position, count)
        state.data_position += count
        draws += 1
        last = generate(items)
        for group in last:
            if dynamic_filter and not has_signal([s.reward for s in group]):
                dropped += 1
            else:
                kept.append(group)
    if not kept:
        logger.warning("every group was filtered out; training on the last draw")
        kept = last
    return kept, {"groups_dropped": dropped, "draws": draws}


def rollout_stats(groups: list[list[GeneratedSample]]) -> dict[str, Any]:
    samples = [s for g in groups for s in g]
    rewards = [s.reward for s in samples]
    versions = sorted({s.weight_version for s in samples if s.weight_version is not None})
    return {
        "reward_mean": sum(rewards) / len(rewards),
        "reward_max": max(rewards),
        "reward_min": min(rewards),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
        "num_samples": len(samples),
        "generated_with_versions": versions,
    }


def save_debug_rollout(
    job: Job, rollout_id: int, batch: Any, groups: list[list[GeneratedSample]], extra: dict
) -> None:
    """``--save-debug-rollout-data``: the batch ``train`` receives, with the record's prompt ids
    and rollout stats and the data position after the rollout (a replay continues from it)."""
    template = job.args.save_debug_rollout_data
    if template:
        info = {
            "prompt_ids": [g[0].prompt.index for g in groups],
            "rollout": {**rollout_stats(groups), **extra},
            "data_position": job.state.data_position,
        }
        save_rollout_data(template, rollout_id, batch, info)


def run_eval(job: Job, rollout_id: int) -> dict[str, dict[str, float]]:
    """Generate and score every eval set (:func:`eval_sampling_config`); its metrics
    (:func:`~miles_launch.rollout.evaluation.eval_metrics`) by set name.

    With ``--eval-weights`` other than ``--rollout-weights`` (e.g. ``ema``), those weights are
    published to the engines first and the rollout weights again afterwards (also on errors),
    so evaluation samples the evaluated weights and training rollouts never do.
    """
    args = job.args
    eval_weights = getattr(args, "eval_weights", "actor")
    swap = eval_weights != getattr(args, "rollout_weights", "actor")
    if swap:
        logger.info("eval: publishing the %s weights to the engines", eval_weights)
        publish(job, weights=eval_weights)
    cfg = eval_sampling_config(args)
    results = {}
    try:
        for name, prompts in job.eval_prompts.items():
            items = [(p, -1 - p.index) for p in prompts]
            n = args.n_samples_per_eval_prompt
            results[name] = eval_metrics(generate_groups(job, items, n, f"eval {name}", cfg))
    finally:
        if swap:
            logger.info("eval: publishing the rollout weights back")
            publish(job)
    return results


def eval_due(args: Any, rollout_id: int) -> bool:
    return bool(args.eval_interval) and (rollout_id + 1) % args.eval_interval == 0


def add_eval(job: Job, record: dict[str, Any]) -> None:
    """Evaluate when due; the metrics go into ``record["eval"]``, the time into
    ``record["time"]["eval"]`` (before the record is reported)."""
    rollout_id = record["rollout_id"]
    if not eval_due(job.args, rollout_id):
        return
    t = time.monotonic()
    record["eval"] = run_eval(job, rollout_id)
    record["time"]["eval"] = time.monotonic() - t


def save_point(job: Job, rollout_id: int, trigger: SaveTrigger | None) -> bool:
    """``save_model`` when due (interval, last rollout, sentinel); the launcher state first."""
    args = job.args
    if not args.save:
        return False
    if not should_save(
        rollout_id, args.save_interval, trigger, last_rollout_id=args.num_rollout - 1
    ):
        return False
    write_launcher_state(args.save, LauncherState(rollout_id + 1, job.state.data_position))
    force = trigger is not None and trigger.armed
    job.trainer.save_model(rollout_id, force_sync=force)
    if trigger is not None:
        trigger.consume()
    return True


def publish(job: Job, weights: str | None = None) -> None:
    """``update_weights`` on every rank (``weights``: ``actor``/``ema``, default the backend's
    ``--rollout-weights``); when it fails because an engine died, say so."""
    try:
        job.trainer.update_weights(job.engines.urls, weights)
    except TrainerFailure:
        job.engines.check_alive("while receiving weights")
        raise


def run_sync(job: Job) -> list[dict[str, Any]]:
    """The synchronous loop (module docstring); returns the per-rollout records."""
    args, trainer, engines = job.args, job.trainer, job.engines
    trigger = SaveTrigger(args.save_trigger_sentinel) if args.save_trigger_sentinel else None
    t0 = time.monotonic()
    publish(job)
    if args.offload_train:
        trainer.sleep()
    version = engines.weight_versions()[0]
    job.reporter.print(f"engines ready, weight version {version} ({time.monotonic() - t0:.1f}s)")
    records = []
    for rollout_id in range(job.state.next_rollout_id, args.num_rollout):
        times: dict[str, float] = {}
        position = job.state.data_position
        t = time.monotonic()
        engines.check_alive("before generation")
        groups, filter_info = collect_rollout(job, rollout_id)
        times["gen"] = time.monotonic() - t
        batch = to_rollout_batch(groups)
        save_debug_rollout(job, rollout_id, batch, groups, filter_info)

        t = time.monotonic()
        if args.offload_rollout:
            engines.release_memory()
        if args.offload_train:
            trainer.wake_up()
        train_metrics = rank0_metrics(trainer.train(rollout_id, batch))
        times["train"] = time.monotonic() - t

        t = time.monotonic()
        saved = save_point(job, rollout_id, trigger)
        times["save"] = time.monotonic() - t
        job.state.next_rollout_id = rollout_id + 1

        t = time.monotonic()
        if args.offload_train:
            trainer.sleep()
        if args.offload_rollout:
            engines.resume_memory()
        publish(job)
        if args.offload_train:
            trainer.sleep()
        times["update"] = time.monotonic() - t
        version = engines.weight_versions()[0]

        record = {
            "rollout_id": rollout_id,
            "data_position": position,
            "prompt_ids": [g[0].prompt.index for g in groups],
            "rollout": {**rollout_stats(groups), **filter_info},
            "train": train_metrics,
            "time": times,
            "weight_version": version,
            "saved": saved,
        }
        add_eval(job, record)
        job.reporter.rollout(record)
        records.append(record)
    return records
