"""How step metrics combine (miles_core.metric_reduction), in one process: shares add up,
extremes take the maximum / minimum, per-sample values the extreme over the samples, steps
average the shares; an extreme that saw nothing is left out. (Across ranks:
tests/miles_core/test_loss_equivalence.py's 2-rank spawn.)"""

from __future__ import annotations

import math

import torch
from miles_core.metric_reduction import (
    MAX,
    MIN,
    SUM,
    StepMetrics,
    kind,
    masked_max,
    masked_min,
    over_steps,
    per_sample,
)


def test_the_name_says_how_a_metric_combines():
    assert kind("loss") == SUM and kind("train_rollout_is_ratio_max") == MAX
    assert kind("train_rollout_is_ratio_min") == MIN and kind("x_sample_max") == MAX
    assert per_sample("x_sample_max") and per_sample("x_sample_min")
    assert not per_sample("x_max") and not per_sample("loss")


def test_micro_batches_combine_by_kind():
    step = StepMetrics()
    step.add({"loss": torch.tensor(0.25), "a_max": torch.tensor(1.0), "a_min": torch.tensor(3.0),
              "s_sample_max": torch.tensor([0.5, 2.0]), "s_sample_min": torch.tensor([0.5])})  # fmt: skip
    step.add({"loss": torch.tensor(0.5), "a_max": torch.tensor(4.0), "a_min": torch.tensor(-1.0),
              "s_sample_max": torch.tensor([]), "s_sample_min": torch.tensor([0.1, 7.0])})  # fmt: skip
    reduced, also = step.reduce(also=torch.tensor(9.0))
    assert reduced == {"loss": 0.75, "a_max": 4.0, "a_min": -1.0, "s_sample_max": 2.0,
                       "s_sample_min": reduced["s_sample_min"]}  # fmt: skip
    assert math.isclose(reduced["s_sample_min"], 0.1, rel_tol=1e-7) and also == 9.0


def test_steps_average_shares_and_keep_extremes_that_saw_something():
    steps = [
        {"loss": 1.0, "a_max": 2.0, "b_min": math.inf, "c_max": -math.inf},
        {"loss": 3.0, "a_max": 5.0, "b_min": 0.5, "c_max": -math.inf},
    ]
    assert over_steps(steps) == {"loss": 2.0, "a_max": 5.0, "b_min": 0.5}


def test_masked_extremes_ignore_untrained_tokens():
    values = torch.tensor([5.0, -1.0, 2.0, 9.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert masked_max(values, mask).item() == 2.0 and masked_min(values, mask).item() == -1.0
    assert masked_max(values, torch.zeros(4)).item() == -math.inf
    assert masked_min(torch.empty(0), torch.empty(0)).item() == math.inf
