"""The rank program of the backend conformance suite (tests/contract/test_conformance.py).

It drives one registered backend through :class:`miles_core.contract.TrainBackend`'s methods
only, as the launcher's trainer group does, and observes what the contract promises from the
outside: the engine's weights (the built-in engine's ``/weights_digest`` and
``/get_weights_by_name`` over HTTP), the metrics ``train`` returns and the checkpoint directory.
Nothing here reads a backend's internals, so a third backend passes it or fails it on the
same terms.
"""

from __future__ import annotations

from typing import Any

#: One RL configuration every backend takes: fp32 on the CPU, two optimizer steps a rollout
#: (the second one's PPO ratio is not 1), an LR schedule that moves every step (a resumed run
#: must restore it), an entropy bonus.
FLAGS = [
    "--lr", "1e-3", "--weight-decay", "0", "--micro-batch-size", "2", "--no-bf16",
    "--advantage-estimator", "grpo", "--num-steps-per-rollout", "2", "--entropy-coef", "0.01",
    "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--lr-decay-iters", "8",
    "--min-lr", "1e-4", "--seed", "3",
]  # fmt: skip
#: What a backend needs besides, on the CPU (a backend not named here gets nothing extra).
BACKEND_FLAGS = {"fsdp": ["--attn-implementation", "sdpa"], "megatron": []}
#: EMA (``--use-ema``): one optimizer step a rollout, decay 0.25 after it
#: (``decay(1) = min(1 * ramp, max)``), so ``ema = 0.25 * w0 + 0.75 * w1`` after rollout 0.
EMA_FLAGS = [
    "--use-ema", "--rollout-weights", "ema", "--ema-decay-ramp", "0.25",
    "--ema-decay-max", "0.9", "--num-steps-per-rollout", "1",
]  # fmt: skip
EMA_DECAY = 0.25
#: Every backend's train metrics carry these (docs/contract.md says what each means).
REQUIRED_METRICS = ("loss", "grad_norm", "lr", "train_rollout_logprob_abs_diff")


def parse(name: str, argv: list[str]):
    """``argv`` through the core groups and the backend's own; a refusal is ``SystemExit`` with
    the parser's one line on stderr."""
    from miles_core.args import core_groups, parse_args
    from miles_core.backends import load

    cls = load(name)
    return parse_args([*argv, *BACKEND_FLAGS.get(name, [])], [*core_groups(), *cls.arg_groups()])


def build(name: str, hf_dir: str, *extra: str, role: str = "actor"):
    """A backend ``name`` initialised for ``role``: ``(backend, next_rollout_id)``."""
    from miles_core.backends import load

    backend = load(name)()
    next_id = backend.init(parse(name, ["--hf-checkpoint", hf_dir, *FLAGS, *extra]), role)
    return backend, next_id


class EngineView:
    """What the engine serves, read over its HTTP API."""

    def __init__(self, url: str) -> None:
        import httpx

        self.url = url
        self.http = httpx.Client(base_url=url, timeout=120.0)

    def digests(self) -> dict[str, list]:
        return self.http.get("/weights_digest").json()

    def version(self) -> str:
        return self.http.get("/get_model_info").json()["weight_version"]

    def values(self, names: list[str]) -> dict[str, list]:
        out = {}
        for name in names:
            body = {"name": name, "truncate_size": 1 << 20}
            reply = self.http.post("/get_weights_by_name", json=body)
            reply.raise_for_status()
            out[name] = reply.json()
        return out


def _refusal(call) -> str | None:
    """The ``ValueError`` message ``call()`` raised, or None when it returned."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def _without_speed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k != "tokens_per_s"}  # each run's own speed


def conformance(
    rank: int, world: int, name: str, hf_dir: str, save_dir: str, engine_url: str
) -> dict[str, Any]:
    """Every case of the suite on backend ``name``, in one process (one import of the backend):
    fresh init, layout, refusals, train, publish (current, named, EMA), save, sleep/wake twice,
    a second rollout, then a fresh backend resumed from the save trains that rollout again; the
    critic role. Returns what the test asserts on."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch
    from miles_core.contract import TrainBackend

    engine = EngineView(engine_url)
    batch = RolloutBatch(samples(masked=True, engine_log_probs=True))
    out: dict[str, Any] = {"served_initial": engine.digests(), "version_initial": engine.version()}

    actor, out["fresh_next_rollout"] = build(
        name, hf_dir, "--save", save_dir, "--save-interval", "1"
    )
    out["is_train_backend"] = isinstance(actor, TrainBackend)
    out["layout"] = actor.data_layout()
    out["ema_refused"] = _refusal(lambda: actor.update_weights([engine_url], weights="ema"))
    out["values_refused"] = _refusal(lambda: actor.compute_values(batch))
    out["version_after_refusals"] = engine.version()

    out["metrics"] = [_without_speed(actor.train(0, batch))]
    actor.update_weights([engine_url])  # weights=None: --rollout-weights (actor)
    out["served_trained"], out["version_trained"] = engine.digests(), engine.version()
    actor.update_weights([engine_url], weights="actor")
    out["served_named"], out["version_named"] = engine.digests(), engine.version()
    actor.save_model(0, force_sync=True)

    for call in (actor.sleep, actor.sleep, actor.wake_up, actor.wake_up):
        call()
    actor.update_weights([engine_url])
    out["served_after_wake"] = engine.digests()
    out["metrics"].append(_without_speed(actor.train(1, batch)))
    actor.update_weights([engine_url])
    out["served_rollout1"] = engine.digests()
    actor.close()

    resumed, out["resumed_next_rollout"] = build(name, hf_dir, "--load", save_dir)
    out["resumed_metrics"] = _without_speed(resumed.train(1, batch))
    resumed.update_weights([engine_url])
    out["served_resumed_rollout1"] = engine.digests()
    resumed.close()

    critic, out["critic_next_rollout"] = build(
        name, hf_dir, "--use-critic", "--advantage-estimator", "ppo", role="critic"
    )
    values = critic.compute_values(batch)
    out["values"] = [(str(v.dtype), v.device.type, tuple(v.shape)) for v in values]
    out["response_lengths"] = [s.response_length for s in batch.samples]
    out["critic_publish_refused"] = _refusal(lambda: critic.update_weights([engine_url]))
    out["critic_metrics"] = _without_speed(critic.train(0, batch.with_fields(values=values)))
    critic.close()
    return out


def ema_publish(
    rank: int, world: int, name: str, hf_dir: str, engine_url: str, names: list[str]
) -> dict[str, Any]:
    """``--use-ema`` (a backend that keeps one): after rollout 0, the actor's and the EMA's
    weights as the engine receives them (``names``' values)."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch

    engine = EngineView(engine_url)
    actor, _ = build(name, hf_dir, *EMA_FLAGS)
    actor.train(0, RolloutBatch(samples(masked=True, engine_log_probs=True)))
    actor.update_weights([engine_url], weights="actor")
    trained = engine.values(names)
    actor.update_weights([engine_url])  # --rollout-weights ema
    ema = engine.values(names)
    actor.close()
    return {"trained": trained, "ema": ema}
