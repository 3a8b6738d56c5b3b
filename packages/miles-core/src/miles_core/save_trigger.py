"""Saving on demand: ``--save-trigger-sentinel PATH`` and the save-point decision.

Creating the sentinel file asks for a checkpoint; the request is taken at the next save point
(whatever ``--save-interval`` says) and the file is deleted only once that checkpoint is durable,
so "file gone" means "checkpoint on disk"::

    touch save_now && until [ ! -e save_now ]; do sleep 5; done

The loop's save point, in one process (the driver, or every rank after :func:`agree_on_all_ranks`)::

    trigger = SaveTrigger(args.save_trigger_sentinel) if args.save_trigger_sentinel else None
    ...
    if should_save(rollout_id, args.save_interval, trigger, last_rollout_id=num_rollout - 1):
        backend.save_model(rollout_id, force_sync=trigger is not None and trigger.armed)
        if trigger is not None:
            trigger.consume()      # after save_model returned: the tracker is written

Under torchrun, where every rank runs the loop, decide with
``agree_on_all_ranks(should_save(...))`` and call :meth:`SaveTrigger.consume` on rank 0 only,
after the barrier that follows the commit: another rank's save_model can return before rank 0
has written the tracker.

A crash anywhere before :meth:`SaveTrigger.consume` leaves the file, so the request stays
pending for the next run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Request:
    """Identity of the sentinel file seen at the save point (a later re-creation differs)."""

    inode: int
    mtime_ns: int


class SaveTrigger:
    """The sentinel file of ``--save-trigger-sentinel``.

    :meth:`pending` looks for the file and, when present, *arms* the trigger with the file's
    identity (inode, mtime). :meth:`consume` deletes the file only if it is still the request
    that armed the trigger: a request made again while the save was being written (``touch``
    updates the mtime; a new file has a new inode) stays pending for the next save point.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._armed: _Request | None = None

    @property
    def armed(self) -> bool:
        """Whether the last :meth:`pending` found a request not yet consumed."""
        return self._armed is not None

    def pending(self) -> bool:
        """True when the sentinel exists; arms the trigger with what it found."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._armed = None
            return False
        self._armed = _Request(inode=st.st_ino, mtime_ns=st.st_mtime_ns)
        return True

    def consume(self) -> bool:
        """Delete the sentinel once the requested checkpoint is durable; True if deleted.

        Call only after the save returned with the tracker written. Does nothing when the
        trigger is not armed, or when the file was re-created or touched since :meth:`pending`
        (that newer request is served by the next save point).
        """
        request, self._armed = self._armed, None
        if request is None:
            return False
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        if (st.st_ino, st.st_mtime_ns) != (request.inode, request.mtime_ns):
            return False
        os.unlink(self.path)
        return True


def should_save(
    rollout_id: int,
    save_interval: int | None,
    trigger: SaveTrigger | None = None,
    *,
    last_rollout_id: int | None = None,
) -> bool:
    """Whether the save point after training ``rollout_id`` writes a checkpoint.

    Yes when ``(rollout_id + 1) % save_interval == 0`` (``save_interval`` None or 0: never by
    interval), when ``rollout_id == last_rollout_id`` (the run's final state is kept, with or
    without an interval: a run given somewhere to save always ends with a checkpoint), or when
    ``trigger`` has a pending request (checked every time, so it arms).
    """
    if save_interval is not None and save_interval < 0:
        raise ValueError(f"--save-interval must be >= 0, got {save_interval}")
    requested = trigger.pending() if trigger is not None else False
    by_interval = bool(save_interval) and (rollout_id + 1) % save_interval == 0
    is_last = last_rollout_id is not None and rollout_id == last_rollout_id
    return requested or by_interval or is_last


def agree_on_all_ranks(decision: bool, group=None) -> bool:
    """Rank 0's ``decision``, on every rank of ``group`` (a no-op without torch.distributed).

    Ranks look at the sentinel at slightly different moments; when each rank decides for
    itself, they must still save together, so rank 0's view is broadcast.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return decision
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    flag = torch.tensor([1 if decision else 0], dtype=torch.int32, device=device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(flag, src=src, group=group)
    return bool(flag.item())
