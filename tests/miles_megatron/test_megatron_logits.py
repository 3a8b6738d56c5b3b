"""Megatron logits equal HF logits (fp32, 1e-5) per bridged family at TP=1, TP=2 and EP=2; the
HF -> megatron -> HF round trip through the sharded model (TP/EP gather) is bit-exact."""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_ranks import layout_argv, logits_and_roundtrip
from megatron_tiny_models import FAMILIES, hf_logits, make_tiny_hf

pytestmark = pytest.mark.numeric


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models = {f: str(make_tiny_hf(f, root / f)) for f in FAMILIES}
    models["llama_tied"] = str(make_tiny_hf("llama", root / "llama_tied", tie=True))
    return models


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))


def _check(results, labels):
    for rank_result in results:
        for label in labels:
            r = rank_result[label]
            assert r["max_diff"] < 1e-5, (label, r)
            assert r["roundtrip_exact"], (label, r)


@pytest.mark.slow
def test_logits_match_hf_each_family(tiny_models, input_ids):
    """Each family at TP=1 and TP=2, and the MoE with its experts split over EP=2, on the same
    two spawned ranks (one spawn: megatron's import dominates a rank's start-up)."""
    families = [*FAMILIES, "llama_tied"]
    hf = {k: hf_logits(tiny_models[k], input_ids) for k in families}
    cases, refs = [], {}
    for tp in (1, 2):
        for k in families:
            cases.append((f"{k}@tp{tp}", tiny_models[k], layout_argv(tp=tp)))
            refs[f"{k}@tp{tp}"] = hf[k]
    # the all-gather dispatcher here; the all-to-all one trains in test_layouts.py
    ep_argv = [*layout_argv(ep=2), "--moe-token-dispatcher-type", "allgather"]
    cases.append(("qwen3_moe@ep2", tiny_models["qwen3_moe"], ep_argv))
    refs["qwen3_moe@ep2"] = hf["qwen3_moe"]
    _check(spawn_ranks(logits_and_roundtrip, 2, cases, input_ids, refs, timeout=600), list(refs))
