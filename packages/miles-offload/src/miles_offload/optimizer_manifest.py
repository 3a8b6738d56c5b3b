"""Checkpoints of the streamed AdamW: per-rank directories with a ``manifest.json``.

Layout (``save(path)`` on every rank)::

    <path>/rank00000/manifest.json            written last (temp file + rename)
    <path>/rank00000/bucket_00000.bin ...     copies of the rank's bucket files
    <path>/rank00000/small_state.safetensors  exp_avg / exp_avg_sq of the small parameters

The manifest records the format, the dtypes, ``bucket_numel``, the step, every parameter
(name, full shape, streamed or small, the rank's flat range and its step count) and the
bucket layout (segments with their byte offsets). :class:`SavedState` reads all ranks'
manifests and serves any flat element range of any parameter's state by name, so a run with
another DP size or bucket size rebuilds its own buckets from it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil

import torch
from miles_native import PinnedArena
from safetensors import safe_open
from safetensors.torch import save_file

from miles_offload.optimizer_buckets import ALIGNMENT, KINDS, MOMENT_DTYPES, entry_view, local_shard

FORMAT = "miles-streamed-adamw"
VERSION = 1
MANIFEST = "manifest.json"
SMALL_STATE = "small_state.safetensors"


def rank_dir(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:05d}")


def write_manifest(directory: str, manifest: dict) -> None:
    """Write ``manifest.json`` atomically (temp file, fsync, rename)."""
    final = os.path.join(directory, MANIFEST)
    tmp = final + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _pread_into(fd: int, out: torch.Tensor, offset: int, path: str) -> None:
    view = out.view(torch.uint8).numpy()
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"{path}: unexpected end of file at offset {offset + done}")
        done += n


class SavedState:
    """A streamed-AdamW checkpoint written by any number of ranks, readable by parameter name."""

    def __init__(self, path: str) -> None:
        files = sorted(glob.glob(os.path.join(path, "rank*", MANIFEST)))
        if not files:
            raise ValueError(
                f"{path}: no streamed optimizer state (rank*/{MANIFEST}); this checkpoint was "
                "written without --stream-optimizer-state-to-disk. Pass --no-load-optim to "
                "start the optimizer fresh from the loaded weights"
            )
        self.path = path
        self.manifests: list[dict] = []
        for file in files:
            with open(file) as f:
                manifest = json.load(f)
            if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
                raise ValueError(
                    f"{file}: not a {FORMAT} v{VERSION} manifest "
                    f"(format={manifest.get('format')!r}, version={manifest.get('version')!r})"
                )
            manifest["_dir"] = os.path.dirname(file)
            self.manifests.append(manifest)
        world = {m["world_size"] for m in self.manifests}
        ranks = sorted(m["rank"] for m in self.manifests)
        if len(world) != 1 or ranks != list(range(world.pop())):
            raise ValueError(f"{path}: incomplete checkpoint, manifests of ranks {ranks} only")
        first = self.manifests[0]
        self.moment_dtype: str = first["moment_dtype"]
        self.step: int = first["step"]
        self.initialized: bool = first["initialized"]
        self.params: dict[str, dict] = first["params"]
        # name -> [(global_start, numel, file, byte offsets of the 3 entries)]
        self._pieces: dict[str, list[tuple[int, int, str, list[int]]]] = {}
        # name -> [(global_start, numel, safetensors file)]
        self._small: dict[str, list[tuple[int, int, str]]] = {}
        for m in self.manifests:
            for bucket in m["buckets"]:
                file = os.path.join(m["_dir"], bucket["file"])
                for s in bucket["segments"]:
                    self._pieces.setdefault(s["name"], []).append(
                        (s["global_start"], s["numel"], file, s["offsets"])
                    )
            for name, info in m["params"].items():
                if not info["streamed"] and info["local_numel"] > 0:
                    self._small.setdefault(name, []).append(
                        (
                            info["global_start"],
                            info["local_numel"],
                            os.path.join(m["_dir"], SMALL_STATE),
                        )
                    )
        for pieces in (*self._pieces.values(), *self._small.values()):
            pieces.sort(key=lambda piece: piece[0])

    def verify(self, moment_dtype: str, params: dict[str, dict]) -> None:
        """Refuse a checkpoint whose dtypes or parameters differ from this optimizer's."""
        where = os.path.join(self.manifests[0]["_dir"], MANIFEST)
        if self.moment_dtype != moment_dtype:
            raise ValueError(
                f"{where}: Adam moments were saved as {self.moment_dtype} but this run uses "
                f"--stream-optimizer-state-moment-dtype {moment_dtype}; resume with "
                f"--stream-optimizer-state-moment-dtype {self.moment_dtype} (or --no-load-optim)"
            )
        for m in self.manifests:
            if m["master_dtype"] != "fp32" or m["moment_dtype"] not in MOMENT_DTYPES:
                raise ValueError(f"{where}: unsupported dtypes in rank {m['rank']}'s manifest")
        missing = sorted(set(params) - set(self.params))
        extra = sorted(set(self.params) - set(params))
        if missing or extra:
            raise ValueError(
                f"{where}: parameter names differ from the model's (missing from the "
                f"checkpoint: {missing[:5]}, unknown to the model: {extra[:5]})"
            )
        for name, info in params.items():
            saved = self.params[name]
            if list(saved["shape"]) != list(info["shape"]):
                raise ValueError(
                    f"{where}: {name} has shape {saved['shape']} in the checkpoint, "
                    f"{list(info['shape'])} in the model"
                )
            if saved["streamed"] != info["streamed"]:
                raise ValueError(
                    f"{where}: {name} was {'streamed' if saved['streamed'] else 'kept on the device'}"
                    " when saved; keep --stream-optimizer-min-numel as it was"
                )

    def param_step(self, name: str) -> int:
        return self.params[name]["step"]

    def read_entry(self, name: str, kind: int, lo: int, out: torch.Tensor) -> None:
        """Fill the 1-D CPU tensor ``out`` with ``KINDS[kind]`` of ``name``'s elements from ``lo``."""
        itemsize = out.element_size()

        def copy(piece, a: int, b: int, dst: torch.Tensor) -> None:
            start, _, file, offsets = piece
            fd = os.open(file, os.O_RDONLY)
            try:
                _pread_into(fd, dst, offsets[kind] + (a - start) * itemsize, file)
            finally:
                os.close(fd)

        self._fill(self._pieces.get(name, []), name, KINDS[kind], lo, out, copy)

    def read_small(self, name: str, key: str, lo: int, out: torch.Tensor) -> None:
        """Fill ``out`` with the saved small-parameter state ``key`` of ``name`` from ``lo``."""

        def copy(piece, a: int, b: int, dst: torch.Tensor) -> None:
            start, _, file = piece
            with safe_open(file, framework="pt") as f:
                dst.copy_(f.get_slice(f"{name}/{key}")[a - start : b - start])

        self._fill(self._small.get(name, []), name, key, lo, out, copy)

    def _fill(self, pieces, name: str, what: str, lo: int, out: torch.Tensor, copy) -> None:
        hi, cursor = lo + out.numel(), lo
        for piece in pieces:
            start, numel = piece[0], piece[1]
            if start + numel <= cursor or cursor >= hi:
                continue
            if start > cursor:
                break
            b = min(hi, start + numel)
            copy(piece, cursor, b, out[cursor - lo : b - lo])
            cursor = b
        if cursor < hi:
            raise ValueError(
                f"{self.path}: the checkpoint lacks {what} of {name} elements [{cursor}, {hi})"
            )


