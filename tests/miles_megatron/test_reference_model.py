"""--ref-load: after the actor trained, the reference pass still gives the reference checkpoint's
log-probs (== HF, 1e-5), the actor's weights come back bit-exact, and the KL loss is 0 while
actor == reference and positive once the actor moved."""

from __future__ import annotations

import pytest
import torch
from backend_reference import samples
from dist_ranks import spawn_ranks
from megatron_ranks import reference_pass
from megatron_tiny_models import make_tiny_hf


@pytest.mark.slow
def test_reference_log_probs_after_training(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf")
    results = spawn_ranks(reference_pass, 2, str(hf_dir), timeout=400)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    expected = []
    with torch.no_grad():
        for s in samples():
            logits = model(input_ids=s.tokens[None]).logits[0]
            lp = torch.log_softmax(logits[:-1].double(), -1).gather(-1, s.tokens[1:, None])[:, 0]
            expected.append(lp[-s.response_length :].float())
    for r in results:
        assert r["actor_restored"]
        diffs = [(torch.tensor(a) - b).abs().max().item() for a, b in zip(r["ref"], expected)]
        assert max(diffs) < 1e-5
        assert abs(r["kl"][0]) < 1e-7 and abs(r["kl"][1]) > 1e-5, r["kl"]  # k1 has either sign
