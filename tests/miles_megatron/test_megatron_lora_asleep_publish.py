"""A sleeping Megatron LoRA actor publishes without waking (issue #24): 2 gloo ranks at TP=2,
one rollout trained, then ``update_weights`` to a real built-in engine awake and after
``sleep()``. The engine serves the same bytes both times; the merged publish source and the
``--publish-lora-adapter`` source (PEFT-named factors) asleep equal awake byte for byte, and so
do ``export_adapter``'s files; the trainer's ``wake_up`` (the backend's and the sleeper's) is
never called, at every tensor of the asleep publish the sleeper is asleep and no optimizer tensor holds device memory, and the model
is still asleep with nothing on the device afterwards.

The ``cpu`` target (base from its retained pinned copy, factors from the arena) and the ``disk``
target (factors read from the file) run under ``extended``: the default suite's asleep publish
is FSDP's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "miles_sync"))

from colocated_testing import engine_checkpoint, with_engine  # noqa: E402
from dist_ranks import spawn_ranks  # noqa: E402
from megatron_tiny_models import make_tiny_hf  # noqa: E402

pytestmark = pytest.mark.slow

LORA = ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8"]
LORA += ["--lora-target-modules", "q_proj", "v_proj", "gate_proj", "down_proj"]
LORA += ["--num-steps-per-rollout", "1"]  # one optimizer step: Adam state exists


def _bytes(stream) -> list[tuple[str, str, tuple, bytes]]:
    """A publish source as (name, dtype, shape, raw bytes): equal means bit for bit."""
    out = []
    for name, t in stream:
        flat = t.detach().cpu().contiguous().view(-1).view(torch.uint8)  # cloned below: a
        # numpy view would make the storage (a factor's DDP buffer) unresizable for sleep()
        out.append((name, str(t.dtype), tuple(t.shape), flat.clone().numpy().tobytes()))
    return out


def lora_publish_awake_then_asleep(
    rank: int, world: int, hf_dir: str, engine_url: str | None, flags: list[str]
) -> dict:
    """Without ``engine_url`` the publish is the ``to_all`` source drained on every rank."""
    import httpx
    from backend_reference import samples
    from megatron_ranks import BOTH_BACKENDS_FLAGS, layout_argv, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend
    from miles_megatron.sleep_wake import _optimizer_tensors

    def served():
        if rank != 0 or engine_url is None:
            return None
        return httpx.get(f"{engine_url}/weights_digest", timeout=60).json()

    def update_weights():
        if engine_url is not None:
            backend.update_weights([engine_url])
            return
        try:
            for _ in backend.publish_weights(to_all=True):
                pass
        finally:
            backend.sleeper.drop_reads()

    def sources():
        """(merged source, adapter source), as bytes, on every rank."""
        merged = _bytes(backend.publish_weights(to_all=True))
        backend.args.publish_lora_adapter = True
        try:
            adapter = _bytes(backend.publish_weights(to_all=True))
        finally:
            backend.args.publish_lora_adapter = False
            backend.sleeper.drop_reads()
        return merged, adapter

    def exported(tag: str) -> dict[str, bytes]:
        """``export_adapter``'s files (rank 0 writes; every rank reads after the barrier)."""
        out_dir = Path(hf_dir).parent / f"export_{tag}"
        backend.export_adapter(str(out_dir))
        return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}

    def optimizer_device_bytes() -> int:
        return sum(t.untyped_storage().nbytes() for t in _optimizer_tensors(backend.optimizer))

    backend = MegatronBackend()
    argv = ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *LORA, *layout_argv(tp=world)]
    backend.init(parse([*argv, "--offload-train", *flags]))
    backend.train(0, RolloutBatch(samples()))
    out = {"optimizer_bytes_awake": optimizer_device_bytes()}
    update_weights()
    out["awake"] = served()
    awake_merged, awake_adapter = sources()
    awake_export = exported("awake")

    backend.sleep()
    calls: list[str] = []
    during: list[tuple[bool, int]] = []  # (asleep, optimizer device bytes) at each tensor
    wake, sleeper_wake, publish = backend.wake_up, backend.sleeper.wake_up, backend.publish_weights

    def recorded(fn, what):
        def call(*a, **kw):
            calls.append(what)
            return fn(*a, **kw)

        return call

    def watched(to_all: bool = False):
        for item in publish(to_all):
            during.append((backend.sleeper.asleep, optimizer_device_bytes()))
            yield item

    backend.wake_up = recorded(wake, "backend.wake_up")
    backend.sleeper.wake_up = recorded(sleeper_wake, "sleeper.wake_up")
    backend.publish_weights = watched
    wakes = backend.sleeper.wakes
    update_weights()
    out["asleep"] = served()
    del backend.publish_weights
    out["wake_calls"] = calls  # also filled by the asleep sources and export below
    out["woke"] = backend.sleeper.wakes - wakes
    out["published"] = len(during)
    out["awake_during_publish"] = sum(not asleep for asleep, _ in during)
    out["optimizer_bytes_during_publish"] = max((b for _, b in during), default=-1)
    out["still_asleep"] = backend.sleeper.asleep
    out["device_bytes"] = backend.sleeper.device_bytes()
    if calls:  # it woke to publish (a LoRA detour): the asleep sources below would not exist
        backend.close()
        return out
    asleep_merged, asleep_adapter = sources()
    out["export_equal"] = exported("asleep") == awake_export and len(awake_export) > 1
    out["woke"] = backend.sleeper.wakes - wakes
    out["still_asleep"] = backend.sleeper.asleep
    out["device_bytes"] = backend.sleeper.device_bytes()
    out["merged_names"] = [n for n, *_ in awake_merged]
    out["dtypes"] = sorted({d for _, d, *_ in awake_merged})
    out["adapter_names"] = [n for n, *_ in awake_adapter]
    out["merged_equal"] = awake_merged == asleep_merged
    out["adapter_equal"] = awake_adapter == asleep_adapter
    backend.wake_up = wake
    backend.sleeper.wake_up = sleeper_wake
    backend.close()
    return out


