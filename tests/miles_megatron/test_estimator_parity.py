"""Every actor advantage estimator without a critic (grpo, gspo, dr_grpo, rloo, REINFORCE++ and
its baseline), the CISPO objective and the SFT loss give the same rollout on Megatron (TP 1) and
FSDP: loss, gradient norm, LR and entropy of one rollout of 2 optimizer steps on masked samples
(tool spans with holes) that carry engine log-probs, within the fp32 bound of
test_backends_agree. Each estimator's formula is held against float64 in tests/miles_core; this
holds the two backends to one answer for each of them. The configurations' losses all differ,
so each flag reached the step."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from estimator_ranks import CONFIGS, estimator_rollouts
from megatron_tiny_models import make_tiny_hf

pytest.importorskip("miles_fsdp")

pytestmark = pytest.mark.extended


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(a))


def test_every_estimator_and_loss_agrees_across_backends(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    (megatron,) = spawn_ranks(estimator_rollouts, 1, "megatron", hf_dir, timeout=600)
    (fsdp,) = spawn_ranks(estimator_rollouts, 1, "fsdp", hf_dir, timeout=600, shim=False)
    assert list(megatron) == list(fsdp) == [name for name, _ in CONFIGS]
    for name in megatron:
        m, f = megatron[name], fsdp[name]
        assert set(m) >= {"loss", "grad_norm", "lr"} and set(m) == set(f), (name, m, f)
        for key in m:
            assert close(m[key], f[key]), (name, key, m[key], f[key])
    losses = [round(fsdp[name]["loss"], 6) for name in fsdp]
    assert len(set(losses)) == len(losses), losses  # every configuration changed the step
