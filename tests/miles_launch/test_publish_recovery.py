"""A publish that an engine's death breaks between buckets, against a real built-in engine and
miles-sync's real publisher: the launcher's publish (``loop.publish`` with an
:class:`EngineRecovery`) takes the engine out of rotation, restarts it (a new process on a new
port), publishes the same version again, and only then serves: the engine holds the trainer's
weights bit for bit under the version the trainer published, and no version was skipped."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from engine_testing import EngineProcess, save_tokenizer, tiny_qwen3
from miles_core.engine import EngineClient
from miles_launch import loop
from miles_launch.engine_launch.recovery import EngineRecovery
from miles_launch.trainer_group import PublishFailed
from miles_sync.errors import PublishError
from miles_sync.weight_sync import SyncConfig, WeightPublisher

# ~30-80 s on the CI machine (two engine starts): extended; the policy itself is in the default
# suite (test_engine_recovery.py, engines stood in for)
pytestmark = [pytest.mark.slow, pytest.mark.extended]

BUCKET = 2048  # bytes: many buckets, so the kill lands between two of them


@dataclass
class Proc:
    name: str
    url: str
    engine: EngineProcess
    pid: int = 0
    log_path: str = ""


class LocalEngines:
    """The engine set of one engine process on this machine (what the recovery calls)."""

    def __init__(self, model_path):
        self.model_path = model_path
        self.engines = [self._proc(EngineProcess(model_path))]
        self.router, self.router_url, self.pullers, self.api_key = None, None, [], None

    @staticmethod
    def _proc(engine: EngineProcess) -> Proc:
        return Proc("engine 0", engine.url, engine, engine.proc.pid)

    def restart(self, k: int) -> Proc:
        self.engines[k].engine.close()
        self.engines[k] = self._proc(EngineProcess(self.model_path))
        return self.engines[k]

    def exit_code(self, proc: Proc) -> int | None:
        return proc.engine.proc.poll()

    def weight_versions(self) -> list[str]:
        versions = []
        for e in self.engines:
            with EngineClient(e.url) as client:
                versions.append(str(client.get_model_info()["weight_version"]))
        return versions

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def register(self, url: str) -> None:
        pass

    def log_tail(self, proc: Proc) -> str:
        return proc.engine.read_log()

    def close(self) -> None:
        for e in self.engines:
            e.engine.close()


class Trainer:
    """One trainer rank's publish, as the trainer group reports it (PublishFailed)."""

    def __init__(self, model, engines: LocalEngines):
        self.model, self.engines = model, engines
        config = SyncConfig(mode="broadcast", buffer_size=BUCKET, group_timeout_s=60)
        config.engine_timeout_s = 30
        self.publisher = WeightPublisher(config)
        self.kill_after: int | None = None  # kill the engine after this many tensors, once
        self.refuse_after: int | None = None  # a tensor the engine refuses, after this many

    def source(self):
        for i, item in enumerate(self.model.state_dict().items()):
            if i == self.kill_after:
                self.kill_after = None
                self.engines.engines[0].engine.proc.kill()
                self.engines.engines[0].engine.proc.wait()
            if i == self.refuse_after:
                yield "model.not_a_weight", torch.zeros(4)  # its bucket is refused
            yield item

    def update_weights(self, urls, weights=None):
        try:
            self.publisher.update_weights(self.source(), urls)
        except PublishError as error:
            raise PublishFailed(f"trainer rank 0 failed in update_weights(): {error}") from error


@dataclass
class Job:
    trainer: Trainer
    engines: LocalEngines
    recovery: EngineRecovery
    published_weights: str | None = None


def engine_weights(url: str, model) -> dict[str, torch.Tensor]:
    out = {}
    with EngineClient(url) as client:
        for name, tensor in model.state_dict().items():
            rows = tensor.shape[0] if tensor.dim() else 1
            out[name] = torch.tensor(client.get_weights_by_name(name, rows), dtype=tensor.dtype)
    return out


def test_an_engine_killed_between_buckets_is_restarted_and_gets_the_same_version(tmp_path):
    path = tmp_path / "hf"
    model = tiny_qwen3(0)
    model.save_pretrained(path)
    save_tokenizer(path)
    engines = LocalEngines(path)
    try:
        recovery = EngineRecovery(engines, 2, backoff_s=0.0, health_timeout_s=60.0)
        trainer = Trainer(model, engines)
        job = Job(trainer, engines, recovery)
        loop.publish(job)  # version 1, every engine serving it
        assert engines.weight_versions() == ["1"]
        first_url = engines.urls[0]

        with torch.no_grad():  # a training step: the next version differs everywhere
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.01)
        trainer.kill_after = 5
        seen = []
        restart = engines.restart
        engines.restart = lambda k: (seen.append(recovery.in_rotation()), restart(k))[1]
        loop.publish(job)

        assert seen == [[]]  # while the version was incomplete nothing served
        assert engines.urls[0] != first_url  # a new process at a new port
        assert engines.weight_versions() == ["2"]  # the same version again, not skipped
        assert recovery.in_rotation() == engines.urls
        assert recovery.metrics()["engine_restarts"] == 1
        got = engine_weights(engines.urls[0], model)
        for name, tensor in model.state_dict().items():
            assert torch.equal(got[name].reshape(tensor.shape), tensor), name
        trainer.publisher.close()
    finally:
        engines.close()


def test_a_refused_bucket_leaves_the_engine_paused_on_its_partial_weights(tmp_path):
    """Buckets before the refused one landed: the engine holds a mix of two versions. The
    failed round leaves it paused (the engine's own scheduler reports it at the moment the
    failure reaches the launcher, before the recovery holds anything), so no decode step runs
    on the mix; the run ends with the publisher's message; a publish that completes resumes it."""
    path = tmp_path / "hf"
    model = tiny_qwen3(0)
    model.save_pretrained(path)
    save_tokenizer(path)
    engines = LocalEngines(path)
    try:
        recovery = EngineRecovery(engines, 2, backoff_s=0.0, health_timeout_s=60.0)
        trainer = Trainer(model, engines)
        job = Job(trainer, engines, recovery)
        loop.publish(job)  # version 1
        old = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.01)
        names = list(model.state_dict())
        trainer.refuse_after = len(names) // 2
        at_failure = []
        failed = recovery.publish_failed

        def observe(error):
            with EngineClient(engines.urls[0]) as client:
                at_failure.append(client.get_server_info()["paused"])
            return failed(error)

        recovery.publish_failed = observe
        with pytest.raises(PublishFailed, match="not_a_weight"):
            loop.publish(job)
        assert at_failure == [True]  # the failed round's close did not resume it
        got = engine_weights(engines.urls[0], model)
        new = model.state_dict()
        mixed = [torch.equal(got[n].reshape(new[n].shape), new[n]) for n in names]
        assert any(mixed) and not all(mixed)  # part of version 2 landed ...
        assert all(torch.equal(got[n].reshape(old[n].shape), old[n]) for n in names[-1:])
        assert engines.weight_versions() == ["1"]  # ... under version 1's name
        with EngineClient(engines.urls[0]) as client:
            assert client.get_server_info()["paused"]
        trainer.refuse_after = None
        loop.publish(job)  # the retry completes: version 2 whole, generation continues
        assert engines.weight_versions() == ["2"]
        with EngineClient(engines.urls[0]) as client:
            assert not client.get_server_info()["paused"]
        trainer.publisher.close()
    finally:
        engines.close()
