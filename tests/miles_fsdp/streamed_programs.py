"""Rank programs of the streamed-optimizer tests (importable by spawned children)."""

from __future__ import annotations

import torch
from miles_core.batch import RolloutBatch, Sample
from miles_core.partition import partition_for_dp
from miles_fsdp.backend import FSDPBackend
from rank_programs import full_params
from run_args import make_args

COMMON = dict(
    advantage_estimator="grpo",
    use_dynamic_batch_size=True,
    max_tokens_per_gpu=24,
    num_steps_per_rollout=2,
    lr_warmup_iters=2,
    lr_decay_style="cosine",
    lr_decay_iters=8,
    weight_decay=0.01,
)


def streamed_flags(disk_dir: str) -> dict:
    """Streaming with several buckets, a piece split across buckets, norms kept on-device."""
    return dict(
        stream_optimizer_state_to_disk=True,
        stream_optimizer_min_numel=256,
        stream_optimizer_bucket_numel=3000,
        offload_train_disk_dir=disk_dir,
    )


def rollout_batch(samples: list[Sample], rollout_id: int, rank: int, world: int) -> RolloutBatch:
    """Rollout ``rollout_id``'s shard for ``rank``: the samples' tokens shifted by the id."""
    shifted = [
        Sample(
            tokens=(s.tokens + rollout_id) % 64,
            response_length=s.response_length,
            reward=(s.reward + 0.37 * rollout_id) % 1.0,
            group_index=s.group_index,
        )
        for s in samples
    ]
    return partition_for_dp(RolloutBatch(shifted), world, keep_groups=True)[rank]


def streamed_program(rank, world, hf_dir, samples, tmp, out_file):
    """Each mode runs on a fresh backend; results (weights, errors) go to ``out_file``.

    memory: 3 rollouts, in-memory AdamW, saved (a DCP checkpoint).   streamed: the same
    streamed, sleep/wake between rollouts.   first: streamed, 2 rollouts, saved.   resume: load
    ``first``, rollout 2.   Then the refusals of a checkpoint in the other format.
    """
    stream = streamed_flags(f"{tmp}/disk")
    modes = {
        "memory": dict(save=f"{tmp}/dcp-ckpt"),
        "streamed": dict(stream),
        "first": dict(stream, save=f"{tmp}/streamed-ckpt"),
        "resume": dict(stream, load=f"{tmp}/streamed-ckpt"),
    }
    results = {}
    for mode, flags in modes.items():
        backend = FSDPBackend()
        start = backend.init(make_args(hf_checkpoint=hf_dir, **COMMON, **flags))
        stop = 2 if mode == "first" else 3
        for rollout_id in range(start, stop):
            if mode == "streamed" and rollout_id > 0:
                backend.sleep()
                assert backend.asleep
                backend.wake_up()
            backend.train(rollout_id, rollout_batch(samples, rollout_id, rank, world))
        if flags.get("save"):
            backend.save_model(stop - 1)
        results[mode] = {"start": start, "params": full_params(backend.model)}
        backend.close()
    for mode, flags in {
        "streamed-into-memory": dict(load=f"{tmp}/streamed-ckpt"),
        "dcp-into-streamed": dict(stream, load=f"{tmp}/dcp-ckpt"),
    }.items():
        backend = FSDPBackend()
        try:
            backend.init(make_args(hf_checkpoint=hf_dir, **COMMON, **flags))
            results[mode] = None
        except ValueError as err:
            results[mode] = str(err)
        if backend.model is not None and hasattr(backend.optimizer, "close"):
            backend.optimizer.close()
    if rank == 0:
        torch.save(results, out_file)
