"""Every endpoint of SGLang's HTTP API that the trainer uses, written once for both clients.

Each method builds an :class:`~miles_core.engine.calls.EngineCall` and returns
``self._call(call)``: the reply on :class:`~miles_core.engine.EngineClient`, an awaitable
of it on :class:`~miles_core.engine.AsyncEngineClient`. Request bodies use SGLang's field
names only (``tests/miles_core/test_sglang_schema.py`` checks them against the released
package); optional fields are sent only when set, so older servers keep their defaults.
Every method takes ``timeout=`` (seconds) to override the client's read timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from miles_core.engine.calls import EngineCall
from miles_core.engine.payloads import SamplingParams, sampling_params_json

DEFAULT_GROUP = "weight_update_group"
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def health_call(path: str = "/health", timeout: float | None = None) -> EngineCall:
    """``GET /health`` or ``/health_generate``: True on 200, False on 503."""
    return EngineCall(
        "GET",
        path,
        idempotent=True,
        accept=frozenset({503}),
        parse=lambda response: response.status_code == 200,
        timeout=timeout,
    )


def _supported(response: httpx.Response) -> bool:
    return True


def _optional(**fields: Any) -> dict[str, Any]:
    """The fields that are set (not ``None``)."""
    return {key: value for key, value in fields.items() if value is not None}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"`` (SGLang's dtype strings)."""
    name = dtype if isinstance(dtype, str) else str(dtype)
    return name.removeprefix("torch.")


