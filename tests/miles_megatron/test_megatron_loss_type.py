"""``--loss-type sft_loss`` on the Megatron actor against float64: one step's loss is the
responses' negative log-likelihood, sequence-mean (``-(1/S) sum_i (1/n_i) sum_t log pi``), and
its gradients are that loss's (the policy loss of the same step is ~0: GRPO's advantages sum to
zero in each group and the ratio is 1)."""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from loss_type_ranks import GRAD_NAMES, one_step
from megatron_tiny_models import make_tiny_hf
from tolerances import GRAD_REL_ERR, assert_within, grad_atol

pytestmark = [pytest.mark.slow, pytest.mark.numeric]


def reference_sft(hf_dir: str):
    """(loss, grad norm, grads by HF name) of the sft step in float64."""
    from backend_reference import samples
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager"
    )
    terms = []
    for s in samples():
        logits = model(input_ids=s.tokens[None], use_cache=False).logits[0, :-1]
        log_p = logits.log_softmax(-1).gather(-1, s.tokens[1:, None])[:, 0]
        terms.append(-log_p[-s.response_length :].mean())
    loss = sum(terms) / len(terms)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.sqrt(sum(g.square().sum() for g in grads.values()))
    return loss.item(), norm.item(), grads


def test_sft_loss_step_matches_float64_nll(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    sft = tmp_path / "sft.pt"
    spawn_ranks(one_step, 1, hf_dir, "sft_loss", str(sft), timeout=400)
    got = torch.load(sft, weights_only=True)
    loss, norm, grads = reference_sft(hf_dir)
    m = got["metrics"]
    assert abs(m["loss"] - loss) <= 1e-5 * loss and abs(m["sft_loss"] - loss) <= 1e-5 * loss
    assert abs(m["grad_norm"] - norm) <= 2 * GRAD_REL_ERR * norm, (m["grad_norm"], norm)
    for mname, hname in GRAD_NAMES.items():
        want = grads[hname]
        mine = got["grads"][mname][: want.shape[0]]  # megatron pads the vocabulary's rows
        assert_within(mine.reshape(want.shape), want, grad_atol(want), mname)
    assert loss > 1.0  # an NLL over a 96-token vocabulary, far from a policy loss's ~0
