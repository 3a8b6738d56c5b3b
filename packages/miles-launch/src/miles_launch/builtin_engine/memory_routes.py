"""The built-in engine's memory endpoints: SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation`` (with their ``tags``) and ``/get_weights_by_name``."""

from __future__ import annotations

import torch
from fastapi import FastAPI, Request

from miles_launch.builtin_engine.request_bodies import (
    GetWeightsByNameReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
)
from miles_launch.builtin_engine.server import (
    MEMORY_TAGS,
    ApiError,
    EngineState,
    body_of,
    route_boundary,
)


def add_memory_routes(app: FastAPI, state: EngineState, control) -> None:
    """Register the memory endpoints on ``app``; ``control(fn)`` runs ``fn`` on the scheduler."""
    sched = state.scheduler

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    @route_boundary
    async def get_weights_by_name(request: Request):
        """SGLang's: the first ``truncate_size`` rows of the tensor of HF name ``name`` as
        float32 lists (bf16 and fp16 values are exact in float32, so callers can compare bits)."""
        req = await body_of(request, GetWeightsByNameReqInput)
        name, size = req.name, req.truncate_size
        if size < 1:
            raise ApiError(f"get_weights_by_name: truncate_size must be a positive int, got {size}")

        def read():
            if state.weights.released:
                raise ApiError("get_weights_by_name: weights are released")
            tensor = state.weights.resolve(name)
            if tensor is None:
                raise ApiError(f"get_weights_by_name: no parameter named {name!r}")
            rows = tensor.detach()[:size] if tensor.dim() else tensor.detach()
            return rows.to(device="cpu", dtype=torch.float32).tolist()

        return await control(read)

    def parse_tags(req) -> set[str]:
        tags = set(req.tags or MEMORY_TAGS)
        unknown = tags - set(MEMORY_TAGS)
        if unknown:
            raise ApiError(f"tags: unknown {sorted(unknown)}; known {list(MEMORY_TAGS)}")
        return tags

    @app.post("/release_memory_occupation")
    @route_boundary
    async def release_memory_occupation(request: Request):
        tags = parse_tags(await body_of(request, ReleaseMemoryOccupationReqInput))

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
    @route_boundary
    async def resume_memory_occupation(request: Request):
        tags = parse_tags(await body_of(request, ResumeMemoryOccupationReqInput))

        def resume():
            if "weights" in tags:
                state.weights.resume()
                sched.weights_released = False

        await control(resume)
        return {"success": True, "message": f"resumed {sorted(tags)}"}
