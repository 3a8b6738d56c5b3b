"""MegatronBackend.update_weights against a real built-in engine (subprocess): 2 gloo ranks at
TP=2 train one rollout, publish in the default non-colocated mode (broadcast), and the engine
then holds the trainer's TP-gathered HF weights cast to its dtype bit for bit, one version later.
``extended``: the same at PP=2, where rank 0 sends both stages' layers.

The trainer loads the fp32 tiny checkpoint (its master copy); the engine serves a bf16 copy of
the same checkpoint, so "bit for bit" means the engine's bf16 bytes equal ``w.to(bfloat16)`` of
every weight ``hf_weights()`` yields after training.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "miles_sync"))

from dist_ranks import spawn_ranks  # noqa: E402
from megatron_tiny_models import make_tiny_hf  # noqa: E402
from sync_testing import Engine, save_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow


def train_and_publish(rank: int, world: int, hf_dir: str, engine_url: str, pp: int) -> dict:
    """On every rank: one rollout at TP=world/pp x PP=pp, then ``update_weights``; this
    stage's HF weights before and after training (numpy: no shared-memory handles cross to the
    parent)."""
    from backend_reference import samples
    from megatron_ranks import BOTH_BACKENDS_FLAGS, layout_argv, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

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
    backend.close()
    return {"initial": initial, "trained": trained}


def digests(weights: dict, dtype: torch.dtype) -> dict[str, list]:
    """xxh3-128 of each weight cast to ``dtype`` (the digest route's format)."""
    import xxhash

    out = {}
    for name, array in weights.items():
        tensor = torch.from_numpy(array).to(dtype).contiguous()
        raw = tensor.view(-1).view(torch.uint8).numpy()
        out[name] = [xxhash.xxh3_128_hexdigest(raw), str(tensor.dtype), list(tensor.shape)]
    return out


@pytest.mark.parametrize(
    "pp", [pytest.param(1, id="tp2"), pytest.param(2, marks=pytest.mark.extended, id="pp2")]
)
def test_update_weights_broadcasts_tp_gathered_weights(tmp_path, pp):
    """TP=2, and (extended) PP=2: the engine gets both stages' layers, rank 0 sends them."""
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf")
    engine_dir = tmp_path / "engine_ckpt"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(engine_dir)
    save_tokenizer(engine_dir)
    engine = Engine(engine_dir)
    try:
        served = engine.digests()
        dtypes = {entry[1] for entry in served.values()}
        assert dtypes == {"torch.bfloat16"}, dtypes
        before = engine.version()
        results = spawn_ranks(train_and_publish, 2, str(hf_dir), engine.url, pp, timeout=500)

        initial, trained = results[0]["initial"], results[0]["trained"]
        if pp == 1:  # TP peers gathered the same full HF tensors
            assert sorted(trained) == sorted(results[1]["trained"])
            assert all((trained[k] == results[1]["trained"][k]).all() for k in trained)
        else:  # each stage's own layers; together the whole model
            assert not set(trained) & set(results[1]["trained"])
            initial = {**initial, **results[1]["initial"]}
            trained = {**trained, **results[1]["trained"]}
        # training moved them
        assert served == digests(initial, torch.bfloat16)  # the engine starts on the checkpoint
        want = digests(trained, torch.bfloat16)
        unmoved = [k for k in want if want[k] == served[k]]
        assert not unmoved, unmoved  # every tensor differs in bf16: a stale one would show

        # The engine now holds every trained weight, cast to bf16, bit for bit.
        got = engine.digests()
        assert sorted(got) == sorted(want)
        assert got == want
        # The version advanced by exactly one, and generation runs under it.
        assert engine.version() == str(int(before) + 1 if before.isdigit() else 1)
        ids, _ = engine.greedy([1, 2, 3], 4)
        assert len(ids) == 4
    finally:
        engine.close()