def save_checkpoint(opt, path: str) -> None:
    """``StreamedAdamW.save``: this rank's files, small state and manifest (see the top)."""
    directory = rank_dir(path, opt.rank)
    os.makedirs(directory, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):  # an older save here is no longer valid
        os.remove(os.path.join(directory, MANIFEST))
    if opt._initialized:
        for bucket in opt.buckets:
            shutil.copyfile(
                os.path.join(opt.directory, bucket.file_name),
                os.path.join(directory, bucket.file_name),
            )
    small = {}
    for p, name, _ in opt._small:
        state = opt.state.get(p)
        if state:
            for key in ("exp_avg", "exp_avg_sq"):
                small[f"{name}/{key}"] = local_shard(state[key])[0].reshape(-1).cpu()
    save_file(small, os.path.join(directory, SMALL_STATE))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "rank": opt.rank,
        "world_size": opt.world_size,
        "master_dtype": "fp32",
        "moment_dtype": opt.config.moment_dtype,
        "bucket_numel": opt.config.bucket_numel,
        "min_numel": opt.config.min_numel,
        "alignment": ALIGNMENT,
        "step": max(opt._steps, default=0),
        "initialized": opt._initialized,
        "params": opt.param_records(),
        "buckets": [
            {"file": b.file_name, "nbytes": b.nbytes, "segments": [s.to_json() for s in b.segments]}
            for b in opt.buckets
        ],
    }
    write_manifest(directory, manifest)


def load_checkpoint(opt, path: str) -> None:
    """``StreamedAdamW.load``: verify, then rebuild this rank's buckets and small state."""
    saved = SavedState(path)
    saved.verify(opt.config.moment_dtype, opt.param_records())
    for k, (_, name, _) in enumerate(opt._streamed):
        opt._steps[k] = saved.param_step(name)
    if saved.initialized and opt.buckets:
        arena = PinnedArena(max(b.nbytes for b in opt.buckets), pin=False)
        host = torch.frombuffer(arena, dtype=torch.uint8)
        for bucket in opt.buckets:
            buffer = host[: bucket.nbytes]
            buffer.zero_()
            for seg in bucket.segments:
                for kind in range(3):
                    out = entry_view(buffer, seg, kind, opt.moment_dtype)
                    saved.read_entry(seg.name, kind, seg.global_start, out)
            opt._streamers[bucket.index].write(arena.ptr, bucket.nbytes, 0)
        del host, buffer
    opt._initialized = saved.initialized
    for p, name, _ in opt._small:
        step = saved.param_step(name)
        opt.state.pop(p, None)
        if step == 0:
            continue
        state = opt.new_small_state(p, step)
        local, start = local_shard(p)
        if local.numel():
            for key in ("exp_avg", "exp_avg_sq"):
                flat = torch.empty(local.numel(), dtype=local.dtype)
                saved.read_small(name, key, start, flat)
                local_shard(state[key])[0].view(-1).copy_(flat)
        opt.state[p] = state
