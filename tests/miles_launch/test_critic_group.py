"""The driver's side of a critic on its own ranks, with stand-in groups (no Ray): one rollout's
training starts the critic's train before the actor's and waits for it after (they overlap),
its metrics come back as ``critic/<name>``; a save point saves both, the critic meanwhile; a failure names a *critic* rank; the job's teardown
ends both groups, the critic's even when the trainer's close fails. The real job is
test_critic_own_ranks_e2e.py's."""

from __future__ import annotations

import pytest
from launch_testing import parse
from miles_launch.job import Job
from miles_launch.rollout_training import RolloutTraining
from miles_launch.trainer_group import TrainerFailure, TrainerGroup

PPO = ["--advantage-estimator", "ppo", "--use-critic", "--train-backend", "fsdp"]
PPO += ["--critic-num-gpus-per-node", "1"]


class StandIn:
    """A trainer group: records its calls in the shared ``events``."""

    def __init__(self, name: str, events: list, fail_close: bool = False):
        self.name, self.events, self.fail_close = name, events, fail_close

    def critic_values(self, batch):
        self.events.append(f"{self.name}.critic_values")
        return batch + ["values"]

    def start_train_critic(self, rollout_id, batch):
        self.events.append(f"{self.name}.start_train_critic")
        assert "values" in batch
        events, name = self.events, self.name

        class Training:
            def result(self):
                events.append(f"{name}.train_critic done")
                return [{"value_loss": 0.25}, {"value_loss": 0.5}]  # rank 0's is reported

        return Training()

    def train(self, rollout_id, batch):
        self.events.append(f"{self.name}.train")
        assert "values" in batch
        return [{"loss": 1.5}, {"loss": 1.5}]

    def save_model(self, rollout_id, force_sync=False):
        self.events.append(f"{self.name}.save_model {rollout_id}")

    def start_save_model(self, rollout_id, force_sync=False):
        self.events.append(f"{self.name}.start_save_model {rollout_id}")
        events, name = self.events, self.name

        class Saving:
            def result(self):
                events.append(f"{name}.save_model done")

        return Saving()

    def close(self):
        self.events.append(f"{self.name}.close")
        if self.fail_close:
            raise TrainerFailure(f"{self.name} rank 1 failed in close(): boom")

    def teardown(self):
        self.events.append(f"{self.name}.teardown")


class Reporter:
    """The job's reporter: closed at the end, nothing else asked of it here."""

    def close(self):
        pass


def _job(args, trainer, critic) -> Job:
    return Job(
        args=args, layout=None, tokenizer=None, prompts=[], order=None, eval_prompts={},
        reward=None, reporter=Reporter(), trainer=trainer, critic=critic,
    )  # fmt: skip


def test_the_critic_trains_while_the_actor_does(tmp_path):
    args = parse(tmp_path, *PPO)
    events: list = []
    job = _job(args, StandIn("trainer", events), StandIn("critic", events))
    training = RolloutTraining(job, 0, ["batch"])
    training.critic()
    metrics = training.actor()
    assert events == [
        "critic.critic_values",
        "critic.start_train_critic",
        "trainer.train",  # while the critic trains
        "critic.train_critic done",
    ]
    assert metrics == {"loss": 1.5, "critic/value_loss": 0.25}


def test_critic_only_rollouts_still_train_the_critic(tmp_path):
    args = parse(tmp_path, *PPO, "--num-critic-only-steps", "1")
    events: list = []
    job = _job(args, StandIn("trainer", events), StandIn("critic", events))
    training = RolloutTraining(job, 0, ["batch"])
    training.critic()
    assert training.actor() == {"critic/value_loss": 0.25}
    assert "trainer.train" not in events and "critic.train_critic done" in events


def test_a_failure_names_a_critic_rank():
    group = TrainerGroup.__new__(TrainerGroup)  # no actors: only the line is made
    group.name, group.hosts = "critic", ["10.0.0.7"]
    line = group._failure_line(0, "train_critic", RuntimeError("value head diverged"))
    assert line == "critic rank 0 on 10.0.0.7 failed in train_critic(): RuntimeError: value " + (
        "head diverged"
    )


@pytest.mark.parametrize("failed", [True, False])
def test_teardown_ends_both_groups(tmp_path, failed):
    events: list = []
    job = _job(parse(tmp_path, *PPO), StandIn("trainer", events), StandIn("critic", events))
    job.teardown(failed=failed)
    end = "teardown" if failed else "close"
    assert events == [f"trainer.{end}", f"critic.{end}"]


def test_the_critic_closes_when_the_trainers_close_fails(tmp_path):
    events: list = []
    trainer = StandIn("trainer", events, fail_close=True)
    job = _job(parse(tmp_path, *PPO), trainer, StandIn("critic", events))
    with pytest.raises(TrainerFailure, match="trainer rank 1 failed in close"):
        job.teardown()
    assert events == ["trainer.close", "critic.close"]


def test_a_save_point_saves_the_critic_while_the_actor_saves(tmp_path):
    from miles_launch.job import LauncherState
    from miles_launch.loop import save_point

    events: list = []
    args = parse(tmp_path, *PPO, "--save", str(tmp_path / "ckpt"), "--num-rollout", "1")
    job = _job(args, StandIn("trainer", events), StandIn("critic", events))
    job.state = LauncherState(0, 0)
    assert save_point(job, 0, None)
    assert events == [
        "critic.start_save_model 0",
        "trainer.save_model 0",
        "critic.save_model done",
    ]
    assert (tmp_path / "ckpt" / "launcher" / "iter_0000001.json").is_file()
