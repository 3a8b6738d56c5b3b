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

from miles_launch.builtin_engine.safe_unpickle import UnsafePayloadError
from miles_launch.builtin_engine.server import ApiError, EngineState, _error, _json_body
from miles_launch.builtin_engine.weight_checks import (
    WeightUpdateError,
    group_body_problem,
    parse_distributed_spec,
)
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
    on the scheduler."""
    sched = state.scheduler

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        await _json_body(request)
        state.update_window_used = state.update_window_open = True
        return {"success": True, "message": "weight update window open"}

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        await _json_body(request)
        if not state.update_window_open:
            return _error("end_weight_update without begin_weight_update", success_field=True)
        state.update_window_open = False
        return {"success": True, "message": "weight update window closed"}

    def check_window(endpoint: str) -> None:
        if state.update_window_used and not state.update_window_open:
            raise ApiError(
                f"{endpoint} must be wrapped by /begin_weight_update and /end_weight_update"
            )

    async def apply_update(body: dict, load) -> dict:
        """Run ``load()`` on the scheduler thread: after in-flight requests finish, or at once
        (aborting them) with ``abort_all_requests``, or at once on a paused server."""
        abort_all = bool(body.get("abort_all_requests", False))

        def run():
            if abort_all:
                sched.abort(abort_all=True, message="aborted by a weight update")
            count = load()
            if body.get("weight_version") is not None:
                state.weight_version = str(body["weight_version"])
            return count

        try:
            count = await control(run, wait_idle=not abort_all)
        except Exception as exc:  # checks run before any byte is loaded: the model is unchanged
            return _error(f"weight update failed: {exc}", success_field=True)
        return {"success": True, "message": f"updated {count} tensors", "num_paused_requests": 0}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await _json_body(request)
        check_window("update_weights_from_tensor")
        device_type = torch.device(state.config.device).type
        t0 = time.perf_counter()
        try:
            named = await asyncio.to_thread(
                decode_tensor_payload,
                body.get("serialized_named_tensors"),
                body.get("load_format"),
                device_type,
            )
        except (UnsafePayloadError, WeightUpdateError, ValueError, RuntimeError, OSError) as exc:
            return _error(f"update_weights_from_tensor: {exc}", success_field=True)
        t1 = time.perf_counter()
        loaded_at = []

        def load():
            started = time.perf_counter()
            count = state.weights.load_named(named)
            loaded_at.extend([started, time.perf_counter()])
            return count

        reply = await apply_update(body, load)
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
    async def update_weights_from_disk(request: Request):
        body = await _json_body(request)
        if not body.get("model_path") or not isinstance(body["model_path"], str):
            return _error(
                "update_weights_from_disk: field model_path (a directory) is required",
                success_field=True,
            )
        return await apply_update(body, lambda: state.weights.load_from_disk(body["model_path"]))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await _json_body(request)
        missing = [
            k
            for k in ("master_address", "master_port", "rank_offset", "world_size")
            if k not in body
        ]
        if missing:
            return _error(
                f"init_weights_update_group: missing field(s) {missing}", success_field=True
            )
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        problem = group_body_problem(body, name, backend)
        if problem:
            return _error(f"init_weights_update_group: {problem}", success_field=True)
        if state.config.device == "cpu" and backend == "nccl":
            backend = "gloo"
        if name in state.groups:
            return _error(f"weight update group {name!r} already exists", success_field=True)
        try:
            state.groups[name] = await asyncio.to_thread(
                join_weight_update_group,
                body["master_address"],
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                name,
                backend,
            )
        except Exception as exc:  # a failed rendezvous is reported, the server lives on
            return _error(f"Failed to initialize custom process group: {exc}", success_field=True)
        logger.info(
            "joined weight-update group %s at master %s:%s as rank %s of %s (%s)",
            name,
            body["master_address"],
            body["master_port"],
            body["rank_offset"],
            body["world_size"],
            backend,
        )
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await _json_body(request)
        check_window("update_weights_from_distributed")
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str) or name not in state.groups:
            return _error(
                f"no weight update group {name!r}; call /init_weights_update_group",
                success_field=True,
            )
        pg, device = state.groups[name], torch.device(state.config.device)
        names, dtypes, shapes = (body.get(k, []) for k in ("names", "dtypes", "shapes"))
        if body.get("load_format") not in (None, "direct", "flattened_bucket"):
            return _error(
                f"load_format must be null or 'flattened_bucket', got {body['load_format']!r}",
                success_field=True,
            )
        try:  # before anything is allocated or received; fit is checked before loading
            parse_distributed_spec(names, dtypes, shapes)
        except WeightUpdateError as exc:
            return _error(f"update_weights_from_distributed: {exc}", success_field=True)

        def load():
            named = receive_broadcast(pg, names, dtypes, shapes, body.get("load_format"), device)
            return state.weights.load_named(named)

        return await apply_update(body, load)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await _json_body(request)
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            return _error(
                "destroy_weights_update_group: group_name must be a string", success_field=True
            )
        pg = state.groups.pop(name, None)
        if pg is None:
            return _error(f"no weight update group {name!r}", success_field=True)
        await asyncio.to_thread(destroy_weight_update_group, pg)
        return {"success": True, "message": f"destroyed {name}"}
