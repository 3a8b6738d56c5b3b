"""The checkpoint layout both backends share: naming, the tracker, meta.json, durability.

::

    <save>/latest_checkpointed_iteration.txt   one integer; written last, atomically
    <save>/iter_0000001/meta.json              CheckpointMeta (temp file + rename)
    <save>/iter_0000001/...                    the backend's own files (DCP, torch_dist, ...)

A checkpoint *exists* once the tracker names it. :func:`commit_iteration` is the only writer of
the tracker and runs in this order: meta.json -> fsync of every file and directory of the
iteration -> fsync of ``<save>`` -> tracker (temp + fsync + rename + fsync of ``<save>``). A crash
at any point before the rename leaves the tracker naming the previous iteration, which is
therefore still what ``--load`` resumes. ``--load`` always takes the parent directory; the
tracker (or ``--ckpt-step``) picks the iteration. See docs/checkpoints.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
META_FILENAME = "meta.json"
ITERATION_DIR_RE = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint directory, tracker or meta.json is missing or malformed (the message names it)."""


def iteration_dir_name(iteration: int) -> str:
    """``iter_{iteration:07d}``, the name of an iteration's directory."""
    if iteration < 0:
        raise ValueError(f"checkpoint iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    """``<save_dir>/iter_{iteration:07d}``."""
    return Path(save_dir) / iteration_dir_name(iteration)


def list_iterations(save_dir: str | os.PathLike) -> list[int]:
    """Iterations that have a directory under ``save_dir``, ascending (committed or not)."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = ITERATION_DIR_RE.match(entry.name)
        if match and entry.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def installed_miles_versions() -> dict[str, str]:
    """Versions of the installed ``miles-*`` distributions and of torch, by distribution name."""
    versions: dict[str, str] = {}
    for dist in distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        if name.startswith("miles-") or name == "torch":
            versions[name] = dist.version
    return dict(sorted(versions.items()))


@dataclass
class CheckpointMeta:
    """What meta.json holds: the counters a resumed run continues from.

    ``iteration`` is the directory's number; ``rollout_id`` the rollout whose training the
    checkpoint follows; ``next_rollout_id`` the rollout a resumed run starts with (the value
    :meth:`TrainBackend.init` returns); ``global_step`` counts optimizer steps and ``micro_step``
    micro-batches since the start of training; ``world_size`` is the number of trainer ranks that
    wrote it; ``backend`` the ``--train-backend`` name. ``timestamp`` is Unix seconds at commit.
    ``versions`` maps installed miles distributions (and torch) to versions. ``extra`` is the
    backend's own JSON-serialisable state (EMA step, data-loader offset, ...).
    """

    iteration: int
    rollout_id: int
    next_rollout_id: int
    global_step: int
    micro_step: int
    world_size: int
    backend: str
    timestamp: float = field(default_factory=time.time)
    versions: dict[str, str] = field(default_factory=installed_miles_versions)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "meta.json") -> CheckpointMeta:
        """Build from parsed JSON; a missing or mistyped field raises naming ``source`` and it.

        Keys this version does not know are ignored, so a newer writer stays readable.
        """
        if not isinstance(data, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(data).__name__}")
        expected: dict[str, tuple[type, ...]] = {
            "iteration": (int,),
            "rollout_id": (int,),
            "next_rollout_id": (int,),
            "global_step": (int,),
            "micro_step": (int,),
            "world_size": (int,),
            "backend": (str,),
            "timestamp": (int, float),
            "versions": (dict,),
            "extra": (dict,),
        }
        values = {}
        for f in fields(cls):
            if f.name not in data:
                raise CheckpointError(f"{source}: missing field '{f.name}'")
            value = data[f.name]
            if isinstance(value, bool) or not isinstance(value, expected[f.name]):
                raise CheckpointError(
                    f"{source}: field '{f.name}' must be {expected[f.name][0].__name__}, "
                    f"got {value!r}"
                )
            values[f.name] = value
        return cls(**values)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so that the entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every regular file under ``root``, then every directory bottom-up, then ``root``.

    Symbolic links are not followed (their targets are not part of the checkpoint).
    """
    root = Path(root)
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a part.

    Temp file in the same directory -> write -> fsync -> rename over ``path`` -> fsync directory.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_meta(iter_dir: str | os.PathLike, meta: CheckpointMeta) -> Path:
    """Write ``<iter_dir>/meta.json`` atomically; returns its path."""
    path = Path(iter_dir) / META_FILENAME
    atomic_write_text(path, json.dumps(meta.to_dict(), indent=2, sort_keys=True) + "\n")
    return path


def read_meta(iter_dir: str | os.PathLike) -> CheckpointMeta:
    """Read ``<iter_dir>/meta.json``; errors name the file."""
    path = Path(iter_dir) / META_FILENAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint meta file {path} does not exist") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    return CheckpointMeta.from_dict(data, source=str(path))


def write_tracker(save_dir: str | os.PathLike, iteration: int) -> Path:
    """Point ``<save_dir>/latest_checkpointed_iteration.txt`` at ``iteration`` (atomic, durable)."""
    path = Path(save_dir) / TRACKER_FILENAME
    iteration_dir_name(iteration)  # validates
    atomic_write_text(path, f"{iteration}\n")
    return path


def read_tracker(save_dir: str | os.PathLike) -> int | None:
    """The iteration the tracker names, or None when ``save_dir`` has no tracker yet.

    A tracker that is not one non-negative integer raises :class:`CheckpointError` naming it.
    """
    path = Path(save_dir) / TRACKER_FILENAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    stripped = text.strip()
    if not (stripped.isascii() and stripped.isdigit()):
        raise CheckpointError(
            f"checkpoint tracker {path} is corrupt: expected one non-negative integer, "
            f"got {text[:40]!r}"
        )
    return int(stripped)


def prepare_iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    """Create an empty ``<save_dir>/iter_{iteration:07d}`` for a new save; returns it.

    Call on one rank (rank 0) before the others write, with a barrier after. Leftovers of an
    earlier save of the same iteration that was never committed (a crash) are removed first. The
    iteration the tracker names is refused: overwriting it in place would leave no loadable
    checkpoint should this save crash.
    """
    target = iteration_dir(save_dir, iteration)
    if read_tracker(save_dir) == iteration:
        raise CheckpointError(
            f"refusing to overwrite {target}: it is the committed checkpoint named by "
            f"{Path(save_dir) / TRACKER_FILENAME}"
        )
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    return target


def commit_iteration(save_dir: str | os.PathLike, iteration: int, meta: CheckpointMeta) -> Path:
    """Make ``iteration`` the checkpoint that ``--load <save_dir>`` resumes.

    Call on one rank (rank 0) after every rank has finished writing its files into
    ``<save_dir>/iter_{iteration:07d}`` (and after async writers have finished). Order: write
    meta.json; fsync every file and directory of the iteration; fsync ``save_dir``; write the
    tracker atomically. Returns the iteration directory.
    """
    if meta.iteration != iteration:
        raise ValueError(f"CheckpointMeta.iteration {meta.iteration} != iteration {iteration}")
    target = iteration_dir(save_dir, iteration)
    if not target.is_dir():
        raise CheckpointError(f"cannot commit checkpoint: {target} does not exist")
    write_meta(target, meta)
    fsync_tree(target)
    fsync_dir(save_dir)
    write_tracker(save_dir, iteration)
    return target


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """The iteration ``--load`` resumes: its number, directory and meta.json."""

    iteration: int
    path: Path
    meta: CheckpointMeta


def resolve_load(
    load_dir: str | os.PathLike, ckpt_step: int | None = None
) -> ResolvedCheckpoint | None:
    """Pick the iteration to resume from ``--load load_dir`` (and ``--ckpt-step``).

    With ``ckpt_step`` that iteration is taken, whatever the tracker says: it is how one goes
    back to an older checkpoint. Its directory must exist and hold a meta.json (written by
    :func:`commit_iteration` only after every rank finished writing). Without it the tracker decides; a directory
    with no tracker holds no committed checkpoint and gives None (start from scratch). Errors
    name the flag, directory or file at fault.
    """
    root = Path(load_dir)
    if ITERATION_DIR_RE.match(root.name):
        raise CheckpointError(
            f"--load takes the parent directory of the iter_* directories: use "
            f"--load {root.parent} (with --ckpt-step {int(root.name[5:])} for this one)"
        )
    if not root.is_dir():
        raise CheckpointError(f"--load directory {root} does not exist")
    if ckpt_step is not None:
        target = iteration_dir(root, ckpt_step)
        if not target.is_dir():
            have = ", ".join(str(i) for i in list_iterations(root)) or "none"
            raise CheckpointError(
                f"--ckpt-step {ckpt_step}: {target} does not exist (iterations in {root}: {have})"
            )
        iteration = ckpt_step
    else:
        iteration = read_tracker(root)
        if iteration is None:
            return None
        target = iteration_dir(root, iteration)
        if not target.is_dir():
            raise CheckpointError(
                f"checkpoint tracker {root / TRACKER_FILENAME} names iteration {iteration}, "
                f"but {target} does not exist"
            )
    meta = read_meta(target)
    if meta.iteration != iteration:
        raise CheckpointError(
            f"{target / META_FILENAME}: iteration {meta.iteration} does not match the directory"
        )
    return ResolvedCheckpoint(iteration=iteration, path=target, meta=meta)
