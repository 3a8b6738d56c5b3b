"""RolloutBatch validation, selection and attached fields."""

from __future__ import annotations

import pytest
import torch
from miles_core.batch import BatchError, RolloutBatch, Sample


def _sample(length=6, resp=3, **kw):
    return Sample(tokens=torch.arange(length), response_length=resp, reward=1.0, **kw)


def test_counts_and_defaults():
    b = RolloutBatch([_sample(6, 3), _sample(5, 2)], None)
    assert b.total_lengths == [6, 5] and b.response_lengths == [3, 2] and b.total_tokens == 11
    b2 = RolloutBatch(
        [
            _sample(6, 3, loss_mask=torch.tensor([1, 1, 0])),
            _sample(5, 2, loss_mask=torch.tensor([1, 0])),
        ]
    )
    assert b2.num_loss_tokens == 3
    assert b2[0].prompt_length == 3
    assert torch.equal(b2.response_field("loss_mask")[1], torch.tensor([1.0, 0.0]))
    assert RolloutBatch([_sample()]).num_loss_tokens == 3  # no mask: every response token trains


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(response_length=0), "sample 1: field 'response_length'"),
        (dict(response_length=6), "sample 1: field 'response_length'"),
        (dict(loss_mask=torch.ones(2)), "sample 1: field 'loss_mask' has shape"),
        (dict(loss_mask=torch.tensor([1.0, 2.0, 0.0])), "sample 1: field 'loss_mask' must contain"),
        (
            dict(rollout_log_probs=torch.tensor([0.0, float("nan"), 0.0])),
            "sample 1: field 'rollout_log_probs' contains NaN",
        ),
        (
            dict(teacher_log_probs=torch.tensor([0.0, float("inf"), 0.0])),
            "sample 1: field 'teacher_log_probs' contains NaN or inf",
        ),
        (dict(reward=float("nan")), "sample 1: field 'reward'"),
        (
            dict(routed_experts=torch.zeros(3, 2, 2, dtype=torch.long)),
            "sample 1: field 'routed_experts' has 3 rows",
        ),
        (dict(tokens=torch.zeros(6)), "sample 1: field 'tokens' must hold integer"),
    ],
)
def test_validation_names_sample_and_field(kwargs, match):
    good = dict(tokens=torch.arange(6), response_length=3, reward=0.5)
    bad = {**good, **kwargs}
    with pytest.raises(BatchError, match=match):
        RolloutBatch([Sample(**good), Sample(**bad)])


def test_optional_fields_must_be_consistent():
    with pytest.raises(BatchError, match="sample 1: field 'rollout_log_probs' is missing"):
        RolloutBatch([_sample(rollout_log_probs=torch.zeros(3)), _sample()])


def test_routed_experts_accepts_one_row_short():
    RolloutBatch([_sample(routed_experts=torch.zeros(5, 2, 2, dtype=torch.int32))])
    RolloutBatch([_sample(routed_experts=torch.zeros(6, 2, 2, dtype=torch.int32))])


def test_select_and_with_fields():
    b = RolloutBatch([_sample(4 + i, 2) for i in range(5)])
    adv = [torch.full((2,), float(i)) for i in range(5)]
    b = b.with_fields(advantages=adv)
    sub = b.select([4, 1])
    assert sub.source_indices == (4, 1)
    assert [float(a[0]) for a in sub.response_field("advantages")] == [4.0, 1.0]
    subsub = sub.select([1])
    assert subsub.source_indices == (1,) and subsub[0].total_length == 5
    assert b[1:3].source_indices == (1, 2)
    with pytest.raises(BatchError, match="sample 2: field 'old_log_probs' has shape"):
        b.with_fields(
            old_log_probs=[
                torch.zeros(2),
                torch.zeros(2),
                torch.zeros(3),
                torch.zeros(2),
                torch.zeros(2),
            ]
        )
    with pytest.raises(BatchError, match="field 'values' has 1 entries for 5 samples"):
        b.with_fields(values=[torch.zeros(2)])
    with pytest.raises(BatchError, match="no field 'returns'"):
        b.response_field("returns")
