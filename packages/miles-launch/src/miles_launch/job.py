"""One training job: its pieces set up in order, torn down in reverse, and its data position.

Setup order (what can fail on a bad file fails before Ray starts): tokenizer and prompts ->
reward function -> Ray and the placement group -> engines started (disaggregated: they start
while the trainer does) -> trainer ranks (``init``, which resumes from ``--load``; a critic on
its own ranks initialises at the same time, from ``--critic-load``) -> engines
started (colocated: after the trainer, which sleeps first with ``--offload-train``) -> engines
health-checked (none under ``--load-debug-rollout-data``, which replays saved rollouts).
Teardown closes the trainer and a critic's own ranks (or kills
them after a failure), stops the engines, removes the placement group and shuts down the Ray it started.

Resume: the launcher keeps its own state next to the backend's checkpoint, written before
``save_model`` so that it exists whenever the tracker names the iteration::

    <save>/launcher/iter_0000003.json    {"next_rollout_id": 3, "data_position": 24}
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from miles_core.args.parsed import ParsedArgs
from miles_core.checkpoint_layout import atomic_write_text, iteration_dir_name, resolve_load
from transformers import AutoTokenizer

from miles_launch.engine_launch.api_key import ensure_api_key
from miles_launch.engine_launch.engine_set import EngineSet
from miles_launch.engine_launch.recovery import EngineRecovery
from miles_launch.placement import (
    Layout,
    Placement,
    init_ray,
    node_ip,
    plan_layout,
)
from miles_launch.reporting import Reporter, phase
from miles_launch.rollout.partial import PartialBuffer
from miles_launch.rollout.prompts import Prompt, PromptOrder, drop_long_prompts, load_prompts
from miles_launch.rollout.rewards import RewardModel
from miles_launch.rollout_args import eval_sets
from miles_launch.trainer_group import TrainerGroup, resume_mismatch

logger = logging.getLogger(__name__)


@dataclass
class LauncherState:
    """What the launcher needs to resume: the next rollout and the next prompt position."""

    next_rollout_id: int
    data_position: int


def launcher_state_path(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / "launcher" / f"{iteration_dir_name(iteration)}.json"


def write_launcher_state(save_dir: str | Path, state: LauncherState) -> Path:
    """Write the state a checkpoint of iteration ``state.next_rollout_id`` resumes with."""
    path = launcher_state_path(save_dir, state.next_rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(state.__dict__))
    return path


def read_launcher_state(args: ParsedArgs, next_rollout_id: int) -> LauncherState:
    """The resumed state: the launcher file of the loaded iteration, or, when there is none
    (a checkpoint written without the launcher), the position an unfiltered run reaches."""
    default = LauncherState(next_rollout_id, next_rollout_id * args.rollout_batch_size)
    if not args.load or next_rollout_id == 0:
        return default
    resolved = resolve_load(args.load, args.ckpt_step)
    if resolved is None:
        return default
    path = launcher_state_path(args.load, resolved.iteration)
    if not path.is_file():
        logger.warning("%s missing: resuming at data position %d", path, default.data_position)
        return default
    data = json.loads(path.read_text())
    state = LauncherState(int(data["next_rollout_id"]), int(data["data_position"]))
    if state.next_rollout_id != next_rollout_id:
        raise RuntimeError(
            f"{path}: next_rollout_id {state.next_rollout_id} differs from the trainer's "
            f"{next_rollout_id}"
        )
    return state


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


@dataclass
class Job:
    """Everything a loop drives (built by :meth:`Job.setup`)."""

    args: ParsedArgs
    layout: Layout
    tokenizer: Any
    prompts: list[Prompt]
    order: PromptOrder
    eval_prompts: dict[str, list[Prompt]]  # --eval-prompt-data: name -> prompts
    reward: RewardModel | None  # None: --load-debug-rollout-data (nothing is generated)
    reporter: Reporter
    placement: Placement | None = None
    trainer: TrainerGroup | None = None
    critic: TrainerGroup | None = None  # a critic on its own ranks (None: in the trainer's)
    engines: EngineSet | None = None
    state: LauncherState = field(default_factory=lambda: LauncherState(0, 0))
    started_ray: bool = False
    prompts_too_long: int = 0  # dropped by --rollout-max-prompt-len
    partial: PartialBuffer = field(default_factory=PartialBuffer)  # --partial-rollout
    recovery: EngineRecovery | None = None  # --engine-restart-limit > 0
    published_weights: str | None = None  # what the last publish sent (None: --rollout-weights)

    @classmethod
    def setup(cls, args: ParsedArgs) -> Job:

        phase(f"loading the tokenizer and prompts ({args.hf_checkpoint})")
        tokenizer = load_tokenizer(args.hf_checkpoint)
        replay = bool(args.load_debug_rollout_data)  # trains on saved rollouts: no engines
        prompts, too_long = [], 0
        if args.prompt_data:
            prompts = load_prompts(
                args.prompt_data,
                tokenizer,
                args.input_key,
                args.label_key,
                args.apply_chat_template,
                args.metadata_key,
            )
            prompts, too_long = drop_long_prompts(
                prompts, args.rollout_max_prompt_len, args.prompt_data
            )
        if too_long:
            logger.warning(
                "--rollout-max-prompt-len %d: dropped %d of %d prompts",
                args.rollout_max_prompt_len,
                too_long,
                too_long + len(prompts),
            )
        eval_prompts = {
            name: load_prompts(
                path,
                tokenizer,
                args.input_key,
                args.label_key,
                args.apply_chat_template,
                args.metadata_key,
            )
            for name, path in eval_sets(args).items()
        }
        reward = None if replay else RewardModel.from_args(args)
        use_gpu = torch.cuda.is_available()
        started = not ray.is_initialized() and not args.ray_address
        layout = plan_layout(args, use_gpu)
        phase(f"joining Ray at {args.ray_address}" if args.ray_address else "starting a local Ray")
        init_ray(layout, args.ray_address)
        if args.ray_address:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
            layout = plan_layout(args, use_gpu)
        job = cls(
            args=args,
            layout=layout,
            tokenizer=tokenizer,
            prompts=prompts,
            order=PromptOrder(len(prompts), args.rollout_shuffle, args.rollout_seed),
            eval_prompts=eval_prompts,
            reward=reward,
            reporter=Reporter.from_args(args, args.num_rollout),
            started_ray=started,
            prompts_too_long=too_long,
        )
        try:
            job._start()
        except BaseException:
            job.teardown(failed=True)
            raise
        return job

    def groups(self) -> list[TrainerGroup]:
        """The job's trainer groups: the trainer's, then a critic's own."""
        return [g for g in (self.trainer, self.critic) if g is not None]

    def _init_trainers(self) -> int:
        """``init`` of the trainer and of a critic on its own ranks, at the same time; the
        rollout both resume at (they must agree)."""
        args = self.args
        ranks = f"{self.layout.num_trainer_ranks} rank(s)"
        if self.critic is not None:
            ranks += f", the critic's own {self.layout.num_critic_ranks}"
        phase(f"loading the trainer ({ranks})")
        starting = [(group, group.start_init(args)) for group in self.groups()]
        for group in self.groups():
            logger.info(group.where())
        next_ids = [group.finish_init(pending, args) for group, pending in starting]
        if len(set(next_ids)) > 1:  # [the actor's, the critic's]
            raise RuntimeError(resume_mismatch(args, next_ids[1], next_ids[0]))
        phase("trainer ready")
        return next_ids[0]

    def _start(self) -> None:
        args = self.args
        # Before anything receives args: engines, router, trainer (its weight publisher).
        ensure_api_key(args, node_ip())
        phase(f"placing {self.layout.num_bundles} bundle(s)")
        self.placement = Placement(self.layout)
        shared_critic = args.use_critic and not self.layout.num_critic_ranks
        roles = ("critic", "actor") if shared_critic else ("actor",)
        self.trainer = TrainerGroup(self.placement, args.train_backend, roles)
        if self.layout.num_critic_ranks:
            self.critic = TrainerGroup(self.placement, args.train_backend, ("critic",))
        if args.load_debug_rollout_data:  # a replay (miles_launch.replay): no engines
            self.state = read_launcher_state(args, self._init_trainers())
            return
        self.engines = EngineSet(args, self.placement)
        # Disaggregated, the engines have GPUs of their own: they start while the trainer
        # initialises. Colocated, they start once the trainer is built (and asleep with
        # --offload-train), since they share its GPUs.
        overlap = not self.layout.colocate
        if overlap:
            phase(f"starting {self.layout.num_engines} engine(s) while the trainer loads")
            self.engines.start()
        next_rollout_id = self._init_trainers()
        self.state = read_launcher_state(args, next_rollout_id)
        if args.offload_train:
            self.trainer.sleep()
            if shared_critic:  # a critic on its own ranks shares its GPUs with nothing
                self.trainer.sleep("critic")
        if not overlap:
            phase(f"starting {self.layout.num_engines} engine(s) on the trainer's GPUs")
            self.engines.start()
        self.engines.wait_ready()
        phase("engines healthy")
        if args.engine_restart_limit:
            self.recovery = EngineRecovery(
                self.engines,
                args.engine_restart_limit,
                args.engine_restart_backoff,
                args.engine_health_timeout,
                pause_mode=args.pause_generation_mode,
            )

    @staticmethod
    def _end(group: TrainerGroup, failed: bool) -> None:
        if failed:
            group.teardown()
        else:
            group.close()

    def teardown(self, failed: bool = False) -> None:
        try:
            try:
                if self.trainer is not None:  # first: closing leaves the engines' weight groups
                    self._end(self.trainer, failed)
            finally:  # a critic's own ranks go whatever the trainer's end raised
                if self.critic is not None:
                    self._end(self.critic, failed)
        finally:
            if self.recovery is not None:
                self.recovery.close()
            if self.engines is not None:
                self.engines.shutdown()
        if self.placement is not None:
            self.placement.remove()
        self.reporter.close()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
