"""A critic on its own ranks end to end: ``miles train --use-critic --critic-num-gpus-per-node 1``
on the demo task (2 gloo trainer ranks for the actor, 1 rank of its own for the critic, 1
built-in CPU engine), against the same job with the critic in the trainer's ranks.

Extended (jobs each starting Ray, its trainer actors and an engine). The job with the critic in
the trainer's ranks is the session's ``ppo_critic_run`` (conftest.py: the same job's rollouts
are what test_debug_rollout_data.py replays), the own-ranks job is the same command line with
``--critic-num-gpus-per-node 1``. The two layouts train
on the same rollouts (the saved batches are equal), and every per-rollout actor and critic
metric (losses, value clip fraction, grad norms, KL, entropy) agrees within two fp32 results'
rounding (``2 * GRAD_REL_ERR``, relative; the critic's data-parallel degree, 1 against 2,
changes its gradient's reduction order). Coverage: the critic's ranks ran in processes of their
own (the job's log names every rank's pid), its checkpoint was written by a world of 1 rank
(the shared critic's by the trainer's 2), and each side took 4 optimizer steps (2 per rollout).
A third job resumes the own-ranks run from its checkpoint (``--load``, the critic's from
``<load>/critic``) for a third rollout: both sides continue from their 4 steps to 6.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from demo_jobs import PPO_CRITIC, REQUIRES, ppo_critic_job, records, train
from miles_launch.rollout.debug_data import load_rollout_data
from tolerances import GRAD_REL_ERR

pytestmark = [pytest.mark.slow, pytest.mark.extended, *REQUIRES]


def numeric(train_metrics: dict) -> dict:
    """The train metrics less the timing ones and the train/rollout mismatch ones (those
    measure the engine's log-probs, as test_ppo_e2e.py's ``numeric`` says)."""
    return {
        k: v
        for k, v in train_metrics.items()
        if not k.endswith("tokens_per_s") and not k.startswith("train_rollout_")
    }


def rank_pids(log: str, group: str) -> set[int]:
    """The pids of the job's log line ``<group> ranks: 0 on HOST pid P, ...``."""
    (line,) = [x for x in log.splitlines() if f" {group} ranks: " in x]
    return {int(p) for p in re.findall(r"pid (\d+)", line)}


def meta(checkpoint, iteration: int = 2) -> dict:
    return json.loads((checkpoint / f"iter_{iteration:07d}" / "meta.json").read_text())


@pytest.mark.timeout(1800)  # two jobs, and the shared one if this test builds it
def test_a_critic_on_its_own_rank_trains_as_the_shared_one(ppo_critic_run, tmp_path):
    material, shared_out, shared_log = ppo_critic_run  # the critic in the trainer's ranks
    own_out = tmp_path / "own"
    own_result = ppo_critic_job(material, own_out, "--critic-num-gpus-per-node", "1")
    outputs = {"shared": shared_out, "own": own_out}
    runs = {
        "shared": (records(shared_out / "metrics.jsonl"), shared_log),
        "own": (records(own_out / "metrics.jsonl"), own_result.stdout + own_result.stderr),
    }

    # the same rollouts: both layouts trained on equal batches
    for rollout_id in (0, 1):
        a, _ = load_rollout_data(str(shared_out / "rollout_{rollout_id}.pt"), rollout_id)
        b, _ = load_rollout_data(str(own_out / "rollout_{rollout_id}.pt"), rollout_id)
        assert len(a) == len(b) == 16
        assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b)), rollout_id

    shared, own = runs["shared"][0], runs["own"][0]
    assert [r["rollout_id"] for r in own] == [0, 1]
    for a, b in zip(shared, own, strict=True):
        ma, mb = numeric(a["train"]), numeric(b["train"])
        assert ma.keys() == mb.keys(), (sorted(ma), sorted(mb))
        assert {"loss", "grad_norm", "critic/value_loss", "critic/grad_norm"} <= ma.keys()
        for key, want in ma.items():
            bound = 2 * GRAD_REL_ERR * max(1.0, abs(want))
            assert abs(mb[key] - want) <= bound, (a["rollout_id"], key, want, mb[key])

    # coverage: its own processes, its own world, more than one optimizer step on each side
    log = runs["own"][1]
    trainer, critic = rank_pids(log, "trainer"), rank_pids(log, "critic")
    assert len(trainer) == 2 and len(critic) == 1 and not trainer & critic, log[-3000:]
    assert " critic ranks: " not in runs["shared"][1]
    for name, critic_world in (("shared", 2), ("own", 1)):
        ckpt = outputs[name] / "ckpt"
        actor, critic_meta = meta(ckpt), meta(ckpt / "critic")
        assert (actor["world_size"], critic_meta["world_size"]) == (2, critic_world), name
        assert actor["global_step"] == critic_meta["global_step"] == 4, name

    # resume: the critic's own ranks load its checkpoint and continue from its step count
    result = train(
        material, own_out / "resumed.jsonl", *PPO_CRITIC, "--critic-num-gpus-per-node", "1",
        "--num-rollout", "3", "--load", str(own_out / "ckpt"), "--save", str(own_out / "resumed"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = records(own_out / "resumed.jsonl")
    assert row["rollout_id"] == 2 and "critic/value_loss" in row["train"]
    actor, critic_meta = meta(own_out / "resumed", 3), meta(own_out / "resumed" / "critic", 3)
    assert (actor["global_step"], critic_meta["global_step"]) == (6, 6)
    assert critic_meta["world_size"] == 1
