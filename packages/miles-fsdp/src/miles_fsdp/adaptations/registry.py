"""Per-architecture adaptations: six hooks, keyed by the HF ``config.model_type``.

Most models need none of them. A spec file under ``adaptations/specs/`` registers only what its
architecture needs; an architecture without a spec loads and trains as transformers builds it.

Hook (decorator factory)          Called                          Signature of the function
``register_param_transform``      weight publication / export     ``(name, tensor, config) -> list[(name, tensor)] | None``
``register_model_patch``          before the model is built       ``(config) -> None``
``register_model_instance_patch`` after construction, pre-shard   ``(model, config) -> None``
``register_packing_patch``        after construction, pre-shard   ``(model, config) -> None``
``register_post_load_fixup``      after weights are loaded        ``(model, config) -> None``
``register_precision_policy``     when FSDP is applied            ``(config, precision) -> PrecisionConfig``

A param transform returning ``None`` leaves the tensor alone; otherwise its list replaces it
(empty list drops it, several entries split it, e.g. fused experts into per-expert tensors).
Transforms of one architecture are applied in registration order, each to the previous output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

ParamTransform = Callable[[str, torch.Tensor, Any], list[tuple[str, torch.Tensor]] | None]


@dataclass
class Adaptation:
    """Everything registered for one ``model_type``."""

    param_transforms: list[ParamTransform] = field(default_factory=list)
    model_patches: list[Callable[[Any], None]] = field(default_factory=list)
    model_instance_patches: list[Callable[[torch.nn.Module, Any], None]] = field(
        default_factory=list
    )
    packing_patches: list[Callable[[torch.nn.Module, Any], None]] = field(default_factory=list)
    post_load_fixups: list[Callable[[torch.nn.Module, Any], None]] = field(default_factory=list)
    precision_policies: list[Callable[[Any, Any], Any]] = field(default_factory=list)


_REGISTRY: dict[str, Adaptation] = {}


def adaptation_for(model_type: str) -> Adaptation:
    """The hooks registered for ``model_type`` (an empty :class:`Adaptation` when none)."""
    from miles_fsdp.adaptations import specs  # noqa: F401  (cycle: the specs register here)

    return _REGISTRY.get(model_type, Adaptation())


def registered_model_types() -> list[str]:
    """Model types with at least one registered hook."""
    from miles_fsdp.adaptations import specs  # noqa: F401  (cycle: the specs register here)

    return sorted(_REGISTRY)


def _register(kind: str, model_types: str | tuple[str, ...]) -> Callable:
    types = (model_types,) if isinstance(model_types, str) else model_types

    def decorator(fn: Callable) -> Callable:
        for model_type in types:
            getattr(_REGISTRY.setdefault(model_type, Adaptation()), kind).append(fn)
        return fn

    return decorator


def register_param_transform(model_types: str | tuple[str, ...]) -> Callable:
    """Register a train -> checkpoint/rollout rename or reshape applied at publication."""
    return _register("param_transforms", model_types)


def register_model_patch(model_types: str | tuple[str, ...]) -> Callable:
    """Register a config-time patch of a transformers class, run before construction."""
    return _register("model_patches", model_types)


def register_model_instance_patch(model_types: str | tuple[str, ...]) -> Callable:
    """Register a patch of one model instance, run after construction and before sharding."""
    return _register("model_instance_patches", model_types)


def register_packing_patch(model_types: str | tuple[str, ...]) -> Callable:
    """Register a patch that makes stateful layers reset per document under THD packing."""
    return _register("packing_patches", model_types)


def register_post_load_fixup(model_types: str | tuple[str, ...]) -> Callable:
    """Register a repair of weights that ``from_pretrained`` clobbered (runs on loaded weights)."""
    return _register("post_load_fixups", model_types)


def register_precision_policy(model_types: str | tuple[str, ...]) -> Callable:
    """Register a function mapping the run's :class:`PrecisionConfig` to the model's own."""
    return _register("precision_policies", model_types)


def apply_param_transforms(
    adaptation: Adaptation, name: str, tensor: torch.Tensor, config: Any
) -> list[tuple[str, torch.Tensor]]:
    """Run ``adaptation``'s param transforms over one (name, tensor) pair."""
    items = [(name, tensor)]
    for transform in adaptation.param_transforms:
        out: list[tuple[str, torch.Tensor]] = []
        for item_name, item in items:
            result = transform(item_name, item, config)
            out.extend([(item_name, item)] if result is None else result)
        items = out
    return items
