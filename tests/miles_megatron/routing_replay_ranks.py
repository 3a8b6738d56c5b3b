"""Test support: the Megatron actor's log-prob pass under ``--use-rollout-routing-replay``
(spawned ranks of tests/miles_megatron/test_routing_replay.py)."""

from __future__ import annotations

import torch
from megatron_ranks import build_from_hf, layout_argv


def replayed_log_probs(rank: int, world: int, hf_dir: str, ep: int, samples: list) -> dict:
    """Per-sample response log-probs of one packed micro-batch, the routers replaying the
    samples' ``routed_experts``; with how many routers each forward replayed."""
    import miles_megatron.schedule as schedule
    from miles_core.batch import RolloutBatch
    from miles_megatron.packed_forward import rollout_log_probs

    argv = [*layout_argv(ep=ep), "--use-rollout-routing-replay"]
    _, margs, model, _ = build_from_hf(hf_dir, argv)
    replayed: list[int] = []
    original = schedule.set_routed_experts

    def counting(module, routed):
        replayed.append(original(module, routed))
        return replayed[-1]

    schedule.set_routed_experts = counting
    batch = RolloutBatch(samples)
    out = rollout_log_probs(
        model,
        [batch],
        len(batch),
        {i: i for i in range(len(batch))},
        margs["vocab_size"],
        1.0,
        torch.device("cpu"),
    )
    from miles_megatron.routing_replay import replay_routers

    cleared = all(r.router_replay.router_replay_action is None for r in replay_routers(model))
    return {"log_probs": [t.tolist() for t in out], "replayed": replayed, "cleared": cleared}
