"""Evaluation: pass@k, named eval sets with their sampling, metrics and time in the record."""

from __future__ import annotations

import itertools
import json
import time
from fractions import Fraction
from math import comb
from types import SimpleNamespace

import pytest
from launch_testing import StubEngine, parse
from miles_core.args import ArgumentError
from miles_launch import loop
from miles_launch.args import OutputArgs
from miles_launch.reporting import Reporter
from miles_launch.rollout.evaluation import eval_metrics, pass_at_k, pass_ks
from miles_launch.rollout.prompts import Prompt
from miles_launch.rollout.rewards import RewardModel


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (4, 2), (5, 1), (6, 0), (6, 6), (7, 3)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(n, c):
    passes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(passes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_ks():
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]


def _codex_pass_at_k(groups, threshold, k):
    """Chen et al. 2021, eq. 1, exactly: mean over prompts of 1 - C(n - c, k) / C(n, k), each
    prompt with its own n samples of which c have reward >= threshold."""
    total = Fraction(0)
    for rewards in groups:
        n, c = len(rewards), sum(r >= threshold for r in rewards)
        total += 1 - Fraction(comb(n - c, k), comb(n, k))
    return float(total / len(groups))


def _samples(rewards):
    return [SimpleNamespace(reward=r, response_ids=[0]) for r in rewards]


