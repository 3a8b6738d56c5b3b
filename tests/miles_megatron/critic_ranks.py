"""Test support: per-rank bodies of tests/miles_megatron/test_megatron_critic.py (the Megatron
critic: values, value-loss gradients, save and resume)."""

from __future__ import annotations

from typing import Any

import torch

SEED, GAMMA, LAMBD, VALUE_CLIP = 3, 0.9, 0.8, 0.2
#: Parameters whose value-loss gradients the tests compare with the float64 HF reference
#: (megatron name -> HF name): the value head and the final norm (the whole model enters the
#: grad norm).
GRAD_NAMES = {
    "output_layer.weight": "lm_head.weight",
    "output_layer.bias": "lm_head.bias",
    "decoder.final_layernorm.weight": "model.norm.weight",
}


def critic_argv(hf_dir: str, tp: int, *extra: str) -> list[str]:
    from megatron_ranks import layout_argv

    argv = ["--hf-checkpoint", hf_dir, "--advantage-estimator", "ppo", "--use-critic"]
    argv += ["--gamma", str(GAMMA), "--lambd", str(LAMBD), "--value-clip", str(VALUE_CLIP)]
    argv += ["--seed", str(SEED), "--micro-batch-size", "2", "--lr", "1e-3"]
    argv += ["--critic-lr", "1e-2", "--weight-decay", "0", "--clip-grad", "1e6"]
    return argv + layout_argv(tp=tp) + list(extra)


def _critic(argv: list[str]):
    from megatron_ranks import parse
    from miles_megatron.backend import MegatronBackend

    backend = MegatronBackend()
    next_id = backend.init(parse(argv), "critic")
    return backend, next_id


def _scored_batch(backend, samples: list):
    from miles_core.batch import RolloutBatch

    batch = RolloutBatch(samples)
    return batch.with_fields(values=backend.compute_values(batch))


def _params(backend) -> dict[str, torch.Tensor]:
    from miles_megatron.sharding import unwrap

    return {
        n: p.detach().float().cpu().clone() for n, p in unwrap(backend.model).named_parameters()
    }


def values_and_grads(rank: int, world: int, hf_dir: str, tp: int, out_dir: str) -> None:
    """At ``tp``: the critic's values of the samples, one value-loss step's metrics and the
    gradients of :data:`GRAD_NAMES` (read from DDP's buffers after the step), saved to
    ``out_dir/tp{tp}_rank{rank}.pt``; also what a publish does and which of the actor's
    ``--custom-megatron-*`` hooks ran (none should)."""
    from backend_reference import samples
    from megatron_ranks import HOOK_CALLS, HOOK_FLAGS
    from miles_megatron.sharding import unwrap

    backend, next_id = _critic(critic_argv(hf_dir, tp, *HOOK_FLAGS))  # the actor's hooks
    batch = _scored_batch(backend, samples())
    metrics = backend.train(0, batch)
    params = dict(unwrap(backend.model).named_parameters())
    grads = {n: params[n].main_grad.detach().float().cpu().clone() for n in GRAD_NAMES}
    refusals = []
    for call in (lambda: backend.update_weights([]), lambda: backend.publish_weights()):
        try:
            call()
        except ValueError as error:
            refusals.append(str(error))
    out: dict[str, Any] = {
        "next_id": next_id,
        "values": [v.clone() for v in batch.response_field("values")],
        "metrics": metrics,
        "grads": grads,
        "head_type": type(unwrap(backend.model).output_layer).__name__,
        "refusals": refusals,
        "hook_calls": list(HOOK_CALLS),
    }
    backend.close()
    torch.save(out, f"{out_dir}/tp{tp}_rank{rank}.pt")


def layout_values(rank: int, world: int, hf_dir: str, flags: list[str]) -> dict:
    """At the layout ``flags`` give (TP 1): this rank's critic values of the samples (numpy, as
    every rank of the DP rank receives them), one value-loss step's metrics, and whether this
    stage holds the value head."""
    from backend_reference import samples
    from miles_megatron.sharding import unwrap

    backend, _ = _critic(critic_argv(hf_dir, 1, *flags))
    batch = _scored_batch(backend, samples())
    metrics = backend.train(0, batch)
    head = getattr(unwrap(backend.model), "output_layer", None)
    out = {
        "values": [v.numpy().copy() for v in batch.response_field("values")],
        "metrics": metrics,
        "head": type(head).__name__ if head is not None else None,
    }
    backend.close()
    return out


def straight_then_resumed(rank: int, world: int, hf_dir: str, root: str) -> dict:
    """Rollouts 0 and 1 straight (saving the critic after rollout 0 into ``<root>/a/critic``),
    then a critic resumed from that save trains rollout 1: the metrics and every parameter and
    the optimizer's step count, both ways."""
    from backend_reference import samples

    def rollout(backend, rollout_id):
        return backend.train(rollout_id, _scored_batch(backend, samples()))

    straight, _ = _critic(critic_argv(hf_dir, world, "--save", f"{root}/a"))
    first = rollout(straight, 0)
    straight.save_model(0)
    before = _params(straight)
    second = rollout(straight, 1)
    expected = _params(straight)
    straight.close()
    resumed, next_id = _critic(
        critic_argv(hf_dir, world, "--load", f"{root}/a", "--save", f"{root}/b")
    )
    loaded = _params(resumed)
    again = rollout(resumed, 1)
    got = _params(resumed)
    resumed.close()
    return {
        "next_id": next_id,
        "loaded_exact": all(torch.equal(loaded[n], before[n]) for n in before),
        "resumed_exact": sorted(got) == sorted(expected)
        and all(torch.equal(got[n], expected[n]) for n in expected),
        "moved": any(not torch.equal(before[n], expected[n]) for n in expected),
        "metrics": (first, second, again),
    }


def actor_beside_critic(rank: int, world: int, hf_dir: str, root: str) -> dict:
    """What a trainer rank of ``miles train --use-critic`` does, in one process: the critic's
    init, then the actor's (one megatron parallel state), the critic scores and trains, the
    actor trains on the GAE advantages of those values; both save (the critic asleep, as under
    --colocate), sleep (the disk target: one file each) and wake, and close."""
    from backend_reference import samples
    from megatron_ranks import parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    argv = critic_argv(hf_dir, world, "--save", f"{root}/ckpt")
    argv += ["--offload-train", "--offload-train-target", "disk"]
    argv += ["--offload-train-disk-dir", f"{root}/offload"]
    args = parse(argv)
    critic = MegatronBackend()
    critic.init(args, "critic")
    actor = MegatronBackend()
    actor.init(args, "actor")
    batch = RolloutBatch(samples()).with_fields(
        values=critic.compute_values(RolloutBatch(samples()))
    )
    critic_metrics = critic.train(0, batch)
    actor_metrics = actor.train(0, batch)
    actor.save_model(0)
    critic.sleep()
    critic.save_model(0)  # asleep, as under --colocate: wakes for the save, sleeps again
    asleep_after_save = critic.sleeper.asleep
    actor.sleep()
    files = sorted(p for p in (critic.sleeper.disk_path, actor.sleeper.disk_path) if p)
    critic.wake_up()
    actor.wake_up()
    again = critic.compute_values(RolloutBatch(samples()))
    critic.close()
    actor.close()
    return {
        "values": [v.tolist() for v in batch.response_field("values")],
        "values_after": [v.tolist() for v in again],
        "critic": critic_metrics,
        "actor": actor_metrics,
        "sleep_files": files,
        "asleep_after_save": asleep_after_save,
    }
