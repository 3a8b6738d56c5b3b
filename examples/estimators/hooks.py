"""Examples of the estimator hooks: ``--custom-advantage-function-path hooks:length_penalized``
and ``--dynamic-sampling-filter-path hooks:keep_mixed_groups`` (with this directory on
``PYTHONPATH``).

``length_penalized`` is GRPO's group-normalised reward minus a small penalty per trained token,
as an example of shaping the advantage from the batch; ``keep_mixed_groups`` keeps a prompt
group only when some but not all of its samples reach the full reward (``--pass-threshold``'s
default, 1.0): a group all solved or all failed has no learning signal under a group baseline.
"""

from __future__ import annotations

import torch
from miles_core.advantages import group_normalized_rewards

LENGTH_PENALTY = 1e-3


def length_penalized(args, batch) -> list[torch.Tensor]:
    """``A_i = (R_i - mean_g) / (std_g + 1e-6) - 1e-3 * (trained tokens of i)`` on every token
    of sample ``i``. ``batch`` is this rank's share of the rollout (whole prompt groups), a
    ``miles_core.batch.RolloutBatch``; return one float tensor per sample, one value per
    response token."""
    scores = group_normalized_rewards(batch.rewards, batch.group_indices)
    return [
        torch.full((s.response_length,), float(scores[i]) - LENGTH_PENALTY * float(s.mask.sum()))
        for i, s in enumerate(batch)
    ]


def keep_mixed_groups(args, group) -> bool:
    """Keep a prompt group (its samples, each with ``reward``, ``response_ids``,
    ``loss_mask``...) when some but not all samples have reward >= 1.0."""
    solved = sum(s.reward >= 1.0 for s in group)
    return 0 < solved < len(group)
