"""PPO with a critic end to end: ``miles train --advantage-estimator ppo --use-critic`` on the
demo task (2 gloo trainer ranks, each holding the actor and the critic, 1 built-in CPU engine).

Extended (each job starts Ray, two trainer actors and an engine): the demo's reward rises under
PPO; a resume from a mid-run checkpoint ends with the same actor *and critic* weights, bit for
bit, as the straight run; the colocated run (trainer and critic asleep during generation) gives
the same rollouts as the disaggregated one. The critic's numerics (values, GAE, value-loss
gradient) are checked in-process by tests/miles_fsdp/test_critic.py, in the default suite.
"""

from __future__ import annotations

import pytest
import torch
from demo_jobs import REQUIRES, SMALL, demo, records, rollout_lines, train
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


@pytest.mark.timeout(1800)  # two jobs
def test_resume_with_a_critic_matches_the_straight_run(material, tmp_path):
    """3 rollouts straight (saving at 2 and 3) vs a restart at the checkpoint of 2: the actor's
    and the critic's weights and optimizer state at 3 are equal bit for bit."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*SMALL, *PPO, "--save-interval", "2", "--num-rollout", "3"]
    a = train(material, tmp_path / "a.jsonl", *common, "--save", str(straight))
    assert a.returncode == 0, a.stderr[-3000:]
    b = train(
        material, tmp_path / "b.jsonl", *common,
        "--save", str(resumed), "--load", str(straight), "--ckpt-step", "2",
    )  # fmt: skip
    assert b.returncode == 0, b.stderr[-3000:]
    ra, rb = records(tmp_path / "a.jsonl"), records(tmp_path / "b.jsonl")
    assert [r["rollout_id"] for r in rb] == [2]
    assert rb[0]["prompt_ids"] == ra[2]["prompt_ids"]
    assert numeric(rb[0]["train"]) == numeric(ra[2]["train"])  # the critic's metrics too
    assert "train_rollout_logprob_abs_diff" in rb[0]["train"]
    assert "critic/value_loss" in ra[2]["train"]
    for role in ("", "critic/"):
        for part in ("model", "optimizer"):
            wa = dcp_tensors(straight / f"{role}iter_0000003" / part)
            wb = dcp_tensors(resumed / f"{role}iter_0000003" / part)
            assert wa.keys() == wb.keys() and len(wa) > 0, (role, part)
            for name in wa:
                assert torch.equal(wa[name], wb[name]), (role, part, name)
        w0 = dcp_tensors(straight / f"{role}iter_0000002" / "model")
        w3 = dcp_tensors(straight / f"{role}iter_0000003" / "model")
        assert any(not torch.equal(w0[n], w3[n]) for n in w3), role  # training moved it
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
