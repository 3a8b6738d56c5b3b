"""Where trainer ranks and engines run: the bundle layout and its Ray placement group.

One placement group holds one bundle per device: ``{GPU: 1, CPU: 1}``, or ``{CPU: 1}`` when the
job runs without GPUs (then a "GPU" below is a CPU slot). Bundles are numbered thus:

* disaggregated (default): bundles ``0 .. T-1`` are the trainer's (``T = --actor-num-nodes x
  --actor-num-gpus-per-node``, rank ``r`` on bundle ``r``), bundles ``T .. T+R-1`` the engines'
  (``R = --rollout-num-gpus``), engine ``k`` on ``T + k*g .. T + (k+1)*g - 1`` with
  ``g = --rollout-num-gpus-per-engine``;
* ``--colocate``: ``T`` bundles; engine ``k`` shares bundles ``k*g .. (k+1)*g - 1`` with the
  trainer ranks there (``R`` is reconciled to ``T``);
* a critic on its own ranks (``--use-critic`` with ``--critic-num-nodes`` or
  ``--critic-num-gpus-per-node``, ``C`` ranks): bundles ``T .. T+C-1`` are the critic's, right
  after the trainer's (colocated or not: engines never share them); the engines' bundles
  follow them. Without those flags the critic lives in the trainer's ranks (``C = 0``).

Which node each bundle sits on is decided here, before Ray is asked
(:func:`assign_nodes`): the trainer's ranks fill ``--actor-num-nodes`` nodes of
``--actor-num-gpus-per-node`` each, every engine's ``g`` bundles sit on one node, and no node
holds more than ``--num-gpus-per-node`` of the job's bundles (a critic's ranks fill
``--critic-num-nodes`` nodes of ``--critic-num-gpus-per-node`` each, next to the trainer's or on
nodes of their own). Nodes are taken in address order, the trainer's first. A layout that cannot fit the cluster's nodes is refused with one message
naming what does not fit; one that fits pins every bundle to its node (Ray's ``node:<ip>``
resource), so the placement group is exactly the plan.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass

from miles_core.args.parsed import ParsedArgs

logger = logging.getLogger(__name__)

#: Share of a bundle's CPU/GPU taken by a trainer actor and by an engine host actor. Both fit
#: in one bundle (colocated) and a trainer alone still gets the device.
TRAINER_SHARE = 0.5
ENGINE_HOST_SHARE = 0.25


@dataclass(frozen=True)
class Layout:
    """The bundle plan of a job (pure arithmetic over the flags)."""

    num_trainer_ranks: int
    num_engines: int
    gpus_per_engine: int
    colocate: bool
    use_gpu: bool
    trainer_gpus_per_node: int = 1  # --actor-num-gpus-per-node
    gpus_per_node: int = 8  # --num-gpus-per-node
    num_critic_ranks: int = 0  # a critic on its own ranks; 0: in the trainer's (or none)
    critic_gpus_per_node: int = 1  # --critic-num-gpus-per-node

    @property
    def num_bundles(self) -> int:
        own = self.num_trainer_ranks + self.num_critic_ranks
        if self.colocate:
            return own
        return own + self.num_engines * self.gpus_per_engine

    def trainer_bundles(self) -> list[int]:
        """Bundle index of each trainer rank."""
        return list(range(self.num_trainer_ranks))

    def critic_bundles(self) -> list[int]:
        """Bundle index of each rank of a critic on its own ranks ([] when it has none)."""
        start = self.num_trainer_ranks
        return list(range(start, start + self.num_critic_ranks))

    def engine_bundles(self) -> list[list[int]]:
        """Bundle indices of each engine."""
        start = 0 if self.colocate else self.num_trainer_ranks + self.num_critic_ranks
        g = self.gpus_per_engine
        return [list(range(start + k * g, start + (k + 1) * g)) for k in range(self.num_engines)]

    def bundle_resources(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.use_gpu else {"CPU": 1.0}

    def node_groups(self) -> list[tuple[str, list[int]]]:
        """``(what, bundles)`` that must share one node: each trainer node's ranks, each node of
        a critic on its own ranks, then (not colocated) each engine's bundles. Colocated engines
        sit inside the trainer's nodes."""
        groups = []
        for name, ranks, per_node in (
            ("trainer", self.trainer_bundles(), self.trainer_gpus_per_node),
            ("critic", self.critic_bundles(), self.critic_gpus_per_node),
        ):
            groups += [
                (f"{name} node {i // per_node}", ranks[i : i + per_node])
                for i in range(0, len(ranks), per_node)
            ]
        if not self.colocate:
            groups += [(f"engine {k}", b) for k, b in enumerate(self.engine_bundles())]
        return groups


