"""Test support: the Megatron actor's log-prob pass under ``--use-rollout-routing-replay``
(spawned ranks of tests/miles_megatron/test_routing_replay.py)."""

from __future__ import annotations

import torch
from megatron_ranks import build_from_hf


def replayed_log_probs(
    rank: int, world: int, hf_dir: str, layout: list[str], samples: list
) -> dict:
    """Per-sample response log-probs of one packed micro-batch, the routers replaying the
    samples' ``routed_experts``, then one training forward/backward (full recompute of every
    layer) of the sum of those log-probs: the routers' gradients, how often the layers ran,
    and how many routers each forward replayed."""
    import miles_megatron.schedule as schedule
    from miles_core.batch import RolloutBatch
    from miles_megatron.packed_forward import rollout_log_probs

    argv = [*layout, "--use-rollout-routing-replay", *RECOMPUTE]
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
    grads, layer_calls = _train_step(model, batch, margs["vocab_size"])
    return {
        "log_probs": [t.tolist() for t in out],
        "replayed": replayed,
        "cleared": cleared,
        "router_grads": grads,
        "layer_calls": layer_calls,
    }


#: every layer recomputed in the backward (each of the 2 layers runs twice)
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
RECOMPUTE += ["--recompute-num-layers", "1"]


def _train_step(model, batch, vocab_size: int) -> tuple[dict[int, list], int]:
    """One forward/backward through the schedule of ``sum`` of the response log-probs."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from miles_core.packing import pack_thd, unpack_response
    from miles_megatron.context_parallel import row_pad_multiple
    from miles_megatron.output_head import ScoreHead
    from miles_megatron.schedule import run_schedule

    calls = [0]
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    model.train()
    model.zero_grad()
    packed = [pack_thd(batch, pad_multiple=row_pad_multiple())]

    def on_scores(index, shard, log_probs, *_):
        return torch.cat(unpack_response(shard.full, log_probs)).sum()

    run_schedule(model, packed, ScoreHead(vocab_size, 1.0, True), on_scores, forward_only=False)
    grads = {
        int(name.split(".")[2]): p.grad.detach().double().tolist()
        for name, p in model.named_parameters()
        if name.endswith("mlp.router.weight")
    }
    return grads, calls[0]
