"""Test support: MegatronBackend against an HF model trained with torch AdamW (same math).

The reference writes the loss from the formulas: GRPO advantages ``(R - mean_g) / (std_g +
1e-6)``, the PPO term at ratio 1 (one update per rollout) and the sequence mean
``(1/S) sum_i (1/n_i) sum_t -m_it A_i r_it`` (``m_it`` each sample's ``loss_mask``: all 1, or
with ``masked`` a masked tool span; ``n_i = sum_t m_it``); then ``clip_grad_norm_(1.0)`` and
``AdamW`` (weight decay 0). :func:`run_backend` and :func:`check` use the masked samples. Used by tests/miles_megatron/test_backend.py (gloo) and tests/gpu (NCCL).
"""

from __future__ import annotations

import tempfile

import torch
from safetensors.torch import load_file

LR = 1e-3
REWARDS = (1.0, 0.0, 0.5, 2.0)  # two prompt groups of two samples
GROUPS = (0, 0, 1, 1)
ROLLOUTS = 2


def samples(masked: bool = False, engine_log_probs: bool = False):
    """The four samples; ``masked``: each with a ``loss_mask`` that is 0 on a tool-output span
    after the first response token (``response // 3`` tokens); ``engine_log_probs``: with
    ``rollout_log_probs`` an engine might have reported (about -4.6 = log(1/96) each)."""
    from miles_core.batch import Sample

    gen = torch.Generator().manual_seed(7)
    out = []
    for i, (length, response) in enumerate(((12, 5), (9, 3), (15, 7), (7, 4))):
        tokens = torch.randint(0, 96, (length,), generator=gen)
        mask = torch.ones(response)
        if masked:
            mask[1 : 1 + response // 3] = 0
        out.append(
            Sample(
                tokens=tokens,
                response_length=response,
                reward=REWARDS[i],
                group_index=GROUPS[i],
                loss_mask=mask if masked else None,
                rollout_log_probs=(
                    -4.6 + 0.5 * torch.rand(response, generator=gen) if engine_log_probs else None
                ),
            )
        )
    return out


#: (length, response) of :func:`long_samples`: alone in a row padded to 128 at CP = 2 (chunks of
#: 32, rank 0 holding row positions 0-31 and 96-127), every response reaches both ranks
LONG = ((100, 70), (120, 50), (110, 80), (104, 60))


def long_samples():
    """Four samples long enough that, each packed alone at CP = 2, both CP ranks hold loss
    tokens of each; every loss mask has a hole (a masked tool span of ``response // 4``)."""
    from miles_core.batch import Sample

    gen = torch.Generator().manual_seed(11)
    out = []
    for i, (length, response) in enumerate(LONG):
        mask = torch.ones(response)
        mask[response // 3 : response // 3 + response // 4] = 0
        tokens = torch.randint(0, 96, (length,), generator=gen)
        out.append(Sample(tokens, response, REWARDS[i], group_index=GROUPS[i], loss_mask=mask))
    return out


def backend_argv(hf_dir: str, save: str, tp: int, load: str | None = None) -> list[str]:
    argv = ["--hf-checkpoint", hf_dir, "--save", save, "--lr", str(LR), "--weight-decay", "0"]
    argv += ["--tensor-model-parallel-size", str(tp), "--micro-batch-size", "2"]
    argv += ["--advantage-estimator", "grpo"] + (["--sequence-parallel"] if tp > 1 else [])
    return argv + (["--load", load] if load else [])


def run_backend(hf_dir: str, save: str, tp: int) -> dict:
    """On every rank: train ROLLOUTS rollouts at ``tp``, save, resume at TP=1 from the save."""
    from megatron_ranks import parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    backend = MegatronBackend()
    first_id = backend.init(parse(backend_argv(hf_dir, save, tp=tp)))
    layout = backend.data_layout()
    batch = RolloutBatch(samples(masked=True)) if layout.consumes_data else None
    metrics = [backend.train(r, batch) for r in range(ROLLOUTS)]
    weights = {k: v.detach().cpu().clone() for k, v in backend.hf_weights()}
    backend.save_model(ROLLOUTS - 1)
    backend.close()
    resumed = MegatronBackend()
    next_id = resumed.init(parse(backend_argv(hf_dir, save + "_2", tp=1, load=save)))
    reloaded = {k: v.detach().cpu() for k, v in resumed.hf_weights()}
    resumed.close()
    return {
        "first_id": first_id,
        "layout": layout,
        "metrics": metrics,
        "next_id": next_id,
        "reload_exact": sorted(reloaded) == sorted(weights)
        and all(torch.equal(reloaded[k], weights[k]) for k in weights),
        "weights": weights,
    }


def reference(hf_dir: str, device: str = "cpu", rollouts: int = ROLLOUTS, masked: bool = False):
    """``([(loss, grad_norm)] per rollout, final weights)`` of the HF + AdamW run; the weights
    under the names of the HF checkpoint it saves (transformers fuses experts in memory)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    data = samples(masked)
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    adv = []
    for i, g in enumerate(GROUPS):
        members = rewards[[j for j, h in enumerate(GROUPS) if h == g]]
        adv.append(float((rewards[i] - members.mean()) / (members.std() + 1e-6)))
    steps = []
    for _ in range(rollouts):
        opt.zero_grad()
        loss = torch.zeros((), device=device)
        for s, a in zip(data, adv, strict=True):
            tokens = s.tokens.to(device)
            logits = model(input_ids=tokens[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None])[:, 0]
            lp = lp[-s.response_length :]
            ratio = torch.exp(lp - lp.detach())
            m = s.mask.to(device)
            loss = loss + (-a * ratio * m).sum() / m.sum() / len(data)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps.append((loss.item(), norm.item()))
    with tempfile.TemporaryDirectory() as out:  # in the checkpoint's names (experts unfused)
        model.save_pretrained(out)
        return steps, load_file(f"{out}/model.safetensors")


def check(results: list[dict], hf_dir: str, device: str = "cpu") -> None:
    ref_steps, ref_weights = reference(hf_dir, device, masked=True)
    for rank, r in enumerate(results):
        assert r["first_id"] == 0 and r["next_id"] == ROLLOUTS and r["reload_exact"], rank
        for m, (loss, norm) in zip(r["metrics"], ref_steps, strict=True):
            assert abs(m["loss"] - loss) < 1e-5, (m, loss)
            assert abs(m["grad_norm"] - norm) < 1e-4 * max(norm, 1.0), (m, norm)
    weights = results[0]["weights"]
    assert sorted(weights) == sorted(ref_weights)
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in weights)
    assert worst < 1e-4, worst  # Adam's first steps move ~lr = 1e-3 per weight