def plan_layout(args: ParsedArgs, use_gpu: bool) -> Layout:
    """The :class:`Layout` of the parsed flags (``rollout_num_gpus`` already reconciled)."""
    trainer = args.actor_num_nodes * args.actor_num_gpus_per_node
    g = args.rollout_num_gpus_per_engine
    total_rollout = trainer if args.colocate else args.rollout_num_gpus
    critic = critic_ranks(args)
    if total_rollout % g:
        raise ValueError(
            f"--rollout-num-gpus {total_rollout} is not a multiple of "
            f"--rollout-num-gpus-per-engine {g}"
        )
    return Layout(
        num_trainer_ranks=trainer,
        num_engines=total_rollout // g,
        gpus_per_engine=g,
        colocate=bool(args.colocate),
        use_gpu=use_gpu,
        trainer_gpus_per_node=args.actor_num_gpus_per_node,
        gpus_per_node=args.num_gpus_per_node,
        num_critic_ranks=critic,
        critic_gpus_per_node=(
            (args.critic_num_gpus_per_node or args.actor_num_gpus_per_node) if critic else 1
        ),
    )


def critic_ranks(args: ParsedArgs) -> int:
    """Ranks of a critic on its own ranks: ``--critic-num-nodes x --critic-num-gpus-per-node``
    when either is given with ``--use-critic`` (the other then defaults to the actor's); 0 when
    the critic lives in the trainer's ranks or there is none."""
    if not args.use_critic:
        return 0
    nodes, per_node = args.critic_num_nodes, args.critic_num_gpus_per_node
    if nodes is None and per_node is None:
        return 0
    nodes = args.actor_num_nodes if nodes is None else nodes
    per_node = args.actor_num_gpus_per_node if per_node is None else per_node
    return int(nodes) * int(per_node)


class LayoutDoesNotFit(RuntimeError):
    """The job's bundles cannot be placed on the cluster's nodes (the message says why)."""


def assign_nodes(layout: Layout, capacities: dict[str, int]) -> list[str]:
    """The node of every bundle (by layout index), given each node's devices by address.

    A node holds at most ``min(its devices, --num-gpus-per-node)`` of the job's bundles. Each
    trainer node group takes a node of its own (the first, in address order, with room), and so
    does each critic node group (a node of the trainer's may hold one of them); engines then fill
    the room left, first fit, in the same order. Raises
    :class:`LayoutDoesNotFit` naming the first group with no room and the room per node.
    """
    where, failed, room = _pack(layout, capacities)
    if failed is None:
        return where
    what, size = failed
    needed = nodes_needed(layout)
    raise LayoutDoesNotFit(
        f"the layout needs {needed or 'more than any number of'} node(s) of "
        f"--num-gpus-per-node {layout.gpus_per_node}: {what} ({size} {_unit(layout)}) fits no "
        f"node; room per node: {room or 'no nodes'}"
    )


def nodes_needed(layout: Layout) -> int:
    """Nodes of ``--num-gpus-per-node`` devices the layout fills, packed as
    :func:`assign_nodes` packs it (for the log line and the refusal); 0 when a group is larger
    than a node."""
    spare = {f"node {i:05d}": layout.gpus_per_node for i in range(len(layout.node_groups()))}
    where, failed, _ = _pack(layout, spare)
    return 0 if failed is not None else len(set(where))