class EngineEndpoints:
    """The endpoints; subclasses provide ``_call`` (sync or async sending)."""

    def _call(self, call: EngineCall) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        text: str | list[str] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | list[dict[str, Any]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int | None = None,
        rid: str | list[str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """``POST /generate``: exactly one of ``text`` / ``input_ids``; a list of prompts
        (or of token lists) is a batch and the reply is a list.

        Reply: ``{"text", "output_ids", "meta_info"}``; with ``return_logprob``,
        ``meta_info["output_token_logprobs"]`` is ``[[logprob, token_id, text|None], ...]``
        (``logprob_start_len`` -1, the default, = output tokens only); with
        ``return_routed_experts`` (server started with ``--enable-return-routed-experts``),
        ``meta_info["routed_experts"]`` decodes with
        :func:`~miles_core.engine.decode_routed_experts`. Not retried after it was sent.
        """
        if (text is None) == (input_ids is None):
            raise ValueError("generate takes exactly one of text or input_ids")
        if isinstance(sampling_params, list):
            params: Any = [sampling_params_json(p) for p in sampling_params]
        else:
            params = sampling_params_json(sampling_params)
        body = _optional(
            text=text,
            input_ids=input_ids,
            sampling_params=params,
            rid=rid,
            logprob_start_len=logprob_start_len,
            routed_experts_start_len=routed_experts_start_len,
        )
        if return_logprob:
            body["return_logprob"] = True
        if return_routed_experts:
            body["return_routed_experts"] = True
        return self._call(EngineCall("POST", "/generate", body, timeout=timeout))

    # ------------------------------------------------------------------ health and info

    def health(self, *, timeout: float | None = None) -> bool:
        """``GET /health``: True on 200, False on 503 (starting, or unhealthy)."""
        return self._call(health_call("/health", timeout))

    def health_generate(self, *, timeout: float | None = None) -> bool:
        """``GET /health_generate``: True once a 1-token generation succeeds, False on 503."""
        return self._call(health_call("/health_generate", timeout))

    def get_model_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``GET /get_model_info``: ``model_path``, ``tokenizer_path``, ``is_generation``,
        ``weight_version`` (the live weight version; "default" until one is set)."""
        return self._call(EngineCall("GET", "/get_model_info", idempotent=True, timeout=timeout))

    def get_server_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``GET /get_server_info``: the server's arguments, flattened, plus ``version``."""
        return self._call(EngineCall("GET", "/get_server_info", idempotent=True, timeout=timeout))

    # ------------------------------------------------------------------ pause, flush, abort

    def pause_generation(self, mode: str = "abort", *, timeout: float | None = None) -> Any:
        """``POST /pause_generation {"mode"}``: ``abort`` returns running requests as
        aborted, ``retract`` sends them back to the queue, ``in_place`` freezes them with
        their KV cache. New ``/generate`` calls block until :meth:`continue_generation`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        return self._call(EngineCall("POST", "/pause_generation", {"mode": mode}, timeout=timeout))

    def continue_generation(self, *, timeout: float | None = None) -> Any:
        """``POST /continue_generation {}``."""
        return self._call(EngineCall("POST", "/continue_generation", {}, timeout=timeout))

    def flush_cache(self, *, timeout: float | None = None) -> Any:
        """``POST /flush_cache {}``: drops the prefix cache; 400 (raised) while requests run."""
        call = EngineCall("POST", "/flush_cache", {}, idempotent=True, timeout=timeout)
        return self._call(call)

    def abort_request(
        self, rid: str = "", *, abort_all: bool = False, timeout: float | None = None
    ) -> Any:
        """``POST /abort_request {"rid", "abort_all"}``: rid is matched as a prefix."""
        body = {"rid": rid, "abort_all": abort_all}
        call = EngineCall("POST", "/abort_request", body, idempotent=True, timeout=timeout)
        return self._call(call)

    # ------------------------------------------------------------------ weight updates

    def begin_weight_update(self, selector: str = "all", *, timeout: float | None = None) -> bool:
        """``POST /begin_weight_update {"selector"}`` (SGLang >= 0.5.23, where updates from
        tensor/distributed must sit between begin and end). Returns True when the session
        opened, False when the server has no such endpoint (404): the client then skips
        begin/end from now on."""
        call = EngineCall(
            "POST",
            "/begin_weight_update",
            {"selector": selector},
            check_success=True,
            parse=_supported,
            feature="weight_update_session",
            timeout=timeout,
        )
        return self._call(call)

    def end_weight_update(self, *, timeout: float | None = None) -> bool:
        """``POST /end_weight_update {}``; False (nothing sent) on servers without it."""
        call = EngineCall(
            "POST",
            "/end_weight_update",
            {},
            check_success=True,
            parse=_supported,
            feature="weight_update_session",
            timeout=timeout,
        )
        return self._call(call)

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool | None = None,
        flush_cache: bool | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """``POST /update_weights_from_disk``: reload weights from a HF checkpoint dir.
        Reply ``{"success", "message", "num_paused_requests"}``; failure raises."""
        body = {"model_path": model_path} | _optional(
            load_format=load_format,
            weight_version=weight_version,
            abort_all_requests=abort_all_requests,
            flush_cache=flush_cache,
        )
        call = EngineCall(
            "POST", "/update_weights_from_disk", body, check_success=True, timeout=timeout
        )
        return self._call(call)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """``POST /init_weights_update_group``: engine TP rank i joins ``group_name`` as
        rank ``rank_offset + i`` of ``world_size`` (the trainer is rank 0 and hosts the
        store at ``master_address:master_port``). Blocks until every rank joined: issue it
        concurrently with the trainer's own group setup."""
        body = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        call = EngineCall(
            "POST", "/init_weights_update_group", body, check_success=True, timeout=timeout
        )
        return self._call(call)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = DEFAULT_GROUP,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool | None = None,
        abort_all_requests: bool | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """``POST /update_weights_from_distributed``: the server receives one
        ``broadcast(src=0)`` per tensor, in list order, in ``group_name`` (one uint8
        tensor with ``load_format="flattened_bucket"``). Broadcast while this call is
        outstanding. ``dtypes`` may be torch dtypes or names such as ``"bfloat16"``."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(
                f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        body = {
            "names": list(names),
            "dtypes": [dtype_name(d) for d in dtypes],
            "shapes": [[int(n) for n in shape] for shape in shapes],
            "group_name": group_name,
        } | _optional(
            load_format=load_format,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        )
        call = EngineCall(
            "POST", "/update_weights_from_distributed", body, check_success=True, timeout=timeout
        )
        return self._call(call)

    def destroy_weights_update_group(
        self, group_name: str = DEFAULT_GROUP, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """``POST /destroy_weights_update_group {"group_name"}``."""
        call = EngineCall(
            "POST",
            "/destroy_weights_update_group",
            {"group_name": group_name},
            check_success=True,
            timeout=timeout,
        )
        return self._call(call)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool | None = None,
        abort_all_requests: bool | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """``POST /update_weights_from_tensor``: one base64 string per engine TP rank, as
        produced by ``miles_sync``'s codec (a ForkingPickler dump of named tensors, or of a
        flattened bucket with ``load_format="flattened_bucket"``). Keep the tensors alive
        until this returns."""
        strings = list(serialized_named_tensors)
        if not strings or not all(isinstance(s, str) for s in strings):
            raise TypeError("serialized_named_tensors must be a non-empty list of base64 strings")
        body = {"serialized_named_tensors": strings} | _optional(
            load_format=load_format,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        )
        call = EngineCall(
            "POST", "/update_weights_from_tensor", body, check_success=True, timeout=timeout
        )
        return self._call(call)

    def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = True, timeout: float | None = None
    ) -> dict[str, Any]:
        """``POST /update_weight_version {"new_version", "abort_all_requests"}``."""
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        call = EngineCall(
            "POST", "/update_weight_version", body, check_success=True, timeout=timeout
        )
        return self._call(call)

    def get_weights_by_name(
        self, name: str, truncate_size: int = 100, *, timeout: float | None = None
    ) -> Any:
        """``POST /get_weights_by_name {"name", "truncate_size"}``: the first
        ``truncate_size`` rows of the tensor of HF name ``name``, as nested float lists."""
        body = {"name": name, "truncate_size": truncate_size}
        call = EngineCall("POST", "/get_weights_by_name", body, idempotent=True, timeout=timeout)
        return self._call(call)

    # ------------------------------------------------------------------ memory

    def release_memory_occupation(
        self, tags: Sequence[str] | None = None, *, timeout: float | None = None
    ) -> Any:
        """``POST /release_memory_occupation {"tags"}`` (no tags: all of weights,
        kv_cache, cuda_graph). Needs an idle server; memory is really freed only with
        ``--enable-memory-saver``."""
        body = self._memory_body(tags)
        return self._call(EngineCall("POST", "/release_memory_occupation", body, timeout=timeout))

    def resume_memory_occupation(
        self, tags: Sequence[str] | None = None, *, timeout: float | None = None
    ) -> Any:
        """``POST /resume_memory_occupation {"tags"}``. Weights come back as they were only
        with ``--enable-weights-cpu-backup``: re-sync them after a resume."""
        body = self._memory_body(tags)
        return self._call(EngineCall("POST", "/resume_memory_occupation", body, timeout=timeout))

    @staticmethod
    def _memory_body(tags: Sequence[str] | None) -> dict[str, Any]:
        if tags is None:
            return {}
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"memory tags must be among {MEMORY_TAGS}, got {unknown}")
        return {"tags": list(tags)}
