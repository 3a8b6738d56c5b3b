"""The backend conformance suite: every installed backend (the ``miles.backends`` entry points)
honours :class:`miles_core.contract.TrainBackend` as docs/contract.md states it.

Driven through the contract's methods only (``conformance_ranks``), against a real built-in
engine serving the tiny model in fp32, one spawned rank per backend:

- ``init`` of a fresh run returns 0 and its ``data_layout`` is one whole data-parallel rank;
- a publish of weights the backend does not keep (``"ema"`` without ``--use-ema``) and
  ``compute_values`` on the actor raise ``ValueError`` and touch no engine;
- ``train`` returns finite metrics with the names every backend reports, the LR schedule's
  value moving between rollouts;
- ``update_weights`` (``weights=None`` meaning ``--rollout-weights``, and ``"actor"`` named)
  moves every tensor the engine serves to the trained weights and the engine's version on;
- ``sleep``/``sleep``/``wake_up``/``wake_up`` gives back the same weights bit for bit;
- ``save_model(r, force_sync=True)`` is durable on return (the tracker names iteration
  ``r + 1``), and a fresh
  backend ``--load``-ing it returns the next rollout id and trains the next rollout to the same
  metrics and the same published weights, bit for bit, as the run that went on;
- the critic role: ``compute_values`` gives one float32 CPU tensor per sample, response-aligned,
  its ``train`` finite metrics, and it refuses to publish;
- ``--use-ema`` either publishes ``decay * w0 + (1 - decay) * w1`` (the EMA formula from the
  checkpoint's and the published actor's values) or is refused at argument time in one line.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conformance_ranks import EMA_DECAY, REQUIRED_METRICS, conformance, ema_publish
from dist_ranks import spawn_ranks
from megatron_tiny_models import make_tiny_hf
from miles_core import backends
from miles_core.contract import DataLayout
from sync_testing import Engine, save_tokenizer
from tolerances import FP32_EPS

BACKENDS = backends.available()
#: The backends that keep an EMA of the actor; the others must refuse ``--use-ema``.
KEEPS_EMA = {"fsdp"}
#: The representative case of the default suite; the other backends' runs are ``extended``.
DEFAULT_SUITE = "fsdp"
pytestmark = pytest.mark.slow


def marked(names, default_suite) -> list:
    return [pytest.param(n, marks=() if default_suite(n) else pytest.mark.extended) for n in names]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """The tiny fp32 Qwen3 both the trainer and the engine load (the engine needs a tokenizer)."""
    out = make_tiny_hf("qwen3", tmp_path_factory.mktemp("conformance") / "hf")
    save_tokenizer(out)
    return out


def run(name: str, fn, *args):
    (result,) = spawn_ranks(fn, 1, name, *args, timeout=600, shim=name == "megatron")
    return result


def finite(metrics: dict) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", marked(BACKENDS, lambda n: n == DEFAULT_SUITE))
def test_backend_honours_the_contract(name, hf_dir, tmp_path):
    assert {"fsdp", "megatron"} <= set(BACKENDS)  # the suite ran on both shipped backends
    save = tmp_path / "ckpt"
    engine = Engine(hf_dir, timeout=300)
    try:
        r = run(name, conformance, str(hf_dir), str(save), engine.url)
    finally:
        engine.close()

    assert r["is_train_backend"] and r["fresh_next_rollout"] == 0
    assert r["layout"] == DataLayout(dp_rank=0, dp_size=1, consumes_data=True)
    assert r["ema_refused"] and r["values_refused"], r  # ValueError, each with its reason
    assert r["version_after_refusals"] == r["version_initial"]  # a refusal touched no engine

    first, second = r["metrics"]
    for metrics in (first, second, r["resumed_metrics"], r["critic_metrics"]):
        assert finite(metrics), metrics
    for metrics in (first, second):
        assert set(REQUIRED_METRICS) <= set(metrics), sorted(metrics)
        assert metrics["grad_norm"] > 0 and metrics["lr"] > 0
    assert first["lr"] != second["lr"]  # the schedule moved: a resume must restore it

    initial, trained = r["served_initial"], r["served_trained"]
    assert sorted(initial) == sorted(trained)
    assert not [k for k in trained if trained[k] == initial[k]]  # every tensor was published
    assert r["version_trained"] != r["version_initial"]
    assert r["served_named"] == trained and r["version_named"] != r["version_trained"]
    assert r["served_after_wake"] == trained  # sleep and wake, twice each, lost nothing

    # the save after rollout r is iteration r + 1 (the rollouts done), committed when durable
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (save / "iter_0000001" / "meta.json").is_file()
    assert r["resumed_next_rollout"] == 1
    assert r["resumed_metrics"] == second  # optimizer, schedule and RNG state came back
    assert r["served_rollout1"] != trained
    assert r["served_resumed_rollout1"] == r["served_rollout1"]

    assert r["critic_next_rollout"] == 0
    want = [("torch.float32", "cpu", (n,)) for n in r["response_lengths"]]
    assert r["values"] == want
    assert r["critic_publish_refused"]


@pytest.mark.parametrize("name", marked(BACKENDS, lambda n: n not in KEEPS_EMA))
def test_ema_is_published_or_refused_at_argument_time(name, hf_dir):
    from conformance_ranks import EMA_FLAGS, parse
    from miles_core.args.flags import ArgumentError

    try:
        parse(name, ["--hf-checkpoint", str(hf_dir), *EMA_FLAGS])
    except ArgumentError as refused:  # miles train prints it as one error: line, exit 2
        assert name not in KEEPS_EMA, refused
        line = str(refused)
        assert "\n" not in line and "--use-ema" in line and f"--train-backend {name}" in line
        return
    assert name in KEEPS_EMA, f"--train-backend {name} accepts --use-ema: list it in KEEPS_EMA"

    from safetensors.torch import load_file

    initial = load_file(str(hf_dir / "model.safetensors"))
    engine = Engine(hf_dir, timeout=300)
    try:
        r = run(name, ema_publish, str(hf_dir), engine.url, sorted(initial))
    finally:
        engine.close()
    for key, w0 in initial.items():
        w1 = torch.tensor(r["trained"][key], dtype=torch.float64).reshape(w0.shape)
        ema = torch.tensor(r["ema"][key], dtype=torch.float64).reshape(w0.shape)
        assert not torch.equal(w1, w0.double()), key  # the actor moved
        want = EMA_DECAY * w0.double() + (1 - EMA_DECAY) * w1
        # two fp32 products and a sum: a few roundings of 2^-24 of the operands' magnitude
        scale = torch.maximum(w0.double().abs(), w1.abs())
        assert torch.all((ema - want).abs() <= 4 * FP32_EPS * scale), key
