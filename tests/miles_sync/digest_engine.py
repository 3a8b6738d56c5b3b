"""The built-in engine plus one test-only endpoint, ``GET /weights_digest``.

``python digest_engine.py --model-path DIR --port P`` serves exactly what ``python -m
miles_launch.builtin_engine`` serves (same argument parser, state and app) and adds a route that returns
the xxh3-128 of every parameter's raw bytes, read on the scheduler thread, so tests can compare
the engine's live weights with the trainer's bit for bit; and ``GET /memory_state``, whether
its weights are released and the bytes of its KV cache (the colocated cycle's residency test).
"""

from __future__ import annotations

import asyncio

import torch
import uvicorn
import xxhash
from miles_launch.builtin_engine.__main__ import build_state, parse_args
from miles_launch.builtin_engine.server import build_app


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    out = {}
    for name, tensor in tensors.items():
        raw = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        out[name] = [xxhash.xxh3_128_hexdigest(raw), str(tensor.dtype), list(tensor.shape)]
    return out


def main() -> None:
    config = parse_args()
    state = build_state(config)
    app = build_app(state)

    @app.get("/weights_digest")
    async def weights_digest():
        future = state.scheduler.run_control(lambda: digests(state.weights.tensors))
        return await asyncio.wrap_future(future)

    @app.get("/memory_state")
    async def memory_state():
        def read():
            return {
                "weights_released": state.weights.released,
                "kv_cache_bytes": state.scheduler.kv_cache_bytes(),
            }

        return await asyncio.wrap_future(state.scheduler.run_control(read))

    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
    finally:
        state.scheduler.shutdown()


if __name__ == "__main__":
    main()
