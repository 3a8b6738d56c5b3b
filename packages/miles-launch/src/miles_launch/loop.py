"""The synchronous RL loop (``train.py`` in the seeds): phases alternate.

::

    [--offload-rollout: engines release KV cache and CUDA graphs]  [--offload-train: sleep]
    update_weights                                   (engines start from the trainer's weights)
    [--offload-rollout: engines resume KV cache and CUDA graphs]
    eval before training (from rollout 0 with --eval-prompt-data; --skip-eval-before-train)
    for rollout_id in range(next_rollout_id, --num-rollout):
        generate --rollout-batch-size prompts x --n-samples-per-prompt, score, filter
        [--offload-rollout: engines release weights, KV cache, CUDA graphs]
        [--use-critic: wake the critic, score (values), train it, sleep it]
        [--offload-train: wake the trainer]
        train (not during the first --num-critic-only-steps rollouts)
                            (a critic on its own ranks: it scores, then trains meanwhile)
        save_model on --save-interval, the last rollout, or the sentinel
        [--offload-train: sleep (model and optimizer state to the host)]
        [--offload-rollout: engines resume weights only]
        update_weights                               (engine weight version + 1)
        [--offload-rollout: engines resume KV cache and CUDA graphs]
        eval every --eval-interval

Under ``--offload-train`` the trainer is woken once and put to sleep once per rollout: it
publishes asleep, streaming its host copies bucket by bucket (the backends' weight sources), so
the device never holds the whole trainer and the engines' weights at once. The steps that
move memory are :class:`ColocatedCycle`'s (one place, for every trainer group of the job).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from miles_core.args.groups.offload import offload_rollout_on, offload_train_on
from miles_core.args.parsed import ParsedArgs
from miles_core.save_trigger import SaveTrigger, should_save

from miles_launch.job import Job, LauncherState, write_launcher_state
from miles_launch.rollout.custom_generate import load_generate_function
from miles_launch.rollout.debug_data import save_rollout_data
from miles_launch.rollout.draw import draw_groups
from miles_launch.rollout.evaluation import eval_metrics, pass_at_ks
from miles_launch.rollout.filtering import group_filter
from miles_launch.rollout.generate import (
    GeneratedSample,
    Generator,
    SamplingConfig,
    to_rollout_batch,
)
from miles_launch.rollout.routed_experts import routed_experts_layout
from miles_launch.rollout_training import RolloutTraining
from miles_launch.trainer_group import PublishFailed, TrainerFailure

logger = logging.getLogger(__name__)


def sampling_config(args: ParsedArgs) -> SamplingConfig:
    """Sampling of training rollouts."""
    return SamplingConfig(
        max_new_tokens=args.rollout_max_response_len,
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        seed=args.rollout_seed,
        stop=tuple(args.rollout_stop or ()),
        stop_token_ids=tuple(args.rollout_stop_token_ids or ()),
    )


def eval_sampling_config(args: ParsedArgs) -> SamplingConfig:
    """Sampling of evaluation: each ``--eval-*`` value given, else the rollout's."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return SamplingConfig(
        max_new_tokens=pick(args.eval_max_response_len, args.rollout_max_response_len),
        temperature=pick(args.eval_temperature, args.rollout_temperature),
        top_p=pick(args.eval_top_p, args.rollout_top_p),
        top_k=args.rollout_top_k,
        seed=args.rollout_seed,
        stop=tuple(args.rollout_stop or ()),
        stop_token_ids=tuple(args.rollout_stop_token_ids or ()),
    )


