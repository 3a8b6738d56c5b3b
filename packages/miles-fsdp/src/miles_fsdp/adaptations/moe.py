"""MoE per architecture: the expert kernel (``--moe-kernel``) and routing replay (R3).

Two small registries, filled by the spec files of the MoE architectures:

* :func:`register_fused_experts` marks a ``model_type`` whose experts module is transformers'
  batched 3-D experts, which miles-native's fused Triton kernels can run
  (:mod:`miles_native.kernels.hf_experts`); :func:`apply_moe_kernel` switches the model to them
  or to transformers' eager loop before sharding. Weight names and shapes do not change, so
  publication (per-expert names, :mod:`.fused_experts`) is the same with either kernel.
* :func:`register_routing_adapter` registers ``adapter(model, config, replay) -> int``, which
  patches the model's routers to take their top-k expert ids from a :class:`RoutingReplay`
  (the rollout engine's) and returns how many routers it patched. Adapters are built on
  :func:`patch_routers` with the architecture's router formula evaluated at given ids
  (:mod:`.softmax_topk_replay`, :mod:`.sigmoid_group_topk_replay`).
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Any

import torch
from miles_core.args import ArgumentError
from torch import nn

MOE_KERNELS = ("fused", "eager")

#: Module names of routers: ``...layers.<l>.mlp.gate`` (``<l>`` indexes ``routed_experts``).
ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")

#: ``replayed(router, hidden_states, ids) -> (router_logits, weights, ids)``: the router's own
#: forward with its top-k choice replaced by ``ids`` ``[T, k]``.
ReplayedRouter = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple]

_FUSED_EXPERTS: set[str] = set()
_ROUTING_ADAPTERS: dict[str, Callable[[nn.Module, Any, RoutingReplay], int]] = {}


def register_fused_experts(model_types: str | tuple[str, ...]) -> None:
    """Declare that ``model_types`` keep transformers' batched experts (fused kernels apply)."""
    types = (model_types,) if isinstance(model_types, str) else model_types
    _FUSED_EXPERTS.update(types)


def register_routing_adapter(model_types: str | tuple[str, ...]) -> Callable:
    """Register the routing-replay adapter of ``model_types`` (decorator)."""
    types = (model_types,) if isinstance(model_types, str) else model_types

    def decorator(fn: Callable) -> Callable:
        for model_type in types:
            _ROUTING_ADAPTERS[model_type] = fn
        return fn

    return decorator


def resolve_moe_kernel(requested: str | None, model_type: str, device_type: str) -> str | None:
    """The expert kernel of this run: ``"fused"``, ``"eager"`` or ``None`` (not a MoE we adapt).

    Unset ``--moe-kernel``: fused on CUDA, eager on the CPU (the kernels run there only under
    Triton's interpreter). ``fused`` asked for a model without batched experts is an error.
    """
    from miles_fsdp.adaptations import specs  # noqa: F401  (cycle: the specs register here)

    if requested is not None and requested not in MOE_KERNELS:
        raise ArgumentError(f"--moe-kernel must be one of {MOE_KERNELS}, got {requested!r}")
    if model_type not in _FUSED_EXPERTS:
        if requested == "fused":
            raise ArgumentError(
                f"--moe-kernel fused: model_type {model_type!r} has no batched experts the "
                f"fused kernels support (supported: {sorted(_FUSED_EXPERTS)})"
            )
        return None
    if requested is not None:
        return requested
    return "fused" if device_type == "cuda" else "eager"


def apply_moe_kernel(model: nn.Module, kernel: str | None, device_type: str) -> None:
    """Run the experts of ``model`` on ``kernel`` (before sharding; ``None``: leave as built)."""
    if kernel == "fused":
        # optional: triton (Linux only); the kernels read TRITON_INTERPRET when first imported
        from miles_native.kernels.fused_moe import INTERPRETED
        from miles_native.kernels.hf_experts import use_fused_experts

        if device_type != "cuda" and not INTERPRETED:
            raise ArgumentError(
                "--moe-kernel fused on the CPU runs the Triton kernels under the interpreter "
                "only: set TRITON_INTERPRET=1 before starting, or use --moe-kernel eager"
            )
        use_fused_experts(model)
    elif kernel == "eager":
        model.set_experts_implementation("eager")


