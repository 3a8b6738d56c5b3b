"""Test support: the spawned body of test_estimator_parity.py (one rollout per advantage
estimator and loss on one backend, in one process)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: (name, extra flags): every actor estimator without a critic, both policy objectives, and
#: the SFT loss (whose entropy bonus must be 0). REINFORCE++ and its baseline normalise the
#: advantages over the batch as the paper does; CISPO normalises by the step's token count as
#: its paper does.
CONFIGS = (
    ("grpo", ("--advantage-estimator", "grpo")),
    ("gspo", ("--advantage-estimator", "gspo")),
    ("dr_grpo", ("--advantage-estimator", "dr_grpo")),
    ("rloo", ("--advantage-estimator", "rloo")),
    (
        "reinforce_plus_plus",
        ("--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages"),
    ),
    (
        "reinforce_plus_plus_baseline",
        ("--advantage-estimator", "reinforce_plus_plus_baseline", "--normalize-advantages"),
    ),
    ("cispo", ("--policy-loss", "cispo", "--calculate-per-token-loss")),
    ("sft_loss", ("--loss-type", "sft_loss", "--entropy-coef", "0")),
)

#: the rollout metrics compared: step means of the loss and its parts, the last step's
#: gradient norm and LR, the mean train/rollout mismatch of the old policy
KEYS = (
    "loss",
    "pg_loss",
    "sft_loss",
    "grad_norm",
    "lr",
    "entropy",
    "ppo_kl",
    "train_rollout_logprob_abs_diff",
    "kl_loss",
    "tis",
)


@contextlib.contextmanager
def recorded_steps(backend_name: str, after_step=None) -> Iterator[list[dict]]:
    """Each optimizer step's metrics, as the backend's rollout loop receives them from its
    ``optimizer_step`` (``train()`` reports only the rollout's: step means, the last step's
    gradient norm and LR): a list filled with one dict per step; ``after_step()``, if given,
    is called after each step."""
    if backend_name == "megatron":
        import miles_megatron.train_step as module

        def read(result):
            return dict(result)
    else:
        import miles_fsdp.train_step as module

        def read(result):
            return {**result.parts, "grad_norm": result.grad_norm, "lr": result.lr}

    steps: list[dict] = []
    original = module.optimizer_step

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        steps.append({k: float(v) for k, v in read(result).items() if k in KEYS})
        if after_step is not None:
            after_step()
        return result

    module.optimizer_step = spy
    try:
        yield steps
    finally:
        module.optimizer_step = original


def estimator_rollouts(
    rank: int, world: int, backend_name: str, hf_dir: str, configs=CONFIGS
) -> dict:
    """For each ``(name, flags)`` of ``configs`` (:data:`CONFIGS`), a fresh ``backend_name``
    trains one rollout (2 optimizer steps, the LR decaying as
    ``estimator_reference.SCHEDULE_FLAGS`` say) on the masked samples carrying engine
    log-probs. Per configuration: the rollout's :data:`KEYS` metrics, as ``steps`` each step's
    (:func:`recorded_steps`), as ``scores`` each step's per-token log-probs and entropies as
    the step handed them to its loss (score_capture.captured_scores; ``scores_tokens``: this
    rank must have compared some; with each sample's old-policy and reference-model log-probs
    its loss read, score_capture.INPUTS), as ``starts`` the weights each optimizer step started
    from and as ``weights`` those after the rollout (the HF checkpoint's names; the float64
    reference takes each step from them: forced_adam.py), and as ``log_probs`` each sample's
    response log-probs after the rollout (plain lists)."""
    from backend_reference import samples
    from estimator_reference import SCHEDULE_FLAGS
    from megatron_ranks import both_backends_backend
    from miles_core.batch import RolloutBatch
    from score_capture import captured_scores, last_stage

    out = {}
    for name, flags in configs:
        backend = both_backends_backend(world, backend_name, hf_dir, *flags, *SCHEDULE_FLAGS)
        data = samples(masked=True, engine_log_probs=True)
        batch = RolloutBatch(data)
        scores: list[dict] = []  # per step: what the recorder took since the last step
        starts = [weights_of(backend, backend_name)]  # then the weights after each step

        def after_step(recorder, backend=backend, scores=scores, starts=starts):
            scores.append(recorder.take())
            starts.append(weights_of(backend, backend_name))

        with captured_scores(data, backend_name) as recorder:
            with recorded_steps(backend_name, lambda r=recorder: after_step(r)) as steps:
                metrics = backend.train(0, batch)
        # every rank trains the whole batch (DP 1): the last stage's rank(s) score it
        scores_tokens = backend_name == "fsdp" or last_stage()
        if backend_name == "megatron":
            after = actor_log_probs(backend, batch)
        else:
            after = backend.eval_log_probs(batch)
        weights = weights_of(backend, backend_name)
        backend.close()
        out[name] = {k: metrics[k] for k in KEYS if k in metrics}
        out[name]["steps"] = steps
        out[name]["scores"] = scores
        out[name]["scores_tokens"] = scores_tokens
        out[name]["log_probs"] = [t.tolist() for t in after]
        out[name]["weights"] = weights
        out[name]["starts"] = starts[:-1]  # the last: the weights after the rollout
    return out


def weights_of(backend, backend_name: str) -> dict:
    """The backend's current weights under the HF checkpoint's names (a collective over its
    model-parallel ranks), as numpy copies (no shared-memory handles to the parent)."""
    source = backend.hf_weights() if backend_name == "megatron" else backend.weight_source()
    return {k: v.detach().cpu().numpy().copy() for k, v in source}


def actor_log_probs(backend, batch) -> list:
    """The Megatron actor's response log-probs of ``batch``: its old-log-prob pass
    (``rollout_log_probs``, what ``train_rollout`` runs), on the actor's weights even where a
    ``--ref-load`` model is kept (``reference_log_probs`` scores that one)."""
    from miles_megatron.packed_forward import rollout_log_probs
    from miles_megatron.train_step import split_micro_batches

    ctx = backend._context()
    index = {src: i for i, src in enumerate(batch.source_indices)}
    micro_batches = split_micro_batches(ctx, batch)
    args = backend.args
    return rollout_log_probs(
        backend.model,
        micro_batches,
        len(batch),
        index,
        ctx.vocab_size,
        args.rollout_temperature,
        backend.device,
        fused=args.fused_log_probs,
    )
