"""A THD-packed micro-batch (miles-core packing, block-causal mask) at TP=2 gives each sample's
response log-probs as the HF model does on that sample alone (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_ranks import packed_log_probs_match
from megatron_tiny_models import make_tiny_hf
from miles_core.batch import Sample

pytestmark = pytest.mark.numeric


@pytest.mark.slow
def test_packed_log_probs_equal_per_sample_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf("qwen2", tmp_path / "hf")
    gen = torch.Generator().manual_seed(11)
    samples, refs = [], []
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for length, response in ((9, 4), (14, 6), (5, 2)):
        tokens = torch.randint(0, 96, (length,), generator=gen)
        samples.append(Sample(tokens=tokens, response_length=response, reward=1.0))
        with torch.no_grad():
            logits = model(input_ids=tokens[None]).logits[0] / 0.7
        # response token t (absolute position p) is predicted by position p - 1
        lp = torch.log_softmax(logits[:-1].double(), -1).gather(-1, tokens[1:, None])[:, 0]
        refs.append(lp[-response:].float())
    results = spawn_ranks(packed_log_probs_match, 2, str(hf_dir), samples, refs, timeout=300)
    assert max(results) < 1e-5
