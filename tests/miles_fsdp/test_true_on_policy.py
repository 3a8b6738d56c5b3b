"""--true-on-policy between the built-in engine and the FSDP trainer, both in this process.

The built-in engine as ``python -m miles_launch.builtin_engine --true-on-policy`` builds it
samples three responses of different prompt lengths submitted together (a left-padded prefill
of the three, then batched decode steps against the KV cache) at temperature 0.7, with their
log-probs. The FSDP
backend, built from the same directory with the real parser's ``--true-on-policy``, trains one
rollout of them packed into one row: the train/rollout mismatch its loss reports (the training
forward's log-probs against the engine's, ``miles_core.mismatch``) is exactly 0, token maximum
included. The same rollout on a backend without the mode (``--use-rollout-logprobs``, sdpa,
the fused head) reports a nonzero mismatch, so the equality is not one any two forwards show.
"""

from __future__ import annotations

import threading

import pytest
import torch
from miles_core import batch_invariant, mismatch
from miles_core.batch import RolloutBatch, Sample
from run_args import make_args
from tiny_models import qwen3_config, save_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 2, 33, 7], [11, 4], [8, 8, 21, 40, 3, 17, 25, 6, 12]]
RESPONSE_LEN = 6
TEMPERATURE = 0.7


def engine_rollout(
    hf_dir, device: str = "cpu", prompts=PROMPTS, response_len: int = RESPONSE_LEN
) -> RolloutBatch:
    """The prompts' responses sampled by the engine that ``python -m
    miles_launch.builtin_engine --true-on-policy --device DEVICE`` builds (its parser and
    loader, in this process: the scheduler thread, no HTTP), submitted together: one prompt
    group (tests/gpu/test_true_on_policy_gpu.py runs it on a GPU)."""
    from miles_launch.builtin_engine.__main__ import build_state, parse_args
    from miles_launch.builtin_engine.request import Request
    from miles_launch.builtin_engine.sampling import SamplingParams

    config = parse_args(["--model-path", str(hf_dir), "--true-on-policy", "--device", device])
    assert config.true_on_policy and config.dtype == ("float32" if device == "cpu" else "auto")
    state = build_state(config)
    assert state.scheduler.model.config._attn_implementation == batch_invariant.HF_ATTENTION_NAME
    done = threading.Semaphore(0)
    params = dict(max_new_tokens=response_len, temperature=TEMPERATURE, ignore_eos=True)
    requests = [
        Request(
            rid=str(i),
            prompt_ids=prompt,
            params=SamplingParams(**params, sampling_seed=i),
            on_done=lambda r: done.release(),
        )
        for i, prompt in enumerate(prompts)
    ]
    try:
        state.scheduler.submit(requests)
        for _ in requests:
            assert done.acquire(timeout=60)
    finally:
        state.scheduler.shutdown()
    samples = []
    for i, req in enumerate(requests):
        assert req.finish_reason["type"] == "length" and len(req.output_ids) == response_len
        samples.append(
            Sample(
                tokens=torch.tensor(req.prompt_ids + req.output_ids),
                response_length=response_len,
                reward=float(i),
                rollout_log_probs=torch.tensor(req.output_logprobs),
            )
        )
    return RolloutBatch(samples)


def train_once(hf_dir, batch: RolloutBatch, **flags) -> tuple[str, dict[str, float]]:
    """One rollout of ``batch`` (all three samples in one packed micro-batch) on a fresh
    backend: (its attention implementation, the metrics)."""
    from miles_fsdp.backend import FSDPBackend

    args = make_args(
        hf_checkpoint=str(hf_dir),
        rollout_temperature=TEMPERATURE,
        micro_batch_size=len(batch),
        advantage_estimator="grpo",
        **flags,
    )
    backend = FSDPBackend()
    backend.init(args)
    try:
        return backend.attn_implementation, backend.train(0, batch)
    finally:
        backend.close()


def test_the_mismatch_is_exactly_zero_with_the_mode_and_not_without(
    one_rank_group, tmp_path, monkeypatch
):
    from miles_core import batch_invariant_head

    hf_dir = save_tiny_model(tmp_path / "tiny", qwen3_config())
    batch = engine_rollout(hf_dir)
    heads = []
    real_head = batch_invariant_head.log_probs
    monkeypatch.setattr(
        batch_invariant_head, "log_probs", lambda *a, **k: heads.append(1) or real_head(*a, **k)
    )

    on = make_args(hf_checkpoint=str(hf_dir), attn_implementation=None, true_on_policy=True)
    assert on.use_rollout_logprobs and on.fused_log_probs  # what the mode implies and keeps
    attn, metrics = train_once(hf_dir, batch, attn_implementation=None, true_on_policy=True)
    assert attn == batch_invariant.HF_ATTENTION_NAME
    assert heads, "the mode's fused head did not run"
    assert metrics[mismatch.ABS_DIFF] == 0.0, metrics
    assert metrics[mismatch.ABS_DIFF_MAX] == 0.0, metrics
    # with gradient checkpointing the backward's recompute runs in the mode too (else torch's
    # checkpoint sees other ops saving other tensors, and refuses); the dense head, too
    heads.clear()
    _, metrics = train_once(
        hf_dir,
        batch,
        attn_implementation=None,
        true_on_policy=True,
        gradient_checkpointing=True,
        fused_log_probs=False,
    )
    assert not heads  # the logits materialised, the engine's log_softmax over them
    assert metrics[mismatch.ABS_DIFF_MAX] == 0.0, metrics

    attn, metrics = train_once(hf_dir, batch, use_rollout_logprobs=True)
    assert attn == "sdpa"
    assert metrics[mismatch.ABS_DIFF_MAX] > 0.0, metrics
