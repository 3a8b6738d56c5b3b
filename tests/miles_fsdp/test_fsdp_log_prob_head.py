"""The FSDP backend's log-probs and entropies through the fused head (``--fused-log-probs``, the
default) and the dense path (``--no-fused-log-probs``) both equal a float64 HF reference: values
and the gradients of every parameter, tied and untied embeddings, temperature 1 and 0.7, on two
FSDP ranks with THD-packed rows.

Bounds: both paths are fp32 computations of the same function of the weights; a gradient's error
is bounded relative to the tensor's largest gradient (``tolerances.grad_atol``, a few hundred fp32
roundings along the backward chain) and so is each value's (the forward chain is the same
length). LoRA on ``lm_head``: the concatenated-operand form equals PEFT's own forward, in
float64, to float64 rounding.
"""

from __future__ import annotations

import pytest
import samples as sample_data
import torch
from head_programs import head_program, token_weights
from spawn import run_ranks
from tiny_models import qwen3_config, save_tiny_model
from tolerances import GRAD_REL_ERR, assert_within, grad_atol

pytestmark = pytest.mark.numeric


def reference(hf_dir, samples, temperature):
    """float64 values and gradients of ``sum(a lp + b ent)`` with the plain HF model."""
    from dense_reference import dense_model

    model = dense_model(hf_dir)
    loss = 0.0
    values = {}
    for i, s in enumerate(samples):
        logits = model(input_ids=s.tokens[None], use_cache=False).logits[0, :-1] / temperature
        log_p = torch.log_softmax(logits, -1)
        n = s.response_length
        lp = log_p.gather(-1, s.tokens[1:, None]).squeeze(-1)[-n:]
        ent = -(log_p.exp() * log_p).sum(-1)[-n:]
        a, b = token_weights(i, n)
        loss = loss + (a * lp).sum() + (b * ent).sum()
        values[i] = (lp.detach(), ent.detach())
    loss.backward()
    return values, {name: p.grad for name, p in model.named_parameters()}


def _run(tmp_path, modes):
    """``modes``: (temperature, fused) pairs, each run on the tied and the untied model in one
    spawn of two ranks."""
    samples = sample_data.make_samples(6, group_size=2)
    dirs = {
        "untied": str(save_tiny_model(tmp_path / "untied")),
        "tied": str(save_tiny_model(tmp_path / "tied", qwen3_config(tie_word_embeddings=True))),
    }
    cases = [
        (f"{tie}@T{t}:{'fused' if f else 'dense'}", d, t, f)
        for tie, d in dirs.items()
        for t, f in modes
    ]
    out = tmp_path / "out.pt"
    run_ranks(2, head_program, cases, samples, str(out), timeout=600)
    got = torch.load(out, weights_only=True)
    for label, hf_dir, temperature, _ in cases:
        ref_values, ref_grads = reference(hf_dir, samples, temperature)
        result = got[label]
        scale = max(v.abs().max().item() for pair in ref_values.values() for v in pair)
        for i, (lp, ent) in ref_values.items():
            got_lp, got_ent = result["values"][i]
            bound = torch.full_like(lp, GRAD_REL_ERR * scale)
            assert_within(got_lp, lp, bound, f"{label}: log_prob {i}")
            assert_within(got_ent, ent, bound, f"{label}: entropy {i}")
        assert set(result["grads"]) == set(ref_grads)
        for name, grad in ref_grads.items():
            assert_within(result["grads"][name], grad, grad_atol(grad), f"{label}: {name}")


@pytest.mark.slow
def test_fused_head_matches_float64_on_two_fsdp_ranks(tmp_path):
    """Temperature 0.7, tied and untied (one spawn)."""
    _run(tmp_path, [(0.7, True)])


@pytest.mark.extended
def test_fused_and_dense_heads_at_temperature_one_and_dense_at_07(tmp_path):
    _run(tmp_path, [(1.0, True), (1.0, False), (0.7, False)])


def test_lora_on_lm_head_is_one_projection_of_concatenated_operands():
    """PEFT LoRA on ``lm_head`` (dropout 0, random ``B``): the fused head's values and the
    gradients of ``x``, ``W``, ``A`` and ``B`` equal PEFT's dense forward in float64."""
    from miles_fsdp.output_head import scoring
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_config(), dtype=torch.float64)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"])
    model = inject_adapter_in_model(config, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    g = torch.randn(2, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def run(fused):
        model.zero_grad()
        if fused:
            with scoring(model, targets, 0.8):
                out = model(input_ids=ids).logits
            lp, ent = out[..., 0], out[..., 1]
        else:
            log_p = torch.log_softmax(model(input_ids=ids).logits / 0.8, -1)
            lp = log_p.gather(-1, targets[..., None]).squeeze(-1)
            ent = -(log_p.exp() * log_p).sum(-1)
        ((lp[0] * g[0]).sum() + (ent[0] * g[1]).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return lp.detach(), ent.detach(), grads

    fused, dense = run(True), run(False)
    assert any("lm_head.lora_A" in n for n in fused[2])
    for a, b in zip(fused[:2], dense[:2]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert fused[2].keys() == dense[2].keys()
    for name, grad in dense[2].items():
        bound = 1e-12 * max(1.0, grad.abs().max().item())
        torch.testing.assert_close(fused[2][name], grad, atol=bound, rtol=0, msg=name)


def test_logit_transforming_models_are_refused():
    from miles_fsdp.output_head import check_fused_head

    config = qwen3_config()
    config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="--no-fused-log-probs"):
        check_fused_head(config)
    check_fused_head(qwen3_config())
