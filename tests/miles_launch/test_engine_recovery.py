"""Engine restarts without Ray or engine processes (``miles_launch.engine_launch.recovery``):
the re-issue bookkeeping of the generator when an engine dies (or its host is cut off) with
requests in flight, and the
rotation around a publish that an engine's death broke. Engines are ``httpx.MockTransport``
handlers; the engine set is a stand-in with the methods the recovery calls."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx
import pytest
from miles_launch import loop
from miles_launch.engine_launch import recovery as recovery_module
from miles_launch.engine_launch.process import EngineDied
from miles_launch.engine_launch.recovery import EngineRecovery
from miles_launch.engine_launch.watch_timing import MIN_HEALTH_TIMEOUT_S
from miles_launch.rollout import generate
from miles_launch.rollout.generate import Generator, SamplingConfig
from miles_launch.rollout.prompts import Prompt
from miles_launch.rollout.rewards import RewardModel
from miles_launch.trainer_group import PublishFailed

CFG = SamplingConfig(max_new_tokens=2, temperature=1.0, top_p=1.0, top_k=-1, seed=0)


class FakeEngine:
    """``/generate`` answers with the engine's name as text and the sampling seed as token;
    :meth:`kill` fails every held and later request as a dropped connection would."""

    def __init__(self, name: str, version: str = "1", hold: int = 0):
        self.name, self.version = name, version
        self.hold = hold  # requests held open until this many arrived, then the engine dies
        self.arrived = 0
        self.seeds: set[int] = set()  # the sampling seeds of every request sent here
        self.controls: list[str] = []  # paths of the synchronous control calls
        self.dead = False
        self.died = asyncio.Event()
        self.hung: asyncio.Event | None = None  # set: /health waits for it (a hung engine)
        # once this many requests arrived the engine's host is cut off: every request, /health
        # and its host actor's poll wait for ``restored`` (no connection drops)
        self.cut_after = 0
        self.restored: asyncio.Event | None = None
        self.held = 0  # requests waiting for the cut host

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.restored is not None:
            await self._unreachable(request)
        if request.url.path.startswith("/health"):
            if self.hung is not None:
                await self.hung.wait()
            return httpx.Response(200 if not self.dead else 503)
        body = json.loads(request.content)
        self.seeds.add(body["sampling_params"]["sampling_seed"])
        if self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        self.arrived += 1
        if self.cut_after and self.arrived >= self.cut_after:
            self.restored = asyncio.Event()
            await self._unreachable(request)
        if self.hold:
            if self.arrived >= self.hold:
                self.kill()
            await self.died.wait()
            raise httpx.ReadError("connection reset by peer", request=request)
        token = body["sampling_params"]["sampling_seed"] % 1000
        meta = {
            "finish_reason": {"type": "length", "length": 1},
            "weight_version": self.version,
            "output_token_logprobs": [[-0.5, token, None]],
        }
        return httpx.Response(
            200, json={"text": self.name, "output_ids": [token], "meta_info": meta}
        )

    async def _unreachable(self, request: httpx.Request) -> None:
        if request.url.path == "/generate":
            self.held += 1
            self.seeds.add(json.loads(request.content)["sampling_params"]["sampling_seed"])
        await self.restored.wait()

    def kill(self) -> None:
        self.dead = True
        self.died.set()

    def control(self, request: httpx.Request) -> httpx.Response:
        """The synchronous control calls (the recovery's pause of a stale engine)."""
        if self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        self.controls.append(request.url.path)
        return httpx.Response(200, json={"success": True, "message": "ok"})


class Poll:
    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def remote(self):
        async def code():
            if self.engine.restored is not None:  # its host is cut off: no answer
                await self.engine.restored.wait()
            return -9 if self.engine.dead else None

        return code()


@dataclass
class Proc:
    name: str
    url: str
    host: object
    pid: int = 1
    log_path: str = "engine.log"


class Host:
    def __init__(self, engine: FakeEngine):
        self.poll = Poll(engine)


class FakeEngineSet:
    """What :class:`EngineRecovery` calls on the job's engine set."""

    def __init__(self, fakes: dict[str, FakeEngine]):
        self.fakes = fakes
        self.engines = [
            Proc(f"engine {k}", url, Host(fake)) for k, (url, fake) in enumerate(fakes.items())
        ]
        self.router, self.router_url, self.pullers, self.api_key = None, None, [], None
        self.restarted: list[str] = []
        self.on_restart = lambda: None

    def restart(self, k: int) -> Proc:
        self.on_restart()
        url = f"{self.engines[k].url}-r{len(self.restarted) + 1}"
        self.fakes[url] = FakeEngine(url, version="0")  # the checkpoint's weights
        self.engines[k] = Proc(self.engines[k].name, url, Host(self.fakes[url]))
        self.restarted.append(url)
        return self.engines[k]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def exit_code(self, proc: Proc) -> int | None:
        return -9 if self.fakes[proc.url].dead else None

    def weight_versions(self) -> list[str]:
        return [self.fakes[e.url].version for e in self.engines]

    def register(self, url: str) -> None:
        pass

    def log_tail(self, proc: Proc) -> str:
        return "(tail)"

    def check_alive(self, when: str) -> None:
        pass


@pytest.fixture
def mock_http(monkeypatch):
    """Every engine client of the generator and the recovery talks to ``fakes`` by URL."""
    fakes: dict[str, FakeEngine] = {}

    def client(url, *args, **kwargs):
        kwargs["transport"] = httpx.MockTransport(fakes[url.rstrip("/")].handle)
        return real(url, *args, **kwargs)

    def sync_client(url, *args, **kwargs):
        kwargs["transport"] = httpx.MockTransport(fakes[url.rstrip("/")].control)
        return real_sync(url, *args, **kwargs)

    real = generate.AsyncEngineClient
    real_sync = recovery_module.EngineClient
    monkeypatch.setattr(generate, "AsyncEngineClient", client)
    monkeypatch.setattr(recovery_module, "AsyncEngineClient", client)
    monkeypatch.setattr(recovery_module, "EngineClient", sync_client)
    monkeypatch.setattr(recovery_module, "DEATH_GRACE_S", 5.0)
    return fakes


def make_recovery(engines, limit=2, republish=None) -> EngineRecovery:
    return EngineRecovery(engines, limit, backoff_s=0.0, health_timeout_s=60.0, republish=republish)


async def constant_reward(inp):
    return 1.0


def run_groups(fakes, recovery, prompts, n):
    gen = Generator(
        list(fakes), RewardModel(constant_reward, "constant"), recovery.acheck, recovery=recovery
    )

    async def main():
        try:
            return await gen.watched(gen.groups([(p, p.index) for p in prompts], n, CFG))
        finally:
            await gen.aclose()

    return asyncio.run(main())


def test_a_group_whose_engine_died_is_reissued_whole_on_the_survivor(mock_http):
    """Engine a dies once 3 requests are in flight on it: each group with a request there is
    sent again, whole, to b. Every group comes back with its n samples, one per sampling seed,
    all from b (one weight version); none is lost or counted twice."""
    fakes = mock_http
    fakes["http://a"] = FakeEngine("a", hold=3)
    fakes["http://b"] = FakeEngine("b")
    engines = FakeEngineSet(fakes)
    recovery = make_recovery(engines)
    prompts = [Prompt(i, f"p{i}", None, (1, 2, 3)) for i in range(4)]
    n = 3
    groups = run_groups(fakes, recovery, prompts, n)

    assert [g[0].prompt.index for g in groups] == [0, 1, 2, 3]
    for group in groups:
        assert len(group) == n
        assert {s.response_text for s in group} == {"b"}
        assert {s.weight_version for s in group} == {1}
        seeds = [generate.sampling_seed(0, group[0].position, k) % 1000 for k in range(n)]
        assert [s.response_ids[0] for s in group] == seeds  # each sample once, in order
    tried_a = fakes["http://a"].seeds
    reissued_groups = sum(
        any(generate.sampling_seed(0, p.index, k) in tried_a for k in range(n)) for p in prompts
    )
    assert reissued_groups >= 2
    assert recovery.metrics() == {"engine_restarts": 1, "requests_reissued": n * reissued_groups}
    assert recovery.metrics() == {"engine_restarts": 0, "requests_reissued": 0}  # per rollout
    recovery.settle()
    # the restarted engine serves only after a publish gave it the version of the others
    assert recovery.in_rotation() == ["http://b"]
    fakes[engines.restarted[0]].version = "1"
    assert recovery.published() == "1"
    assert sorted(recovery.in_rotation()) == ["http://a-r1", "http://b"]


def test_with_every_engine_lost_the_restarted_one_gets_the_weights_first(mock_http):
    """The only engine dies mid-rollout: the groups wait for its restart and the republish
    (the synchronous loop's publish), then run on it at the new version."""
    fakes = mock_http
    fakes["http://a"] = FakeEngine("a", hold=2)
    engines = FakeEngineSet(fakes)
    published = []

    def republish():
        recovery.before_publish()
        for e in engines.engines:
            fakes[e.url].version = "2"
        published.append(recovery.in_rotation())  # nothing serves before the publish ends
        recovery.published()

    recovery = make_recovery(engines, republish=republish)
    prompts = [Prompt(i, f"p{i}", None, (1,)) for i in range(2)]
    groups = run_groups(fakes, recovery, prompts, 2)
    assert published == [[]]
    assert all({s.weight_version for s in g} == {2} and len(g) == 2 for g in groups)
    assert recovery.metrics()["engine_restarts"] == 1


def test_the_restart_limit_ends_the_run_in_one_line(mock_http):
    fakes = mock_http
    fakes["http://a"] = FakeEngine("a", hold=1)
    fakes["http://b"] = FakeEngine("b")
    recovery = make_recovery(FakeEngineSet(fakes), limit=0)
    with pytest.raises(EngineDied) as failure:
        run_groups(fakes, recovery, [Prompt(0, "p", None, (1,))], 2)
    first = str(failure.value).splitlines()[0]
    assert first.startswith("engine 0 (http://a, pid 1) killed by SIGKILL during generation")
    assert "--engine-restart-limit 0 spent" in first


def test_an_engine_whose_health_does_not_answer_is_restarted_as_hung(mock_http, caplog):
    fakes = mock_http
    fakes["http://a"] = FakeEngine("a")
    fakes["http://b"] = FakeEngine("b")
    engines = FakeEngineSet(fakes)
    recovery = EngineRecovery(engines, 2, backoff_s=0.0, health_timeout_s=MIN_HEALTH_TIMEOUT_S)

    async def watch() -> None:
        fakes["http://a"].hung = asyncio.Event()
        deadline = asyncio.get_running_loop().time() + 30
        while not engines.restarted:
            assert asyncio.get_running_loop().time() < deadline
            await recovery.acheck("during generation")
            await asyncio.sleep(0.05)
        fakes["http://a"].hung.set()
        await asyncio.gather(*recovery._probes.values())

    asyncio.run(watch())
    recovery.settle()
    assert "did not answer /health for" in caplog.text and "(hung)" in caplog.text
    assert recovery.in_rotation() == ["http://b"]
    assert recovery.metrics()["engine_restarts"] == 1


def test_an_engine_whose_host_is_cut_off_loses_no_sample(mock_http):
    """Engine a's host is cut off as its first request arrives: its requests, /health and host
    actor's poll never answer, and no connection drops. The watch does not wait on the host
    (its tick goes on), the health timeout finds a hung, the requests it holds fail at once,
    and their groups are sent again, whole, to b: every group comes back with its n samples
    from b, counted once. (Before, the watch awaited the host actor's poll and the run hung.)"""
    fakes = mock_http
    fakes["http://a"] = FakeEngine("a")
    fakes["http://a"].cut_after = 1
    fakes["http://b"] = FakeEngine("b")
    engines = FakeEngineSet(fakes)
    # (the shortest --engine-health-timeout: three of the generator's watch ticks)
    recovery = EngineRecovery(engines, 2, backoff_s=0.0, health_timeout_s=MIN_HEALTH_TIMEOUT_S)
    prompts = [Prompt(i, f"p{i}", None, (1, 2, 3)) for i in range(4)]
    n = 3
    gen = Generator(
        list(fakes), RewardModel(constant_reward, "constant"), recovery.acheck, recovery=recovery
    )

    async def main():
        try:
            work = gen.watched(gen.groups([(p, p.index) for p in prompts], n, CFG))
            return await asyncio.wait_for(work, timeout=30)
        finally:
            await gen.aclose()

    groups = asyncio.run(main())
    cut = fakes["http://a"]
    assert cut.held >= 1 and not cut.restored.is_set()  # they were in flight, and never came
    for group in groups:
        assert {s.response_text for s in group} == {"b"} and len(group) == n
        seeds = [generate.sampling_seed(0, group[0].position, k) % 1000 for k in range(n)]
        assert [s.response_ids[0] for s in group] == seeds  # each sample once, in order
    reissued_groups = sum(
        any(generate.sampling_seed(0, p.index, k) in cut.seeds for k in range(n)) for p in prompts
    )
    assert reissued_groups >= 1
    assert recovery.metrics() == {"engine_restarts": 1, "requests_reissued": n * reissued_groups}


def test_fully_async_requests_wait_for_the_publish_retry_under_way(mock_http):
    """--fully-async (no republish): while the driver's publish is being retried the rotation
    is empty, and a group's next request waits for it rather than failing the run."""
    import threading
    import time

    fakes = mock_http
    fakes["http://a"] = FakeEngine("a", version="3")
    engines = FakeEngineSet(fakes)
    recovery = make_recovery(engines)
    recovery.before_publish()
    with recovery._lock:  # as publish_failed leaves it while the retry runs
        recovery._serving.clear()
    got = []
    waiter = threading.Thread(target=lambda: got.append(asyncio.run(recovery.rotation())))
    waiter.start()
    deadline = time.monotonic() + 30
    while not recovery._rotation_changed._waiters:  # the request is waiting (a state)
        assert time.monotonic() < deadline and waiter.is_alive()
        time.sleep(0.01)
    fakes["http://a"].version = "4"
    recovery.published()  # the retry completed
    waiter.join(timeout=30)
    assert got == [["http://a"]]


class FakeTrainer:
    """``update_weights`` as the trainer group does it: the publish of version ``v`` sets
    every engine's version only when it completes; ``fail`` makes the next one die half-way."""

    def __init__(self, fakes, engines):
        self.fakes, self.engines = fakes, engines
        self.version = 3
        self.fail: str | None = None
        self.calls: list[list[str]] = []

    def update_weights(self, urls, weights=None):
        self.calls.append(list(urls))
        if self.fail == "death":
            self.fail = None
            self.fakes[urls[1]].kill()  # engine 1 dies between buckets; engine 0 took some
            raise PublishFailed("trainer rank 0 failed in update_weights(): PublishError: ...")
        if self.fail == "refused":
            raise PublishFailed("trainer rank 0 failed in update_weights(): PublishError: no fit")
        self.version += 1
        for url in urls:
            self.fakes[url].version = str(self.version)


@dataclass
class FakeJob:
    trainer: object
    engines: object
    recovery: object
    published_weights: str | None = None


def test_a_publish_broken_by_a_death_is_retried_and_nothing_serves_in_between(mock_http):
    fakes = mock_http
    fakes["http://a"] = FakeEngine("a", version="3")
    fakes["http://b"] = FakeEngine("b", version="3")
    engines = FakeEngineSet(fakes)
    recovery = make_recovery(engines)
    trainer = FakeTrainer(fakes, engines)
    seen = []
    engines.on_restart = lambda: seen.append(recovery.in_rotation())
    trainer.fail = "death"
    loop.publish(FakeJob(trainer, engines, recovery))
    assert seen == [[]]  # engine a held part of the failed publish: out of rotation too
    assert fakes["http://a"].controls == ["/pause_generation"]  # and paused until the retry
    assert trainer.calls == [["http://a", "http://b"], ["http://a", "http://b-r1"]]
    assert engines.weight_versions() == ["4", "4"]
    assert sorted(recovery.in_rotation()) == ["http://a", "http://b-r1"]
    assert recovery.metrics()["engine_restarts"] == 1


def test_a_publish_that_fails_without_a_death_ends_with_every_engine_out(mock_http, monkeypatch):
    monkeypatch.setattr(recovery_module, "DEATH_GRACE_S", 0.0)
    fakes = mock_http
    fakes["http://a"] = FakeEngine("a", version="3")
    engines = FakeEngineSet(fakes)
    recovery = make_recovery(engines)
    trainer = FakeTrainer(fakes, engines)
    trainer.fail = "refused"
    with pytest.raises(PublishFailed, match="no fit"):
        loop.publish(FakeJob(trainer, engines, recovery))
    assert recovery.in_rotation() == [] and engines.weight_versions() == ["3"]
    assert fakes["http://a"].controls == ["/pause_generation"]  # left paused: it never serves


# megatron's parser imports megatron-core (~45 s on the CI machine): extended
@pytest.mark.parametrize("backend", ["fsdp", pytest.param("megatron", marks=pytest.mark.extended)])
def test_the_restart_flags_under_each_backend(tmp_path, backend):
    """Launcher flags: the same on both backends. Unset, the limit is 2, or 0 where engines
    are not restarted (--colocate, disk-delta); asking for restarts there is refused."""
    from miles_core import backends
    from miles_core.args import ArgumentError, entry_point_groups, parse_args
    from miles_launch.demo import build_tiny_qwen3

    if backend not in backends.available():
        pytest.skip(f"the {backend} backend is not installed")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "1"}\n')
    build_tiny_qwen3(tmp_path / "hf")  # megatron's parser reads the architecture
    groups = entry_point_groups("core", backend, "launch")
    base = ["--hf-checkpoint", str(tmp_path / "hf"), "--prompt-data", str(prompts)]
    base += ["--train-backend", backend, "--rollout-engine", "builtin"]

    def parse(*flags):
        return parse_args([*base, *flags], groups)

    args = parse()
    assert (args.engine_restart_limit, args.engine_restart_backoff) == (2, 2.0)
    assert args.engine_health_timeout == 60.0
    assert parse("--engine-restart-limit", "0").engine_restart_limit == 0
    assert parse("--colocate").engine_restart_limit == 0
    disk = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "d"]
    assert parse(*disk).engine_restart_limit == 0
    with pytest.raises(ArgumentError, match=r"--engine-restart-limit 1: .*--colocate"):
        parse("--colocate", "--engine-restart-limit", "1")
    with pytest.raises(ArgumentError, match=r"--engine-restart-limit 3: .*disk-delta"):
        parse(*disk, "--engine-restart-limit", "3")
    with pytest.raises(ArgumentError, match="--engine-restart-limit must be >= 0"):
        parse("--engine-restart-limit", "-1")
    # the watch ticks once a second: a timeout under three ticks would count healthy engines
    # as hung (watch_timing); the smallest one it honours is accepted
    for short in ("0", "2.9", "nan"):
        with pytest.raises(ArgumentError) as refused:
            parse("--engine-health-timeout", short)
        assert str(refused.value) == (
            f"--engine-health-timeout must be >= 3 (the engines' /health is watched once a "
            f"second), got {float(short):g}"
        )
    assert parse("--engine-health-timeout", "3").engine_health_timeout == 3.0
    # without restarts nothing is watched or restarted: their settings would do nothing
    for flag, no_restarts in (
        ("--engine-restart-backoff", ["--engine-restart-limit", "0"]),
        ("--engine-health-timeout", ["--colocate"]),
    ):
        with pytest.raises(ArgumentError, match=f"^{flag} acts on engine restarts"):
            parse(*no_restarts, flag, "5")
    assert parse("--engine-restart-backoff", "5").engine_restart_backoff == 5.0