def run(tmp_path: Path, target: str) -> None:
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf")
    engine_dir = engine_checkpoint(hf_dir, tmp_path / "engine_ckpt")
    flags = ["--offload-train-target", target]
    if target == "disk":
        flags += ["--offload-train-disk-dir", str(tmp_path / "offload")]

    def publish(engine):
        args = (str(hf_dir), engine.url, flags)
        return engine.digests(), spawn_ranks(lora_publish_awake_then_asleep, 2, *args, timeout=300)

    before, results = with_engine(engine_dir, publish)
    awake = results[0]["awake"]
    assert awake != before  # the merged, trained weights arrived
    assert results[0]["asleep"] == awake
    check(results)


def check(results: list[dict]) -> None:
    for r in results:
        assert r["optimizer_bytes_awake"] > 0  # there is optimizer state that must stay away
        assert r["wake_calls"] == [] and r["woke"] == 0, "the publish woke the trainer"
        assert r["published"] > 0 and r["awake_during_publish"] == 0, r
        assert r["optimizer_bytes_during_publish"] == 0, "optimizer state came to the device"
        assert r["still_asleep"] and r["device_bytes"] == 0, r
        assert any(n.endswith("q_proj.weight") for n in r["merged_names"])
        assert any(n.endswith("lora_B.weight") for n in r["adapter_names"])
        assert r["merged_equal"], "merged publish source differs asleep"
        assert r["adapter_equal"], "--publish-lora-adapter source differs asleep"
        assert r["export_equal"], "export_adapter asleep wrote other files"


@pytest.mark.extended  # the default suite's asleep publish is FSDP's (its time budget)
def test_lora_asleep_publish_tp2_cpu(tmp_path):
    run(tmp_path, "cpu")


@pytest.mark.extended
def test_lora_asleep_publish_tp2_disk(tmp_path):
    run(tmp_path, "disk")


@pytest.mark.extended
def test_lora_remat_asleep_source_tp2(tmp_path):
    """bf16 under ``--rematerialize-param-from-master-weight``: the factors' bucket is rebuilt
    from the host fp32 masters; compared at the source (a remat run is colocated and publishes
    over ipc, which one built-in engine cannot take from two ranks)."""
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    flags = ["--bf16", "--colocate", "--rematerialize-param-from-master-weight"]
    results = spawn_ranks(lora_publish_awake_then_asleep, 2, hf_dir, None, flags, timeout=300)
    check(results)
    assert all(r["dtypes"] == ["torch.bfloat16"] for r in results), results[0]["dtypes"]
