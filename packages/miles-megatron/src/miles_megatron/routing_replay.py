"""``--use-rollout-routing-replay`` (R3) on megatron-core's own routing replay.

The model config sets ``moe_enable_routing_replay``: every ``TopKRouter`` then holds a
``megatron.core.transformer.moe.router_replay.RouterReplay``. Before a micro-batch's forward
:func:`set_routed_experts` hands the router of decoder layer ``l`` (``layer_number`` ``l + 1``)
the column ``routed[:, l]`` of the packed row's ``routed_experts`` (int ``[T, layers, top_k]``,
the engine's ids in the packed order the model sees) and sets ``REPLAY_FORWARD``: megatron
takes those ids and gathers their weights from the router's own scores. The ids stay set
through the micro-batch's backward, so activation recomputation replays them too (the
micro-batch's forward and backward run back to back: pipeline size 1, which the argument check
requires, with context parallelism and sequence parallelism, which split the row's tokens).
:func:`clear_routed_experts` clears them after the schedule.

The routers are found in the model handed in, not through megatron's class-wide instance list,
which also holds every other role's routers (the reference model).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

FLAG = "--use-rollout-routing-replay"


def replay_routers(model: torch.nn.Module) -> list[Any]:
    """The routers of ``model`` that replay (``router_replay`` set), in layer order."""
    return [m for m in model.modules() if getattr(m, "router_replay", None) is not None]


def set_routed_experts(model: torch.nn.Module, routed: torch.Tensor | None) -> int:
    """Give each replaying router of ``model`` its layer's ids of ``routed`` and replay them;
    returns the number of routers set (0: the model does not replay)."""
    routers = replay_routers(model)
    if not routers:
        return 0
    if routed is None:
        raise ValueError(
            f"{FLAG}: samples carry no routed_experts (ask the engine for them: "
            "return_routed_experts, --enable-return-routed-experts)"
        )
    for router in routers:
        layer = router.layer_number - 1
        top_k = router.topk
        if routed.dim() != 3 or layer >= routed.shape[1] or routed.shape[2] != top_k:
            raise ValueError(
                f"{FLAG}: routed experts of shape {tuple(routed.shape)} do not give layer "
                f"{layer} its top_k={top_k} ids per token"
            )
        ids = routed[:, layer].long()
        if ids.numel() and (ids.min() < 0 or ids.max() >= router.num_experts):
            raise ValueError(
                f"{FLAG}: routed expert ids of layer {layer} fall outside "
                f"[0, {router.num_experts}); was the rollout engine serving this model?"
            )
        replay = router.router_replay
        replay.clear_indices()
        replay.set_target_indices(ids)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return len(routers)


def clear_routed_experts(model: torch.nn.Module) -> None:
    """Back to the routers' own top-k."""
    for router in replay_routers(model):
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