class RoutingReplay:
    """The rollout engine's routed experts for the packed row being forwarded.

    ``set(routed)`` with int ``[T, num_hidden_layers, top_k]`` (``PackedBatch.routed_experts``)
    before a forward; a patched router of decoder layer ``l`` then routes the ``T`` tokens to
    ``routed[:, l]``. The ids stay set until the next ``set`` so that activation recomputation
    in backward (gradient checkpointing) replays the same ids. Rows of layers without a router
    (dense layers; the engine sends -1 there) are never read.
    """

    def __init__(self) -> None:
        self.routed: torch.Tensor | None = None
        #: ``layer -> (num_experts, top_k)`` of every patched router (filled by patch_routers)
        self.routers: dict[int, tuple[int, int]] = {}

    def set(self, routed: torch.Tensor | None) -> None:
        """Replay ``routed`` from the next forward on (``None``: the routers' own top-k)."""
        if routed is not None:
            self.check(routed)
        self.routed = routed

    def check(self, routed: torch.Tensor) -> None:
        """One clear error for ids the patched routers cannot take (one host sync per batch)."""
        flag = "--use-rollout-routing-replay"
        layers = sorted(self.routers)
        if routed.dim() != 3 or (layers and routed.shape[1] <= layers[-1]):
            raise ValueError(
                f"{flag}: routed experts must be [tokens, num_hidden_layers, top_k], got shape "
                f"{tuple(routed.shape)} for routers in layers {layers}"
            )
        for layer in layers:
            num_experts, top_k = self.routers[layer]
            if routed.shape[2] != top_k:
                raise ValueError(
                    f"{flag}: routed experts carry {routed.shape[2]} ids per token, the router "
                    f"of layer {layer} takes top_k={top_k} (num_experts_per_tok)"
                )
        if not layers or routed.shape[0] == 0:
            return
        low, high = torch.stack(torch.aminmax(routed[:, layers])).tolist()
        num_experts = min(e for e, _ in self.routers.values())
        if low < 0 or high >= num_experts:
            raise ValueError(
                f"{flag}: routed expert ids span [{low}, {high}] in MoE layers, "
                f"outside [0, {num_experts}); was the rollout engine serving this model?"
            )

    def layer_ids(self, layer: int, num_tokens: int) -> torch.Tensor | None:
        """Layer ``layer``'s replayed ids ``[num_tokens, top_k]`` (int64), or ``None`` if unset."""
        if self.routed is None:
            return None
        if self.routed.shape[0] != num_tokens or layer >= self.routed.shape[1]:
            raise ValueError(
                f"--use-rollout-routing-replay: routed experts of shape {tuple(self.routed.shape)}"
                f" do not cover layer {layer} over {num_tokens} tokens"
            )
        return self.routed[:, layer].long()


def patch_routers(
    model: nn.Module, replay: RoutingReplay, classes: set[str], replayed: ReplayedRouter
) -> int:
    """Make every router of a class in ``classes`` (at ``...layers.<l>.mlp.gate``) replay.

    The patched forward routes through ``replayed(router, hidden, ids)`` with layer ``l``'s ids
    from ``replay``; while ``replay`` holds no ids it runs the router's original forward.
    Returns the number of routers patched.
    """
    patched = 0
    for name, module in model.named_modules():
        match = ROUTER_NAME.search(name)
        if match is None or type(module).__name__ not in classes:
            continue
        layer, original = int(match.group(1)), module.forward
        replay.routers[layer] = (int(module.num_experts), int(module.top_k))

        def forward(self, hidden_states, _layer=layer, _original=original):
            num_tokens = hidden_states.numel() // hidden_states.shape[-1]
            ids = replay.layer_ids(_layer, num_tokens)
            if ids is None:
                return _original(hidden_states)
            return replayed(self, hidden_states, ids.to(hidden_states.device))

        module.forward = types.MethodType(forward, module)
        patched += 1
    return patched


def install_routing_replay(
    model: nn.Module, config: Any, replay: RoutingReplay | None = None
) -> RoutingReplay:
    """Patch ``model``'s routers through its architecture's adapter to read ``replay`` (a new
    one unless given: every role of a run shares the actor's) and return it."""
    from miles_fsdp.adaptations import specs  # noqa: F401  (cycle: the specs register here)

    adapter = _ROUTING_ADAPTERS.get(config.model_type)
    if adapter is None:
        raise ArgumentError(
            f"--use-rollout-routing-replay: no routing adapter for model_type "
            f"{config.model_type!r} (supported: {sorted(_ROUTING_ADAPTERS)})"
        )
    replay = RoutingReplay() if replay is None else replay
    if adapter(model, config, replay) == 0:
        raise ValueError(f"routing adapter of {config.model_type!r} found no router to patch")
    return replay
