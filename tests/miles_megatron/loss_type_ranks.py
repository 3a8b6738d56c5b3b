"""Test support: the spawned body of tests/miles_megatron/test_megatron_loss_type.py (the Megatron
actor's ``--loss-type sft_loss`` step)."""

from __future__ import annotations

import torch

#: Parameters whose gradients the test compares with the float64 HF reference (megatron name ->
#: HF name): ones stored unfused in both, at the start and the end of the model.
GRAD_NAMES = {
    "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def one_step(rank: int, world: int, hf_dir: str, loss_type: str, out: str) -> None:
    """One optimizer step of the actor under ``--loss-type loss_type`` (lr 0, no clipping):
    its metrics and the gradients of :data:`GRAD_NAMES`, saved to ``out``."""
    from backend_reference import samples
    from megatron_ranks import parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend
    from miles_megatron.sharding import unwrap

    argv = ["--hf-checkpoint", hf_dir, "--advantage-estimator", "grpo", "--lr", "0"]
    argv += ["--loss-type", loss_type, "--clip-grad", "1e6", "--micro-batch-size", "2"]
    backend = MegatronBackend()
    backend.init(parse(argv))
    metrics = backend.train(0, RolloutBatch(samples()))
    params = dict(unwrap(backend.model).named_parameters())
    grads = {n: params[n].main_grad.detach().float().cpu().clone() for n in GRAD_NAMES}
    backend.close()
    torch.save({"metrics": metrics, "grads": grads}, out)