def make_generator(job: Job, check_alive: Callable[[str], Any]) -> Generator:
    """The job's generator (engines, reward, routing replay, custom generate function, and
    under ``--partial-rollout`` the engines it aborts). With engine restarts its watch is the
    recovery's, and it sends to the engines in rotation."""
    path = job.args.custom_generate_function_path
    return Generator(
        job.engines.generation_urls,
        job.reward,
        check_alive if job.recovery is None else job.recovery.acheck,
        recovery=job.recovery,
        routed_experts=routed_experts_layout(job.args),
        api_key=job.engines.api_key,
        custom_generate=load_generate_function(path) if path else None,
        tokenizer=job.tokenizer,
        abort_urls=job.engines.urls if job.args.partial_rollout else None,
        passes=group_filter(job.args).passes,
        mask_carried=job.args.mask_offpolicy_in_partial_rollout,
    )


def generate_groups(
    job: Job,
    items: list[tuple[Any, int]],
    n: int,
    desc: str,
    cfg: SamplingConfig | None = None,
    carried: dict[int, list[GeneratedSample]] | None = None,
    need: int | None = None,
) -> list[list[GeneratedSample]]:
    """Generate and score ``n`` samples of each (prompt, position), with a progress bar
    (``cfg``: the rollout's sampling unless given; ``carried``, ``need``: ``--partial-rollout``,
    see :meth:`Generator.groups`)."""
    cfg = cfg or sampling_config(job.args)

    async def run() -> list[list[GeneratedSample]]:
        gen = make_generator(job, job.engines.acheck_alive)
        try:
            with job.reporter.progress(desc, len(items) * n) as bar:
                return await gen.groups(
                    items, n, cfg, lambda: bar.update(1), carried=carried, need=need
                )
        finally:
            await gen.aclose()

    return asyncio.run(run())


def collect_rollout(job: Job, rollout_id: int) -> tuple[list[list[GeneratedSample]], dict]:
    """The groups of one rollout (see :func:`draw_groups`), generated on the engines."""
    args = job.args
    groups, info = draw_groups(
        job.state,
        lambda start, count: [
            (job.prompts[i], start + j) for j, i in enumerate(job.order.take(start, count))
        ],
        lambda items, carried=None, need=None: generate_groups(
            job,
            items,
            args.n_samples_per_prompt,
            f"generate {rollout_id + 1}",
            carried=carried,
            need=need,
        ),
        want=args.rollout_batch_size,
        max_draws=args.dynamic_filter_max_draws if args.dynamic_filter else 1,
        dynamic_filter=group_filter(args),
        over_sampling=args.over_sampling_batch_size,
        partial=job.partial if args.partial_rollout else None,
    )
    if args.rollout_max_prompt_len is not None:
        info["prompts_too_long"] = job.prompts_too_long
    return groups, info


