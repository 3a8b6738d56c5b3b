"""Keeping the engines in service during the run (``--engine-restart-limit`` > 0).

::

    watch (each second of generation): process alive?  /health within --engine-health-timeout?
                                       (at least 3 s: engine_launch.watch_timing)
      dead or hung -> out of rotation -> its requests in flight fail at once
                   -> [back-off] restart on its placement (a thread), once its host answers
    a request fails -> its engine's death shows within the grace -> the group is re-issued
                       on the engines in rotation (none left: wait for the restart, publish)
    publish -> complete on every engine: all of them in rotation, on one version
            -> failed: every engine is stale (out of rotation); dead ones are restarted, and
               the publish is retried; a failure without a death ends the run

An engine serves only weights of a complete publish: a restarted one starts from the checkpoint
and joins the rotation after the next publish; one that took part of a failed publish stays out
until a retry completes. The rotation therefore holds engines of one weight version only, and a
group is re-issued whole (its finished samples are dropped), so its samples come from one
version and are counted once.

An engine whose host is cut off the network (or whose process hangs) drops no connection: its
requests would wait for replies that never come. Nothing the watch asks waits on it either: the
process's exit status comes from its host actor in the background (a call that does not answer
holds no tick), so the ``/health`` timeout finds it hung; the requests it holds then fail at
once and their groups are re-issued. Its restart waits until the host actor answers again (at
most ``--engine-startup-timeout``; a host that left the Ray cluster ends the run in one line
naming the engine and its host).

The restarts of the whole run are bounded by the limit; the back-off before a restart doubles
with each restart made. The router (SGLang), a disk-delta puller and a restart that fails are
not restarted: they end the run as without restarts (:class:`EngineDied`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from miles_core.engine import AsyncEngineClient, EngineClient, EngineError

from miles_launch.engine_launch.process import EngineDied, exit_description
from miles_launch.engine_launch.watch_timing import PROBE_INTERVAL_S, probe_interval

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: How long a failed request waits for its engine's death to become visible (a killed engine
#: drops its connections a moment before its exit status can be read, longer on a busy host).
DEATH_GRACE_S = 15.0


class EngineRecovery:
    """The rotation, the restarts and their counters of one job (module docstring).

    ``engines``: the job's :class:`~miles_launch.engine_launch.engine_set.EngineSet` (or
    anything with its ``engines``, ``router``, ``pullers``, ``restart``, ``register``,
    ``weight_versions``, ``generation_urls`` and ``api_key``); ``republish``: publishes the
    current weights to every engine (the synchronous loop's publish; None under
    ``--fully-async``, where the trainer may be training: there a run that lost every engine
    ends)."""

    def __init__(
        self,
        engines: Any,
        limit: int,
        backoff_s: float,
        health_timeout_s: float,
        republish: Callable[[], None] | None = None,
        pause_mode: str = "retract",
    ) -> None:
        self.engines = engines
        self.pause_mode = pause_mode  # --pause-generation-mode: how stale engines are held
        self.limit = limit
        self.backoff_s = backoff_s
        self.health_timeout_s = health_timeout_s
        self.republish = republish
        self.restarts = 0  # over the run
        self.reissued = 0  # requests sent again, over the run
        self._reported = (0, 0)  # the counters at the last metrics()
        self._lock = threading.Lock()
        self._rotation_changed = threading.Condition(self._lock)
        self._publishing = False  # a publish (or its retry) is under way
        self._republishing = threading.Lock()
        self._serving = {e.url for e in engines.engines}  # in rotation
        self._retired: set[str] = set()  # URLs of engines that died (their requests fail)
        self._threads: dict[int, threading.Thread] = {}  # engine index -> its restart
        self._failures: list[BaseException] = []  # what a restart raised
        self._healthy_at: dict[str, float] = {}  # url -> last /health 200 (monotonic)
        self._probes: dict[str, asyncio.Task] = {}
        self._polls: dict[tuple[str, int], asyncio.Task] = {}  # (name, pid) -> its exit status
        # url -> (its event loop, set once the engine is lost): its requests in flight fail
        self._lost_events: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._watched_at = 0.0  # the last watch tick: between generations nobody probes
        self._unregistered: set[str] = set()  # restarted engines the router does not know yet
        self._closed = False

    # ------------------------------------------------------------------ the rotation
    def in_rotation(self) -> list[str]:
        """Where generation requests go now: the engines serving the current version (or the
        router in front of them); [] while none does."""
        with self._lock:
            serving = [e.url for e in self.engines.engines if e.url in self._serving]
        if not serving:
            return []
        router = self.engines.router_url
        return [router] if router else serving

    async def rotation(self) -> list[str]:
        """:meth:`in_rotation`, waiting while it is empty: for the restarts under way and then
        for a publish to them (``republish``); raises :class:`EngineDied` when none can come."""
        urls = self.in_rotation()
        if urls:
            return urls
        return await asyncio.to_thread(self._serve_again)

    def _serve_again(self) -> list[str]:
        """Every engine is out: wait for the restarts, publish to them (once, whichever group
        asks first), return the rotation."""
        with self._republishing:
            urls = self.in_rotation()
            if urls:
                return urls
            self.settle()
            with self._lock:  # --fully-async: the driver's publish under way brings them back
                while self._publishing and not self._serving:
                    self._rotation_changed.wait()
            urls = self.in_rotation()
            if urls:
                return urls
            if self.republish is None:
                raise EngineDied(
                    "every engine was lost during generation, and under --fully-async the "
                    "trainer does not publish to the restarted ones before its next publish"
                )
            self.republish()
            urls = self.in_rotation()
            if not urls:
                raise EngineDied("no engine serves after restarting and publishing to them")
            return urls

    # ------------------------------------------------------------------ watching
    async def acheck(self, when: str) -> None:
        """The watch of one generation tick: each engine's process, and its ``/health``
        (probes run in the background, one per engine at a time). A dead or hung engine goes
        out of rotation and is restarted; what cannot be restarted raises :class:`EngineDied`."""
        self._raise_failures()
        now = time.monotonic()
        if now - self._watched_at > 2 * PROBE_INTERVAL_S:  # a new generation phase
            self._healthy_at.clear()
        self._watched_at = now
        for k, proc in enumerate(list(self.engines.engines)):
            if k in self._threads:
                continue
            code = self._poll(proc)
            if code is not None:
                self.lost(k, f"{exit_description(code)} {when}")
            elif proc.url in self._serving:
                self._probe(k, proc.url, when)
        others = list(self.engines.pullers) + (
            [self.engines.router] if self.engines.router is not None else []
        )
        for proc in others:  # not restarted: raise as without restarts
            code = self._poll(proc)
            if code is not None:
                raise self.engines.died(proc, code, when)

    def _poll(self, proc: Any) -> int | None:
        """``proc``'s exit status as its host actor last told it (None: running, or no answer
        yet). The question runs in the background, one at a time: a host that does not answer
        (cut off the network) holds no tick, and its engine's ``/health`` decides."""
        key = (proc.name, proc.pid)
        task = self._polls.get(key)
        if task is not None and not task.done():
            return None
        self._polls[key] = asyncio.ensure_future(self._ask_exit(proc))
        if task is None or task.cancelled():
            return None
        error = task.exception()
        if error is not None:  # the host actor unreachable, or gone with its node
            logger.debug("polling %s: %s", proc.name, error)
            return None
        return task.result()

    @staticmethod
    async def _ask_exit(proc: Any) -> int | None:
        return await proc.host.poll.remote()

    def _probe(self, k: int, url: str, when: str) -> None:
        now = time.monotonic()
        last = self._healthy_at.setdefault(url, now)
        if now - last > self.health_timeout_s:
            self.lost(k, f"did not answer /health for {now - last:.0f}s {when} (hung)")
            return
        task = self._probes.get(url)
        if task is not None and not task.done():
            return
        if task is not None and now - last < probe_interval(self.health_timeout_s):
            return

        async def probe() -> None:
            client = AsyncEngineClient(url, api_key=self.engines.api_key, retries=0)
            try:
                if await client.health(timeout=self.health_timeout_s):
                    self._healthy_at[url] = time.monotonic()
            except EngineError:
                pass
            finally:
                await client.aclose()

        self._probes[url] = asyncio.ensure_future(probe())

    def lost(self, k: int, why: str) -> None:
        """Engine ``k`` died or hangs: out of rotation, and restarted after the back-off;
        beyond ``--engine-restart-limit`` raises :class:`EngineDied` (one line, then the log
        tail)."""
        proc = self.engines.engines[k]
        with self._lock:
            if k in self._threads:
                return
            self._serving.discard(proc.url)
            self._retired.add(proc.url)
            self._fail_in_flight(proc.url)
            if self.restarts >= self.limit:
                tail = self.engines.log_tail(proc)
                raise EngineDied(
                    f"{proc.name} ({proc.url}, pid {proc.pid}) {why}; --engine-restart-limit "
                    f"{self.limit} spent; last lines of {proc.log_path}:\n{tail}"
                )
            delay = self.backoff_s * 2**self.restarts
            self.restarts += 1
            thread = threading.Thread(
                target=self._restart, args=(k, delay), name=f"miles-restart-{k}", daemon=True
            )
            self._threads[k] = thread
        logger.warning(
            "%s (%s, pid %d) %s: restarting it in %.1fs (restart %d of --engine-restart-limit %d)",
            proc.name, proc.url, proc.pid, why, delay, self.restarts, self.limit,
        )  # fmt: skip
        thread.start()

    def _fail_in_flight(self, url: str) -> None:
        """Fail the requests in flight on a lost engine (under the lock; any thread)."""
        entry = self._lost_events.get(url)
        if entry is not None and not entry[0].is_closed():
            entry[0].call_soon_threadsafe(entry[1].set)

    def _lost_event(self, url: str) -> asyncio.Event:
        """The event set when the engine at ``url`` is lost (this event loop's)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._lost_events.get(url)
            if entry is None or entry[0] is not loop:
                entry = self._lost_events[url] = (loop, asyncio.Event())
                if url in self._retired:
                    entry[1].set()
            return entry[1]

    async def unless_lost(self, url: str, work: Awaitable[T]) -> T:
        """``work`` (a request to the engine at ``url``), failed with a connection-less
        :class:`EngineError` as soon as that engine is lost: a hung engine, or one whose host
        is cut off, holds its requests open (nothing drops the connection), and its groups are
        re-issued without waiting for it."""
        request = asyncio.ensure_future(work)
        lost = asyncio.ensure_future(self._lost_event(url).wait())
        try:
            await asyncio.wait({request, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # cancelled from outside too: neither outlives the call
            for task in (request, lost):
                if not task.done():
                    task.cancel()
            await asyncio.gather(request, lost, return_exceptions=True)
        if not request.cancelled():
            return request.result()
        raise EngineError(
            "its engine was lost (hung, or its host unreachable) with this request in flight",
            endpoint="POST /generate",
            base_url=url,
            status_code=None,
        )

    def _restart(self, k: int, delay: float) -> None:
        try:
            time.sleep(delay)
            if self._closed:
                return
            engine = self.engines.restart(k)
            with self._lock:
                self._unregistered.add(engine.url)
            logger.warning("%s restarted at %s (pid %d); it serves after the next publish",
                           engine.name, engine.url, engine.pid)  # fmt: skip
        except BaseException as error:  # handed to whoever waits (settle, acheck)
            self._failures.append(error)

    def _raise_failures(self) -> None:
        if self._failures:
            error = self._failures[0]
            raise EngineDied(f"restarting an engine failed: {error}") from error

    def settle(self) -> None:
        """Wait for the restarts under way; raise what one of them raised."""
        while True:
            with self._lock:
                threads = dict(self._threads)
            if not threads:
                break
            for k, thread in threads.items():
                thread.join()
                with self._lock:
                    self._threads.pop(k, None)
        self._raise_failures()

    async def explained(self, error: EngineError, when: str) -> bool:
        """Whether a failed request is explained by an engine's death (its engine, or with a
        router any engine, out of rotation within :data:`DEATH_GRACE_S`). An HTTP error (the
        engine answered) never is."""
        if error.status_code is not None:
            return False
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            await self.acheck(when)
            with self._lock:
                lost = ({e.url for e in self.engines.engines} - self._serving) | self._retired
                restarting = bool(self._threads)
            if error.base_url.rstrip("/") in lost:
                return True
            if self.engines.router_url is not None and (restarting or lost):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.25)

    def count_reissued(self, requests: int) -> None:
        with self._lock:
            self.reissued += requests

    # ------------------------------------------------------------------ publishing
    def before_publish(self) -> None:
        """A publish goes to every engine: wait until the restarted ones serve their
        ``/health``."""
        self.settle()
        with self._lock:
            self._publishing = True

    def published(self) -> str:
        """After a publish that completed: every engine must report one version (the one the
        trainer published); they all join the rotation. Returns that version."""
        versions = self.engines.weight_versions()
        if len(set(versions)) != 1:
            raise EngineDied(
                "after a complete publish the engines report different weight versions: "
                + ", ".join(f"{e.url} {v}" for e, v in zip(self.engines.engines, versions))
            )
        urls = [e.url for e in self.engines.engines]
        with self._lock:
            restarted, self._unregistered = self._unregistered, set()
        for url in urls:
            if url in restarted:
                self.engines.register(url)
        with self._lock:
            self._serving = set(urls)
            # a restarted engine may serve at the URL of one that was lost before
            self._retired -= self._serving
            for url in urls:
                self._lost_events.pop(url, None)
            self._publishing = False
            self._rotation_changed.notify_all()
        self._healthy_at.clear()
        return versions[0]

    def publish_failed(self, error: BaseException) -> None:
        """A publish failed on every trainer rank: every engine may hold part of it, so all of
        them leave the rotation until a retry completes. Engines that died are restarted (a
        retry follows); without a dead engine the failure is not one a retry mends: raised."""
        with self._lock:
            self._serving.clear()
        self._hold(self.engines.engines)
        dead = []
        deadline = time.monotonic() + DEATH_GRACE_S
        while not dead:
            for k, proc in enumerate(self.engines.engines):
                if self.engines.exit_code(proc) is not None:
                    dead.append(k)
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        if not dead:
            with self._lock:
                self._publishing = False
                self._rotation_changed.notify_all()
            raise error
        for k in dead:
            code = self.engines.exit_code(self.engines.engines[k])
            self.lost(k, f"{exit_description(code)} while receiving weights")
        self.settle()

    def _hold(self, procs: list[Any]) -> None:
        """Pause generation on every live engine of ``procs`` (best effort; pausing a paused
        engine changes nothing). A round that failed once its update windows were open left
        them paused already (miles-sync's ``PublishRound``); one that failed before (a pause or
        ``begin_weight_update`` refused) resumed them, on the previous version whole. The
        retry's round pauses them again and resumes them once it completed."""
        for proc in procs:
            try:
                with EngineClient(proc.url, api_key=self.engines.api_key, timeout=30.0,
                                  retries=0) as client:  # fmt: skip
                    client.pause_generation(self.pause_mode)
            except EngineError as failure:  # a dead engine: restarted below
                logger.debug("holding %s after a failed publish: %s", proc.url, failure)

    def close(self) -> None:
        """At teardown: no restart starts any more; wait (bounded) for those under way, so
        the engine set's shutdown stops what they started."""
        self._closed = True
        with self._lock:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout=60)

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, int]:
        """Restarts and re-issued requests since the previous call (a rollout's record)."""
        with self._lock:
            restarts, reissued = self.restarts, self.reissued
        before = self._reported
        self._reported = (restarts, reissued)
        return {"engine_restarts": restarts - before[0], "requests_reissued": reissued - before[1]}
