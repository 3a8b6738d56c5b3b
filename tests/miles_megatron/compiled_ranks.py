"""Test support: the eager and the compiled (``--compile-decoder-layers``) Megatron backend on one
rank, in lockstep (importable by spawn children)."""

from __future__ import annotations

import torch

#: fp32, GRPO, full recompute, the varlen attention path, and a token
#: budget that splits each step into several micro-batches of different lengths
FLAGS = [
    "--no-bf16", "--lr", "1e-3", "--weight-decay", "0",
    "--advantage-estimator", "grpo", "--clip-grad", "0", "--use-dynamic-batch-size",
    "--max-tokens-per-gpu", "20", "--attn-implementation", "varlen",
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1",
]  # fmt: skip


def _backend(hf_dir: str, compiled: bool):
    from miles_core.args import core_groups, parse_args
    from miles_megatron.backend import MegatronBackend

    argv = ["--hf-checkpoint", hf_dir, *FLAGS]
    argv += ["--compile-decoder-layers"] if compiled else []
    backend = MegatronBackend()
    backend.init(parse_args(argv, [*core_groups(), *MegatronBackend.arg_groups()]))
    return backend


def _grads(backend) -> dict:
    """Each parameter's gradient of the last optimizer step (megatron's DDP buffer), as numpy
    arrays (a tensor returned from a spawned rank would be shared memory it takes away)."""
    return {n: p.main_grad.detach().numpy().copy() for n, p in backend.model.named_parameters()}


def lockstep(rank: int, world: int, hf_dir: str, steps: int) -> dict:
    """``steps`` optimizer steps of both backends, the compiled one given the eager one's weights
    before each: per step the train metrics and the gradients of both, and the compiled layers'
    coverage (calls, failures) and dynamo's counters."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch
    from miles_core.compiled_layers import guarded_forwards
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _backend(hf_dir, False), _backend(hf_dir, True)
    guarded = guarded_forwards(compiled.model)
    out: dict = {"eager_guarded": len(guarded_forwards(eager.model)), "steps": []}
    batch = RolloutBatch(samples(masked=True, engine_log_probs=True))
    for step in range(steps):
        with torch.no_grad():
            for (name, mine), (other, theirs) in zip(
                compiled.model.named_parameters(), eager.model.named_parameters(), strict=True
            ):
                assert name == other
                mine.copy_(theirs)
        want, got = eager.train(step, batch), compiled.train(step, batch)
        out["steps"].append(
            {"want": want, "got": got, "want_grads": _grads(eager), "got_grads": _grads(compiled)}
        )
    out["layers"] = len(guarded)
    out["calls"] = [g.compiled_calls for g in guarded]
    out["failures"] = [g.failure for g in guarded]
    out["graphs"] = counters["stats"]["unique_graphs"]
    out["inductor"] = bool(counters["inductor"])
    eager.close()
    compiled.close()
    return out
