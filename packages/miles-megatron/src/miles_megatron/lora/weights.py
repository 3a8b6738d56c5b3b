"""Adapter factors between this rank's shards and full HF-named tensors (PEFT's layout).

* :func:`gather_factors` (collective over the TP and EP groups): ``hf_module -> {lora_A,
  lora_B}`` full tensors of this PP stage, every expert included, on every rank.
* :func:`load_factors`: fill this rank's shards from full tensors (a PEFT directory).
* :func:`merge_into_hf`: ``W + (alpha / r) * B @ A`` per HF weight, computed in float32 (or
  wider) and cast back to the weight's dtype — the published / exported merged weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from miles_core.peft_adapter import FACTORS, Factors, PeftAdapter, PeftAdapterError

from miles_megatron.lora.layers import LinearTarget, LoRAAdapter


def _ep_group(targets: list[tuple[LinearTarget, LoRAAdapter]]):
    if not any(t.expert is not None for t, _ in targets) or not dist.is_initialized():
        return None, 1, 0

    group = ps.get_expert_model_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


def gather_factors(
    injected: list[tuple[LinearTarget, LoRAAdapter]],
    num_experts: int | None = None,
    read: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Factors:
    """Full factors in HF module names (collective: every TP/EP rank of the stage calls).

    ``read``: each local factor's values on the device (a sleeping model's
    :meth:`~miles_megatron.sleep_wake.SleepWake.read`: the factors live in the DDP buffers,
    whose storage is freed while asleep); default the parameter itself.
    """
    ep_group, ep_size, _ = _ep_group(injected)
    local = read or (lambda t: t)
    out: Factors = {}
    for target, adapter in injected:
        for short in adapter.modules_on:
            full = {
                f: adapter.full_of(f, local(getattr(adapter, f)[short].detach())) for f in FACTORS
            }
            if target.expert is None or ep_size == 1:
                out[adapter.hf_names[short]] = full
                continue
            per_rank = num_experts // ep_size
            for factor in FACTORS:
                parts = [torch.empty_like(full[factor]) for _ in range(ep_size)]
                dist.all_gather(parts, full[factor].contiguous(), group=ep_group)
                for ep_rank, part in enumerate(parts):
                    expert = ep_rank * per_rank + target.local_expert
                    out.setdefault(_hf_module_for(target, short, expert), {})[factor] = part
    return out


def _hf_module_for(target: LinearTarget, short: str, expert: int) -> str:
    for module in target.hf_modules(expert):
        if module.rsplit(".", 1)[-1] == short:
            return module
    raise KeyError(short)


@torch.no_grad()
def load_factors(injected: list[tuple[LinearTarget, LoRAAdapter]], adapter: PeftAdapter) -> None:
    """Copy a PEFT adapter's factors into this rank's shards; every targeted module of the
    model must be in the adapter and every adapter module targeted here."""
    weights = adapter.weights_file
    used = set()
    for _, lora in injected:
        for short in lora.modules_on:
            module = lora.hf_names[short]
            if module not in adapter.factors:
                raise PeftAdapterError(f"{weights}: no factors for {module}")
            used.add(module)
            for factor in FACTORS:
                local = lora.shard_of(factor, adapter.factors[module][factor])
                param = getattr(lora, factor)[short]
                if local.shape != param.shape:
                    raise PeftAdapterError(
                        f"{weights}: {module}.{factor} has shape "
                        f"{tuple(adapter.factors[module][factor].shape)}, which does not fit "
                        f"the model (this rank's shard {tuple(param.shape)})"
                    )
                param.copy_(local.to(param.dtype))
    stage_modules = {m for t, _ in injected for m in t.hf_modules()}
    layers = {_layer_prefix(m) for m in stage_modules}
    extra = sorted(m for m in adapter.factors if m not in used and _layer_prefix(m) in layers)
    if extra:
        raise PeftAdapterError(
            f"{weights}: {extra[0]} is not a LoRA target of the model here "
            "(--lora-target-modules, or a module megatron does not adapt)"
        )


def _layer_prefix(hf_module: str) -> str:
    parts = hf_module.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else hf_module


def merge_into_hf(
    named: Iterable[tuple[str, torch.Tensor]], factors: Factors, scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF ``(name, W)`` -> ``(name, W + scale * B @ A)`` for adapted modules, in ``W``'s dtype."""
    for name, tensor in named:
        pair = factors.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if pair is None:
            yield name, tensor
            continue
        work = torch.promote_types(tensor.dtype, torch.float32)
        a, b = pair["lora_A"].to(work), pair["lora_B"].to(work)
        yield name, (tensor.to(work) + scale * (b @ a)).to(tensor.dtype)
