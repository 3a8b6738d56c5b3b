"""Where FSDP checkpoint pieces go on disk: the one place that knows the shared layout.

``<save>/latest_checkpointed_iteration.txt`` names the newest complete iteration and is rewritten
atomically (temp file + rename) only after that iteration's directory is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(save_dir: Path, rollout_id: int) -> Path:
    return save_dir / f"iter_{rollout_id:07d}"


def partial_dir(save_dir: Path, rollout_id: int) -> Path:
    """Staging directory that every rank writes into before the iteration is published."""
    return save_dir / f"iter_{rollout_id:07d}.partial"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_tracker(save_dir: Path) -> int | None:
    tracker = save_dir / TRACKER
    if not tracker.exists():
        return None
    return int(tracker.read_text().strip())


def tracked_dir(save_dir: Path) -> Path | None:
    """The directory of the tracked iteration, or ``None`` when ``save_dir`` has no tracker."""
    rollout_id = read_tracker(save_dir)
    if rollout_id is None:
        return None
    path = iter_dir(save_dir, rollout_id)
    if not (path / "meta.json").exists():
        raise FileNotFoundError(f"{save_dir / TRACKER} names {path.name}, which has no meta.json")
    return path


def publish(save_dir: Path, rollout_id: int, meta: dict[str, Any]) -> None:
    """Rank 0: write meta.json into the staging dir, move it into place, then the tracker."""
    staged = partial_dir(save_dir, rollout_id)
    _atomic_write(staged / "meta.json", json.dumps(meta, indent=2) + "\n")
    final = iter_dir(save_dir, rollout_id)
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    _atomic_write(save_dir / TRACKER, f"{rollout_id}\n")
    shutil.rmtree(old, ignore_errors=True)