def rollout_stats(groups: list[list[GeneratedSample]], pass_threshold: float) -> dict[str, Any]:
    """The rollout section of a record: reward and length statistics, the share of trained
    tokens, pass@k of the prompt groups (``--pass-threshold``), the weight versions."""
    samples = [s for g in groups for s in g]
    rewards = [s.reward for s in samples]
    versions = sorted({s.weight_version for s in samples if s.weight_version is not None})
    return {
        "reward_mean": sum(rewards) / len(rewards),
        "reward_max": max(rewards),
        "reward_min": min(rewards),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
        "loss_token_fraction": sum(
            len(s.response_ids) if s.loss_mask is None else sum(s.loss_mask) for s in samples
        )
        / sum(len(s.response_ids) for s in samples),
        "num_samples": len(samples),
        **pass_at_ks(groups, pass_threshold),
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
            "rollout": {**rollout_stats(groups, job.args.pass_threshold), **extra},
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
    eval_weights = args.eval_weights
    swap = eval_weights != args.rollout_weights
    if swap:
        logger.info("eval: publishing the %s weights to the engines", eval_weights)
        publish(job, weights=eval_weights)
    cfg = eval_sampling_config(args)
    results = {}
    try:
        for name, prompts in job.eval_prompts.items():
            items = [(p, -1 - p.index) for p in prompts]
            n = args.n_samples_per_eval_prompt
            groups = generate_groups(job, items, n, f"eval {name}", cfg)
            results[name] = eval_metrics(groups, args.pass_threshold)
    finally:
        if swap:
            logger.info("eval: publishing the rollout weights back")
            publish(job)
    return results


def eval_due(args: ParsedArgs, rollout_id: int) -> bool:
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


def eval_before_training(job: Job) -> None:
    """Evaluate the initial weights and report them as the record of rollout -1 (``eval``
    and ``time.eval`` only), when the run starts at rollout 0 with eval sets and without
    ``--skip-eval-before-train``: the baseline every later eval compares with."""
    args = job.args
    if job.state.next_rollout_id != 0 or not args.eval_prompt_data or args.skip_eval_before_train:
        return
    t = time.monotonic()
    results = run_eval(job, -1)
    job.reporter.rollout(
        {"rollout_id": -1, "eval": results, "time": {"eval": time.monotonic() - t}}
    )


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
    critic = getattr(job, "critic", None)  # a critic on its own ranks saves meanwhile
    saving = None if critic is None else critic.start_save_model(rollout_id, force_sync=force)
    job.trainer.save_model(rollout_id, force_sync=force)
    if saving is not None:
        saving.result()
    if trigger is not None:
        trigger.consume()
    return True


#: SGLang memory tags of each colocated step (``/release_memory_occupation``, ``/resume_...``)
ENGINE_ALL = ("weights", "kv_cache", "cuda_graph")
ENGINE_WEIGHTS = ("weights",)
ENGINE_CACHE = ("kv_cache", "cuda_graph")


class ColocatedCycle:
    """Who holds the device when, under ``--offload-train`` / ``--offload-rollout`` (module
    docstring). ``trainers``: every trainer group that sleeps and wakes with the job (the actor
    today); each method is one step of the cycle and does nothing when its flag is off."""

    def __init__(self, args: ParsedArgs, trainers: list[Any], engines: Any) -> None:
        self.offload_train = offload_train_on(args)
        self.offload_rollout = offload_rollout_on(args)
        self.trainers = trainers
        self.engines = engines

    def to_training(self, between: Callable[[], None] | None = None) -> None:
        """After generation: the engines let go of everything, ``between()`` runs (a critic
        that wakes and sleeps on its own), then the trainers wake."""
        if self.offload_rollout:
            self.engines.release_memory(ENGINE_ALL)
        if between is not None:
            between()
        if self.offload_train:
            for trainer in self.trainers:
                trainer.wake_up()

    def to_publish(self) -> None:
        """After training (and saving): the trainers sleep, the engines take back their
        weights only (what a publish writes into)."""
        if self.offload_train:
            for trainer in self.trainers:
                trainer.sleep()
        if self.offload_rollout:
            self.engines.resume_memory(ENGINE_WEIGHTS)

    def to_generation(self) -> None:
        """After the publish: the engines take back their KV cache and CUDA graphs."""
        if self.offload_rollout:
            self.engines.resume_memory(ENGINE_CACHE)

    def first_publish(self, publish: Callable[[], None]) -> None:
        """Before rollout 0: the engines start from the trainer's weights, published as every
        later publish is (trainer asleep, engines holding their weights only)."""
        if self.offload_rollout:  # the weights stay: they are what the publish writes into
            self.engines.release_memory(ENGINE_CACHE)
        if self.offload_train:
            for trainer in self.trainers:
                trainer.sleep()
        publish()
        self.to_generation()

    def after_generation(
        self,
        train: Callable[[], Any],
        save: Callable[[], bool],
        publish: Callable[[], None],
        before_training: Callable[[], None] | None = None,
    ) -> tuple[Any, bool, dict[str, float]]:
        """One rollout from its generated batch on: train, save, publish, with the memory
        steps between them (``before_training``: what runs once the engines let go and before
        the trainers wake); returns (``train()``'s result, ``save()``'s, seconds of
        ``train``/``save``/``update``)."""
        times: dict[str, float] = {}
        t = time.monotonic()
        self.to_training(before_training)
        trained = train()
        times["train"] = time.monotonic() - t
        t = time.monotonic()
        saved = save()
        times["save"] = time.monotonic() - t
        t = time.monotonic()
        self.to_publish()
        publish()
        self.to_generation()
        times["update"] = time.monotonic() - t
        return trained, saved, times


def publish(job: Job, weights: str | None = None) -> None:
    """``update_weights`` on every rank (``weights``: ``actor``/``ema``, default the backend's
    ``--rollout-weights``); when it fails because an engine died, say so. With engine restarts
    (:mod:`~miles_launch.engine_launch.recovery`) it goes to every engine, restarted ones
    included, and a publish an engine's death broke is retried after its restart: it returns
    once every engine holds the same complete version."""
    job.published_weights = weights
    recovery = job.recovery
    if recovery is None:
        try:
            job.trainer.update_weights(job.engines.urls, weights)
        except TrainerFailure:
            job.engines.explain_failure("while receiving weights")
            raise
        return
    while True:
        recovery.before_publish()
        try:
            job.trainer.update_weights(job.engines.urls, weights)
        except PublishFailed as failure:
            recovery.publish_failed(failure)  # raises unless a restart can mend it
            continue
        recovery.published()
        return


def recovery_metrics(job: Job) -> dict[str, int]:
    """``engine_restarts`` and ``requests_reissued`` since the previous rollout's record (none
    without engine restarts)."""
    return {} if job.recovery is None else job.recovery.metrics()


def save_rollout(job: Job, rollout_id: int, trigger: SaveTrigger | None) -> bool:
    saved = save_point(job, rollout_id, trigger)
    job.state.next_rollout_id = rollout_id + 1
    return saved


def run_sync(job: Job) -> list[dict[str, Any]]:
    """The synchronous loop (module docstring); returns the per-rollout records."""
    args, trainer, engines = job.args, job.trainer, job.engines
    trigger = SaveTrigger(args.save_trigger_sentinel) if args.save_trigger_sentinel else None
    cycle = ColocatedCycle(args, [trainer], engines)
    if job.recovery is not None:  # an engine restarted mid-rollout gets the weights at once
        job.recovery.republish = lambda: publish(job, job.published_weights)
    t0 = time.monotonic()
    cycle.first_publish(lambda: publish(job))
    version = engines.weight_versions()[0]
    job.reporter.print(f"engines ready, weight version {version} ({time.monotonic() - t0:.1f}s)")
    eval_before_training(job)
    records = []
    for rollout_id in range(job.state.next_rollout_id, args.num_rollout):
        times: dict[str, float] = {}
        position = job.state.data_position
        t = time.monotonic()
        if job.recovery is None:  # with restarts, the generation's watch handles a death
            engines.check_alive("before generation")
        groups, filter_info = collect_rollout(job, rollout_id)
        times["gen"] = time.monotonic() - t
        batch = to_rollout_batch(groups)
        save_debug_rollout(job, rollout_id, batch, groups, filter_info)
        training = RolloutTraining(job, rollout_id, batch)
        train_metrics, saved, step_times = cycle.after_generation(
            training.actor,
            functools.partial(save_rollout, job, rollout_id, trigger),
            functools.partial(publish, job),
            before_training=training.critic,
        )
        times.update(step_times)
        version = engines.weight_versions()[0]

        record = {
            "rollout_id": rollout_id,
            "data_position": position,
            "prompt_ids": [g[0].prompt.index for g in groups],
            "rollout": {
                **rollout_stats(groups, args.pass_threshold),
                **filter_info,
                **recovery_metrics(job),
            },
            "train": train_metrics,
            "time": times,
            "weight_version": version,
            "saved": saved,
        }
        add_eval(job, record)
        job.reporter.rollout(record)
        records.append(record)
    return records
