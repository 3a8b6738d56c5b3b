"""Programs and hooks run on each gloo rank by test_hooks.py (importable by spawned children).

:func:`distill_loss` is a ``--custom-loss-function-path`` hook written for the test: the squared
difference of the actor's and the teacher's response-token log-probs, so the loss reads a frozen
role through ``ctx.teacher_models`` and ``ctx.logits``.
"""

from __future__ import annotations

import torch
from rank_programs import full_grads, full_params
from role_programs import my_shard
from run_args import make_args
from samples import make_samples

#: What the loss hook saw in this process (read back by the program).
SEEN: dict = {"denominators": [], "teacher_requires_grad": [], "temperatures": []}


def _response_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_p.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def distill_loss(ctx, logits, packed, config, denominator):
    """``sum over loss tokens of (log p_actor - log p_teacher)^2 / denominator``."""
    teacher = ctx.teacher_models["model"]
    with torch.no_grad():
        teacher_logits = ctx.logits(teacher, packed)
    actor_lp = _response_log_probs(logits, packed.targets, config.temperature)
    teacher_lp = _response_log_probs(teacher_logits, packed.targets, config.temperature)
    contribution = ((actor_lp - teacher_lp) ** 2 * packed.loss_mask).sum() / denominator
    SEEN["denominators"].append(denominator)
    SEEN["teacher_requires_grad"].append(teacher_logits.requires_grad)
    SEEN["temperatures"].append(config.temperature)
    loss_tokens = packed.loss_mask.sum() / denominator
    return contribution, {"distill": contribution.detach(), "token_share": loss_tokens}


HOOK_FLAGS = dict(
    custom_loss_function_path="hook_programs:distill_loss",
    micro_batch_size=1,  # 2 micro-batches per rank
    calculate_per_token_loss=True,  # denominator: response tokens of the step, all ranks
    clip_grad=0.0,
    rollout_temperature=0.8,
    advantage_estimator="grpo",
)


def loss_hook_program(rank, world, hf_dir, teacher_dir, out_file, hook="distill_loss"):
    """One train() with the distillation hook; the gradients, metrics and what the hook saw."""
    from miles_fsdp.backend import FSDPBackend

    flags = HOOK_FLAGS | {"custom_loss_function_path": f"hook_programs:{hook}"}
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, teacher_load=teacher_dir, **flags))
    initial = full_params(backend.model)
    shard = my_shard(make_samples(), rank, world)
    metrics = backend.train(0, shard)
    res = {
        "metrics": metrics,
        "grads": full_grads(backend.model),
        "initial": initial,
        "stepped": full_params(backend.model),
        "micro_steps": backend.state.micro_step,
        "seen": {k: list(v) for k, v in SEEN.items()},
    }
    backend.close()
    torch.save(res, f"{out_file}.{rank}")


def distill_scores_loss(ctx, scores, packed, config, denominator):
    """:func:`distill_loss` on the lean path: the actor's and the teacher's log-probs come from
    the fused head (``scores``, ``ctx.scores``), no logits."""
    teacher = ctx.teacher_models["model"]
    with torch.no_grad():
        teacher_scores = ctx.scores(teacher, packed, config.temperature)
    diff = scores.log_probs - teacher_scores.log_probs
    contribution = (diff**2 * packed.loss_mask).sum() / denominator
    SEEN["denominators"].append(denominator)
    SEEN["teacher_requires_grad"].append(teacher_scores.log_probs.requires_grad)
    SEEN["temperatures"].append(config.temperature)
    loss_tokens = packed.loss_mask.sum() / denominator
    return contribution, {"distill": contribution.detach(), "token_share": loss_tokens}


def misnamed_loss(ctx, values, packed, config, denominator):
    raise AssertionError("never called: refused when loaded")
