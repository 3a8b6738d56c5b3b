"""Continuous batching over a HF causal LM with one shared, left-padded KV cache.

One scheduler thread owns the model. Each iteration it (1) runs pending control operations
(weight updates, pause, abort, memory release) when their preconditions hold, (2) admits
waiting requests up to ``max_running_requests``, each prefilled alone and merged into the
running batch, and (3) runs one batched decode step for every running request.

Batch layout: the running requests share a ``transformers.DynamicCache`` whose rows are
left-padded to a common length ``L``; ``mask[b, j] = 1`` where row ``b`` holds a real token.
A decode step feeds each row's last token at its own position ``pos[b]`` (the number of
real tokens of the row) with the attention mask ``[mask, 1]``; padded slots get zero
attention weight, so each row computes exactly what it would compute alone. Rows leave
the batch between steps (finished or aborted) by indexing the cache's batch dimension.

Failures stay with their request: a prefill that fails is retried request by request and
ends only the request that fails; a batched decode step that fails is retried row by row from
the cache as it was before the step, and ends only the rows that fail again; an error while
choosing or appending one request's token ends that request (``finish_reason`` abort,
``engine error: ...``) and the others go on. The engine keeps serving either way.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from miles_core import batch_invariant
from miles_core.log_probs import scaled_log_softmax
from transformers import DynamicCache

from miles_launch.builtin_engine import batch_cache
from miles_launch.builtin_engine.request import Request, eos_ids, input_logprobs
from miles_launch.builtin_engine.routed_experts import RoutedExpertsRecorder
from miles_launch.builtin_engine.sampling import (
    SamplingParams,
    abort_reason,
    choose_token,
    find_stop_string,
    length_reason,
    make_generator,
    stop_reason,
)

logger = logging.getLogger(__name__)


@dataclass
class _Control:
    fn: Callable[[], object]
    wait_idle: bool
    future: Future


class Scheduler:
    """Owns the model on one thread; everything that touches it runs there."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        device: torch.device,
        max_running_requests: int = 64,
        enable_routed_experts: bool = False,
        true_on_policy: bool = False,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.max_running = max_running_requests
        self.eos_ids = eos_ids(model, tokenizer)
        self.recorder = RoutedExpertsRecorder(model) if enable_routed_experts else None
        # --true-on-policy: every step runs in the batch-invariant mode (on this thread)
        self._step_mode = batch_invariant.mode if true_on_policy else contextlib.nullcontext
        # transformers >= 5.2x names the cache argument ``cache``; older ones ``past_key_values``.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.weights_released = False
        self.paused = False
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [B, L] int64
        self._pos: list[int] = []
        self._controls: deque[_Control] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    # ---- public API (any thread) ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def submit(self, requests: list[Request]) -> None:
        for req in requests:
            req.generator = make_generator(req.params, self.device)
        with self._cv:
            self._waiting.extend(requests)
            self._cv.notify_all()

    def run_control(self, fn: Callable[[], object], wait_idle: bool = False) -> Future:
        """Run ``fn`` on the scheduler thread between steps. With ``wait_idle`` it waits until
        no request is running (waiting ones are not admitted meanwhile), unless paused."""
        fut: Future = Future()
        with self._cv:
            self._controls.append(_Control(fn, wait_idle, fut))
            self._cv.notify_all()
        return fut

    def alive(self) -> bool:
        return self._thread.is_alive()

    def fully_idle(self) -> bool:
        """SGLang's precondition for flush and memory release: nothing running, and nothing
        waiting unless paused (retracted or held-back requests do not count then)."""
        with self._cv:
            return not self._running and (self.paused or not self._waiting)

    def num_requests(self) -> int:
        with self._cv:
            return len(self._running) + len(self._waiting)

    def num_controls(self) -> int:
        """Control operations (weight updates, memory moves, aborts) queued for the next gap
        between steps; one that waits for the running requests to finish counts until it ran."""
        with self._cv:
            return len(self._controls)

    # ---- operations run on the scheduler thread (wrap them with run_control) -----------
    def abort(self, rid_prefix: str = "", abort_all: bool = False, message: str = "aborted") -> int:
        """Finish waiting and running requests whose rid starts with ``rid_prefix``."""
        match = (lambda r: True) if abort_all else (lambda r: r.rid.startswith(rid_prefix))
        with self._cv:
            hits = [r for r in self._waiting if match(r)]
            self._waiting = deque(r for r in self._waiting if not match(r))
        keep = [i for i, r in enumerate(self._running) if not match(r)]
        hits += [r for r in self._running if match(r)]
        self._select_rows(keep)
        for req in hits:
            self._finish(req, abort_reason(message))
        return len(hits)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(abort_all=True, message="aborted by pause_generation")
        elif mode == "retract":
            retracted = list(self._running)
            self._select_rows([])
            with self._cv:
                for req in reversed(retracted):
                    req.routed.clear()
                    self._waiting.appendleft(req)
        elif mode != "in_place":
            raise ValueError(
                f"pause_generation mode must be abort, retract or in_place, got {mode!r}"
            )
        self.paused = True

    def unpause(self) -> None:
        self.paused = False

    def drop_kv_cache(self) -> None:
        """Free the batch cache (only valid with no running request)."""
        if self._running:
            raise RuntimeError("cannot drop the KV cache while requests are running")
        self._cache, self._mask, self._pos = None, None, []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def kv_cache_bytes(self) -> int:
        if self._cache is None:
            return 0
        return sum(
            t.numel() * t.element_size()
            for layer in self._cache.layers
            for t in (layer.keys, layer.values)
        )

    # ---- the loop ----------------------------------------------------------------------
    def _idle(self) -> bool:
        return not self._running and not self._waiting

    def _next_control(self) -> _Control | None:
        if self._controls:
            head = self._controls[0]
            # waiting requests are held back behind a wait_idle control, so only running ones count
            if not head.wait_idle or self.paused or not self._running:
                return self._controls.popleft()
        return None

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop:
                    control = self._next_control()
                    if control is not None:
                        break
                    if not self.paused and not self._idle():
                        break
                    self._cv.wait()
                if self._stop:
                    break
            if control is not None:
                if control.future.set_running_or_notify_cancel():
                    try:
                        control.future.set_result(control.fn())
                    except BaseException as exc:  # reported to the HTTP caller
                        control.future.set_exception(exc)
                continue
            try:
                with torch.no_grad(), self._step_mode():
                    self._step()
            except Exception as exc:  # a fault outside any one request: end what is running
                logger.exception("engine step failed")
                self.abort(abort_all=True, message=f"engine error: {exc}")

    def _step(self) -> None:
        blocked = bool(self._controls) and self._controls[0].wait_idle
        admitted = []
        with self._cv:
            while (
                not blocked
                and self._waiting
                and len(self._running) + len(admitted) < self.max_running
            ):
                admitted.append(self._waiting.popleft())
        if admitted:
            self._prefill(admitted)
        if self._running:
            self._decode()

    # ---- model work --------------------------------------------------------------------
    def _prefill(self, reqs: list[Request]) -> None:
        """Prefill new requests as one left-padded batch, then merge them into the batch."""
        todo = []
        for req in reqs:
            if self.weights_released:
                self._finish(
                    req, abort_reason("weights are released; call /resume_memory_occupation")
                )
            elif req.params.max_new_tokens == 0 or len(req.output_ids) >= req.params.max_new_tokens:
                self._finish(req, length_reason(req.params.max_new_tokens))
            elif not req.prompt_ids:
                self._finish(req, abort_reason("empty prompt"))
            else:
                todo.append(req)
        if not todo:
            return
        seqs = [req.prompt_ids + req.output_ids for req in todo]
        lengths = [len(ids) for ids in seqs]
        width = max(lengths)
        ids = torch.tensor(
            [[0] * (width - n) + seq for seq, n in zip(seqs, lengths)], device=self.device
        )
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kw: cache},
            )
        except Exception as exc:  # one request's failure ends only that request
            if len(todo) == 1:
                logger.exception("prefill of request %s failed", todo[0].rid)
                self._fail(todo[0], exc)
                return
            for req in todo:  # prefill each alone to find the one that fails
                self._prefill([req])
            return
        if self.recorder is not None:
            routed = self.recorder.take(len(todo) * width).view(
                len(todo), width, *self.recorder.shape
            )
            for b, req in enumerate(todo):
                if req.return_routed_experts:
                    req.routed.extend(routed[b, width - lengths[b] :].unbind(0))
        for b, req in enumerate(todo):
            if req.return_logprob and req.logprob_start_len >= 0 and req.input_logprobs is None:
                req.input_logprobs = input_logprobs(
                    out.logits[b, width - lengths[b] :], req.prompt_ids, req.logprob_start_len
                )
        self._append_tokens(todo, out.logits[:, -1])
        keep = [b for b, req in enumerate(todo) if not req.finished]
        if keep:
            index = torch.tensor(keep, device=self.device)
            kv = [
                (k.index_select(0, index), v.index_select(0, index))
                for k, v in batch_cache.layers(cache)
            ]
            self._merge(
                [todo[b] for b in keep], kv, mask.index_select(0, index), [lengths[b] for b in keep]
            )

    def _merge(self, reqs: list[Request], kv: list, mask: torch.Tensor, lengths: list[int]) -> None:
        """Add prefilled rows to the batch."""
        self._cache, self._mask = batch_cache.merge(self._cache, self._mask, kv, mask)
        self._pos.extend(lengths)
        self._running.extend(reqs)

    def _decode(self) -> None:
        batch = len(self._running)
        tokens = torch.tensor([[r.output_ids[-1]] for r in self._running], device=self.device)
        positions = torch.tensor([[p] for p in self._pos], device=self.device)
        ones = torch.ones(batch, 1, dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, ones], dim=1)
        # the cache's tensors before the step (a forward that fails midway has already
        # appended to the first layers: the retry starts again from these)
        before = batch_cache.layers(self._cache)
        try:
            out = self._forward(tokens, positions, mask, self._cache)
        except Exception:
            logger.exception(
                "batched decode of %d requests failed; retrying them one by one", batch
            )
            if self.recorder is not None:
                self.recorder.take(0)  # drop what the failed forward captured
            logits, routed = self._decode_rows_alone(tokens, positions, mask, before)
            if not self._running:
                return
        else:
            self._mask = mask
            logits = out.logits[:, -1]
            routed = self.recorder.take(batch) if self.recorder is not None else None
        for b, req in enumerate(self._running):
            self._pos[b] += 1
            if routed is not None and req.return_routed_experts:
                req.routed.append(routed[b])
        self._append_tokens(self._running, logits)
        keep = [b for b, req in enumerate(self._running) if not req.finished]
        if len(keep) < len(self._running):
            self._select_rows(keep)

    def _forward(self, tokens, positions, mask, cache):
        return self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            **{self._cache_kw: cache},
        )

    def _decode_rows_alone(self, tokens, positions, mask, before):
        """The decode step of each running row alone, from the cache ``before`` the failed
        batched step: rows that fail again end (abort, ``engine error: ...``); the batch
        becomes the rows that succeeded, their caches one step longer. Returns their logits
        and routed experts (None without a recorder)."""
        ok, logits, rows, routed = [], [], [], []
        for b, req in enumerate(self._running):
            cache = batch_cache.row(before, b)
            try:
                out = self._forward(tokens[b : b + 1], positions[b : b + 1], mask[b : b + 1], cache)
            except Exception as exc:  # this row fails alone too: it ends, the others go on
                logger.exception("decode of request %s failed", req.rid)
                if self.recorder is not None:
                    self.recorder.take(0)
                self._fail(req, exc)
                continue
            ok.append(b)
            logits.append(out.logits[:, -1])
            rows.append(batch_cache.layers(cache))
            if self.recorder is not None:
                routed.append(self.recorder.take(1))
        self._running = [self._running[b] for b in ok]
        self._pos = [self._pos[b] for b in ok]
        if not ok:
            self._cache, self._mask = None, None
            return torch.empty(0, 1), None
        index = torch.tensor(ok, device=self.device)
        self._cache, self._mask = batch_cache.trim(
            batch_cache.stack(rows), mask.index_select(0, index)
        )
        return torch.cat(logits), torch.cat(routed) if routed else None

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only these batch rows; drop columns that became padding in every row."""
        if len(keep) == len(self._running):
            return
        self._running = [self._running[i] for i in keep]
        self._pos = [self._pos[i] for i in keep]
        if self._cache is not None:
            self._cache, self._mask = batch_cache.select(self._cache, self._mask, keep)

    # ---- tokens and finishing ----------------------------------------------------------
    def _append_tokens(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Choose and append one token per request from ``logits`` ``[len(reqs), vocab]``."""
        temps = torch.tensor(
            [1.0 if r.params.greedy else r.params.temperature for r in reqs], device=logits.device
        )
        logprobs = scaled_log_softmax(logits, temps[:, None])
        for req, row in zip(reqs, logprobs):
            try:
                self._append_token(req, row)
            except Exception as exc:  # this request ends with an error; the others go on
                logger.exception("request %s failed", req.rid)
                if not req.finished:
                    self._fail(req, exc)

    def _append_token(self, req: Request, logprobs: torch.Tensor) -> None:
        params = req.params
        banned = None
        if len(req.output_ids) < params.min_new_tokens:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_ids))
        token, logprob = choose_token(logprobs, params, req.generator, banned)
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        if not params.ignore_eos and token in self.eos_ids or token in params.stop_token_ids:
            text = self._decode_text(
                req.output_ids if params.no_stop_trim else req.output_ids[:-1], params
            )
            self._finish(req, stop_reason(token), text)
            return
        if params.stop:
            text = self._decode_text(req.output_ids, params)
            hit = find_stop_string(text, params.stop)
            if hit is not None:
                stop, pos = hit
                self._finish(req, stop_reason(stop), text if params.no_stop_trim else text[:pos])
                return
        if len(req.output_ids) >= params.max_new_tokens:
            self._finish(req, length_reason(params.max_new_tokens))

    def _decode_text(self, ids: list[int], params: SamplingParams) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _fail(self, req: Request, exc: BaseException) -> None:
        """End ``req`` with an abort naming the error (its text is not decoded again)."""
        self._finish(req, abort_reason(f"engine error: {exc}"), "")

    def _finish(self, req: Request, reason: dict, text: str | None = None) -> None:
        req.finish_reason = reason
        req.text = text if text is not None else self._decode_text(req.output_ids, req.params)
        req.on_done(req)