def test_pass_at_k_uses_each_groups_own_n():
    """Groups of different sizes (a custom generate function returning several samples per
    call): each group's own n, k up to the smallest n."""
    groups = [
        [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # n = 8
        [1.0] * 9 + [0.0, 0.0],  # n = 11, c = 9 > 8
        [0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # n = 12, c = 2
    ]
    assert {len(g) for g in groups} == {8, 11, 12}
    metrics = eval_metrics([_samples(g) for g in groups], 1.0)
    assert [k for k in metrics if k.startswith("pass@")] == ["pass@1", "pass@2", "pass@4", "pass@8"]
    for k in (1, 2, 4, 8):
        # a product of <= 12 float64 factors: a few ulps
        assert metrics[f"pass@{k}"] == pytest.approx(_codex_pass_at_k(groups, 1.0, k), rel=1e-14)


def test_shaped_rewards_pass_only_at_the_threshold(tmp_path, engine):
    """A sample passes when its reward reaches --pass-threshold (default 1.0), not when it is
    positive: partial credit (0.5) is no pass."""
    args = _eval_args(tmp_path, "--custom-rm-path", "rm_fixtures:shaped_quarters")
    results = loop.run_eval(_job(args, engine), rollout_id=1)
    quarters = [1.0, 0.5, 0.0, 0.5]
    for metrics in results.values():
        assert metrics["reward_mean"] == 0.5
        for k in (1, 2, 4):
            assert metrics[f"pass@{k}"] == pytest.approx(_codex_pass_at_k([quarters], 1.0, k))
        assert metrics["pass@1"] == 0.25
    args = _eval_args(
        tmp_path, "--custom-rm-path", "rm_fixtures:shaped_quarters", "--pass-threshold", "0.5"
    )
    results = loop.run_eval(_job(args, engine), rollout_id=1)
    assert results["math"]["pass@1"] == 0.75


def test_training_rollouts_report_pass_at_k():
    groups = [_samples([1.0, 0.5, 0.0, 1.0]), _samples([0.0, 0.0, 0.5, 0.0])]
    for g in groups:
        for s in g:
            s.loss_mask, s.weight_version = None, 3
    stats = loop.rollout_stats(groups, 1.0)
    rewards = [[s.reward for s in g] for g in groups]
    for k in (1, 2, 4):
        assert stats[f"pass@{k}"] == pytest.approx(_codex_pass_at_k(rewards, 1.0, k))
    assert stats["pass@1"] == 0.25


def _eval_args(tmp_path, *flags):
    sets = []
    for name in ("math", "code"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"prompt": "ab"}\n{"prompt": "cde"}\n')
        sets += [name, str(path)]
    return parse(
        tmp_path,
        "--custom-rm-path", "rm_fixtures:even_samples_pass",
        "--eval-interval", "2",
        "--eval-prompt-data", *sets,
        "--n-samples-per-eval-prompt", "4",
        "--rollout-max-response-len", "16",
        *flags,
    )  # fmt: skip


def _job(args, engine, next_rollout_id=0):
    async def alive(when):
        pass

    return SimpleNamespace(
        args=args,
        state=SimpleNamespace(next_rollout_id=next_rollout_id),
        tokenizer=None,
        engines=SimpleNamespace(
            generation_urls=["http://127.0.0.1:1"], acheck_alive=alive, api_key=None
        ),
        reward=RewardModel.from_args(args),
        reporter=Reporter(OutputArgs(progress=False), None, 4),
        recovery=None,  # --engine-restart-limit 0
        eval_prompts={
            "math": [Prompt(0, "ab", None, (1, 2)), Prompt(1, "cde", None, (3, 4, 5))],
            "code": [Prompt(0, "z", None, (26,))],
        },
    )


@pytest.fixture
def engine(monkeypatch):
    stub = StubEngine()
    real = loop.Generator

    def generator(*args, **kwargs):
        gen = real(*args, **kwargs)
        gen.clients = [stub]
        return gen

    monkeypatch.setattr(loop, "Generator", generator)
    return stub


def test_each_eval_set_is_sampled_with_the_eval_params_and_reports_pass_at_k(tmp_path, engine):
    args = _eval_args(
        tmp_path, "--eval-temperature", "0", "--eval-top-p", "0.5", "--eval-max-response-len", "3"
    )
    results = loop.run_eval(_job(args, engine), rollout_id=1)
    assert list(results) == ["math", "code"]
    # samples 0 and 2 of 4 pass: pass@1 = 1/2, pass@2 = 1 - C(2,2)/C(4,2) = 5/6, pass@4 = 1
    for metrics in results.values():
        assert metrics["reward_mean"] == 0.5
        assert metrics["pass@1"] == pytest.approx(0.5)
        assert metrics["pass@2"] == pytest.approx(5 / 6)
        assert metrics["pass@4"] == 1.0
    assert results["math"]["response_len_mean"] == 2.5  # the stub answers the prompt reversed
    assert len(engine.sampling_params) == (2 + 1) * 4
    for params in engine.sampling_params:
        assert (params["temperature"], params["top_p"], params["max_new_tokens"]) == (0, 0.5, 3)


def test_eval_sampling_defaults_to_the_rollouts(tmp_path, engine):
    args = _eval_args(tmp_path, "--rollout-top-p", "0.9", "--rollout-temperature", "0.7")
    loop.run_eval(_job(args, engine), rollout_id=1)
    assert {
        (p["temperature"], p["top_p"], p["max_new_tokens"]) for p in engine.sampling_params
    } == {(0.7, 0.9, 16)}


def test_eval_metrics_and_time_are_in_the_reported_record(tmp_path, engine, monkeypatch):
    args = _eval_args(tmp_path)
    args.metrics_jsonl = str(tmp_path / "m.jsonl")
    job = _job(args, engine)
    job.reporter = Reporter.from_args(args, 4)
    real = loop.run_eval

    def slow_eval(job, rollout_id):
        time.sleep(0.05)
        return real(job, rollout_id)

    monkeypatch.setattr(loop, "run_eval", slow_eval)
    for rollout_id in (0, 1):
        record = {"rollout_id": rollout_id, "rollout": {"reward_mean": 0.0, "response_len_mean": 1}}
        record["time"] = {"gen": 0.1}
        loop.add_eval(job, record)  # as the loops do, before the record is reported
        job.reporter.rollout(record)
    job.reporter.close()
    first, second = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert "eval" not in first and "eval" not in first["time"]  # --eval-interval 2
    assert second["time"]["eval"] >= 0.05
    assert second["eval"]["code"]["pass@2"] == pytest.approx(5 / 6)


def test_evaluation_before_training_is_on_by_default(tmp_path, engine):
    """From rollout 0 with eval sets, the initial weights are evaluated first and reported as
    rollout -1; --skip-eval-before-train and a resumed run do not."""
    args = _eval_args(tmp_path)
    args.metrics_jsonl = str(tmp_path / "m.jsonl")
    job = _job(args, engine)
    job.reporter = Reporter.from_args(args, 4)
    loop.eval_before_training(job)
    job.reporter.close()
    (record,) = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert record["rollout_id"] == -1 and set(record) == {"rollout_id", "eval", "time"}
    assert record["eval"]["code"]["pass@2"] == pytest.approx(5 / 6)
    assert len(engine.sampling_params) == (2 + 1) * 4
    for job in (
        _job(_eval_args(tmp_path, "--skip-eval-before-train"), engine),
        _job(_eval_args(tmp_path), engine, next_rollout_id=3),
    ):
        loop.eval_before_training(job)
    assert len(engine.sampling_params) == (2 + 1) * 4


def test_eval_before_training_line():
    from miles_launch.reporting import eval_lines

    (line,) = eval_lines({"rollout_id": -1, "eval": {"gsm8k": {"pass@1": 0.5}}})
    assert line == "eval before training | gsm8k | pass@1 0.5000"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--eval-prompt-data", "a"],
            "--eval-prompt-data expects NAME PATH pairs, got 1 values: a",
        ),
        (
            ["--eval-prompt-data", "a", "x.jsonl", "a", "y.jsonl"],
            "--eval-prompt-data: the set name 'a' is given twice",
        ),
        (
            ["--eval-interval", "1", "--eval-prompt-data", "a", "nope.jsonl"],
            "a nope.jsonl: no such",
        ),
        (["--eval-top-p", "1.5"], "--eval-top-p must be in (0, 1], got 1.5"),
        (["--eval-temperature", "-1"], "--eval-temperature must be >= 0.0, got -1.0"),
        (["--eval-max-response-len", "0"], "--eval-max-response-len must be >= 1, got 0"),
        (
            ["--skip-eval-before-train"],
            "--skip-eval-before-train requires --eval-prompt-data",
        ),
        (["--pass-threshold", "nan"], "--pass-threshold must be a finite number, got nan"),
    ],
)
def test_bad_eval_flags_are_one_line_errors(tmp_path, flags, message):
    with pytest.raises(ArgumentError) as info:
        parse(tmp_path, *flags)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
