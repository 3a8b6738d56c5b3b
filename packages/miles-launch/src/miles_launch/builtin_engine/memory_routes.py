"""The built-in engine's memory endpoints: SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation`` (with their ``tags``) and ``/get_weights_by_name``."""

from __future__ import annotations

import torch
from fastapi import FastAPI, Request

from miles_launch.builtin_engine.server import (
    MEMORY_TAGS,
    ApiError,
    EngineState,
    _error,
    _json_body,
)


def add_memory_routes(app: FastAPI, state: EngineState, control) -> None:
    """Register the memory endpoints on ``app``; ``control(fn)`` runs ``fn`` on the scheduler."""
    sched = state.scheduler

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        """SGLang's: the first ``truncate_size`` rows of the tensor of HF name ``name`` as
        float32 lists (bf16 and fp16 values are exact in float32, so callers can compare bits)."""
        body = await _json_body(request)
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str):
            return _error("get_weights_by_name: field name (a string) is required")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            return _error(
                f"get_weights_by_name: truncate_size must be a positive int, got {size!r}"
            )

        def read():
            if state.weights.released:
                raise ApiError("get_weights_by_name: weights are released")
            tensor = state.weights.resolve(name)
            if tensor is None:
                raise ApiError(f"get_weights_by_name: no parameter named {name!r}")
            rows = tensor.detach()[:size] if tensor.dim() else tensor.detach()
            return rows.to(device="cpu", dtype=torch.float32).tolist()

        return await control(read)

    def parse_tags(body: dict) -> set[str]:
        tags = body.get("tags") or MEMORY_TAGS
        if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
            raise ApiError(f"tags must be a list of strings, got {tags!r}")
        tags = set(tags)
        unknown = tags - set(MEMORY_TAGS)
        if unknown:
            raise ApiError(f"tags: unknown {sorted(unknown)}; known {list(MEMORY_TAGS)}")
        return tags

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        tags = parse_tags(await _json_body(request))

        def release():
            if not sched.fully_idle():
                raise ApiError(
                    "release_memory_occupation needs an idle server (requests are running)"
                )
            if "kv_cache" in tags:
                sched.drop_kv_cache()
            if "weights" in tags:
                state.weights.release()
                sched.weights_released = True

        await control(release)
        return {"success": True, "message": f"released {sorted(tags)}"}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        tags = parse_tags(await _json_body(request))

        def resume():
            if "weights" in tags:
                state.weights.resume()
                sched.weights_released = False

        await control(resume)
        return {"success": True, "message": f"resumed {sorted(tags)}"}
