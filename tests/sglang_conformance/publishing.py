"""Publishing to the engine stand-in in every transfer mode: configs, the disk-delta puller, and
what the stand-in should then hold."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import xxhash
from miles_sync.puller import Puller, PullerConfig

MODES = ("ipc", "broadcast", "p2p", "disk-delta")


def digests(named) -> dict[str, list]:
    """The stand-in's ``/weights_digest`` format for ``(name, tensor)`` pairs."""
    out = {}
    for name, tensor in named:
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
        out[name] = [xxhash.xxh3_128_hexdigest(raw), str(tensor.dtype), list(tensor.shape)]
    return out


def mode_flags(mode: str, disk_dir: Path) -> dict:
    """The publish settings of ``mode`` (``SyncConfig`` fields / parsed-flag attributes)."""
    flags = {"update_weight_transfer_mode": mode, "colocate": mode == "ipc"}
    if mode == "disk-delta":
        flags["update_weight_disk_dir"] = str(disk_dir)
    return flags


@contextlib.contextmanager
def puller(engine_url: str, shared: Path, local: Path) -> Iterator[None]:
    """The disk-delta puller beside the stand-in, as a thread."""
    stop = threading.Event()
    agent = Puller(PullerConfig(str(shared), str(local), engine_url, poll_interval_s=0.05))
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
