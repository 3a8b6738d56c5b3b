"""The built-in engine's weight-update endpoints: SGLang's ``/update_weights_from_tensor``,
``/update_weights_from_disk``, ``/init_weights_update_group``, ``/update_weights_from_distributed``
and ``/destroy_weights_update_group``, and the update window (``/begin_weight_update``,
``/end_weight_update``). Every load runs on the scheduler thread and checks every tensor before
it copies any."""

from __future__ import annotations

import asyncio
import logging
import re
import statistics
import time

import torch
from fastapi import FastAPI, Request

from miles_launch.builtin_engine.request_bodies import (
    BeginWeightUpdateReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from miles_launch.builtin_engine.server import (
    ApiError,
    EngineState,
    _error,
    body_of,
    route_boundary,
)
from miles_launch.builtin_engine.weight_checks import group_body_problem, parse_distributed_spec
from miles_launch.builtin_engine.weights import (
    decode_tensor_payload,
    destroy_weight_update_group,
    join_weight_update_group,
    receive_broadcast,
)

logger = logging.getLogger(__name__)

#: The debug line each ``/update_weights_from_tensor`` logs: its tensors, bytes, and the
#: milliseconds it spent decoding, waiting for the scheduler and loading.
BUCKET_TIMING = (
    "update_weights_from_tensor: %d tensors, %d bytes: decode %.2f ms, queued %.2f ms, load %.2f ms"
)
_BUCKET_TIMING_RE = re.compile(r"decode ([\d.]+) ms, queued ([\d.]+) ms, load ([\d.]+) ms")


def bucket_timings(log_text: str) -> dict | None:
    """The median decode / queued / load milliseconds of the :data:`BUCKET_TIMING` lines in an
    engine's log (``--log-level debug``), with their count as ``requests``; None without any."""
    found = _BUCKET_TIMING_RE.findall(log_text)
    if not found:
        return None
    columns = list(zip(*[[float(x) for x in f] for f in found]))
    medians = {k: statistics.median(c) for k, c in zip(("decode", "queued", "load"), columns)}
    return {"requests": len(found), **medians}


def add_weight_routes(app: FastAPI, state: EngineState, control) -> None:
    """Register the weight-update endpoints on ``app``; ``control(fn, wait_idle)`` runs ``fn``
    on the scheduler. Each route's errors are answered by :func:`route_boundary` (400, with
    SGLang's ``success: false``)."""
    sched = state.scheduler

    @app.post("/begin_weight_update")
    @route_boundary
    async def begin_weight_update(request: Request):
        await body_of(request, BeginWeightUpdateReqInput)
        state.update_window_used = state.update_window_open = True
        return {"success": True, "message": "weight update window open"}

    @app.post("/end_weight_update")
    @route_boundary
    async def end_weight_update(request: Request):
        await body_of(request, EndWeightUpdateReqInput)
        if not state.update_window_open:
            return _error("end_weight_update without begin_weight_update", success_field=True)
        state.update_window_open = False
        return {"success": True, "message": "weight update window closed"}

    def check_window(endpoint: str) -> None:
        if state.update_window_used and not state.update_window_open:
            raise ApiError(
                f"{endpoint} must be wrapped by /begin_weight_update and /end_weight_update"
            )

    async def apply_update(req, load) -> dict:
        """Run ``load()`` on the scheduler thread: after in-flight requests finish, or at once
        (aborting them) with ``abort_all_requests``, or at once on a paused server. A failure
        reaches the route's boundary: checks run before any byte is loaded, so the model and
        its version are unchanged."""
        abort_all = req.abort_all_requests

        def run():
            if abort_all:
                sched.abort(abort_all=True, message="aborted by a weight update")
            count = load()
            if req.weight_version is not None:
                state.weight_version = req.weight_version
            return count

        count = await control(run, wait_idle=not abort_all)
        return {"success": True, "message": f"updated {count} tensors", "num_paused_requests": 0}

    @app.post("/update_weights_from_tensor")
    @route_boundary
    async def update_weights_from_tensor(request: Request):
        req = await body_of(request, UpdateWeightsFromTensorReqInput)
        check_window("update_weights_from_tensor")
        device_type = torch.device(state.config.device).type
        t0 = time.perf_counter()
        named = await asyncio.to_thread(
            decode_tensor_payload,
            req.serialized_named_tensors,
            req.load_format,
            device_type,
            state.weights.payload_budget(),
        )
        t1 = time.perf_counter()
        loaded_at = []

        def load():
            started = time.perf_counter()
            count = state.weights.load_named(named)
            loaded_at.extend([started, time.perf_counter()])
            return count

        reply = await apply_update(req, load)
        if loaded_at and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                BUCKET_TIMING,
                len(named),
                sum(t.numel() * t.element_size() for _, t in named),
                (t1 - t0) * 1e3,
                (loaded_at[0] - t1) * 1e3,
                (loaded_at[1] - loaded_at[0]) * 1e3,
            )
        return reply

    @app.post("/update_weights_from_disk")
    @route_boundary
    async def update_weights_from_disk(request: Request):
        req = await body_of(request, UpdateWeightFromDiskReqInput)
        if not req.model_path:
            raise ApiError("update_weights_from_disk: field model_path (a directory) is required")
        return await apply_update(req, lambda: state.weights.load_from_disk(req.model_path))

    @app.post("/init_weights_update_group")
    @route_boundary
    async def init_weights_update_group(request: Request):
        req = await body_of(request, InitWeightsUpdateGroupReqInput)
        name, backend = req.group_name, req.backend
        problem = group_body_problem(req.model_dump(), name, backend)
        if problem:
            raise ApiError(f"init_weights_update_group: {problem}")
        if state.config.device == "cpu" and backend == "nccl":
            backend = "gloo"
        if name in state.groups:
            raise ApiError(f"weight update group {name!r} already exists")
        try:
            state.groups[name] = await asyncio.to_thread(
                join_weight_update_group,
                req.master_address,
                req.master_port,
                req.rank_offset,
                req.world_size,
                name,
                backend,
            )
        except Exception as exc:  # a failed rendezvous is reported, the server lives on
            raise ApiError(f"Failed to initialize custom process group: {exc}") from None
        logger.info(
            "joined weight-update group %s at master %s:%s as rank %s of %s (%s)",
            name,
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            backend,
        )
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    @route_boundary
    async def update_weights_from_distributed(request: Request):
        req = await body_of(request, UpdateWeightsFromDistributedReqInput)
        check_window("update_weights_from_distributed")
        name = req.group_name
        if name not in state.groups:
            raise ApiError(f"no weight update group {name!r}; call /init_weights_update_group")
        pg, device = state.groups[name], torch.device(state.config.device)
        if req.load_format not in (None, "direct", "flattened_bucket"):
            raise ApiError(
                f"load_format must be null or 'flattened_bucket', got {req.load_format!r}"
            )
        # before anything is allocated or received; fit is checked before loading
        names, dtypes, shapes = parse_distributed_spec(req.names, req.dtypes, req.shapes)

        def load():
            named = receive_broadcast(pg, names, dtypes, shapes, req.load_format, device)
            return state.weights.load_named(named)

        return await apply_update(req, load)

    @app.post("/destroy_weights_update_group")
    @route_boundary
    async def destroy_weights_update_group(request: Request):
        name = (await body_of(request, DestroyWeightsUpdateGroupReqInput)).group_name
        pg = state.groups.pop(name, None)
        if pg is None:
            raise ApiError(f"no weight update group {name!r}")
        await asyncio.to_thread(destroy_weight_update_group, pg)
        return {"success": True, "message": f"destroyed {name}"}
