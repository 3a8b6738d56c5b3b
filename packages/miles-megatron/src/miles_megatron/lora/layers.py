"""LoRA adapters on megatron-core's tensor-parallel linears, one A/B pair per HF module.

Each targeted ``ColumnParallelLinear`` / ``RowParallelLinear`` gets a child module ``adapter``
(:class:`LoRAAdapter`) and a forward hook that adds the adapter's output to the base output::

    y = x W^T + (alpha / r) * sum_m place_m( dropout(x) A_m^T B_m^T )

``m`` runs over the HF modules the megatron linear fuses (``q_proj``/``k_proj``/``v_proj`` in
``linear_qkv``; ``gate_proj``/``up_proj`` in ``linear_fc1``; one module otherwise), so every HF
module keeps its own A and B exactly as PEFT does on the HF model, and ``place_m`` puts its
output columns where the bridge puts that module's weight rows (group-interleaved QKV per TP
rank, ``[gate_r; up_r]`` per TP rank).

Sharding follows the base layer, over the linear's own TP group (the expert-TP group for
expert linears):

* column-parallel: ``B_m`` split on its output dim (``[out_m / tp, r]``), ``A_m`` replicated;
  the input is the base layer's (all-gathered under sequence parallelism), ``A_m``'s gradient
  is all-reduced over TP (forward identity).
* row-parallel: ``A_m`` split on its input dim (``[r, in / tp]``), ``B_m`` replicated;
  ``x A^T`` is all-reduced before ``B`` (so ``B``'s gradient is complete on every rank), then
  split over the sequence under sequence parallelism, like the base output.
* expert linears with explicit expert communication (the token dispatcher gathers inputs and
  reduces outputs): column as above without the input gather; row adds its partial
  ``x_r A_r^T B^T`` (the dispatcher sums it with the base's partials) and all-reduces ``B``'s
  gradient over expert-TP.

Adapter parameters carry megatron's ``tensor_model_parallel`` / ``partition_dim`` marks where
split and ``allreduce=False`` for experts, so DDP, the distributed optimizer and the grad norm
treat them like the base layer's parameters; base parameters are frozen.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from miles_core.peft_adapter import ALL_LINEAR, LoRAConfig
from torch import nn

from miles_megatron.bridge import attention_shape
from miles_megatron.bridge.rules import WeightRule, match_rule
from miles_megatron.sharding import global_name, is_lora_adapter, unwrap


def is_targeted(hf_module: str, targets: str | tuple[str, ...]) -> bool:
    """PEFT's matching of a module name against ``target_modules``."""
    if isinstance(targets, str):
        return targets == ALL_LINEAR or re.fullmatch(targets, hf_module) is not None
    if ALL_LINEAR in targets:
        return True
    return any(hf_module == t or hf_module.endswith("." + t) for t in targets)


def short_name(hf_module: str) -> str:
    return hf_module.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class LinearTarget:
    """A megatron TP linear and the HF modules its weight is made of (bridge rule order)."""

    name: str  # local module name in the GPTModel
    linear: nn.Module
    rule: WeightRule
    layer: int | None
    expert: int | None  # global expert index
    local_expert: int | None
    parallel: str  # "column" | "row"

    def hf_modules(self, expert: int | None = None) -> list[str]:
        e = self.expert if expert is None else expert
        return [n.removesuffix(".weight") for n in self.rule.hf_names(self.layer, e)]


_LOCAL_EXPERT_RE = re.compile(r"\.local_experts\.(\d+)\.")


