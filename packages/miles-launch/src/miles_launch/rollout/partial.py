"""Partial rollout (``--partial-rollout``, slime's): unfinished samples carried into the next
rollout.

With ``--over-sampling-batch-size`` a draw generates more groups than the rollout needs. Once
enough groups have finished with a learning signal (``--dynamic-filter``), the synchronous loop
aborts every engine's requests (``/abort_request`` with ``abort_all``): the groups still
running come back with some samples finished and others cut short (``finish_reason``
``abort``, their tokens so far). Such a group goes to the :class:`PartialBuffer` and is the
first thing the next rollout draws, after the new weights were published:

* a finished sample is kept as it was generated (its log-probs and ``weight_version`` those of
  the policy that generated it);
* an unfinished one is sent again as ``prompt + partial response`` with ``max_new_tokens``
  reduced by the partial length; the engine continues the response under the new weights. The
  sample trains on ``partial + continuation`` with the log-probs the engine returned when it
  sampled each token: the partial tokens keep their first record (the older policy's), the
  continuation has the new policy's, and ``weight_version`` is the new one (its last tokens').
  So every token's rollout log-prob is that of the policy that sampled it, which is what
  ``--use-tis`` and the mismatch metrics need (re-scoring the carried tokens under the new
  weights would make their importance ratio about 1 for tokens an older policy chose).
  ``--mask-offpolicy-in-partial-rollout`` (slime's flag) gives the carried tokens loss mask 0
  instead: only the continuation trains.

The buffer lives on the driver: a run resumed from a checkpoint starts with an empty buffer
(the carried prompts were drawn already and are not drawn again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: ``finish_reason`` of a sample cut short by the abort.
UNFINISHED = "abort"


def unfinished(group: Sequence[Any]) -> bool:
    """Whether some sample of ``group`` was cut short (the group is carried, not trained)."""
    return any(s.finish_reason == UNFINISHED for s in group)


@dataclass
class PartialBuffer:
    """Groups carried from one rollout into the next: ``(prompt, position, samples)`` in the
    order they were cut short; ``samples[k]`` is sample ``k`` as it stood at the abort."""

    groups: list[tuple[Any, int, list[Any]]] = field(default_factory=list)

    def put(self, group: list[Any]) -> None:
        first = group[0]
        self.groups.append((first.prompt, first.position, list(group)))

    def take(self, count: int) -> list[tuple[Any, int, list[Any]]]:
        """The oldest ``count`` carried groups (fewer when fewer are carried), removed."""
        out, self.groups = self.groups[:count], self.groups[count:]
        return out
