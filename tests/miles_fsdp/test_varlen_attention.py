"""``--attn-implementation varlen``: attention over packed rows from the samples' boundaries,
no mask. The reference is the same HF model attending with the block-diagonal mask (sdpa) and
each sample run alone, in float64."""

from __future__ import annotations

import pytest
import torch
from miles_core.batch import RolloutBatch, Sample
from miles_core.packing import pack_thd, packed_attention_kwargs
from miles_core.varlen_attention import varlen_causal_attention
from miles_fsdp.loading import resolve_attn_implementation
from miles_launch.tiny_model import tiny_qwen3


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return RolloutBatch(
        [
            Sample(
                tokens=torch.randint(1, 60, (n,), generator=g), response_length=n // 2, reward=0.0
            )
            for n in lengths
        ]
    )


def test_varlen_kernel_equals_one_causal_attention_per_sample_with_gqa():
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 9, 3]
    q = torch.randn(sum(lengths), 4, 8, dtype=torch.float64, generator=g)
    k = torch.randn(sum(lengths), 2, 8, dtype=torch.float64, generator=g)
    v = torch.randn(sum(lengths), 2, 8, dtype=torch.float64, generator=g)
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    out = varlen_causal_attention(q, k, v, cu, max(lengths), scale=0.3)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        # written out: softmax(q k^T * scale + causal) v, each query head on its kv head
        qs, ks, vs = q[start:end], k[start:end], v[start:end]
        ks, vs = ks.repeat_interleave(2, dim=1), vs.repeat_interleave(2, dim=1)
        scores = torch.einsum("shd,thd->hst", qs, ks) * 0.3
        n = end - start
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        ref = torch.einsum("hst,thd->shd", scores.softmax(-1), vs)
        torch.testing.assert_close(out[start:end], ref, rtol=1e-12, atol=1e-12)


def test_hf_model_with_varlen_equals_masked_sdpa_and_samples_alone(tmp_path):
    name = resolve_attn_implementation("varlen")
    model = tiny_qwen3(0).to(torch.float64)
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    varlen = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, attn_implementation=name
    )
    masked = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, attn_implementation="sdpa"
    )
    batch = _batch([7, 3, 12, 5])
    packed = pack_thd(batch)
    out = varlen(input_ids=packed.input_ids, **packed_attention_kwargs(packed, name)).logits
    ref = masked(input_ids=packed.input_ids, **packed_attention_kwargs(packed, "sdpa")).logits
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # and each sample alone through the stock model
    start = 0
    for sample in batch.samples:
        n = sample.tokens.numel()
        alone = masked(input_ids=sample.tokens[None], use_cache=False).logits[0]
        torch.testing.assert_close(out[0, start : start + n], alone, rtol=1e-10, atol=1e-10)
        start += n
    # gradients agree too
    out.sum().backward()
    ref.sum().backward()
    for (n1, p1), (_, p2) in zip(varlen.named_parameters(), masked.named_parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-9, atol=1e-10, msg=n1)


def test_varlen_refuses_a_forward_without_boundaries(tmp_path):
    name = resolve_attn_implementation("varlen")
    tiny_qwen3(0).save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name)
    with pytest.raises(ValueError, match="needs one packed row with cu_seq_lens_q"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
