"""Test support: the spawned bodies of the recompute tests (every ``--recompute-*`` case against
no recompute: loss, gradients, how often layers and core attention ran, activation memory)."""

from __future__ import annotations

import torch
from megatron_ranks import build_from_hf

RECOMPUTE_CASES: dict[str, list[str]] = {
    "none": [],
    "full_uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    + ["--recompute-num-layers", "1"],
    "full_block": ["--recompute-granularity", "full", "--recompute-method", "block"]
    + ["--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
}


def _counting_hook(calls: dict[str, int], kind: str):
    def hook(module, inputs) -> None:
        calls[kind] += 1

    return hook


def recompute_run(rank: int, world: int, hf_dir: str, cases: dict[str, list[str]]) -> dict:
    """Per case: the loss and every parameter's gradient of one forward/backward of the model
    loaded from ``hf_dir`` (train mode: megatron recomputes only when training), how often the
    transformer layers and their core attention ran (a recomputed module runs again in the
    backward), and on a GPU the activation bytes the forward leaves allocated for the backward."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    s = ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1)[None, None]
    positions = torch.arange(s, device=device)[None].expand_as(ids)
    out: dict[str, dict] = {}
    for label, argv in cases.items():
        args, margs, model, _ = build_from_hf(hf_dir, argv)
        model.to(device)  # the local spec's norms are built on the host, as the backend's are
        model.train()
        calls = {"layer": 0, "core_attention": 0}
        for module in model.modules():
            if isinstance(module, TransformerLayer):
                module.register_forward_pre_hook(_counting_hook(calls, "layer"))
                module.self_attention.core_attention.register_forward_pre_hook(
                    _counting_hook(calls, "core_attention")
                )
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        logits = model(ids, positions, attention_mask=mask)[..., : margs["vocab_size"]]
        activation_bytes = torch.cuda.memory_allocated() - before if cuda else None
        loss = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).mean()
        loss.backward()
        out[label] = {
            "recompute_granularity": model.config.recompute_granularity,
            "loss": loss.item(),
            # numpy copies: no shared-memory handles to the parent
            "grads": {n: p.grad.detach().cpu().numpy().copy() for n, p in model.named_parameters()},
            "activation_bytes": activation_bytes,
            "calls": calls,
        }
        del model, logits, loss
    return out


#: Per recompute case, how often the 2 layers and their core attention run in one
#: forward/backward: a recomputed module runs again in the backward (full: whole layers, the
#: uniform chunks of 1 layer or the first block of 1; selective: core attention only).
RECOMPUTE_CALLS = {
    "none": {"layer": 2, "core_attention": 2},
    "full_uniform": {"layer": 4, "core_attention": 4},
    "full_block": {"layer": 3, "core_attention": 3},
    "selective": {"layer": 2, "core_attention": 4},
}


def check_recompute(result: dict) -> None:
    """Every recompute case ran what it names and matches no recompute: the same loss (the
    first forward is the same computation) and gradients within fp32 accumulation rounding."""
    from tolerances import assert_within, grad_atol

    base = result["none"]
    for label, case in result.items():
        assert case["calls"] == RECOMPUTE_CALLS[label], (label, case["calls"])
        assert case["recompute_granularity"] == (None if label == "none" else label.split("_")[0])
        assert case["loss"] == base["loss"], label
        assert case["grads"].keys() == base["grads"].keys()
        for name, grad in case["grads"].items():
            want = torch.from_numpy(base["grads"][name])
            assert_within(torch.from_numpy(grad), want, grad_atol(want), f"{label} {name}")
