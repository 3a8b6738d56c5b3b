"""``python -m miles_megatron.convert hf-to-torch-dist|torch-dist-to-hf``: offline conversion.

Runs on one process or under ``torchrun`` (gloo on CPUs, NCCL on GPUs); the parallel-size
flags pick the layout the conversion runs at (any layout writes the same torch_dist checkpoint).

    python -m miles_megatron.convert hf-to-torch-dist --hf-checkpoint HF --save OUT [flags]
    python -m miles_megatron.convert torch-dist-to-hf --load CKPT --hf-checkpoint HF --save OUT

``hf-to-torch-dist`` writes ``OUT/iter_0000000/`` and commits it through the shared tracker, so
``--load OUT`` resumes from it. ``torch-dist-to-hf`` reads the iteration the tracker of
``--load`` names (or ``--ckpt-step``), takes the architecture and tokenizer from
``--hf-checkpoint`` (or the architecture flags) and writes ``OUT/model.safetensors``.

Both keep the source's dtype (an fp32 checkpoint stays fp32) unless ``--bf16``, ``--no-bf16``
or ``--fp16`` names another.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from miles_core.args import core_groups, parse_args_or_exit
from miles_core.args.parsed import ParsedArgs
from miles_core.checkpoint_layout import (
    CheckpointMeta,
    commit_iteration,
    iteration_dir,
    prepare_iteration_dir,
    resolve_load,
)
from miles_core.precision import DTYPES, explicit_dtype_name

from miles_megatron.arch_args import resolve_model_args
from miles_megatron.args import megatron_groups
from miles_megatron.bridge import bridge_for
from miles_megatron.hf_weights import (
    HFCheckpoint,
    iter_hf_weights,
    load_hf_into_model,
    save_hf_checkpoint,
)
from miles_megatron.model_config import build_gpt_model
from miles_megatron.parallel import destroy_parallel, initialize_parallel
from miles_megatron.torch_dist import load_model_weights, save_model_weights, saved_weights_dtype


def _setup(args: ParsedArgs):
    margs = resolve_model_args(args)
    initialize_parallel(args, margs)
    model = build_gpt_model(margs, args)
    return margs, model, bridge_for(margs.get("model_type") or "")


def hf_to_torch_dist(args: ParsedArgs) -> Path:
    """Convert ``--hf-checkpoint`` into a torch_dist checkpoint under ``--save``."""
    source = HFCheckpoint(args.hf_checkpoint)
    _keep_source_dtype(args, source.dtype())
    margs, model, bridge = _setup(args)
    load_hf_into_model(model, source, bridge, margs, args.tensor_model_parallel_size)
    if dist.get_rank() == 0:
        prepare_iteration_dir(args.save, 0)
    dist.barrier()
    save_model_weights(model, iteration_dir(args.save, 0))
    dist.barrier()
    if dist.get_rank() == 0:
        commit_iteration(args.save, 0, _meta())
    dist.barrier()
    return iteration_dir(args.save, 0)


def _meta():
    return CheckpointMeta(
        iteration=0,
        rollout_id=-1,
        next_rollout_id=0,
        global_step=0,
        micro_step=0,
        world_size=dist.get_world_size(),
        backend="megatron",
        extra={"converted_from": "hf"},
    )


def _keep_source_dtype(args: ParsedArgs, dtype: torch.dtype | None) -> None:
    """Convert in the source's own dtype unless ``--bf16`` / ``--no-bf16`` / ``--fp16`` names
    one: the default training dtype (bf16) would round an fp32 checkpoint on its way out."""
    if dtype is None or explicit_dtype_name(args) is not None:
        return
    name = {v: k for k, v in DTYPES.items()}.get(dtype)
    if name is None:
        raise SystemExit(f"the checkpoint's weights are {dtype}; name a precision flag")
    args.bf16, args.fp16 = name == "bf16", name == "fp16"


def torch_dist_to_hf(args: ParsedArgs) -> Path:
    """Convert the torch_dist checkpoint of ``--load`` into an HF directory at ``--save``."""
    if args.pipeline_model_parallel_size != 1:
        raise SystemExit("torch-dist-to-hf runs with --pipeline-model-parallel-size 1")
    resolved = resolve_load(args.load, args.ckpt_step)
    if resolved is None:
        raise SystemExit(f"--load {args.load}: no committed checkpoint (no tracker)")
    _keep_source_dtype(args, saved_weights_dtype(resolved.path))
    margs, model, bridge = _setup(args)
    load_model_weights(model, resolved.path)
    tensors = list(iter_hf_weights(model, bridge, margs))
    out = Path(args.save)
    if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0:
        save_hf_checkpoint(out, tensors, source_dir=args.hf_checkpoint)
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"hf-to-torch-dist": hf_to_torch_dist, "torch-dist-to-hf": torch_dist_to_hf}
    if not argv or argv[0] not in commands:
        print(
            f"usage: python -m miles_megatron.convert {{{','.join(commands)}}} ...", file=sys.stderr
        )
        return 2
    args = parse_args_or_exit(argv[1:], [*core_groups(), *megatron_groups()])
    if not args.save:
        print("error: --save is required", file=sys.stderr)
        return 2
    started = not dist.is_initialized()
    if started:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "MASTER_PORT" in os.environ:  # under torchrun: its rendezvous
            dist.init_process_group(backend)
        else:  # one process: an in-memory store, no port another job on the node could hold
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        commands[argv[0]](args)
    finally:
        destroy_parallel()
        if started:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
