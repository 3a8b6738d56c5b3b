"""miles-native: compiled helpers (pinned arena, copy engine, file streamer) and Triton kernels.

- :class:`PinnedArena` ``(nbytes, pin=True)``: page-aligned host memory, page-locked with
  ``cudaHostRegister`` when a CUDA device is visible; a writable byte buffer
  (``torch.frombuffer(arena, dtype=torch.uint8)``).
- :class:`CopyEngine` ``(device=0, cpu_threads=2, split_bytes=64 MiB)``: ``submit(dst, src,
  nbytes, to_device, after_stream=0)`` enqueues raw-pointer copies on the engine's own CUDA
  stream for that direction after the work on ``after_stream`` and returns a
  :class:`CopyTicket`; ``synchronize()`` waits for all. Without CUDA the copies are memcpy.
- :class:`FileStreamer` ``(path, chunk_bytes, ring_chunks=4, io_threads=4, direct=True)``:
  ``write``/``read`` of aligned host memory, and ``store``/``load`` of (pointer, file offset,
  size) regions pipelined through a pinned ring. Open it with :func:`open_file_streamer`.

Pointers and CUDA streams are Python ints (``tensor.data_ptr()``,
``torch.cuda.current_stream().cuda_stream``). File errors raise ``OSError`` with ``errno``,
the file name, and ``offset``; the GIL is released during copies, waits and I/O.
"""

from importlib.metadata import version as _version

from miles_native._core import (
    CopyEngine,
    CopyTicket,
    FileStreamer,
    PinnedArena,
    build_info,
    built_with_cuda,
    cuda_runtime_available,
)
from miles_native.file_streamer import open_file_streamer

__version__ = _version("miles-native")
__all__ = [
    "CopyEngine",
    "CopyTicket",
    "FileStreamer",
    "PinnedArena",
    "build_info",
    "built_with_cuda",
    "cuda_runtime_available",
    "open_file_streamer",
    "__version__",
]
