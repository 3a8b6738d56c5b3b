"""THD packing layout, and that packed attention never crosses sample boundaries (tiny Qwen3)."""

from __future__ import annotations

import pytest
import torch
from miles_core.batch import RolloutBatch, Sample
from miles_core.log_probs import token_log_probs
from miles_core.packing import pack_thd, packed_attention_kwargs, unpack_response

pytestmark = pytest.mark.numeric


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread avoids oversubscription stalls on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch(specs, seed=0, vocab=64):
    """specs: (total_length, response_length) per sample, with masks, log-probs and routing."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (length, resp) in enumerate(specs):
        mask = (torch.rand(resp, generator=g) > 0.3).float()
        samples.append(
            Sample(
                tokens=torch.randint(1, vocab, (length,), generator=g),
                response_length=resp,
                reward=float(i),
                loss_mask=mask,
                rollout_log_probs=-torch.rand(resp, generator=g),
                routed_experts=torch.randint(0, 8, (length - 1, 2, 2), generator=g),
                group_index=i,
            )
        )
    batch = RolloutBatch(samples)
    return batch.with_fields(advantages=[torch.randn(r, generator=g) for _, r in specs])


def test_layout_against_per_sample_reference():
    specs = [(7, 3), (1 + 1, 1), (20, 11), (5, 4)]
    batch = _batch(specs)
    p = pack_thd(batch, pad_multiple=16)
    used = sum(n for n, _ in specs)
    assert p.num_tokens == 48 and p.num_tokens % 16 == 0 and p.num_padding == 48 - used
    assert p.cu_seqlens.tolist() == [0, 7, 9, 29, 34, 48] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 20 and p.num_samples == 4
    assert p.sample_loss_tokens.tolist() == [float(s.loss_mask.sum()) for s in batch]
    offset = 0
    for i, s in enumerate(batch):
        n, r = s.total_length, s.response_length
        seg = slice(offset, offset + n)
        assert torch.equal(p.input_ids[0, seg], s.tokens)
        assert p.position_ids[0, seg].tolist() == list(range(n))
        assert (p.sample_ids[0, seg] == i).all()
        # position t predicts token t + 1 of the same sample
        assert torch.equal(p.targets[0, offset : offset + n - 1], s.tokens[1:])
        for j in range(r):
            pos = offset + (n - r) + j - 1
            assert p.targets[0, pos] == s.tokens[n - r + j]
            assert p.loss_mask[0, pos] == s.loss_mask[j]
            assert p.fields["advantages"][0, pos] == s.fields["advantages"][j]
            assert p.fields["rollout_log_probs"][0, pos] == s.rollout_log_probs[j]
        prompt_positions = list(range(offset, offset + n - r - 1)) + [offset + n - 1]
        assert p.loss_mask[0, prompt_positions].abs().sum() == 0
        assert torch.equal(p.routed_experts[offset : offset + n - 1], s.routed_experts)
        assert p.routed_experts[offset + n - 1].abs().sum() == 0
        offset += n
    pad = slice(used, 48)
    assert (p.sample_ids[0, pad] == -1).all() and p.loss_mask[0, pad].abs().sum() == 0
    assert p.position_ids[0, pad].tolist() == list(range(48 - used))
    parts = unpack_response(p, p.fields["advantages"])
    for s, part in zip(batch, parts):
        assert torch.equal(part, s.fields["advantages"])


def test_padding_rules():
    batch = _batch([(64, 8), (64, 8)])
    assert pack_thd(batch).num_tokens == 128 and len(pack_thd(batch).cu_seqlens) == 3
    assert pack_thd(_batch([(65, 8), (64, 8)])).num_tokens == 256
    empty = pack_thd(batch.select([]))
    assert empty.num_tokens == 128 and empty.num_samples == 0 and empty.loss_mask.sum() == 0
    assert empty.cu_seqlens.tolist() == [0, 128]
    # the batch's fields and optional values, zero: an empty micro-batch's loss reads them
    assert sorted(empty.fields) == ["advantages", "rollout_log_probs"]
    assert all(v.shape == (1, 128) and v.abs().sum() == 0 for v in empty.fields.values())
    assert empty.routed_experts.shape == (128, 2, 2) and empty.routed_experts.abs().sum() == 0
    # fields attached to an empty selection are named by it too
    later = batch.select([]).with_fields(old_log_probs=[])
    assert sorted(pack_thd(later).fields) == ["advantages", "old_log_probs", "rollout_log_probs"]


def test_transformers_detects_the_same_segments():
    from transformers.masking_utils import find_packed_sequence_indices

    p = pack_thd(_batch([(7, 3), (2, 1), (9, 4)]), pad_multiple=32)
    seg = find_packed_sequence_indices(p.position_ids)[0]
    want = torch.repeat_interleave(torch.arange(4), p.cu_seqlens.diff().long())
    assert torch.equal(seg, want)


def _tiny_qwen3(attn_implementation):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    )  # fmt: skip
    config._attn_implementation = attn_implementation
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_logits_equal_per_sample_logits(attn_implementation):
    model = _tiny_qwen3(attn_implementation)
    batch = _batch([(9, 4), (3, 1), (17, 6), (6, 5)], seed=3)
    p = pack_thd(batch, pad_multiple=16)
    kwargs = packed_attention_kwargs(p, attn_implementation)
    with torch.no_grad():
        packed = model(input_ids=p.input_ids, **kwargs).logits[0]
        # control: one causal sequence without resets lets later samples see earlier ones
        leaky = model(
            input_ids=p.input_ids, position_ids=torch.arange(p.num_tokens)[None], use_cache=False
        ).logits[0]
        lp_packed = unpack_response(p, token_log_probs(packed[None], p.targets))
        for i, s in enumerate(batch):
            seg = slice(int(p.cu_seqlens[i]), int(p.cu_seqlens[i + 1]))
            alone = model(input_ids=s.tokens[None]).logits[0]
            torch.testing.assert_close(packed[seg], alone, rtol=1e-5, atol=1e-5)
            if i > 0:
                assert (leaky[seg] - alone).abs().max() > 1e-3
            resp = s.tokens[-s.response_length :]
            want = torch.log_softmax(alone[-s.response_length - 1 : -1].double(), -1)
            want = want.gather(-1, resp[:, None])[:, 0]
            torch.testing.assert_close(lp_packed[i].double(), want, rtol=1e-5, atol=1e-5)


def test_attention_kwargs_for_flash_and_errors():
    p = pack_thd(_batch([(9, 4), (3, 1)]), pad_multiple=16)
    kw = packed_attention_kwargs(p, "flash_attention_2")
    assert kw["cu_seq_lens_q"].tolist() == [0, 9, 12, 16] and kw["max_length_q"] == 9
    assert "attention_mask" not in kw and kw["use_cache"] is False
    # --true-on-policy: the mask (its CPU path, the engine's contract) and the boundaries (the
    # GPU's packed-row attention) together
    mode = packed_attention_kwargs(p, "miles_batch_invariant")
    assert mode["cu_seq_lens_q"].tolist() == [0, 9, 12, 16] and mode["max_length_q"] == 9
    assert mode["attention_mask"].dtype == torch.bool and mode["attention_mask"].shape == (
        1,
        1,
        16,
        16,
    )
    eager = packed_attention_kwargs(p, "eager", dtype=torch.bfloat16)["attention_mask"]
    assert eager.dtype == torch.bfloat16 and eager.shape == (1, 1, 16, 16)
    assert eager[0, 0, 9, 8] == torch.finfo(torch.bfloat16).min and eager[0, 0, 9, 9] == 0
    with pytest.raises(ValueError, match="attn_implementation"):
        packed_attention_kwargs(p, "flex_attention")
