"""--true-on-policy on a GPU in bf16: the built-in engine (as ``python -m
miles_launch.builtin_engine --true-on-policy --device cuda`` builds it, in this process)
samples responses of prompts of different lengths together (a left-padded prefill, batched
decode steps against the KV cache); the FSDP backend (one rank, NCCL, bf16 compute from a bf16
checkpoint) trains them packed into one row. The train/rollout mismatch of its training forward
against the engine's log-probs is exactly 0, token maximum included; every op of the mode ran in
the Triton kernels (counted), the log-probs in the mode's fused head (and, with
``--no-fused-log-probs``, from the materialised logits: the same bits), the packed row's attention through its boundaries and its backward
through torch's varlen kernel; the same rollout on a backend without the mode (sdpa, the fused
head, torch's kernels) reports a mismatch > 0, so the equality is not one any two forwards show.

Run on a GPU node: ``uv run pytest tests/gpu/test_true_on_policy_gpu.py`` (skipped without
CUDA).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_fsdp"))

from test_true_on_policy import engine_rollout, train_once  # noqa: E402
from tiny_models import qwen3_config, save_tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# prompts of 3..40 tokens (left padding up to 37 in the prefill; the packed row puts each
# sample's keys at another offset); 24 new tokens each
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 28)]
RESPONSE_LEN = 24


@pytest.fixture(scope="module")
def nccl_one_rank(tmp_path_factory):
    init = tmp_path_factory.mktemp("pg") / "init"
    os.environ.setdefault("LOCAL_RANK", "0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times each GPU kernel's launcher ran."""
    from miles_native.kernels import batch_invariant as kernels

    calls: Counter = Counter()
    for name in ("linear_forward", "attention_forward", "row_mean_forward", "log_softmax_forward"):
        real = getattr(kernels, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(kernels, name, counted)
    from miles_core import batch_invariant

    # the trainer's packed row: its forward, and its backward through the varlen kernel
    for name in ("packed_attention", "varlen_causal_attention"):
        real = getattr(batch_invariant, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(batch_invariant, name, counted)
    from miles_core import batch_invariant_head

    real_head = batch_invariant_head.log_probs

    def head(*a, **k):  # the trainer's fused head in the mode
        calls["head"] += 1
        return real_head(*a, **k)

    monkeypatch.setattr(batch_invariant_head, "log_probs", head)
    return calls


def test_bf16_mismatch_is_exactly_zero_with_the_mode_and_not_without(
    nccl_one_rank, kernel_calls, tmp_path
):
    from miles_core import batch_invariant, mismatch

    config = qwen3_config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
    )  # fmt: skip
    hf_dir = save_tiny_model(tmp_path / "tiny", config, dtype=torch.bfloat16)
    batch = engine_rollout(hf_dir, "cuda", PROMPTS, RESPONSE_LEN)
    engine_calls = {n: c for n, c in kernel_calls.items() if n.endswith("_forward")}
    assert "packed_attention" not in kernel_calls  # the engine's spans come from its masks
    assert all(engine_calls.get(n, 0) > 0 for n in ("linear_forward", "attention_forward",
                                                    "row_mean_forward", "log_softmax_forward")), engine_calls  # fmt: skip
    kernel_calls.clear()

    bf16 = dict(fsdp_compute_dtype=None)  # the CLI's default compute dtype, bf16
    attn, metrics = train_once(hf_dir, batch, attn_implementation=None, true_on_policy=True, **bf16)
    assert attn == batch_invariant.HF_ATTENTION_NAME
    assert all(kernel_calls[n] > 0 for n in engine_calls), dict(kernel_calls)
    layers = config.num_hidden_layers
    assert kernel_calls["packed_attention"] >= layers, dict(kernel_calls)
    assert kernel_calls["varlen_causal_attention"] >= layers, dict(kernel_calls)  # a backward ran
    assert kernel_calls["head"] > 0, dict(kernel_calls)  # the fused head, in the mode
    assert metrics[mismatch.ABS_DIFF] == 0.0, metrics
    assert metrics[mismatch.ABS_DIFF_MAX] == 0.0, metrics
    # the materialised logits (--no-fused-log-probs): the same bits
    kernel_calls.clear()
    _, metrics = train_once(
        hf_dir, batch, attn_implementation=None, true_on_policy=True, fused_log_probs=False, **bf16
    )
    assert "head" not in kernel_calls and kernel_calls["log_softmax_forward"] > 0
    assert metrics[mismatch.ABS_DIFF_MAX] == 0.0, metrics

    attn, metrics = train_once(hf_dir, batch, use_rollout_logprobs=True, **bf16)
    assert attn == "sdpa"
    assert metrics[mismatch.ABS_DIFF_MAX] > 0.0, metrics