def _pack(layout: Layout, capacities: dict[str, int]):
    """``(node per bundle, None, room left)``, or ``(partial, (group, size), room)`` for the
    first group that fits no node."""
    nodes = sorted(capacities, key=_address_key)
    room = {n: min(int(capacities[n]), layout.gpus_per_node) for n in nodes}
    where: dict[int, str] = {}
    taken: dict[str, set[str]] = {}  # "trainer" / "critic": the nodes its node groups took
    for what, bundles in layout.node_groups():
        family = what.split(" node ")[0] if " node " in what else None
        used = taken.setdefault(family, set()) if family else set()
        candidates = [n for n in nodes if n not in used]
        node = next((n for n in candidates if room[n] >= len(bundles)), None)
        if node is None:
            return [], (what, len(bundles)), room
        used.add(node)
        room[node] -= len(bundles)
        for b in bundles:
            where[b] = node
    return [where[b] for b in range(layout.num_bundles)], None, room


def _unit(layout: Layout) -> str:
    return "GPU(s)" if layout.use_gpu else "CPU slot(s)"


def _address_key(address: str) -> tuple:

    try:
        return (0, ipaddress.ip_address(address).packed)
    except ValueError:
        return (1, address.encode())


@dataclass(frozen=True)
class BundleInfo:
    """Where a bundle landed: its node and (with GPUs) the physical GPU ids it holds."""

    index: int  # index in the placement group
    node_id: str
    node_ip: str
    gpu_ids: tuple[int, ...]


class Placement:
    """The job's placement group: bundle ``i`` pinned to the node :func:`assign_nodes` planned
    for layout bundle ``i``. Use ``strategy(bundle(i))`` to run on it."""

    def __init__(self, layout: Layout, timeout_s: float = 300.0):
        import ray  # ray stays off the CLI's parse path (test_cli_help)

        # ray stays off the CLI's parse path (test_cli_help)
        from ray.util.placement_group import placement_group

        self.layout = layout
        self.nodes = assign_nodes(layout, cluster_capacities(layout.use_gpu))
        bundles = [{**layout.bundle_resources(), f"node:{node}": NODE_SHARE} for node in self.nodes]
        logger.info(
            "placement: %d bundles on %d node(s): %s",
            layout.num_bundles,
            len(set(self.nodes)),
            {n: self.nodes.count(n) for n in sorted(set(self.nodes), key=_address_key)},
        )
        self.group = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            available = ray.available_resources()
            raise RuntimeError(
                f"Ray could not place {layout.num_bundles} bundles of {bundles[0]} within "
                f"{timeout_s:.0f}s (available: {available})"
            )
        self.infos = self._probe()
        misplaced = [i.index for i in self.infos if i.node_ip != self.nodes[i.index]]
        if misplaced:  # the node:<ip> pin makes this impossible; say so if it ever happens
            raise RuntimeError(
                f"Ray placed bundles {misplaced} off their planned nodes: "
                + ", ".join(f"{i}: {self.infos[i].node_ip} not {self.nodes[i]}" for i in misplaced)
            )

    def _probe(self) -> list[BundleInfo]:
        """Node and GPU ids of every bundle: from the placement-group table without GPUs,
        from a tiny task per bundle (``ray.get_gpu_ids``) with them."""
        import ray  # ray stays off the CLI's parse path (test_cli_help)

        # ray stays off the CLI's parse path (test_cli_help)
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.group)
        node_of = table["bundles_to_node_id"]
        # the node's address as the plan names it (Ray's NodeManagerAddress), not the address
        # a process advertises (loopback on a local cluster, whatever Ray's node address is)
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        if not self.layout.use_gpu:
            return [
                BundleInfo(i, node_of[i], ips.get(node_of[i], ""), ())
                for i in range(self.layout.num_bundles)
            ]
        gpu_ids = ray.remote(_gpu_ids)
        found = ray.get(
            [
                gpu_ids.options(
                    num_cpus=0.01, num_gpus=0.01, scheduling_strategy=self.strategy(i)
                ).remote()
                for i in range(self.layout.num_bundles)
            ]
        )
        return [
            BundleInfo(i, node_of[i], ips.get(node_of[i], ""), tuple(gpus))
            for i, gpus in enumerate(found)
        ]

    def bundle(self, layout_index: int) -> int:
        """The placement-group bundle of a layout bundle (the same index: bundle ``i`` of the
        group is pinned to the node planned for layout bundle ``i``)."""
        return layout_index

    def info(self, layout_index: int) -> BundleInfo:
        return self.infos[layout_index]

    def strategy(self, bundle_index: int):
        # ray stays off the CLI's parse path (test_cli_help)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        )

    def remove(self) -> None:
        # ray stays off the CLI's parse path (test_cli_help)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


