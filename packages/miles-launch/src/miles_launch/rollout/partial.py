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
  reduced by the partial length and ``logprob_start_len = len(prompt) - 1``: the engine
  re-scores the partial tokens under the new weights (SGLang's ``input_token_logprobs``) while
  it continues the response. The sample trains on ``partial + continuation`` with the re-scored
  log-probs followed by the continuation's, and the new ``weight_version``: every token's
  rollout log-prob is the recorded policy's.

The buffer lives on the driver: a run resumed from a checkpoint starts with an empty buffer
(the carried prompts were drawn already and are not drawn again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_core.engine import EngineError

#: ``finish_reason`` of a sample cut short by the abort.
UNFINISHED = "abort"


def unfinished(group: Sequence[Any]) -> bool:
    """Whether some sample of ``group`` was cut short (the group is carried, not trained)."""
    return any(s.finish_reason == UNFINISHED for s in group)


def rescored_prefix(meta: dict[str, Any], prefix: list[int], url: str) -> list[float]:
    """The log-probs of the partial response ``prefix`` from a continuation reply's
    ``input_token_logprobs`` (requested from ``len(prompt) - 1``: the first entry, the prompt's
    last token, has none). A reply that does not cover exactly ``prefix`` raises."""
    entries = meta.get("input_token_logprobs")
    if not entries or len(entries) != len(prefix) + 1 or entries[0][0] is not None:
        got = "none" if not entries else f"{len(entries)} entries"
        raise EngineError(
            f"partial rollout: the engine's input_token_logprobs ({got}) do not cover the "
            f"{len(prefix)} carried tokens plus the prompt's last one",
            endpoint="/generate",
            base_url=url,
            status_code=None,
        )
    ids = [int(entry[1]) for entry in entries[1:]]
    if ids != prefix:
        raise EngineError(
            "partial rollout: input_token_logprobs name other tokens than the carried response",
            endpoint="/generate",
            base_url=url,
            status_code=None,
        )
    return [float(entry[0]) for entry in entries[1:]]


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
