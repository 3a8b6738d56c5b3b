"""Megatron at TP=2 (sequence parallel): the fused vocabulary-parallel head (the default) gives
the same log-probs, entropies and gradients as the vocabulary-gathered logits
(``--no-fused-log-probs``), tied and untied embeddings, temperature 0.7, on a THD-packed row;
the values also equal the float64 HF model's per sample.

Bounds: both paths are fp32 computations of the same function from the same hidden states; each
differs from the exact value by fp32 rounding of a chain of a few hundred operations, bounded
relative to the tensor's largest entry by ``tolerances.GRAD_REL_ERR`` (for two fp32 results:
twice that).
"""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_ranks import head_scores_and_grads, head_token_weights
from megatron_tiny_models import make_tiny_hf
from miles_core.batch import Sample
from tolerances import GRAD_REL_ERR

pytestmark = pytest.mark.numeric


def _samples():
    gen = torch.Generator().manual_seed(11)
    out = []
    for length, response in ((9, 4), (14, 6), (5, 2)):
        tokens = torch.randint(0, 96, (length,), generator=gen)
        out.append(Sample(tokens=tokens, response_length=response, reward=1.0))
    return out


def _hf_values(hf_dir, samples, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=s.tokens[None]).logits[0, :-1] / temperature
            log_p = torch.log_softmax(logits, -1)
            lp = log_p.gather(-1, s.tokens[1:, None])[:, 0]
            ent = -(log_p.exp() * log_p).sum(-1)
            out.append((lp[-s.response_length :], ent[-s.response_length :]))
    return out


def _within(a, b, scale, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= 2 * GRAD_REL_ERR * scale, f"{what}: {err:.3e} > {2 * GRAD_REL_ERR * scale:.3e}"


@pytest.mark.slow
def test_fused_head_equals_gathered_logits_at_tp2(tmp_path):
    samples = _samples()
    dirs = {
        "untied": str(make_tiny_hf("qwen2", tmp_path / "untied")),
        "tied": str(make_tiny_hf("qwen2", tmp_path / "tied", tie=True)),
    }
    cases = [(f"{k}:{f}", d, 0.7, f) for k, d in dirs.items() for f in ("fused", "dense")]
    cases = [(label, d, t, f == "fused") for label, d, t, f in cases]
    spawn_ranks(head_scores_and_grads, 2, cases, samples, str(tmp_path), timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for tie, hf_dir in dirs.items():
        reference = _hf_values(hf_dir, samples, 0.7)
        scale = max(v.abs().max().item() for pair in reference for v in pair)
        for rank, result in enumerate(ranks):
            fused, dense = result[f"{tie}:fused"], result[f"{tie}:dense"]
            for i, (lp, ent) in enumerate(reference):
                for got in (fused, dense):
                    _within(got["lp"][i], lp, scale, f"{tie} rank{rank} lp{i}")
                    _within(got["ent"][i], ent, scale, f"{tie} rank{rank} ent{i}")
            assert fused["grads"].keys() == dense["grads"].keys()
            for name, grad in dense["grads"].items():
                g_scale = grad.abs().max().item()
                _within(fused["grads"][name], grad, g_scale, f"{tie} rank{rank} {name}")
            assert any(g.abs().max() > 0 for g in fused["grads"].values())
    assert head_token_weights(0, 3)[0].shape == (3,)