#: Share of a node's own ``node:<ip>`` resource that pins a bundle to that node.
NODE_SHARE = 0.001


def cluster_capacities(use_gpu: bool) -> dict[str, int]:
    """Devices (GPUs, or CPU slots without GPUs) of every live Ray node, by node address."""
    import ray  # ray stays off the CLI's parse path (test_cli_help)

    key = "GPU" if use_gpu else "CPU"
    out: dict[str, int] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            address = node["NodeManagerAddress"]
            out[address] = out.get(address, 0) + int(node["Resources"].get(key, 0))
    return out


# miles_sync's NODE_IP_ENV is set in the runtime environment of a local (single-machine) Ray cluster: every
# address the job hands out (engines, the trainer's process groups) is then loopback. Trainer
# ranks set it to their node's address, which the weight-update groups advertise.


def node_ip() -> str:
    """The address this process's servers bind and advertise: loopback on a local cluster,
    Ray's node IP on a real one (``--ray-address``)."""
    import ray  # ray stays off the CLI's parse path (test_cli_help)

    # miles_sync.node_address is off the CLI's parse path
    from miles_sync.node_address import NODE_IP_ENV

    return os.environ.get(NODE_IP_ENV) or ray.util.get_node_ip_address()


def _gpu_ids() -> list[int]:
    """Run inside a bundle: the physical GPU ids Ray gave it."""
    import ray  # ray stays off the CLI's parse path (test_cli_help)

    return [int(g) for g in ray.get_gpu_ids()]


def init_ray(layout: Layout, address: str | None) -> None:
    """Join ``address`` or start a local Ray sized to the job (logical CPUs = bundles + 1).

    Local Ray gets as many logical GPUs as CUDA devices (0 without), a small object store and
    no dashboard, so it starts on a 2-core machine.
    """
    import ray  # ray stays off the CLI's parse path (test_cli_help)

    # miles_sync.node_address is off the CLI's parse path
    from miles_sync.node_address import NODE_IP_ENV

    if ray.is_initialized():
        return
    # workers' output reaches the driver's log line by line: no progress bars there (tqdm)
    env = {"env_vars": {"PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return
    env["env_vars"][NODE_IP_ENV] = "127.0.0.1"
    os.environ[NODE_IP_ENV] = "127.0.0.1"
    num_gpus = 0
    if layout.use_gpu:
        import torch  # torch stays off the CLI's parse path (test_cli_help)

        num_gpus = torch.cuda.device_count()
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            _start_local_ray(env, layout.num_bundles + 1, num_gpus)
            return
        except Exception as error:
            # Ray gives its raylet a fixed 30 s to register; on a busy host that can pass
            if "timed out during startup" not in str(error) or attempt == RAY_START_ATTEMPTS:
                raise
            logger.warning("local Ray did not start in time (a busy host?); trying again")
            ray.shutdown()


#: How many times a local Ray cluster is started before its startup time-out is an error.
RAY_START_ATTEMPTS = 3


def _start_local_ray(env: dict, num_cpus: int, num_gpus: int) -> None:
    import ray  # ray stays off the CLI's parse path (test_cli_help)

    ray.init(
        # A local cluster lives on loopback: Ray, the engines and the trainer's process group
        # all bind 127.0.0.1, never the machine's external address.
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        object_store_memory=256 * 1024**2,
        runtime_env=env,
        log_to_driver=True,
        logging_level=os.environ.get("MILES_RAY_LOG_LEVEL", "WARNING"),
        # No idle workers started ahead of the job: the job's runtime environment differs from
        # theirs, so its actors never use them (each one imported Ray for nothing: about a CPU
        # second per logical CPU at every start).
        _system_config={"prestart_worker_first_driver": False},
    )
