"""MegatronBackend.update_weights from 2 gloo ranks at TP=2, after one training rollout:

* to a real built-in engine (subprocess) in the default non-colocated mode (broadcast): the
  engine then holds the trainer's TP-gathered HF weights cast to its dtype bit for bit, one
  version later. The trainer loads the fp32 tiny checkpoint (its master copy); the engine serves
  a bf16 copy of it, so "bit for bit" means the engine's bf16 bytes equal ``w.to(bfloat16)``.
* to SGLang's own receive code (the engine stand-in of tests/sglang_conformance) in every
  transfer mode (ipc: one engine of 2 TP workers, the stand-in being its worker 0; the group
  modes: one engine of one worker): what SGLang's code reconstructed equals the HF weights bit
  for bit. The backend's own flags pick the mode; its publisher is re-made for each.

Both run in the same two ranks (one spawn: megatron-core's import dominates the cost).
``extended``: the built-in engine case at PP=2, where rank 0 sends both stages' layers.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "miles_sync"))
sys.path.insert(0, str(TESTS / "sglang_conformance"))

from dist_ranks import spawn_ranks  # noqa: E402
from megatron_tiny_models import make_tiny_hf  # noqa: E402
from publishing import MODES, puller  # noqa: E402
from sync_testing import Engine, save_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow


def train_and_publish(
    rank: int, world: int, hf_dir: str, engine_url: str, sglang: dict, pp: int = 1
) -> dict:
    """On every rank: one rollout at TP=world/pp x PP=pp, then ``update_weights`` to the built-in
    engine; this stage's HF weights before and after training (numpy, so no shared-memory handles
    cross to the parent). With ``sglang`` (``url``, ``shared``): then one publish per mode to the
    stand-in, and (rank 0) what the stand-in holds after each."""
    import httpx
    import torch.distributed as dist
    from backend_reference import samples
    from megatron_ranks import BOTH_BACKENDS_FLAGS, layout_argv, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend
    from publishing import digests, mode_flags

    backend = MegatronBackend()
    args = parse(
        ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *layout_argv(tp=world // pp, pp=pp)]
    )
    assert args.update_weight_transfer_mode in (None, "broadcast") and not args.colocate
    backend.init(args)
    initial = {k: v.detach().cpu().numpy().copy() for k, v in backend.hf_weights()}
    backend.train(0, RolloutBatch(samples()))
    trained = {k: v.detach().cpu().numpy().copy() for k, v in backend.hf_weights()}
    backend.update_weights([engine_url])
    result = {"initial": initial, "trained": trained}
    if sglang:
        url = sglang["url"]
        result["sglang_want"] = digests(backend.hf_weights())
        result["sglang_served"] = {}
        for mode in MODES:
            for key, value in mode_flags(mode, Path(sglang["shared"])).items():
                setattr(backend.args, key, value)
            backend.args.rollout_num_gpus_per_engine = world if mode == "ipc" else 1
            backend.args.update_weight_buffer_size = 4096
            backend._publisher.close()
            backend._publisher = None
            if rank == 0:
                httpx.post(f"{url}/reset_weights", json={}).raise_for_status()
            dist.barrier()
            backend.update_weights([url])
            dist.barrier()  # every rank's share (p2p) has landed
            if rank == 0:
                result["sglang_served"][mode] = httpx.get(f"{url}/weights_digest").json()
    backend.close()
    return result


def digests(weights: dict, dtype: torch.dtype) -> dict[str, list]:
    """xxh3-128 of each weight cast to ``dtype`` (the digest route's format)."""
    import xxhash

    out = {}
    for name, array in weights.items():
        tensor = torch.from_numpy(array).to(dtype).contiguous()
        raw = tensor.view(-1).view(torch.uint8).numpy()
        out[name] = [xxhash.xxh3_128_hexdigest(raw), str(tensor.dtype), list(tensor.shape)]
    return out


@pytest.fixture(scope="module")
def published(tmp_path_factory, request):
    """One spawn of the two ranks; the built-in engine's before/after and the stand-in's
    results (None when the SGLang harness is unavailable)."""
    tmp_path = tmp_path_factory.mktemp("megatron_publish")
    try:
        stand_in = request.getfixturevalue("sglang_engine")
    except pytest.skip.Exception as why:
        stand_in, skipped = None, str(why)
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf")
    engine_dir = tmp_path / "engine_ckpt"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(engine_dir)
    save_tokenizer(engine_dir)
    engine = Engine(engine_dir)
    shared = tmp_path / "shared"
    sglang = {"url": stand_in.url, "shared": str(shared)} if stand_in else {}
    try:
        served = engine.digests()
        before = engine.version()
        beside = puller(stand_in.url, shared, tmp_path / "local") if stand_in else nullcontext()
        with beside:
            results = spawn_ranks(
                train_and_publish, 2, str(hf_dir), engine.url, sglang, timeout=500
            )
        yield {
            "engine": engine,
            "served_before": served,
            "version_before": before,
            "results": results,
            "sglang_skipped": None if stand_in else skipped,
        }
    finally:
        engine.close()


def check_engine(engine: Engine, served: dict, before: str, initial: dict, trained: dict) -> None:
    """The engine started on the checkpoint and now holds every trained weight in bf16, bit for
    bit, one version later, and generates under it."""
    dtypes = {entry[1] for entry in served.values()}
    assert dtypes == {"torch.bfloat16"}, dtypes
    assert served == digests(initial, torch.bfloat16)  # the engine starts on the checkpoint
    want = digests(trained, torch.bfloat16)
    unmoved = [k for k in want if want[k] == served[k]]
    assert not unmoved, unmoved  # every tensor differs in bf16: a stale one would show
    got = engine.digests()
    assert sorted(got) == sorted(want)
    assert got == want
    assert engine.version() == str(int(before) + 1 if before.isdigit() else 1)
    ids, _ = engine.greedy([1, 2, 3], 4)
    assert len(ids) == 4


def test_update_weights_broadcasts_tp_gathered_weights(published):
    results = published["results"]
    # TP peers gathered the same full HF tensors.
    initial, trained = results[0]["initial"], results[0]["trained"]
    assert sorted(trained) == sorted(results[1]["trained"])
    assert all((trained[k] == results[1]["trained"][k]).all() for k in trained)
    check_engine(
        published["engine"],
        published["served_before"],
        published["version_before"],
        initial,
        trained,
    )


@pytest.mark.extended
def test_update_weights_at_pp2_sends_both_stages(tmp_path):
    """PP=2: each rank holds its stage's layers; the engine gets the whole model (rank 0 sends)."""
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf")
    engine_dir = tmp_path / "engine_ckpt"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(engine_dir)
    save_tokenizer(engine_dir)
    engine = Engine(engine_dir)
    try:
        served, before = engine.digests(), engine.version()
        results = spawn_ranks(train_and_publish, 2, str(hf_dir), engine.url, {}, 2, timeout=500)
        assert not set(results[0]["trained"]) & set(results[1]["trained"])
        initial = {**results[0]["initial"], **results[1]["initial"]}
        trained = {**results[0]["trained"], **results[1]["trained"]}
        check_engine(engine, served, before, initial, trained)
    finally:
        engine.close()


def test_megatron_publishes_to_sglang_in_every_mode(published):
    if published["sglang_skipped"]:
        pytest.skip(published["sglang_skipped"])
    result = published["results"][0]
    want = result["sglang_want"]
    assert len(want) > 4
    for mode in MODES:
        assert result["sglang_served"][mode] == want, mode
