"""MegatronBackend on GPUs (NCCL; TP=2 on 2 devices, TP=1 on one): training through the distributed optimizer matches an HF
reference trained with torch AdamW, and the checkpoint resumes at TP=1 bit-exact.

Skipped without CUDA. Reference: the HF model of the same tiny checkpoint, the loss
written here from the formulas (GRPO advantages, PPO with ratio 1 at the first update,
sequence-mean aggregation), ``clip_grad_norm_`` and ``torch.optim.AdamW`` with weight decay 0.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).parents[1] / "miles_megatron"))

LR = 1e-3
REWARDS = (1.0, 0.0, 0.5, 2.0)  # two groups of two
GROUPS = (0, 0, 1, 1)


def _samples():
    from miles_core.batch import Sample

    gen = torch.Generator().manual_seed(7)
    out = []
    for i, (length, response) in enumerate(((12, 5), (9, 3), (15, 7), (7, 4))):
        tokens = torch.randint(0, 96, (length,), generator=gen)
        out.append(
            Sample(
                tokens=tokens, response_length=response, reward=REWARDS[i], group_index=GROUPS[i]
            )
        )
    return out


def _argv(hf_dir: str, save: str, tp: int, load: str | None = None) -> list[str]:
    argv = ["--hf-checkpoint", hf_dir, "--save", save, "--lr", str(LR), "--weight-decay", "0"]
    argv += ["--tensor-model-parallel-size", str(tp), "--micro-batch-size", "2"]
    argv += ["--advantage-estimator", "grpo"] + (["--sequence-parallel"] if tp > 1 else [])
    return argv + (["--load", load] if load else [])


def _rank(rank: int, world: int, port: int, hf_dir: str, save: str, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    try:
        import torch.distributed as dist
        from megatron_ranks import parse
        from miles_core.batch import RolloutBatch
        from miles_megatron.backend import MegatronBackend

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
        backend = MegatronBackend()
        assert backend.init(parse(_argv(hf_dir, save, tp=world))) == 0
        layout = backend.data_layout()
        batch = RolloutBatch(_samples()) if layout.consumes_data else None
        metrics = [backend.train(r, batch) for r in range(2)]
        weights = {k: v.cpu() for k, v in backend.hf_weights()}
        backend.save_model(1)
        backend.close()
        # resume at TP=1 (DP=2): the weights come back bit-exact, the rollout id continues
        resumed = MegatronBackend()
        next_id = resumed.init(parse(_argv(hf_dir, save + "_2", tp=1, load=save)))
        reloaded = {k: v.cpu() for k, v in resumed.hf_weights()}
        exact = all(torch.equal(reloaded[k], weights[k]) for k in weights)
        resumed.close()
        dist.destroy_process_group()
        queue.put((rank, "ok", (layout, metrics, next_id, exact, weights if rank == 0 else None)))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def _reference(hf_dir: str):
    """Losses and grad norms of two updates of the HF model with the same math, on GPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    samples = _samples()
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    adv = []
    for i, g in enumerate(GROUPS):
        members = rewards[[j for j, h in enumerate(GROUPS) if h == g]]
        adv.append(float((rewards[i] - members.mean()) / (members.std() + 1e-6)))
    out = []
    for _ in range(2):
        opt.zero_grad()
        loss = torch.zeros((), device="cuda")
        for s, a in zip(samples, adv, strict=True):
            tokens = s.tokens.cuda()
            logits = model(input_ids=tokens[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None])[:, 0]
            lp = lp[-s.response_length :]
            ratio = torch.exp(lp - lp.detach())  # 1 in value: one update per rollout
            loss = loss + (-a * ratio).sum() / s.response_length / len(samples)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out.append((loss.item(), norm.item()))
    return out, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_train_matches_hf_adamw_and_resumes_tp2_to_tp1(tmp_path):
    from tiny_models import make_tiny_hf

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = min(2, torch.cuda.device_count())
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, hf_dir, str(tmp_path / "ckpt"), queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, status, value = queue.get(timeout=500)
        assert status == "ok", value
        results[rank] = value
    for p in procs:
        p.join(timeout=30)
    ref_steps, ref_weights = _reference(hf_dir)
    for rank in range(world):
        layout, metrics, next_id, exact, _ = results[rank]
        assert layout.dp_size == 1 and layout.consumes_data == (rank == 0)
        assert next_id == 2 and exact
        for m, (loss, norm) in zip(metrics, ref_steps, strict=True):
            assert abs(m["loss"] - loss) < 1e-5, (m, loss)
            assert abs(m["grad_norm"] - norm) < 1e-4 * max(norm, 1.0), (m, norm)
    weights = results[0][4]
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in weights)
    assert worst < 1e-4  # Adam's first steps are ~lr * sign(g): tolerance well below lr
