"""Opening a :class:`FileStreamer` with O_DIRECT, falling back (with a warning) to buffered I/O."""

from __future__ import annotations

import logging

from miles_native._core import FileStreamer

logger = logging.getLogger(__name__)


def open_file_streamer(
    path: str,
    chunk_bytes: int,
    ring_chunks: int = 4,
    io_threads: int = 4,
    direct: bool = True,
) -> FileStreamer:
    """Open ``path`` for streaming through ``ring_chunks`` staging chunks of ``chunk_bytes``.

    With ``direct`` the file bypasses the page cache (O_DIRECT); where the filesystem refuses
    that, the streamer falls back to buffered I/O and this logs a warning (host memory is then
    no longer bounded by the ring: the page cache holds what was written).
    """
    streamer = FileStreamer(
        path, chunk_bytes, ring_chunks=ring_chunks, io_threads=io_threads, direct=direct
    )
    if direct and not streamer.direct:
        logger.warning(
            "%s: the filesystem refused O_DIRECT; using buffered I/O (the page cache will "
            "hold a copy of what is written)",
            path,
        )
    return streamer
