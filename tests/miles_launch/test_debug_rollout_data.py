"""``--save-debug-rollout-data`` / ``--load-debug-rollout-data``: the flags' validation, the file
round trip, and the replay: a live ``miles train`` run saves its rollouts, a run with no engine
trains on them, and the weights after the steps are equal bit for bit (FSDP here; megatron in
tests/miles_megatron/test_debug_rollout_replay.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_testing import parse
from miles_core import backends
from miles_core.args import ArgumentError
from miles_core.batch import RolloutBatch, Sample
from miles_launch.rollout.debug_data import (
    DebugDataError,
    load_rollout_data,
    save_rollout_data,
)
from train_runs import dcp_tensors, metric_records

ROOT = Path(__file__).resolve().parents[2]


def saved(tmp_path: Path, rollout_ids=(0,)) -> str:
    """A template with a (one-sample) file for each of ``rollout_ids``."""
    template = str(tmp_path / "data" / "r{rollout_id}.pt")
    batch = RolloutBatch([Sample(tokens=torch.tensor([1, 2, 3]), response_length=2, reward=1.0)])
    stats = {"reward_mean": 1.0, "response_len_mean": 2.0}
    for rollout_id in rollout_ids:
        save_rollout_data(template, rollout_id, batch, {"rollout": stats})
    return template


def test_a_replay_needs_neither_engines_nor_prompts(tmp_path):
    template = saved(tmp_path, (0, 1))
    args = parse(tmp_path, "--load-debug-rollout-data", template, "--num-rollout", "2")
    assert args.rollout_num_gpus == 0  # no engine is placed
    args.prompt_data = None
    from miles_launch.rollout_args import RolloutArgs

    RolloutArgs.check_paths(args)  # --prompt-data may be left out of a replay


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--save-debug-rollout-data", "a_{rollout_id}", "--load-debug-rollout-data", "SAVED"],
         "--save-debug-rollout-data and --load-debug-rollout-data are mutually exclusive"),
        (["--save-debug-rollout-data", "a_{rank}.pt"],
         "--save-debug-rollout-data 'a_{rank}.pt': the only placeholder allowed is {rollout_id}"),
        (["--save-debug-rollout-data", "a.pt", "--num-rollout", "3"],
         "no {rollout_id} in the path, so each of the 3 rollouts would overwrite the last"),
        (["--load-debug-rollout-data", "SAVED", "--rollout-num-gpus", "1"],
         "without engines: --rollout-num-gpus cannot be used with it"),
        (["--load-debug-rollout-data", "SAVED", "--colocate"],
         "without engines: --colocate cannot be used with it"),
        (["--load-debug-rollout-data", "SAVED", "--eval-interval", "1", "--eval-prompt-data",
          "e", "SAVED"], "without engines: --eval-interval cannot be used with it"),
        (["--load-debug-rollout-data", "SAVED", "--num-rollout", "2"],
         r"r1.pt \(rollout 1\) does not exist"),
    ],
)  # fmt: skip
def test_bad_combinations_are_refused(tmp_path, flags, message):
    template = saved(tmp_path)
    flags = [template if f == "SAVED" else f for f in flags]
    with pytest.raises(ArgumentError, match=message.replace("{", r"\{").replace("}", r"\}")):
        parse(tmp_path, *flags)


def test_cli_load_without_the_file_is_one_line_exit_2(tmp_path):
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    missing = tmp_path / "none_{rollout_id}.pt"
    result = subprocess.run(
        [sys.executable, "-m", "miles_launch.cli", "train", "--train-backend", "fsdp",
         "--hf-checkpoint", str(tmp_path), "--load-debug-rollout-data", str(missing)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        f"error: --load-debug-rollout-data {missing}: {tmp_path / 'none_0.pt'} (rollout 0) "
        "does not exist"
    )


def test_the_file_holds_the_batch_bit_for_bit(tmp_path):
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            tokens=torch.randint(0, 100, (7 + k,), generator=gen),
            response_length=3 + k,
            reward=float(torch.rand((), generator=gen)),
            loss_mask=torch.tensor([1, 0, 1] + [1] * k),
            rollout_log_probs=-torch.rand(3 + k, generator=gen),
            teacher_log_probs=-torch.rand(3 + k, generator=gen),
            routed_experts=torch.randint(0, 4, (6 + k, 2, 2), dtype=torch.int32, generator=gen),
            group_index=k // 2,
            weight_version=5,
        )
        for k in range(4)
    ]
    template = str(tmp_path / "{rollout_id}" / "data.pt")
    info = {"prompt_ids": [3, 9], "rollout": {"reward_mean": 0.25}, "data_position": 12}
    path = save_rollout_data(template, 7, RolloutBatch(samples), info)
    assert path == tmp_path / "7" / "data.pt"
    batch, loaded = load_rollout_data(template, 7)
    assert loaded == {"format": 1, "rollout_id": 7, **info}
    assert len(batch) == len(samples)
    for a, b in zip(samples, batch, strict=True):
        for name in ("tokens", "loss_mask", "rollout_log_probs", "teacher_log_probs"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert a.routed_experts.dtype == b.routed_experts.dtype
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert (a.response_length, a.reward, a.group_index, a.weight_version) == (
            b.response_length,
            b.reward,
            b.group_index,
            b.weight_version,
        )


class CriticTrainer:
    """A trainer group stand-in: the critic's values are a function of the tokens; ``train``
    computes the actor's advantages as both backends do (``with_advantages``)."""

    def __init__(self, args):
        self.args, self.calls = args, []

    def critic_values(self, batch):
        self.calls.append("critic_values")
        values = [s.tokens[-s.response_length :].float() / 10 for s in batch]
        return batch.with_fields(values=values)

    def train_critic(self, rollout_id, batch):
        self.calls.append("train_critic")
        assert "values" in batch.field_names
        return [{"value_loss": 0.5}]

    def train(self, rollout_id, batch):
        from miles_core.advantages import with_advantages

        self.calls.append("train")
        out = with_advantages(batch, self.args, None)
        return [{"loss": float(sum(s.fields["advantages"].sum() for s in out))}]


