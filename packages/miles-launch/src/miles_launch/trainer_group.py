"""The trainer: one Ray actor per rank, each wrapping one backend instance.

Every rank sets up ``torch.distributed`` (:func:`process_group_backend`: nccl with a GPU, plus
a CPU backend beside it when a flag needs CPU collectives; gloo without a GPU) before the
backend's ``init``; the driver then calls the contract's methods on all ranks in lock step
(:meth:`TrainerGroup.call`). When any rank raises, or its process dies, every rank is killed
and :class:`TrainerFailure` names the rank, the method and the cause: a failure never leaves
the other ranks hanging in a collective.

With ``--use-critic`` each rank holds the critic beside the actor (a second backend instance in
role ``critic``), unless the critic has ranks of its own (``--critic-num-nodes`` /
``--critic-num-gpus-per-node``): then a second group, ``critic`` ranks only, runs on the
critic's bundles with a ``torch.distributed`` world of its own (its own rendezvous, its own
data-parallel degree), and its batches are sharded by its own data layout.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from miles_core.args.checks import flag_value
from miles_core.args.parsed import ParsedArgs
from miles_core.backends import load
from miles_core.batch import RolloutBatch
from miles_core.partition import partition_for_dp
from miles_core.ports import free_port
from miles_sync.errors import PublishError
from miles_sync.node_address import NODE_IP_ENV
from ray.exceptions import RayActorError

from miles_launch.args import fsdp_cpu_offload
from miles_launch.placement import TRAINER_SHARE, Placement, node_ip

logger = logging.getLogger(__name__)

#: Timeout of the trainer's process-group collectives.
COLLECTIVE_TIMEOUT_S = 1800


#: flags whose models keep shards on the host, so their collectives (the frozen roles' loading,
#: and FSDP's gradient reduce-scatter under ``--fsdp-cpu-offload``) run on CPU tensors
CPU_COLLECTIVE_FLAGS = ("ref_cpu_offload", "teacher_cpu_offload")


def process_group_backend(args: ParsedArgs, use_gpu: bool) -> str:
    """The default group's backend: ``gloo`` without a GPU; with one, ``nccl``, or
    ``cpu:<--fsdp-cpu-backend>,cuda:nccl`` when a flag of :data:`CPU_COLLECTIVE_FLAGS` is
    set (CPU tensors then reduce over the CPU backend, device tensors over NCCL)."""
    if not use_gpu:
        return "gloo"
    if any(flag_value(args, flag) for flag in CPU_COLLECTIVE_FLAGS) or fsdp_cpu_offload(args):
        cpu = args.fsdp_cpu_backend if "fsdp_cpu_backend" in args else "gloo"
        return f"cpu:{cpu},cuda:nccl"
    return "nccl"


class TrainerFailure(RuntimeError):
    """A trainer rank raised or died; all ranks were torn down."""


class PublishFailed(TrainerFailure):
    """``update_weights`` raised :class:`~miles_sync.errors.PublishError` on every rank: the
    ranks agree that the publish did not complete, their state is whole and they were kept
    (a retry publishes the same version); the engines may hold part of it."""


class TrainerRank:
    """What runs in each trainer actor (``ray.remote``-wrapped by :class:`TrainerGroup`).

    ``roles``: the backend instances this rank holds, initialised in this order: ``("actor",)``,
    ``("critic", "actor")`` (a critic beside the actor) or ``("critic",)`` (a rank of a critic
    on its own ranks). None: the actor, with the critic beside it under ``--use-critic``."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend_name: str,
        use_gpu: bool,
        roles: tuple[str, ...] | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.backend_name = backend_name
        self.use_gpu = use_gpu
        self.roles = roles
        self.models: dict[str, Any] = {}  # role -> its backend instance

    @property
    def backend(self) -> Any:
        """The actor's backend instance (None on a critic's own rank)."""
        return self.models.get("actor")

    @property
    def critic(self) -> Any:
        """The critic's backend instance (None without one on this rank)."""
        return self.models.get("critic")

    def host(self) -> str:
        """This rank's node address (named when the rank fails)."""
        return node_ip()

    def pid(self) -> int:
        """This rank's process id (the job's log names it)."""
        return os.getpid()

    def master_endpoint(self) -> tuple[str, int]:
        """A free TCP port on this actor's node (rank 0 hosts the rendezvous store), outside the
        ephemeral range: no socket the kernel numbers takes it before the store binds it."""
        return node_ip(), free_port()

    def init(self, args: ParsedArgs, master_addr: str, master_port: int) -> int:
        """Process group, then ``backend.init(args)``; returns the next rollout id."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray shows each actor its own device only
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            # The address this rank's weight-update groups advertise to the engines.
            **{NODE_IP_ENV: node_ip()},
        )
        if args.update_weight_verify:
            # rank 0's "weight version N verified: ..." line of each publish reaches the driver
            logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            logging.getLogger("miles_sync.weight_sync").setLevel(logging.INFO)
        if self.use_gpu:
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend=process_group_backend(args, self.use_gpu),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        backend_cls = load(self.backend_name)
        roles = self.roles
        if roles is None:
            roles = ("critic", "actor") if args.use_critic else ("actor",)
        next_ids = {}
        # the critic first: the actor's init (and its --load) sets the process's RNG state last
        for role in roles:
            self.models[role] = backend_cls()
            next_ids[role] = int(self.models[role].init(args, role))
        if len(set(next_ids.values())) > 1:
            raise RuntimeError(resume_mismatch(args, next_ids["critic"], next_ids["actor"]))
        return next_ids[roles[-1]]

    def data_layout(self):
        """The layout of the rank's last role (the actor's; a critic rank's own)."""
        return next(reversed(self.models.values())).data_layout()

    def process_group(self) -> str:
        """The default group's backend as torch reports it (e.g. ``cpu:gloo,cuda:nccl``)."""
        return str(dist.get_backend())

    def _role(self, role: str):
        if role not in self.models:
            held = " and ".join(self.models) or "nothing"
            raise RuntimeError(f"no {role} on this trainer rank (it holds {held})")
        return self.models[role]

    def train(self, rollout_id: int, shard: RolloutBatch) -> dict[str, float]:
        return self._role("actor").train(rollout_id, shard)

    def critic_values(self, shard: RolloutBatch) -> list:
        return self._role("critic").compute_values(shard)

    def train_critic(self, rollout_id: int, shard: RolloutBatch) -> dict[str, float]:
        return self._role("critic").train(rollout_id, shard)

    def update_weights(self, engines: list[str], weights: str | None = None) -> None:
        self._role("actor").update_weights(engines, weights=weights)

    def save_model(self, rollout_id: int, force_sync: bool) -> None:
        """Each role's checkpoint at the same point: the actor's, then the critic's
        (``--critic-save``)."""
        for role in ("actor", "critic"):
            if role in self.models:
                self.models[role].save_model(rollout_id, force_sync=force_sync)

    def sleep(self, role: str = "actor") -> None:
        self._role(role).sleep()

    def wake_up(self, role: str = "actor") -> None:
        self._role(role).wake_up()

    def close(self) -> None:
        for model in self.models.values():  # the critic first, as built
            model.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def resume_mismatch(args: ParsedArgs, critic_next: int, actor_next: int) -> str:
    """The error of a critic checkpoint that resumes at another rollout than the actor's."""
    return (
        f"the critic's checkpoint (--critic-load {args.critic_load}) resumes at rollout "
        f"{critic_next}, the actor's (--load {args.load}) at {actor_next}"
    )


