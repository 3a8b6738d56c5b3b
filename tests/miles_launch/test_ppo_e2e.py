"""PPO with a critic end to end: ``miles train --advantage-estimator ppo --use-critic`` on the
demo task (2 gloo trainer ranks, each holding the actor and the critic, 1 built-in CPU engine).

Extended (each job starts Ray, two trainer actors and an engine): the demo's reward rises under
PPO; a resume from a mid-run checkpoint ends with the same actor *and critic* weights, bit for
bit, as the straight run (the session's ``ppo_critic_run`` of conftest.py, which the critic-own-
ranks and replay tests compare with too); the colocated run (trainer and critic asleep during
generation) gives the same rollouts as the disaggregated one. The critic's numerics (values, GAE, value-loss
gradient) are checked in-process by tests/miles_fsdp/test_critic.py, in the default suite.
"""

from __future__ import annotations

import pytest
import torch
from demo_jobs import REQUIRES, demo, ppo_critic_job, records, rollout_lines
from train_runs import dcp_tensors

pytestmark = [pytest.mark.slow, pytest.mark.extended, *REQUIRES]
PPO = [
    "--advantage-estimator", "ppo", "--use-critic", "--critic-lr", "1e-2",
    "--normalize-advantages", "--gamma", "1.0", "--lambd", "0.95", "--value-clip", "0.5",
]  # fmt: skip


def numeric(train: dict) -> dict:
    """The train metrics without the timing ones (``tokens_per_s``) and without the
    train/rollout mismatch ones (``train_rollout_*``): those measure the engine's log-probs,
    which move in the last bits with the batch the engine's scheduler happened to form (the
    timing of requests, one engine or two), so two runs of the same rollout differ there. The
    training itself does not read them (no --use-tis here)."""
    return {
        k: v
        for k, v in train.items()
        if not k.endswith("tokens_per_s") and not k.startswith("train_rollout_")
    }


def test_ppo_with_a_critic_raises_the_demo_reward(tmp_path):
    first, last, out = demo(tmp_path, *PPO)
    assert last >= first + 0.15, out[-3000:]
    rows = records(tmp_path / "metrics.jsonl")
    assert len(rows) == 12
    for row in rows:
        assert {"loss", "critic/value_loss", "critic/value_clipfrac"} <= set(row["train"])


@pytest.mark.timeout(1800)  # the resumed job, and the straight one if this test builds it
def test_resume_with_a_critic_matches_the_straight_run(ppo_critic_run, tmp_path):
    """The session's PPO-with-critic job (``ppo_critic_run``: 2 rollouts straight, saving at 1
    and 2) vs the same command line restarted at the checkpoint of 1 (``--ckpt-step 1``, while
    its tracker says 2), training the second rollout again: the actor's and the critic's
    weights and optimizer state at 2 are equal bit for bit."""
    material, out, _ = ppo_critic_run
    straight, resumed = out / "ckpt", tmp_path / "resumed"
    ppo_critic_job(material, resumed, "--load", str(straight), "--ckpt-step", "1")
    ra, rb = records(out / "metrics.jsonl"), records(resumed / "metrics.jsonl")
    assert [r["rollout_id"] for r in ra] == [0, 1] and [r["rollout_id"] for r in rb] == [1]
    assert rb[0]["prompt_ids"] == ra[1]["prompt_ids"]
    assert numeric(rb[0]["train"]) == numeric(ra[1]["train"])  # the critic's metrics too
    assert "train_rollout_logprob_abs_diff" in rb[0]["train"]
    assert "critic/value_loss" in ra[1]["train"]
    for role in ("", "critic/"):
        for part in ("model", "optimizer"):
            wa = dcp_tensors(straight / f"{role}iter_0000002" / part)
            wb = dcp_tensors(resumed / "ckpt" / f"{role}iter_0000002" / part)
            assert wa.keys() == wb.keys() and len(wa) > 0, (role, part)
            for name in wa:
                assert torch.equal(wa[name], wb[name]), (role, part, name)
        w1 = dcp_tensors(straight / f"{role}iter_0000001" / "model")
        w2 = dcp_tensors(straight / f"{role}iter_0000002" / "model")
        assert any(not torch.equal(w1[n], w2[n]) for n in w2), role  # training moved it
    heads = [n for n in wa if "lm_head" in n]
    assert heads  # the critic checkpoint holds the value head


@pytest.mark.timeout(1800)  # two jobs
def test_colocated_ppo_matches_the_disaggregated_run(tmp_path):
    """--colocate: the actor and the critic sleep during generation (each wakes for its own
    phase); same seeds, so the same rollouts as disaggregated. With --num-critic-only-steps 1
    the first rollout trains only the critic."""
    flags = ["--num-rollout", "2", "--num-critic-only-steps", "1", *PPO]
    _, _, apart = demo(tmp_path / "apart", *flags)
    _, _, together = demo(tmp_path / "together", "--colocate", *flags)
    assert "colocated" in together
    assert rollout_lines(together) == rollout_lines(apart)
    assert len(rollout_lines(together)) == 2  # "rollout 1: ...", "rollout 2: ..."
    rows = records(tmp_path / "together" / "metrics.jsonl")
    assert "loss" not in rows[0]["train"] and "critic/value_loss" in rows[0]["train"]
    assert "loss" in rows[1]["train"] and "critic/value_loss" in rows[1]["train"]
    apart_rows = records(tmp_path / "apart" / "metrics.jsonl")
    assert "train_rollout_logprob_abs_diff" in rows[1]["train"]
    assert numeric(rows[1]["train"]) == numeric(apart_rows[1]["train"])
