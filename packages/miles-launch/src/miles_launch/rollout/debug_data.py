"""``--save-debug-rollout-data`` / ``--load-debug-rollout-data``: one rollout's training data on
disk, and its replay into training without engines.

The path is a template: ``{rollout_id}`` is replaced by the rollout's id (as in slime), e.g.
``/tmp/run/rollout_{rollout_id}.pt``. One file per rollout, written with ``torch.save`` and read
back with ``torch.load(weights_only=True)`` (tensors and plain values only, nothing executes)::

    {"format": 1, "rollout_id": 3,
     "samples": [{"tokens": int64 [L], "response_length": int, "reward": float,
                  "loss_mask": ..., "rollout_log_probs": float32 [R], "teacher_log_probs": ...,
                  "routed_experts": ..., "group_index": int, "weight_version": int | None,
                  "fields": {}}, ...],
     "prompt_ids": [...], "rollout": {reward_mean, ..., draws, groups_dropped}}

``samples`` is exactly the :class:`~miles_core.batch.RolloutBatch` the live run handed to
``train`` (in its order), so a replay trains on the same bytes: the step is bitwise the live
run's (given the same checkpoint, seeds and layout).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from miles_core.batch import RolloutBatch, Sample

logger = logging.getLogger(__name__)

FORMAT = 1
_SAMPLE_FIELDS = (
    "tokens",
    "response_length",
    "reward",
    "loss_mask",
    "rollout_log_probs",
    "teacher_log_probs",
    "routed_experts",
    "group_index",
    "weight_version",
)


class DebugDataError(ValueError):
    """A debug rollout data file is missing or malformed (the message names the file)."""


def data_path(template: str, rollout_id: int) -> Path:
    """The file of ``rollout_id``: ``template`` with ``{rollout_id}`` replaced."""
    return Path(template.format(rollout_id=rollout_id))


def check_template(flag: str, template: str) -> None:
    """Raise :class:`DebugDataError` naming ``flag`` when ``template`` has a field other than
    ``{rollout_id}`` (or a stray brace)."""
    try:
        template.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as error:
        raise DebugDataError(
            f"{flag} {template!r}: the only placeholder allowed is {{rollout_id}} ({error!r})"
        ) from None


def save_rollout_data(
    template: str, rollout_id: int, batch: RolloutBatch, info: dict[str, Any]
) -> Path:
    """Write ``batch`` (what ``train`` receives) and ``info`` (``prompt_ids``, ``rollout``
    stats) to the file of ``rollout_id``."""
    path = data_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = [
        {**{name: getattr(s, name) for name in _SAMPLE_FIELDS}, "fields": dict(s.fields)}
        for s in batch
    ]
    payload = {"format": FORMAT, "rollout_id": rollout_id, "samples": samples, **info}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)
    logger.info("rollout %d: training data saved to %s", rollout_id, path)
    return path


def load_rollout_data(template: str, rollout_id: int) -> tuple[RolloutBatch, dict[str, Any]]:
    """The batch saved for ``rollout_id`` and the rest of its file (``prompt_ids``,
    ``rollout``, ``rollout_id`` as saved)."""
    path = data_path(template, rollout_id)
    if not path.is_file():
        raise DebugDataError(f"--load-debug-rollout-data: {path} (rollout {rollout_id}) missing")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise DebugDataError(f"--load-debug-rollout-data: {path}: unreadable ({error})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise DebugDataError(
            f"--load-debug-rollout-data: {path}: not a miles rollout data file of format {FORMAT}"
        )
    try:
        batch = RolloutBatch([Sample(**s) for s in payload.pop("samples")])
    except (TypeError, ValueError) as error:
        raise DebugDataError(f"--load-debug-rollout-data: {path}: {error}") from None
    return batch, payload
