"""disk-delta without an engine: the writer's versions, the puller's decoding and refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from miles_sync.delta_format import DATA, read_index, read_latest
from miles_sync.disk_delta import DeltaWriter, DeltaWriterConfig, puller_key, wait_for_pullers
from miles_sync.errors import DeltaError, PublishError
from miles_sync.puller import LOCAL_WEIGHTS, Puller, PullerConfig
from safetensors.torch import load_file
from sync_testing import save_checkpoint, source, tiny_model, train_step

FROZEN = ("model.embed_tokens", "model.layers.0")
URL = "http://127.0.0.1:30000"


@pytest.fixture
def setup(tmp_path):
    model = tiny_model(0)
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    return model, ckpt, tmp_path


def writer_for(tmp_path, ckpt, **kw) -> DeltaWriter:
    return DeltaWriter(DeltaWriterConfig(str(tmp_path / "shared"), str(ckpt), **kw))


def puller_for(tmp_path, local="local") -> Puller:
    return Puller(PullerConfig(str(tmp_path / "shared"), str(tmp_path / local), URL))


def assert_local_equals(puller: Puller, model) -> None:
    """The puller's local checkpoint holds exactly the trainer's bf16 bytes."""
    local = load_file(str(puller.local_path(puller.version) / LOCAL_WEIGHTS))
    want = dict(source(model))
    assert local.keys() == want.keys()
    for name, tensor in want.items():
        assert local[name].dtype == tensor.dtype, name
        assert torch.equal(local[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize(
    "encoding,checksum", [("xor", "xxh3-128"), ("overwrite", "blake3"), ("xor", "adler32")]
)
def test_changed_tensors_only_and_puller_decodes_bit_for_bit(setup, encoding, checksum):
    model, ckpt, tmp_path = setup
    writer = writer_for(tmp_path, ckpt, encoding=encoding, checksum=checksum)
    puller = puller_for(tmp_path)
    trainable = [n for n, _ in model.named_parameters() if not n.startswith(FROZEN)]
    for version, base in ((2, 0), (3, 2), (7, 3)):  # versions need not be consecutive
        train_step(model, seed=version, frozen=FROZEN)
        stats = writer.write(source(model), version)
        assert read_latest(tmp_path / "shared") == version
        index = read_index(tmp_path / "shared" / f"weight_v{version:06d}")
        assert index["base_version"] == base and index["kind"] == "delta"
        written = sorted(n for n, e in index["tensors"].items() if e["encoding"] is not None)
        assert written == sorted(trainable) and stats.changed == len(trainable)
        assert {e["encoding"] for e in index["tensors"].values()} == {None, encoding}
        assert 0 < stats.published_bytes < stats.full_bytes
        assert puller.sync() == version
        assert_local_equals(puller, model)
    baseline = read_index(tmp_path / "shared" / "weight_v000000")
    assert (
        baseline["kind"] == "baseline" and not (tmp_path / "shared/weight_v000000" / DATA).exists()
    )


def test_unchanged_state_publishes_nothing(setup):
    model, ckpt, tmp_path = setup
    writer = writer_for(tmp_path, ckpt)
    stats = writer.write(source(model), 1)  # same bytes as the checkpoint
    assert stats.changed == 0 and stats.published_bytes == 0
    puller = puller_for(tmp_path)
    assert puller.sync() == 1
    assert_local_equals(puller, model)


@pytest.mark.parametrize("where", ["header", "middle", "last", "truncate"])
def test_corrupt_delta_is_refused_and_local_stays(setup, where):
    model, ckpt, tmp_path = setup
    writer = writer_for(tmp_path, ckpt)
    puller = puller_for(tmp_path)
    train_step(model, seed=1)
    writer.write(source(model), 1)
    assert puller.sync() == 1
    before = {n: t.clone() for n, t in source(model)}
    train_step(model, seed=2)
    writer.write(source(model), 2)
    data = tmp_path / "shared" / "weight_v000002" / DATA
    raw = bytearray(data.read_bytes())
    if where == "truncate":
        raw = raw[: len(raw) - 7]
    else:
        pos = {"header": 20, "middle": len(raw) // 2, "last": len(raw) - 1}[where]
        raw[pos] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(DeltaError, match="weight_v000002/delta.safetensors: .*checksum"):
        puller.sync()
    assert puller.version == 1 and read_latest(tmp_path / "local") == 1
    local = load_file(str(tmp_path / "local" / "weight_v000001" / LOCAL_WEIGHTS))
    assert all(torch.equal(local[n], t) for n, t in before.items())
    report = json.loads((tmp_path / "shared" / "pullers" / f"{puller_key(URL)}.json").read_text())
    assert report["version"] == 1 and report["error_version"] == 2
    with pytest.raises(PublishError, match="refused weight version 2: .*stays on version 1"):
        wait_for_pullers(tmp_path / "shared", [URL], 2, timeout_s=5)


def test_fresh_puller_starts_from_the_newest_full_state(setup):
    model, ckpt, tmp_path = setup
    writer = writer_for(tmp_path, ckpt, full_every=3)
    for version in range(1, 6):
        train_step(model, seed=version)
        writer.write(source(model), version)
    kinds = [read_index(tmp_path / "shared" / f"weight_v{v:06d}")["kind"] for v in range(1, 6)]
    assert kinds == ["delta", "delta", "full", "delta", "delta"]
    # Deltas before the full state are not needed: hide them, and the baseline's checkpoint.
    for version in (0, 1, 2):
        shutil.move(tmp_path / "shared" / f"weight_v{version:06d}", tmp_path / f"hidden{version}")
    shutil.move(ckpt, tmp_path / "hidden-ckpt")
    puller = puller_for(tmp_path, local="fresh")
    assert puller.sync() == 5
    assert_local_equals(puller, model)


def test_puller_resumes_from_its_local_checkpoint(setup):
    model, ckpt, tmp_path = setup
    writer = writer_for(tmp_path, ckpt)
    train_step(model, seed=1)
    writer.write(source(model), 1)
    assert puller_for(tmp_path).sync() == 1
    train_step(model, seed=2)
    writer.write(source(model), 2)
    shutil.move(tmp_path / "shared" / "weight_v000001", tmp_path / "hidden")  # not needed again
    restarted = puller_for(tmp_path)
    assert restarted.sync() == 2
    assert_local_equals(restarted, model)
    assert wait_for_pullers(tmp_path / "shared", [URL], 2, timeout_s=5) == {
        URL: str(restarted.local_path(2).resolve())
    }


def test_restarted_writer_publishes_a_full_version(setup):
    model, ckpt, tmp_path = setup
    writer_for(tmp_path, ckpt).write(source(model), 1)
    train_step(model, seed=1)
    again = writer_for(tmp_path, ckpt)
    with pytest.raises(PublishError, match="not newer"):
        again.write(source(model), 1)
    assert again.write(source(model), 2).kind == "full"
    puller = puller_for(tmp_path)
    assert puller.sync() == 2
    assert_local_equals(puller, model)


def test_wait_for_pullers_times_out_naming_the_engine(tmp_path):
    with pytest.raises(PublishError, match="no puller reported weight version 4 .*127.0.0.1:1"):
        wait_for_pullers(tmp_path, ["http://127.0.0.1:1"], 4, timeout_s=0.2)


@pytest.mark.slow  # two interpreter starts
def test_cli_pull_once(setup):
    model, ckpt, tmp_path = setup
    writer = writer_for(tmp_path, ckpt)
    train_step(model, seed=1)
    writer.write(source(model), 1)
    base = [sys.executable, "-m", "miles_sync.cli", "pull"]
    flags = ["--update-weight-disk-dir", str(tmp_path / "shared")]
    flags += ["--update-weight-local-checkpoint-dir", str(tmp_path / "cli")]
    done = subprocess.run([*base, *flags, "--engine-url", URL, "--once"], capture_output=True)
    assert done.returncode == 0, done.stderr
    assert read_latest(tmp_path / "cli") == 1
    bad = subprocess.run([*base, *flags, "--once"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: miles-sync pull requires --engine-url"
    ]