class Pending:
    """One method in flight on every rank of a group (:meth:`TrainerGroup.start`): another
    group can work meanwhile; :meth:`result` waits for it (failures as :meth:`TrainerGroup.call`)."""

    def __init__(self, group: TrainerGroup, method: str, refs: list) -> None:
        self.group, self.method, self.refs = group, method, refs

    def result(self) -> list[Any]:
        return self.group._gather(self.method, self.refs)


class TrainerGroup:
    """Trainer ranks of a job: the actor's on the trainer's bundles (``roles`` ``("actor",)``,
    or ``("critic", "actor")`` with the critic beside it), or a critic's own on the critic's
    bundles (``("critic",)``; named ``critic`` in failures)."""

    name = "trainer"  # how a failure names the group's ranks

    def __init__(
        self, placement: Placement, backend_name: str, roles: tuple[str, ...] = ("actor",)
    ):
        layout = placement.layout
        own_critic = "actor" not in roles
        self.name = "critic" if own_critic else "trainer"
        bundles = layout.critic_bundles() if own_critic else layout.trainer_bundles()
        self.world_size = len(bundles)
        # colocated engines share the trainer's bundles, never a critic's own
        share = TRAINER_SHARE if layout.colocate and not own_critic else 1.0
        actor_cls = ray.remote(TrainerRank)
        self.actors = []
        for rank, bundle in enumerate(bundles):
            options: dict[str, Any] = dict(
                num_cpus=share,
                scheduling_strategy=placement.strategy(placement.bundle(bundle)),
                max_concurrency=1,
            )
            if layout.use_gpu:
                options["num_gpus"] = share
            self.actors.append(
                actor_cls.options(**options).remote(
                    rank, self.world_size, backend_name, layout.use_gpu, tuple(roles)
                )
            )
        self.layouts: list[Any] = []
        self.num_steps = 1  # --num-steps-per-rollout, from init
        self.alive = True
        self.hosts: list[str | None] = [None] * self.world_size  # node address per rank
        self.pids: list[int] = []  # process id per rank, from init

    # ------------------------------------------------------------------ lock-step calls
    def call(self, method: str, *args: Any, per_rank: list[tuple] | None = None) -> list[Any]:
        """``method`` on every rank (the same ``args``, or ``per_rank[r]`` for rank ``r``);
        returns the per-rank results. Any failure tears every rank down (see module doc)."""
        return self.start(method, *args, per_rank=per_rank).result()

    def start(self, method: str, *args: Any, per_rank: list[tuple] | None = None) -> Pending:
        """:meth:`call` without waiting: the results come from ``.result()``."""
        if not self.alive:
            raise TrainerFailure(f"{self.name} already torn down (calling {method})")
        refs = [
            getattr(actor, method).remote(*(per_rank[r] if per_rank is not None else args))
            for r, actor in enumerate(self.actors)
        ]
        return Pending(self, method, refs)

    def _gather(self, method: str, refs: list) -> list[Any]:
        """The results of ``refs`` (one per rank, in rank order). The first rank that fails
        tears every rank down, and :class:`TrainerFailure` names it, its host and ``method``;
        except a publish every rank failed alike (:class:`PublishFailed`, ranks kept)."""
        index = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as error:  # a rank raised, or its process died
                rank = index[done[0]]
                cause = getattr(error, "cause", None) or error
                if isinstance(cause, PublishError) and self._all_failed_alike(refs):
                    raise PublishFailed(self._failure_line(rank, method, cause)) from error
                self.teardown()
                raise TrainerFailure(self._failure_line(rank, method, cause)) from error
        return ray.get(refs)

    def _failure_line(self, rank: int, method: str, cause: BaseException) -> str:
        """``trainer rank R on HOST failed in METHOD(): ...``; a dead process in one line
        (Ray's own description of it takes several)."""
        host = self.hosts[rank] if rank < len(self.hosts) else None
        where = f"{self.name} rank {rank}" + (f" on {host}" if host else "")
        if isinstance(cause, RayActorError):
            detail = " ".join(str(cause).split())
            return f"{where} failed in {method}(): its process died ({detail[:300]})"
        return f"{where} failed in {method}(): {type(cause).__name__}: {cause}"

    def _all_failed_alike(self, refs: list) -> bool:
        """Whether every rank raised :class:`PublishError` (waits for all of them: a rank
        still in the publish's collectives returns once rank 0's error reached it)."""
        for ref in refs:
            try:
                ray.get(ref)
            except Exception as error:
                if not isinstance(getattr(error, "cause", None) or error, PublishError):
                    return False
            else:
                return False
        return True

    # ------------------------------------------------------------------ the contract
    def init(self, args: ParsedArgs) -> int:
        """Process groups and ``backend.init`` on every rank; the next rollout id."""
        return self.finish_init(self.start_init(args), args)

    def start_init(self, args: ParsedArgs) -> Pending:
        """:meth:`init` without waiting for the backends (another group can start meanwhile):
        this group's own rendezvous on its rank 0's node, then ``init`` in flight."""
        self.hosts = self._gather("host", [actor.host.remote() for actor in self.actors])
        self.pids = self._gather("pid", [actor.pid.remote() for actor in self.actors])
        ((master_addr, master_port),) = self._gather(
            "master_endpoint", [self.actors[0].master_endpoint.remote()]
        )
        return self.start("init", args, master_addr, master_port)

    def where(self) -> str:
        """``trainer ranks: 0 on HOST pid P, ...`` (the job's log line)."""
        ranks = [f"{r} on {h} pid {p}" for r, (h, p) in enumerate(zip(self.hosts, self.pids))]
        return f"{self.name} ranks: " + ", ".join(ranks)

    def finish_init(self, pending: Pending, args: ParsedArgs) -> int:
        """Wait for :meth:`start_init`'s ranks; the next rollout id they agree on."""
        next_ids = pending.result()
        if len(set(next_ids)) != 1:
            self.teardown()
            raise TrainerFailure(f"{self.name} ranks disagree on the next rollout id: {next_ids}")
        self.layouts = self.call("data_layout")
        self.num_steps = args.num_steps_per_rollout
        return next_ids[0]

    def _shards(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """``batch`` split by the data layouts (prompt groups kept whole, token counts
        balanced per optimizer step): shard ``d`` for data-parallel rank ``d``."""
        dp_size = self.layouts[0].dp_size
        return partition_for_dp(batch, dp_size, keep_groups=True, num_steps=self.num_steps)

    def train(self, rollout_id: int, batch: RolloutBatch) -> list[dict[str, float]]:
        """Train every rank on its shard of ``batch`` (:meth:`_shards`)."""
        return self._on_shards("train", rollout_id, self._shards(batch))

    def _on_shards(self, method: str, rollout_id: int | None, shards: list[RolloutBatch]):
        return self._start_on_shards(method, rollout_id, shards).result()

    def _start_on_shards(
        self, method: str, rollout_id: int | None, shards: list[RolloutBatch]
    ) -> Pending:
        refs = [ray.put(shard) for shard in shards]
        head = () if rollout_id is None else (rollout_id,)
        return self.start(
            method, per_rank=[(*head, refs[layout.dp_rank]) for layout in self.layouts]
        )

    def critic_values(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` with the critic's ``values`` field (``--use-critic``): every rank scores its
        shard before this rollout's updates; the shards' values are put back in batch order."""
        shards = self._shards(batch)
        per_rank = self._on_shards("critic_values", None, shards)
        position = {src: i for i, src in enumerate(batch.source_indices)}
        values: list = [None] * len(batch)
        for layout, shard_values in zip(self.layouts, per_rank):
            shard = shards[layout.dp_rank]
            for src, v in zip(shard.source_indices, shard_values):
                values[position[src]] = v
        return batch.with_fields(values=values)

    def train_critic(self, rollout_id: int, batch: RolloutBatch) -> list[dict[str, float]]:
        """Train the critic of every rank on its shard of ``batch`` (which carries ``values``)."""
        return self.start_train_critic(rollout_id, batch).result()

    def start_train_critic(self, rollout_id: int, batch: RolloutBatch) -> Pending:
        """:meth:`train_critic` in flight (a critic on its own ranks trains while the actor
        does)."""
        return self._start_on_shards("train_critic", rollout_id, self._shards(batch))

    def update_weights(self, engine_urls: list[str], weights: str | None = None) -> None:
        self.call("update_weights", list(engine_urls), weights)

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        self.call("save_model", rollout_id, force_sync)

    def start_save_model(self, rollout_id: int, force_sync: bool = False) -> Pending:
        return self.start("save_model", rollout_id, force_sync)

    def sleep(self, role: str = "actor") -> None:
        """``role``: ``actor`` or ``critic`` (``--use-critic``)."""
        self.call("sleep", role)

    def wake_up(self, role: str = "actor") -> None:
        self.call("wake_up", role)

    def close(self) -> None:
        """``backend.close`` on every rank, then the actors go."""
        if not self.alive:
            return
        try:
            self.call("close")
        finally:
            self.teardown()

    def teardown(self) -> None:
        """Kill every rank's actor (idempotent)."""
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone
                pass
        self.alive = False
