"""Test support: the spawned body of tests/miles_megatron/test_megatron_loss_type.py (the Megatron
actor's ``--loss-type sft_loss`` step and its ``--custom-loss-function-path`` steps)."""

from __future__ import annotations

import torch

#: Parameters whose gradients the test compares with the float64 HF reference (megatron name ->
#: HF name): ones stored unfused in both, at the start and the end of the model.
GRAD_NAMES = {
    "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}

#: The flags of the custom-loss runs: the hook's denominator is the step's loss tokens, its
#: log-probs at a temperature other than 1.
HOOK_ARGV = ["--calculate-per-token-loss", "--rollout-temperature", "0.8"]


def one_step(rank: int, world: int, hf_dir: str, runs: dict[str, list[str]], out: str) -> None:
    """For each ``label -> extra flags`` of ``runs``, one optimizer step of a fresh actor (lr 0,
    no clipping): its metrics and this rank's gradients of :data:`GRAD_NAMES` (those on its
    pipeline stage), saved to ``{out}.{rank}`` (tensors do not travel back through the queue)."""
    from backend_reference import samples
    from megatron_ranks import parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend
    from miles_megatron.sharding import unwrap

    results = {}
    for label, extra in runs.items():
        argv = ["--hf-checkpoint", hf_dir, "--advantage-estimator", "grpo", "--lr", "0"]
        argv += ["--clip-grad", "1e6", "--micro-batch-size", "2", *extra]
        backend = MegatronBackend()
        backend.init(parse(argv))
        metrics = backend.train(0, RolloutBatch(samples()))
        params = dict(unwrap(backend.model).named_parameters())
        grads = {
            n: params[n].main_grad.detach().float().cpu().clone() for n in GRAD_NAMES if n in params
        }
        backend.close()
        results[label] = {"metrics": metrics, "grads": grads}
    torch.save(results, f"{out}.{rank}")


def fsdp_step(rank: int, world: int, hf_dir: str, extra: list[str], out: str) -> None:
    """:func:`one_step`'s step on the FSDP backend (fp32, the same samples and flags): its
    metrics and the gradients of :data:`GRAD_NAMES`' HF parameters, saved to ``out``."""
    from backend_reference import samples
    from full_tensors import full
    from miles_core.args import core_groups, parse_args
    from miles_core.batch import RolloutBatch
    from miles_fsdp.args import fsdp_groups
    from miles_fsdp.backend import FSDPBackend

    argv = ["--hf-checkpoint", hf_dir, "--advantage-estimator", "grpo", "--lr", "0", "--no-bf16"]
    argv += ["--clip-grad", "1e6", "--micro-batch-size", "2", "--attn-implementation", "sdpa"]
    backend = FSDPBackend()
    backend.init(parse_args([*argv, *extra], [*core_groups(), *fsdp_groups()]))
    metrics = backend.train(0, RolloutBatch(samples()))
    params = dict(backend.model.named_parameters())
    grads = {}
    for name in GRAD_NAMES.values():
        g = params[name].grad
        grads[name] = full(g).detach().float().clone()
    backend.close()
    torch.save({"metrics": metrics, "grads": grads}, out)