def linear_targets(model: nn.Module, bridge: Any, margs: dict) -> list[LinearTarget]:
    """Every column/row-parallel linear of this rank's model that the bridge maps to HF
    modules, except the output layer (PEFT's ``all-linear`` also skips ``lm_head``)."""
    rules = bridge.rules(margs)
    out = []
    for name, module in unwrap(model).named_modules():
        if isinstance(module, ColumnParallelLinear):
            parallel = "column"
        elif isinstance(module, RowParallelLinear):
            parallel = "row"
        else:
            continue
        if name == "output_layer":
            continue
        gname = global_name(f"{name}.weight", model, margs.get("num_experts"))
        found = match_rule(rules, gname)
        if found is None or found[0].kind == "vocab":
            continue
        rule, layer, expert = found
        local = _LOCAL_EXPERT_RE.search(name)
        out.append(
            LinearTarget(
                name, module, rule, layer, expert, int(local.group(1)) if local else None, parallel
            )
        )
    return out


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def init_factor(shape: tuple[int, int], seed: int, hf_module: str) -> torch.Tensor:
    """A fresh ``lora_A`` (full shape): PEFT's kaiming-uniform(a=sqrt(5)) draw from a generator
    seeded by ``seed`` and the module name, so every layout draws the same values."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(hf_module.encode()))
    a = torch.empty(shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
    return a


class LoRAAdapter(nn.Module):
    """The A/B factors of one megatron linear (keys: HF short names, e.g. ``q_proj``)."""

    def __init__(self, target: LinearTarget, modules: list[str], config: LoRAConfig, margs: dict):
        super().__init__()
        linear = target.linear
        self.parallel = target.parallel
        self.kind = target.rule.kind
        self.scale = config.scale
        self.enabled = True
        self.group = linear.tp_group
        self.tp_size, self.tp_rank = _group_size_rank(self.group)
        self.explicit_comm = bool(getattr(linear, "explicit_expert_comm", False))
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False))
        self.is_expert = target.expert is not None
        self.dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        self.all_modules = [short_name(m) for m in target.hf_modules()]
        self.hf_names = {short_name(m): m for m in target.hf_modules()}
        self.modules_on = [short_name(m) for m in modules]
        if self.kind == "qkv":
            shape = attention_shape(margs)
            self.groups = shape.num_groups // self.tp_size
            self.heads_per_group = shape.num_heads // shape.num_groups
            self.head_dim = shape.head_dim
        weight = linear.weight
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        r = config.rank
        for short in self.modules_on:
            if self.parallel == "column":
                a_shape = (r, linear.input_size)
                b_shape = (self._local_out(short, linear.output_size_per_partition), r)
            else:
                a_shape = (r, linear.input_size_per_partition)
                b_shape = (linear.output_size, r)
            kw = dict(dtype=weight.dtype, device=weight.device)
            self.lora_A[short] = nn.Parameter(torch.zeros(a_shape, **kw))
            self.lora_B[short] = nn.Parameter(torch.zeros(b_shape, **kw))
        for factor, split_dim in self.split_dims().items():
            for param in getattr(self, factor).values():
                _mark(param, split_dim, self.is_expert)

    def split_dims(self) -> dict[str, int | None]:
        """Which dim of each factor is split over TP (None: replicated)."""
        if self.parallel == "column":
            return {"lora_A": None, "lora_B": 0}
        return {"lora_A": 1, "lora_B": None}

    def _local_out(self, short: str, out_local: int) -> int:
        if self.kind == "qkv":
            d, n = self.head_dim, self.heads_per_group
            return self.groups * d * (n if short == self.all_modules[0] else 1)
        if self.kind == "gate_up":
            return out_local // 2
        return out_local

    # ---------------------------------------------------------------- values
    def shard_of(self, factor: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full (HF-shaped) ``lora_A`` / ``lora_B``."""
        dim = self.split_dims()[factor]
        if dim is None or self.tp_size == 1:
            return full
        return torch.chunk(full, self.tp_size, dim=dim)[self.tp_rank]

    def full_of(self, factor: str, local: torch.Tensor) -> torch.Tensor:
        """The full factor from every TP peer's slice (collective over the linear's TP group)."""
        dim = self.split_dims()[factor]
        if dim is None or self.tp_size == 1:
            return local.detach()
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    # ---------------------------------------------------------------- forward
    def _place(self, deltas: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        lead = like.shape[:-1]
        if self.kind == "copy":
            return deltas[self.all_modules[0]]
        parts = []
        for short in self.all_modules:
            part = deltas.get(short)
            if part is None:  # a fused module the adapter does not target
                part = like.new_zeros(*lead, self._local_out(short, like.shape[-1]))
            parts.append(part)
        if self.kind == "gate_up":
            return torch.cat(parts, dim=-1)
        # qkv: per query group [q heads, k, v]
        grouped = [p.reshape(*lead, self.groups, -1) for p in parts]
        return torch.cat(grouped, dim=-1).reshape(*lead, -1)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution to the base output ``out`` for base input ``x``."""
        group = self.group
        if self.parallel == "column":
            if self.explicit_comm:
                x_full = x
            elif self.sequence_parallel:
                x_full = mappings.gather_from_sequence_parallel_region(x, group=group)
            else:
                x_full = mappings.copy_to_tensor_model_parallel_region(x, group=group)
            x_full = self.dropout(x_full)
            deltas = {}
            for short in self.modules_on:
                a = mappings.copy_to_tensor_model_parallel_region(self.lora_A[short], group=group)
                deltas[short] = (x_full @ a.t()) @ self.lora_B[short].t()
            return self.scale * self._place(deltas, out)
        x = self._row_dropout(x)
        (short,) = self.modules_on
        h = x @ self.lora_A[short].t()
        b = self.lora_B[short]
        if self.explicit_comm:
            b = mappings.copy_to_tensor_model_parallel_region(b, group=group)
            return self.scale * (h @ b.t())
        h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
        delta = self.scale * (h @ b.t())
        if self.sequence_parallel:
            delta = mappings.scatter_to_sequence_parallel_region(delta, group=group)
        return delta

    def _row_dropout(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.dropout, nn.Identity) or self.tp_size == 1 or not self.training:
            return self.dropout(x)

        with get_cuda_rng_tracker().fork():  # the input is split over TP: distinct masks
            return self.dropout(x)


def _mark(param: nn.Parameter, split_dim: int | None, is_expert: bool) -> None:
    param.lora_adapter = True
    if split_dim is not None:
        set_tensor_model_parallel_attributes(param, True, split_dim, 1)
    if is_expert:
        param.allreduce = False  # expert parameters reduce over the expert-data-parallel group


def _adapter_hook(linear: nn.Module, inputs: tuple, output: Any) -> Any:
    adapter = linear.adapter
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(inputs[0], out).to(out.dtype), bias


is_adapter_param = is_lora_adapter


def inject_lora(
    model: nn.Module, bridge: Any, margs: dict, config: LoRAConfig
) -> list[tuple[LinearTarget, LoRAAdapter]]:
    """Attach adapters to the targeted linears of ``model`` (before DDP) and freeze the base.

    Raises ``ValueError`` naming ``--lora-target-modules`` when nothing matches.
    """
    injected = []
    for target in linear_targets(model, bridge, margs):
        modules = [m for m in target.hf_modules() if is_targeted(m, config.target_modules)]
        if not modules:
            continue
        if target.parallel == "row" and len(target.hf_modules()) != 1:
            raise ValueError(f"{target.name}: fused row-parallel linears are not supported")
        adapter = LoRAAdapter(target, modules, config, margs)
        target.linear.add_module("adapter", adapter)
        target.linear.register_forward_hook(_adapter_hook)
        injected.append((target, adapter))
    if not injected:
        raise ValueError(
            f"--lora-target-modules {config.target_modules}: no linear of the model matches"
        )
    for param in unwrap(model).parameters():
        param.requires_grad_(is_adapter_param(param))
    return injected


def init_fresh(injected: list[tuple[LinearTarget, LoRAAdapter]], seed: int) -> None:
    """PEFT's initialisation: ``A`` kaiming-uniform (same values at any layout), ``B = 0``."""
    with torch.no_grad():
        for _, adapter in injected:
            for short, param in adapter.lora_A.items():
                rank = param.shape[0]
                in_full = param.shape[1] * (adapter.tp_size if adapter.parallel == "row" else 1)
                full = init_factor((rank, in_full), seed, adapter.hf_names[short])
                param.copy_(adapter.shard_of("lora_A", full))
            for param in adapter.lora_B.values():
                param.zero_()


def lora_adapters(model: nn.Module) -> list[LoRAAdapter]:
    return [m for m in unwrap(model).modules() if isinstance(m, LoRAAdapter)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the body with every adapter off (``--ref-mode lora_base``); restored on exit."""
    adapters = lora_adapters(model)
    if not adapters:
        raise RuntimeError("--ref-mode lora_base: the model has no LoRA adapter")
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True
