"""``--update-weight-verify`` (miles_sync.readback) against real built-in engines: a publish reads
every tensor back and finds them equal to the trainer's; a tensor one bf16 ulp off, or an
engine serving different weights, fails the check naming the tensor."""

from __future__ import annotations

import pytest
import torch
from miles_core.engine import EngineClient
from miles_sync.errors import PublishError
from miles_sync.readback import SentDigests, engine_dtype, tensors_digest, verify_engines
from miles_sync.weight_sync import SyncConfig, WeightPublisher
from sync_testing import Engine, save_checkpoint, source, tiny_model, train_step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    checkpoint = save_checkpoint(tiny_model(0), tmp_path_factory.mktemp("readback") / "ckpt")
    started = [Engine(checkpoint), Engine(checkpoint)]
    yield started
    for engine in started:
        engine.close()


def sent_digests(pairs, dtype=None) -> SentDigests:
    sent = SentDigests({dtype})
    for name, tensor in pairs:
        sent.record(name, tensor)
    return sent


def test_verified_publish_and_a_one_ulp_difference_is_caught(engines):
    model = tiny_model(0)
    train_step(model, 5)
    config = SyncConfig(mode="broadcast", buffer_size=2048, group_timeout_s=60, verify=True)
    publisher = WeightPublisher(config)
    urls = [e.url for e in engines]
    version = publisher.update_weights(source(model), urls)
    count = len(list(source(model)))
    assert publisher.last_stats["verified"] == {
        "tensors": count,
        "engines": 2,
        "state": tensors_digest(source(model)),
    }
    publisher.close()

    clients = [EngineClient(url) for url in urls]
    dtypes = {c.base_url: engine_dtype(c) for c in clients}
    assert verify_engines(clients, dtypes, sent_digests(source(model)), version)["tensors"] == count
    # The same weights with one element of one tensor moved by one bf16 ulp.
    pairs = list(source(model))
    name, tensor = pairs[3]
    bumped = tensor.clone()
    bumped.view(torch.int16).view(-1)[0] += 1  # the next bf16 value of its first element
    assert not torch.equal(bumped, tensor)
    pairs[3] = (name, bumped)
    with pytest.raises(
        PublishError, match=rf"differs from the trainer's .* 1 of {count} tensors: {name}"
    ):
        verify_engines(clients, dtypes, sent_digests(pairs), version)
    for client in clients:
        client.close()


def test_an_engine_that_missed_the_publish_fails_it(engines):
    """Engine 0 gets newly trained weights, engine 1 keeps the ones it had: checking both
    against the new ones names engine 1."""
    model = tiny_model(0)
    train_step(model, 6)
    publisher = WeightPublisher(SyncConfig(mode="broadcast", buffer_size=2048, group_timeout_s=60))
    version = publisher.update_weights(source(model), [engines[0].url])
    publisher.close()
    clients = [EngineClient(e.url) for e in engines]
    dtypes = {c.base_url: engine_dtype(c) for c in clients}
    assert dtypes == {c.base_url: None for c in clients}  # "auto": the checkpoint's bf16
    sent = sent_digests(source(model))
    assert verify_engines(clients[:1], dtypes, sent, version)["engines"] == 1
    with pytest.raises(PublishError, match=f"on {engines[1].url} differs"):
        verify_engines(clients, dtypes, sent, version)
    for client in clients:
        client.close()


def test_a_dtype_the_float32_reply_cannot_hold_is_refused():
    with pytest.raises(PublishError, match="float64, which /get_weights_by_name cannot"):
        sent_digests([("w", torch.zeros(2, dtype=torch.float64))])
