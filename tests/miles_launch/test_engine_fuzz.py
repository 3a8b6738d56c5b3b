"""A fuzz test of the built-in engine's HTTP surface, with its API key set (hypothesis,
loopback, bounded; the cases are :mod:`engine_fuzzing`'s). No answer may be a 5xx; refused
weight updates leave the version as it was; afterwards the engine answers /health, every
tensor equals the checkpoint's, the version is unchanged, and a normal /generate is exactly
transformers'. The default run is bounded by MAX_CASES and BUDGET_S, the extended one runs
longer; each prints how many cases ran and asserts that the mutated payloads reached the
checks they target (not only the JSON parser). ``scripts/fuzz_engine.py`` runs 10,000+."""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from engine_fuzzing import Checkpoint, assert_serves_the_checkpoint, run_fuzz  # noqa: E402
from engine_testing import assert_generates  # noqa: E402

pytestmark = pytest.mark.slow

MAX_CASES = 400
BUDGET_S = 25.0


def _fuzz(engine, models, tmp_path, capsys, max_cases, budget_s):
    marker = str(tmp_path / "pwned")
    ckpt = Checkpoint(models["old"][1].state_dict(), models["old"][0], tmp_path)
    version = engine.client.get("/get_model_info").json()["weight_version"]
    stats = run_fuzz(engine, ckpt, marker, max_cases, budget_s)
    with capsys.disabled():
        print(
            f"\nengine fuzz: {stats['cases']} cases in {stats['elapsed_s']:.1f}s, statuses "
            f"{dict(stats['statuses'])}, {sum(stats['mutated'].values())} mutated payloads "
            f"({stats['accepted']} valid), refusals {dict(stats['refusals'])}"
        )
    assert not os.path.exists(marker)
    assert_serves_the_checkpoint(engine, ckpt, version)
    assert_generates(engine, models, "old")
    return stats


def test_fuzzing_the_http_surface_leaves_the_engine_serving_the_same_weights(
    engine, models, tmp_path, capsys
):
    stats = _fuzz(engine, models, tmp_path, capsys, MAX_CASES, BUDGET_S)
    assert stats["cases"] >= 100
    assert sum(stats["mutated"].values()) >= 20
    # the mutations reached the payload checks themselves
    assert (
        stats["refusals"]["metadata["]
        and stats["refusals"]["shared-memory"]
        + stats["refusals"]["reaches past"]
        + stats["refusals"]["shape"]
    )


@pytest.mark.extended
def test_fuzzing_longer(engine, models, tmp_path, capsys):
    stats = _fuzz(engine, models, tmp_path, capsys, 5000, 55.0)
    assert stats["cases"] >= 1000