def test_a_replay_runs_the_critic_phase(tmp_path):
    """--use-critic --advantage-estimator ppo: the replay scores the saved batch with the critic,
    trains the critic, then the actor on the batch with the critic's values (as the live loop)."""
    from types import SimpleNamespace

    from miles_launch.args import OutputArgs
    from miles_launch.replay import run_replay
    from miles_launch.reporting import Reporter

    template = saved(tmp_path, (0, 1))
    args = parse(
        tmp_path, "--load-debug-rollout-data", template, "--num-rollout", "2",
        "--use-critic", "--advantage-estimator", "ppo", "--gamma", "0.9", "--lambd", "0.8",
    )  # fmt: skip
    trainer = CriticTrainer(args)
    job = SimpleNamespace(
        args=args,
        trainer=trainer,
        state=SimpleNamespace(next_rollout_id=0, data_position=0),
        reporter=Reporter(OutputArgs(progress=False), None, 2),
    )
    records = run_replay(job)
    assert trainer.calls == ["critic_values", "train_critic", "train"] * 2
    # one sample, tokens [1, 2, 3], response [2, 3]: V = [0.2, 0.3], reward 1 on the last token
    v, gamma, lambd = [0.2, 0.3], 0.9, 0.8
    deltas = [0.0 + gamma * v[1] - v[0], 1.0 - v[1]]
    adv = [deltas[0] + gamma * lambd * deltas[1], deltas[1]]
    for record in records:
        assert record["train"]["critic/value_loss"] == 0.5
        assert record["train"]["loss"] == pytest.approx(sum(adv), abs=1e-6)


def test_a_foreign_or_missing_file_is_a_clear_error(tmp_path):
    torch.save({"samples": []}, tmp_path / "r0.pt")
    with pytest.raises(DebugDataError, match="r0.pt: not a miles rollout data file"):
        load_rollout_data(str(tmp_path / "r{rollout_id}.pt"), 0)
    with pytest.raises(DebugDataError, match=r"r1.pt \(rollout 1\) missing"):
        load_rollout_data(str(tmp_path / "r{rollout_id}.pt"), 1)


# ----------------------------------------------------------------------------- end to end
ENGINE_FLAGS = {"--rollout-engine": 1, "--rollout-num-gpus": 1}


def without_engine_flags(flags: list[str]) -> list[str]:
    out, skip = [], 0
    for f in flags:
        if skip:
            skip -= 1
        elif f in ENGINE_FLAGS:
            skip = ENGINE_FLAGS[f]
        else:
            out.append(f)
    return out


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(1800)  # the replay, and the live job if this test builds it
@pytest.mark.skipif("fsdp" not in backends.available(), reason="the FSDP backend is not installed")
def test_fsdp_replay_without_engines_equals_the_live_run(ppo_critic_run, tmp_path):
    """2 rollouts of PPO with a critic live (2 gloo FSDP ranks, 1 built-in engine, the session's
    ``ppo_critic_run``) saving their data and a checkpoint after each, then the same 2 rollouts
    replayed with no engine (the replay runs the critic phase): the actor's and the critic's
    checkpoints after the last step are bitwise equal, and training moved the weights."""
    from demo_jobs import PPO_CRITIC
    from miles_launch.demo import demo_flags

    (hf, prompts), live_out, _ = ppo_critic_run
    data = str(live_out / "rollout_{rollout_id}.pt")
    flags = without_engine_flags(demo_flags(hf, prompts, tmp_path / "replay.jsonl"))
    cmd = [sys.executable, "-m", "miles_launch.train", *flags, *PPO_CRITIC, "--no-progress"]
    cmd += ["--load-debug-rollout-data", data, "--save", str(tmp_path / "replay")]
    replayed = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    checkpoints = {"live": live_out / "ckpt", "replay": tmp_path / "replay"}
    assert "replaying rollouts from" in replayed.stdout
    replay_out = replayed.stdout
    assert "engines: none (a replay of" in replay_out  # the plan says so
    # and no engine was started, became healthy or received weights
    assert not re.search(r"engine\(s\)|engines healthy|engines ready", replay_out), replay_out
    live, replay = (
        metric_records(live_out / "metrics.jsonl"),
        metric_records(tmp_path / "replay.jsonl"),
    )
    assert [r["train"] for r in live] == [r["train"] for r in replay]
    assert all("critic/value_loss" in r["train"] for r in replay)
    assert [r["prompt_ids"] for r in live] == [r["prompt_ids"] for r in replay]
    for role in ("", "critic/"):
        a = dcp_tensors(checkpoints["live"] / f"{role}iter_0000002" / "model")
        b = dcp_tensors(checkpoints["replay"] / f"{role}iter_0000002" / "model")
        assert a.keys() == b.keys() and len(a) > 0, role
        for key in a:
            assert torch.equal(a[key], b[key]), (role, key)
        first = dcp_tensors(checkpoints["live"] / f"{role}iter_0000001" / "model")
        assert any(not torch.equal(first[k], a[k]) for k in a), role  # the 2nd step moved them
