"""Rank program of test_memory_plan_activations.py: the bytes autograd saves while the Megatron
backend trains one rollout of one-sample micro-batches (unique storages, its parameters' buffers
excluded), bf16, sdpa attention, on a gloo CPU rank with the megatron shim. Storages are told
apart by address, so only one micro-batch's are counted exactly (a later one may reuse the
addresses of an earlier one's freed tensors): the test trains one sample.

``fused_norm``: ``torch.nn.RMSNorm`` as a GPU runs it. On CUDA, torch dispatches ``rms_norm`` to
its ``_fused_rms_norm`` kernel, and autograd saves what torch's generated formula for that op
names (derivatives.yaml: the input, the weight, the ``rstd`` output). The CPU has no such
kernel and decomposes into fp32 ops instead. :func:`use_fused_rms_norm` registers CPU kernels
for ``_fused_rms_norm`` and its backward (the same arithmetic in fp32), so that on this CPU
rank torch's own autograd node for the fused op runs, and saves what it saves on a GPU."""

from __future__ import annotations

import torch

_LIBRARIES: list = []  # the registrations live as long as the rank


def use_fused_rms_norm() -> None:
    """CPU kernels for ``aten::_fused_rms_norm`` and ``aten::_fused_rms_norm_backward`` (module
    docstring); torch's autograd formula for the op is the one CUDA uses."""
    lib = torch.library.Library("aten", "IMPL")
    _LIBRARIES.append(lib)

    def normalise(x, shape, weight, eps):
        dims = tuple(range(-len(shape), 0))
        eps = torch.finfo(torch.float32).eps if eps is None else eps
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)
        out = x.float() * rstd
        return (out * weight.float() if weight is not None else out).to(x.dtype), rstd

    def forward(input, normalized_shape, weight=None, eps=None):
        with torch.no_grad():
            return normalise(input, normalized_shape, weight, eps)

    def backward(grad, input, normalized_shape, rstd, weight, output_mask):
        # y = x rstd w: dx = rstd (g w - x_hat mean(g w x_hat)), dw = sum over rows of g x_hat
        dims = tuple(range(-len(normalized_shape), 0))
        with torch.no_grad():
            g, x_hat = grad.float(), input.float() * rstd
            gw = g * weight.float() if weight is not None else g
            grad_x = rstd * (gw - x_hat * (gw * x_hat).mean(dims, keepdim=True))
            rows = tuple(range(grad.dim() - len(normalized_shape)))
            grad_w = (g * x_hat).sum(rows) if weight is not None and output_mask[1] else None
        grad_x = grad_x.to(input.dtype) if output_mask[0] else None
        return grad_x, grad_w.to(weight.dtype) if grad_w is not None else None

    lib.impl("_fused_rms_norm", forward, "CPU")
    lib.impl("_fused_rms_norm_backward", backward, "CPU")


def saved_bytes(rank: int, world_size: int, hf_dir: str, tokens: int, samples: int) -> list[int]:
    """Bytes of every storage saved for backward during ``train`` of ``samples`` samples of
    ``tokens`` tokens, each its own micro-batch (``--max-tokens-per-gpu tokens``): twice, with
    the CPU's RMSNorm, then with RMSNorm as on a GPU (module docstring)."""
    from miles_core.args import core_groups, parse_args
    from miles_core.batch import RolloutBatch, Sample
    from miles_core.partition import partition_for_dp
    from miles_megatron.args import megatron_groups
    from miles_megatron.backend import MegatronBackend

    argv = ["--hf-checkpoint", hf_dir, "--lr", "1e-6", "--advantage-estimator", "grpo"]
    argv += ["--bf16", "--attn-implementation", "sdpa", "--num-steps-per-rollout", "1"]
    argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(tokens)]
    backend = MegatronBackend()
    backend.init(parse_args(argv, [*core_groups(), *megatron_groups()]))
    models = backend.model if isinstance(backend.model, list) else [backend.model]
    params = {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        [
            Sample(
                tokens=torch.randint(2, 500, (tokens,), generator=g),
                response_length=tokens // 2,
                reward=float(i),
                group_index=0,
            )
            for i in range(samples)
        ]
    )
    totals = []
    for rollout_id in range(2):
        if rollout_id == 1:
            use_fused_rms_norm()
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            backend.train(rollout_id, partition_for_dp(batch, 1)[0])
        totals.append(sum(seen.values()))
    backend.close()
    return totals
