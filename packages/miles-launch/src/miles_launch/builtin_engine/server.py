"""The built-in engine's HTTP API: SGLang's endpoints, bodies, replies and status codes.

Every handler that touches the model hands a closure to the :class:`Scheduler` thread
(:meth:`Scheduler.run_control`); handlers themselves only parse, validate and format. Control
routes parse their bodies into SGLang's request types (:mod:`.request_bodies`).

One exception boundary per route (:func:`route_boundary`): whatever fails while a request is
parsed, checked or applied is answered ``{"error": {"message": ...}}`` with a 4xx status (400
unless the error says otherwise; weight-update endpoints also carry SGLang's ``{"success":
false, "message": ...}``), never a 500 or a reset connection, and the error's frames are
cleared so that nothing of the payload (a mapped shared-memory storage) outlives the request.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles_launch import __version__
from miles_launch.builtin_engine.generate_io import (
    GenerateInputError,
    check_admission,
    format_reply,
    logprob_start_len,
    parse_prompts,
    request_ids,
)
from miles_launch.builtin_engine.request import Request as GenRequest
from miles_launch.builtin_engine.request_bodies import (
    AbortReq,
    BodyError,
    ContinueGenerationReqInput,
    PauseGenerationReqInput,
    UpdateWeightVersionReqInput,
    parse_body,
)
from miles_launch.builtin_engine.safe_unpickle import UnsafePayloadError
from miles_launch.builtin_engine.sampling import SamplingParams, SamplingParamsError
from miles_launch.builtin_engine.scheduler import Scheduler
from miles_launch.builtin_engine.weight_checks import WeightUpdateError
from miles_launch.builtin_engine.weights import WeightStore
from miles_launch.engine_launch.api_key import is_loopback

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
PUBLIC_PATHS = {"/health", "/health_generate"}
#: Endpoints that change the engine's state (its weights, memory, running requests) or read
#: its weights. An engine bound to a non-loopback address without an API key refuses them
#: (403); the command line refuses to start such an engine at all.
PROTECTED_PATHS = {
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weight_version",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/flush_cache",
    "/get_weights_by_name",
}
#: Endpoints whose errors also carry SGLang's ``{"success": false, "message": ...}``.
_SUCCESS_FIELD_PREFIXES = ("/update_weights", "/init_weights", "/destroy_weights")


@dataclass
class EngineConfig:
    """Server arguments (reported flattened by /get_server_info)."""

    model_path: str
    tokenizer_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    device: str = "cpu"
    context_length: int | None = None
    dtype: str = "auto"
    weight_version: str = "default"
    tp_size: int = 1
    max_running_requests: int = 64
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    enable_return_routed_experts: bool = False
    true_on_policy: bool = False


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


#: Errors whose message is the answer as it stands (anything else is prefixed with the route
#: and the error's type, and logged).
_REQUEST_ERRORS = (
    ApiError,
    BodyError,
    GenerateInputError,
    SamplingParamsError,
    WeightUpdateError,
    UnsafePayloadError,
)


@dataclass
class EngineState:
    config: EngineConfig
    tokenizer: object
    scheduler: Scheduler
    weights: WeightStore
    weight_version: str
    vocab_size: int
    context_length: int
    healthy: bool = False
    groups: dict = field(default_factory=dict)
    update_window_used: bool = False
    update_window_open: bool = False
    gate: asyncio.Event | None = None  # set = /generate admits; cleared by pause_generation


def bearer_matches(header: str, key: str) -> bool:
    """``Authorization: <scheme> <token>`` carries ``key``: the scheme is ``Bearer`` in any
    case (SGLang's check), the token compared in constant time."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


def scrub(exc: BaseException) -> None:
    """Drop what ``exc`` (and the errors chained to it) keeps alive: the locals of the frames
    it was raised through (a decoded payload, a mapped storage) and the traceback itself."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def route_boundary(handler):
    """The one exception boundary of a route: any error while its request is parsed, checked or
    applied becomes a 4xx answer naming it (400 unless it is an :class:`ApiError` with another
    status), and is scrubbed (:func:`scrub`) before the answer is sent."""

    @functools.wraps(handler)
    async def guarded(request: Request):
        try:
            return await handler(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every failure of a request stays with that request
            status = exc.status if isinstance(exc, ApiError) else 400
            message = str(exc) or type(exc).__name__
            if not isinstance(exc, _REQUEST_ERRORS):
                message = f"{request.url.path}: {type(exc).__name__}: {message}"
                logger.warning("%s failed: %s", request.url.path, message)
            scrub(exc)
        # outside the except clause: the answer holds no reference to the error
        return _error(
            message, status, success_field=request.url.path.startswith(_SUCCESS_FIELD_PREFIXES)
        )

    return guarded


def _error(message: str, status: int = 400, success_field: bool = False) -> JSONResponse:
    body: dict = {"error": {"message": message}}
    if success_field:
        body.update(success=False, message=message)
    return JSONResponse(body, status_code=status)


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        raise ApiError(f"{request.url.path}: missing request body (send at least {{}})")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep
        raise ApiError(f"{request.url.path}: body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(f"{request.url.path}: body must be a JSON object")
    return body


async def body_of(request: Request, model):
    """The JSON object of ``request`` parsed as ``model`` (a :mod:`.request_bodies` type)."""
    return parse_body(model, await _json_body(request), request.url.path.lstrip("/"))


def build_app(state: EngineState) -> FastAPI:
    # cycle: the route modules import this module
    from miles_launch.builtin_engine.memory_routes import add_memory_routes
    from miles_launch.builtin_engine.weight_routes import add_weight_routes

    app = FastAPI(title="miles built-in engine")
    sched = state.scheduler

    state.gate = asyncio.Event()
    state.gate.set()

    key = state.config.api_key
    open_to_network = not key and not is_loopback(state.config.host)

    @app.middleware("http")
    async def _api_key(request: Request, call_next):
        path = request.url.path
        if key and path not in PUBLIC_PATHS:
            if not bearer_matches(request.headers.get("authorization", ""), key):
                return _error("unauthorized: send Authorization: Bearer <api key>", 401)
        if open_to_network and path in PROTECTED_PATHS:
            return _error(
                f"{path} refused: this engine listens on {state.config.host} without --api-key; "
                "start it with --api-key to change its state or read its weights",
                403,
                success_field=True,
            )
        return await call_next(request)

    async def control(fn, wait_idle: bool = False):
        return await asyncio.wrap_future(sched.run_control(fn, wait_idle=wait_idle))

    # ---- generation -----------------------------------------------------------------------
    @app.post("/generate")
    @route_boundary
    async def generate(request: Request):
        body = await _json_body(request)
        if body.get("stream"):
            return _error("generate: stream is not supported by the built-in engine")
        prompts, single = parse_prompts(body, state.tokenizer)
        raw_params = body.get("sampling_params") or {}
        raw_list = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
        if len(raw_list) != len(prompts):
            return _error(f"sampling_params: {len(raw_list)} entries for {len(prompts)} prompts")
        params = [SamplingParams.from_request(p) for p in raw_list]
        check_admission(prompts, params, state.vocab_size, state.context_length)
        for name in ("return_logprob", "return_routed_experts"):
            if not isinstance(body.get(name, False), bool):
                return _error(f"generate: {name} must be a bool, got {body[name]!r}")
        start_len = body.get("routed_experts_start_len") or 0
        if type(start_len) is not int or start_len < 0:
            return _error(
                f"generate: routed_experts_start_len must be an int >= 0, got {start_len!r}"
            )
        want_routed = bool(body.get("return_routed_experts", False))
        if want_routed and not state.config.enable_return_routed_experts:
            return _error(
                "return_routed_experts needs the server flag --enable-return-routed-experts"
            )
        rids = request_ids(body, len(prompts), single)
        logprob_start = logprob_start_len(body, prompts, params)
        await state.gate.wait()
        loop = asyncio.get_running_loop()
        groups: list[list[tuple[GenRequest, asyncio.Future]]] = []
        for prompt, p, r in zip(prompts, params, rids):
            group = []
            for j in range(p.n):
                fut = loop.create_future()
                req = GenRequest(
                    rid=r if p.n == 1 else f"{r}-{j}",
                    prompt_ids=prompt,
                    params=p,
                    on_done=lambda req, fut=fut: loop.call_soon_threadsafe(_resolve, fut, req),
                    return_logprob=bool(body.get("return_logprob", False)),
                    logprob_start_len=logprob_start,
                    return_routed_experts=want_routed,
                )
                group.append((req, fut))
            groups.append(group)
        start = time.monotonic()
        sched.submit([req for group in groups for req, _ in group])
        await asyncio.gather(*(fut for group in groups for _, fut in group))
        replies = [
            format_reply(req, state.weight_version, time.monotonic() - start, start_len)
            for group in groups
            for req, _ in group
        ]
        return replies[0] if single and len(replies) == 1 else replies

    # ---- health and info ----------------------------------------------------------------
    @app.get("/health")
    @app.get("/health_generate")
    @route_boundary
    async def health(request: Request):
        if state.healthy and sched.alive():
            return JSONResponse({}, status_code=200)
        return _error("engine not healthy", 503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    @route_boundary
    async def model_info(request: Request):
        return {
            "model_path": state.config.model_path,
            "tokenizer_path": state.config.tokenizer_path,
            "is_generation": True,
            "weight_version": state.weight_version,
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    @route_boundary
    async def server_info(request: Request):
        info = {k: v for k, v in asdict(state.config).items() if k != "api_key"}
        info.update(
            version=__version__,
            engine="miles-builtin",
            weight_version=state.weight_version,
            memory=_memory(state),
            num_requests=sched.num_requests(),
            num_controls=sched.num_controls(),
            paused=sched.paused,
        )
        return info

    @app.post("/update_weight_version")
    @route_boundary
    async def update_weight_version(request: Request):
        req = await body_of(request, UpdateWeightVersionReqInput)
        if req.abort_all_requests:
            await control(
                lambda: sched.abort(abort_all=True, message="aborted by update_weight_version")
            )
        state.weight_version = req.new_version
        return {"success": True, "message": f"weight version set to {state.weight_version}"}

    # ---- pause / flush / abort ------------------------------------------------------------
    @app.post("/pause_generation")
    @route_boundary
    async def pause_generation(request: Request):
        mode = (await body_of(request, PauseGenerationReqInput)).mode
        state.gate.clear()
        await control(lambda: sched.pause(mode))
        return {"success": True, "message": f"generation paused ({mode})"}

    @app.post("/continue_generation")
    @route_boundary
    async def continue_generation(request: Request):
        await body_of(request, ContinueGenerationReqInput)
        await control(sched.unpause)
        state.gate.set()
        return {"success": True, "message": "generation continued"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @route_boundary
    async def flush_cache(request: Request):
        def flush():
            if not sched.fully_idle():
                raise ApiError("flush_cache refused: requests are running or waiting")
            sched.drop_kv_cache()

        await control(flush)
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.post("/abort_request")
    @route_boundary
    async def abort_request(request: Request):
        req = await body_of(request, AbortReq)
        rid, abort_all = req.rid or "", req.abort_all
        if not rid and not abort_all:  # SGLang ignores it: "" would prefix-match everything
            return {"success": True, "message": "ignored: empty rid without abort_all"}
        n = await control(lambda: sched.abort(rid, abort_all, message="aborted by abort_request"))
        return {"success": True, "message": f"aborted {n} request(s)"}

    add_weight_routes(app, state, control)

    # ---- memory ---------------------------------------------------------------------------
    add_memory_routes(app, state, control)

    return app


def _memory(state: EngineState) -> dict:
    """Bytes held by weights and the KV cache (and, on CUDA, by the allocator overall)."""
    out = {
        "weights_bytes": state.weights.weights_bytes(),
        "kv_cache_bytes": state.scheduler.kv_cache_bytes(),
    }
    if state.weights.device.type == "cuda":
        out["device_allocated_bytes"] = torch.cuda.memory_allocated(state.weights.device)
    return out


def _resolve(fut: asyncio.Future, req: GenRequest) -> None:
    if not fut.done():
        fut.set_result(req)
