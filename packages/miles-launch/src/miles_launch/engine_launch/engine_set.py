"""The job's engines: launched on their bundles, health-checked, watched, stopped.

``EngineSet.start()`` starts one process per engine (SGLang or built-in) through a
:class:`~miles_launch.engine_launch.process.ProcessHost` actor on the engine's first bundle, with
``CUDA_VISIBLE_DEVICES`` naming the GPUs of all its bundles, and returns at once;
``EngineSet.wait_ready()`` waits until every ``/health`` answers 200, then starts the SGLang
router (or registers with an external one, and removes them from it at shutdown). Between
the two the job initialises the trainer (disaggregated), so that engine start-up and trainer
start-up overlap. Any engine that exits, at start or later, raises
:class:`~miles_launch.engine_launch.process.EngineDied` with its log tail
(:meth:`EngineSet.check_alive`), unless the run restarts engines
(:mod:`~miles_launch.engine_launch.recovery`, which calls :meth:`EngineSet.restart`).

With ``--update-weight-transfer-mode disk-delta`` a ``miles-sync pull`` agent runs beside each
engine, on the engine's bundle (so on its host), started with it and stopped with it; a puller
that exits counts as a dead engine.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import ray
from miles_core.args.parsed import ParsedArgs
from miles_core.engine import EngineClient, EngineError
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from miles_launch.engine_launch.builtin_launcher import builtin_engine_command, builtin_engine_env
from miles_launch.engine_launch.process import EngineDied, ProcessHost, exit_description
from miles_launch.engine_launch.router import (
    deregister_worker,
    external_router_url,
    register_worker,
    router_command,
)
from miles_launch.engine_launch.sglang_launcher import sglang_secret_config, sglang_server_command
from miles_launch.placement import ENGINE_HOST_SHARE, Placement
from miles_launch.plan import log_dir
from miles_launch.rollout.routed_experts import routing_replay_on

logger = logging.getLogger(__name__)
#: Seconds one question to an engine's host actor may take before it is asked again (a host
#: cut off the network answers none until it is back).
HOST_ANSWER_S = 5.0


@dataclass
class EngineProcess:
    """One launched engine (or the router): its URL, host actor, pid and log path."""

    name: str
    url: str
    host: Any  # the ProcessHost actor
    pid: int
    log_path: str


class EngineSet:
    """All engines of the job (see the module docstring)."""

    def __init__(self, args: ParsedArgs, placement: Placement):
        self.args = args
        self.placement = placement
        self.engines: list[EngineProcess] = []
        self.router: EngineProcess | None = None
        self.router_url: str | None = None
        self.pullers: list[EngineProcess] = []  # disk-delta: one beside each engine
        self.registered: list[str] = []  # engine URLs this job added to an external router

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Start every engine's process; returns without waiting for them to serve."""
        layout = self.placement.layout
        host_cls = ray.remote(ProcessHost)
        hosts, endpoints, host_options = [], [], []
        # Every host actor is created before any is waited for: each is a worker process of its
        # own, and N engines' hosts start together rather than one after another.
        for k, bundles in enumerate(layout.engine_bundles()):
            first = self.placement.bundle(bundles[0])
            options: dict[str, Any] = dict(
                num_cpus=ENGINE_HOST_SHARE, scheduling_strategy=self.placement.strategy(first)
            )
            if layout.use_gpu:
                options["num_gpus"] = ENGINE_HOST_SHARE
            host = host_cls.options(**options).remote(f"engine-{k}", log_dir(self.args))
            hosts.append(host)
            endpoints.append(host.endpoint.remote())
            host_options.append(options)
        endpoints = ray.get(endpoints)
        for k in range(len(hosts)):
            engine = self._launch(k, hosts[k], endpoints[k])
            self.engines.append(engine)
            if self.args.update_weight_transfer_mode == "disk-delta":
                self._start_puller(k, engine.url, host_options[k])

    def _launch(self, k: int, host: Any, endpoint: tuple[str, int]) -> EngineProcess:
        """Engine ``k``'s process on its host actor, serving at ``endpoint`` (ip, port)."""
        ip, port = endpoint
        env = {}
        if self.placement.layout.use_gpu:
            bundles = self.placement.layout.engine_bundles()[k]
            gpus = [g for b in bundles for g in self.placement.info(b).gpu_ids]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        if self.args.rollout_engine != "sglang":
            env.update(builtin_engine_env(self.args))
        cmd = self.engine_command(ip, port)
        secret = sglang_secret_config(self.args) if self.args.rollout_engine == "sglang" else None
        pid, log_path = ray.get(host.start.remote(cmd, env, secret))
        url = f"http://{ip}:{port}"
        logger.info("engine %d: %s (pid %d, log %s)", k, url, pid, log_path)
        return EngineProcess(f"engine {k}", url, host, pid, log_path)

    def restart(self, k: int) -> EngineProcess:
        """Stop engine ``k``'s process (dead or hung) and start a new one on the same host actor
        (the same bundles and GPUs) at a new port; returns it once ``/health`` answers. The
        new engine serves the checkpoint's weights: it is not registered with the router here
        (:meth:`register` does, once a publish gave it the current weights)."""
        old = self.engines[k]
        self.unregister(old.url)
        self.wait_for_host(old)
        ray.get(old.host.stop.remote(), timeout=60)
        engine = self._launch(k, old.host, ray.get(old.host.endpoint.remote()))
        self.engines[k] = engine
        self.wait_healthy([engine])
        return engine

    def wait_for_host(self, proc: EngineProcess) -> None:
        """Until ``proc``'s host actor answers: a host cut off the network holds every call
        until it is back (at most ``--engine-startup-timeout``); a host actor that is gone
        (its node left the Ray cluster: Ray gave up on it; or the actor died) does not come
        back. Either raises :class:`EngineDied` naming the engine and its host."""
        host = urlsplit(proc.url).hostname
        timeout = self.args.engine_startup_timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                ray.get(proc.host.poll.remote(), timeout=HOST_ANSWER_S)
                return
            except (GetTimeoutError, ActorUnavailableError):
                if time.monotonic() > deadline:
                    raise EngineDied(
                        f"{proc.name} ({proc.url}) cannot be restarted: its host {host} did not "
                        f"answer for --engine-startup-timeout {timeout:.0f}s"
                    ) from None
                time.sleep(1.0)
            except RayActorError as error:
                nodes = [n for n in ray.nodes() if n.get("NodeManagerAddress") == host]
                why = (
                    f"its host {host} left the Ray cluster"
                    if nodes and not any(n["Alive"] for n in nodes)
                    else f"its host actor on {host} died ({str(error).strip().splitlines()[0]})"
                )
                raise EngineDied(
                    f"{proc.name} ({proc.url}) cannot be restarted on its placement: {why}"
                ) from None

    def register(self, url: str) -> None:
        """Put a (restarted) engine behind the router, own or external (SGLang only)."""
        if self.router_url is None or url in self.registered:
            return
        register_worker(self.router_url, url, api_key=self.api_key)
        self.registered.append(url)

    def unregister(self, url: str) -> None:
        """Take an engine out of the router, so it routes nothing more to it (best effort)."""
        if self.router_url is None:
            return
        try:
            deregister_worker(self.router_url, url, api_key=self.api_key)
        except Exception as error:  # a router without the worker, or unreachable
            logger.warning("removing %s from the router: %s", url, error)
        if url in self.registered:
            self.registered.remove(url)

    def _start_puller(self, k: int, engine_url: str, options: dict[str, Any]) -> None:
        """``miles-sync pull`` for engine ``k``, on the engine's bundle (so on its host)."""
        host = ray.remote(ProcessHost).options(**options).remote(f"puller-{k}", log_dir(self.args))
        cmd = puller_command(self.args, k, engine_url)
        pid, log_path = ray.get(host.start.remote(cmd, {}))
        self.pullers.append(EngineProcess(f"puller {k}", engine_url, host, pid, log_path))
        logger.info("puller %d for %s (pid %d, log %s)", k, engine_url, pid, log_path)

    def wait_ready(self) -> None:
        """Wait until every started engine answers ``/health``, then start the router."""
        self.wait_healthy(self.engines)
        self._start_router()

    def engine_command(self, host: str, port: int) -> list[str]:
        if self.args.rollout_engine == "sglang":
            return sglang_server_command(self.args, host=host, port=port)
        device = "cuda:0" if self.placement.layout.use_gpu else "cpu"
        return builtin_engine_command(self.args, host=host, port=port, device=device)

    def _start_router(self) -> None:
        """SGLang: own router in front, or registration with the external one. Built-in:
        none (the driver spreads requests over the engines itself)."""
        if self.args.rollout_engine != "sglang":
            return
        external = external_router_url(self.args)
        if external is not None:
            if routing_replay_on(self.args):
                logger.warning(
                    "--use-rollout-routing-replay with the external router %s: miles starts its "
                    "own engines with --enable-return-routed-experts; any other worker behind "
                    "that router must run with it too (a reply without routed experts fails "
                    "the rollout)",
                    external,
                )
            self.router_url = external
            for engine in self.engines:
                register_worker(external, engine.url, api_key=self.api_key)
                self.registered.append(engine.url)
            return
        host = ray.remote(ProcessHost).options(num_cpus=0).remote("router", log_dir(self.args))
        ip, port = ray.get(host.endpoint.remote())
        cmd = router_command(
            self.args, host=ip, port=port, worker_urls=[e.url for e in self.engines]
        )
        pid, log_path = ray.get(host.start.remote(cmd, {}))
        self.router = EngineProcess("router", f"http://{ip}:{port}", host, pid, log_path)
        self.wait_healthy([self.router])
        self.router_url = self.router.url

    def wait_healthy(self, processes: list[EngineProcess]) -> None:
        """Poll ``/health`` of each until 200; a process that exits meanwhile, or the
        ``--engine-startup-timeout``, raises naming it (with its log tail)."""
        deadline = time.monotonic() + self.args.engine_startup_timeout
        waiting = list(processes)
        clients = {
            p.url: EngineClient(p.url, api_key=self.api_key, timeout=5.0, retries=0)
            for p in waiting
        }
        try:
            while waiting:
                for proc in list(waiting):
                    self._raise_if_dead(proc, "while starting")
                    try:
                        if clients[proc.url].health(timeout=5.0):
                            waiting.remove(proc)
                    except EngineError:
                        pass
                if not waiting:
                    break
                if time.monotonic() > deadline:
                    names = ", ".join(p.name for p in waiting)
                    raise EngineDied(
                        f"{names} not healthy after --engine-startup-timeout "
                        f"{self.args.engine_startup_timeout:.0f}s; log: {waiting[0].log_path}\n"
                        + self.log_tail(waiting[0])
                    )
                time.sleep(0.5)
        finally:
            for client in clients.values():
                client.close()

    # ------------------------------------------------------------------ watching
    def log_tail(self, proc: EngineProcess) -> str:
        try:
            return ray.get(proc.host.log_tail.remote(), timeout=10)
        except Exception as error:  # the host actor itself is gone
            return f"(log tail unavailable: {error}; log: {proc.log_path})"

    def _raise_if_dead(self, proc: EngineProcess, when: str) -> None:
        code = ray.get(proc.host.poll.remote())
        if code is not None:
            raise self.died(proc, code, when)

    def died(self, proc: EngineProcess, code: int, when: str) -> EngineDied:
        """The error of ``proc`` that exited with ``code``: one line, then its log tail."""
        return EngineDied(
            f"{proc.name} ({proc.url}, pid {proc.pid}) {exit_description(code)} {when}; "
            f"last lines of {proc.log_path}:\n{self.log_tail(proc)}"
        )

    def exit_code(self, proc: EngineProcess) -> int | None:
        """The process's exit status, or None while it runs."""
        return ray.get(proc.host.poll.remote())

    def check_alive(self, when: str = "during the run") -> None:
        """Raise :class:`EngineDied` if any engine (or the router) has exited."""
        for proc in self.all_processes():
            self._raise_if_dead(proc, when)

    def explain_failure(self, when: str, grace_s: float = 15.0) -> None:
        """After a failed request: raise :class:`EngineDied` if an engine (or the router) has
        exited or exits within ``grace_s`` (a killed engine drops its connections a moment
        before its exit status can be read, longer on a busy host); else return."""
        deadline = time.monotonic() + grace_s
        while True:
            self.check_alive(when)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.25)

    async def acheck_alive(self, when: str) -> None:
        """:meth:`check_alive` for asyncio code (awaits the host actors)."""
        for proc in self.all_processes():
            code = await proc.host.poll.remote()
            if code is not None:
                self._raise_if_dead(proc, when)

    def all_processes(self) -> list[EngineProcess]:
        return self.engines + self.pullers + ([self.router] if self.router is not None else [])

    # ------------------------------------------------------------------ URLs and memory
    @property
    def urls(self) -> list[str]:
        """Every engine's own URL (what weight updates address)."""
        return [e.url for e in self.engines]

    @property
    def generation_urls(self) -> list[str]:
        """Where generation requests go: the router, or each engine in turn."""
        return [self.router_url] if self.router_url else self.urls

    @property
    def api_key(self) -> str | None:
        """The job's engine API key (``--sglang-api-key``, or the one generated for it)."""
        return getattr(self.args, "sglang_api_key", None)

    def client(self, url: str) -> EngineClient:
        """A client of one of the job's engines, carrying the job's API key."""
        return EngineClient(url, api_key=self.api_key)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/release_memory_occupation`` on every engine with SGLang's memory ``tags``
        (``weights``, ``kv_cache``, ``cuda_graph``; None: all of them)."""
        for url in self.urls:
            with self.client(url) as client:
                client.release_memory_occupation(None if tags is None else list(tags))

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/resume_memory_occupation`` on every engine with ``tags`` (None: all)."""
        for url in self.urls:
            with self.client(url) as client:
                client.resume_memory_occupation(None if tags is None else list(tags))

    def weight_versions(self) -> list[str]:
        """``weight_version`` of every engine (``/get_model_info``)."""
        versions = []
        for url in self.urls:
            with self.client(url) as client:
                versions.append(str(client.get_model_info()["weight_version"]))
        return versions

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Remove the engines from an external router, then stop every process."""
        for url in self.registered:
            try:
                deregister_worker(self.router_url, url, api_key=self.api_key)
            except Exception as error:  # an unreachable router must not block the teardown
                logger.warning("removing %s from the router: %s", url, error)
        self.registered = []
        for proc in reversed(self.all_processes()):
            try:
                ray.get(proc.host.stop.remote(), timeout=30)
            except Exception as error:
                logger.warning("stopping %s: %s", proc.name, error)
            try:
                ray.kill(proc.host)
            except Exception:
                pass
        self.engines, self.pullers, self.router = [], [], None


def puller_command(
    args: ParsedArgs, k: int, engine_url: str, python: str = sys.executable
) -> list[str]:
    """``miles-sync pull`` beside engine ``k``: the shared ``--update-weight-disk-dir``, a
    local checkpoint directory on the engine's host (under
    ``--update-weight-local-checkpoint-dir``, else the host's temporary directory)."""
    local_root = args.update_weight_local_checkpoint_dir or os.path.join(
        tempfile.gettempdir(), "miles-pullers"
    )
    port = engine_url.rsplit(":", 1)[-1]
    return [
        python, "-m", "miles_sync.cli", "pull",
        "--update-weight-disk-dir", str(args.update_weight_disk_dir),
        "--update-weight-local-checkpoint-dir", os.path.join(local_root, f"engine-{k}-{port}"),
        "--engine-url", engine_url,
    ]  # fmt: skip
