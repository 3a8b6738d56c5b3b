"""Generating prompt groups against the engines, with rewards and a watch on engine health.

Every sample is one ``/generate`` request of the prompt's token ids (or whatever the
``--custom-generate-function-path`` function does for it, see
:mod:`miles_launch.rollout.custom_generate`) with ``return_logprob`` (the rollout log-probs
kept for TIS), the ``--rollout-stop`` strings and ``--rollout-stop-token-ids``, and a
``sampling_seed`` derived from ``(--rollout-seed, stream position, sample number)``, so a
group's sampling is reproducible. Requests
go to the router, or round-robin over the engines. With routing replay (a
:class:`~miles_launch.rollout.routed_experts.RoutedExpertsLayout` given) each request also
sets ``return_routed_experts`` and the reply's routed experts travel with the sample
(``Sample.routed_experts``, see :mod:`miles_launch.rollout.routed_experts`). While requests
are in flight every engine process is polled each second: an engine that dies raises
:class:`~miles_launch.engine_launch.process.EngineDied` with its log tail instead of a bare
connection error. With engine restarts (``--engine-restart-limit``) the watch is the
:class:`~miles_launch.engine_launch.recovery.EngineRecovery`'s instead: requests go to the
engines in its rotation, and a group that failed because its engine died is sent again whole
(as is one whose engine was found hung or unreachable: its requests in flight fail at once).

Under ``--partial-rollout`` (:mod:`miles_launch.rollout.partial`) a draw stops once enough groups
passed the filter: the engines' requests are aborted, the groups cut short come back with their
unfinished samples (``finish_reason`` ``abort``, unrewarded), and the next rollout continues
them from the carried tokens, which keep the log-probs they were sampled with (and with
``--mask-offpolicy-in-partial-rollout`` leave the loss).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from miles_core.batch import RolloutBatch, Sample
from miles_core.engine import AsyncEngineClient, EngineError

from miles_launch.engine_launch.watch_timing import WATCH_INTERVAL_S
from miles_launch.rollout.custom_generate import (
    GenerateContext,
    GenerateFunction,
    checked_samples,
    parse_reply,
)
from miles_launch.rollout.filtering import has_signal
from miles_launch.rollout.partial import UNFINISHED, unfinished
from miles_launch.rollout.prompts import Prompt
from miles_launch.rollout.rewards import RewardInput, RewardModel
from miles_launch.rollout.routed_experts import RoutedExpertsLayout, decode_sample_routed_experts

#: How long a failed request waits for an engine's death to become visible (a killed engine
#: drops its connections a moment before its exit status can be read, longer on a busy host).
DEATH_GRACE_S = 15.0


async def all_or_cancel(aws: Iterable[Awaitable[Any]]) -> list[Any]:
    """``asyncio.gather``'s results, except that the first failure cancels the others and
    waits for them before it is raised: no request outlives the call. (With a plain gather the
    siblings of a request that failed because an engine died went on against the surviving
    engines while the run reported its error and tore down.)"""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class GeneratedSample:
    """One response with what the trainer and the reports need."""

    prompt: Prompt
    position: int  # stream position of the prompt
    response_ids: list[int]
    rollout_log_probs: list[float]
    response_text: str
    finish_reason: str
    weight_version: int | None
    reward: float = 0.0
    finished_at: float = 0.0
    # int32 [prompt + response - 1, num_layers, top_k] under routing replay, else None
    routed_experts: torch.Tensor | None = None
    reward_input: RewardInput | None = None  # what the reward function was given
    loss_mask: list[int] | None = None  # per response token (custom generation), None: all 1
    reward_given: bool = False  # the custom generate function set ``reward``
    resumed_tokens: int = 0  # --partial-rollout: leading tokens carried from a previous rollout


def sampling_seed(seed: int, position: int, k: int, resumed_at: int = 0) -> int:
    """The ``sampling_seed`` of sample ``k`` of the prompt at stream ``position`` (continued
    after ``resumed_at`` carried tokens: another seed)."""
    key = f"{seed}/{position}/{k}" + (f"/{resumed_at}" if resumed_at else "")
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


class Generator:
    """Sends requests for prompt groups and scores them (one per asyncio loop)."""

    def __init__(
        self,
        urls: list[str],
        reward: RewardModel,
        check_alive: Callable[[str], Any],
        timeout_s: float = 3600.0,
        routed_experts: RoutedExpertsLayout | None = None,
        api_key: str | None = None,
        custom_generate: GenerateFunction | None = None,
        tokenizer: Any = None,
        abort_urls: list[str] | None = None,
        passes: Callable[[list[GeneratedSample]], bool] | None = None,
        mask_carried: bool = False,
        recovery: Any = None,
    ):
        self.clients = [
            AsyncEngineClient(url, api_key=api_key, timeout=timeout_s, retries=0) for url in urls
        ]
        # --engine-restart-limit: an EngineRecovery; requests go to the engines in its rotation,
        # and a group that failed because its engine died is re-issued there
        self.recovery = recovery
        self._rotation_clients: dict[str, AsyncEngineClient] = {}
        self._client_options = dict(api_key=api_key, timeout=timeout_s, retries=0)
        self.reward = reward
        self.check_alive = check_alive  # async: raises EngineDied
        self.routed_experts = routed_experts  # None: routing replay off
        self.custom_generate = custom_generate  # --custom-generate-function-path
        self.tokenizer = tokenizer  # handed to the custom generate function
        # --partial-rollout: the engines whose requests are aborted (each engine, not a router)
        self.abort_clients = [
            AsyncEngineClient(url, api_key=api_key, timeout=60.0, retries=0)
            for url in abort_urls or []
        ]
        self._aborting = False  # the draw is cut short: abort replies are partial samples
        # --partial-rollout: whether a finished group counts towards ``need`` (the job's
        # dynamic filter rule; default: its rewards are not all equal)
        self.passes = passes or (lambda group: has_signal([s.reward for s in group]))
        # --mask-offpolicy-in-partial-rollout: a continued sample's carried tokens get loss mask 0
        self.mask_carried = mask_carried
        self._next = 0

    def _client(self) -> AsyncEngineClient:
        client = self.clients[self._next % len(self.clients)]
        self._next += 1
        return client

    async def _pick(self) -> AsyncEngineClient:
        """The next engine, round robin (with restarts: over those in rotation now)."""
        if self.recovery is None:
            return self._client()
        urls = await self.recovery.rotation()
        url = urls[self._next % len(urls)]
        self._next += 1
        if url not in self._rotation_clients:
            self._rotation_clients[url] = AsyncEngineClient(url, **self._client_options)
        return self._rotation_clients[url]

    def sampling_params(
        self, cfg: SamplingConfig, position: int, k: int, resumed_at: int = 0
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": cfg.max_new_tokens - resumed_at,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "sampling_seed": sampling_seed(cfg.seed, position, k, resumed_at),
        }
        if cfg.stop:
            params["stop"] = list(cfg.stop)
        if cfg.stop_token_ids:
            params["stop_token_ids"] = list(cfg.stop_token_ids)
        return params

    async def sample(
        self,
        prompt: Prompt,
        position: int,
        k: int,
        cfg: SamplingConfig,
        carried: GeneratedSample | None = None,
    ) -> list[GeneratedSample]:
        """Sample ``k`` of the prompt: one ``/generate`` request, or what the custom generate
        function returns (one or more samples); rewarded when rewards are per sample.
        ``carried``: the sample as a previous rollout left it (``--partial-rollout``): kept when
        it had finished, else continued."""
        if carried is not None and carried.finish_reason != UNFINISHED:
            return [carried]
        prefix = carried.response_ids if carried is not None else []
        params = self.sampling_params(cfg, position, k, len(prefix))
        client = await self._pick()

        async def request() -> list[GeneratedSample]:
            if self.custom_generate is not None:
                return await self._custom(client, prompt, position, k, params)
            return [await self._one_request(client, prompt, position, params, carried)]

        if self.recovery is None:
            outs = await request()
        else:  # fails at once if its engine is lost (hung, or its host unreachable)
            outs = await self.recovery.unless_lost(client.base_url.rstrip("/"), request())
        for out in outs:
            if out.finish_reason == UNFINISHED:  # carried on, rewarded once finished
                continue
            out.reward_input = RewardInput(
                prompt=prompt.text,
                response=out.response_text,
                label=prompt.label,
                response_ids=tuple(out.response_ids),
                finish_reason=out.finish_reason,
                max_response_len=cfg.max_new_tokens,
                metadata=prompt.metadata,
                prompt_index=prompt.index,
                sample_index=k,
            )
            if self.reward.batch == "sample" and not out.reward_given:
                out.reward = await self.reward(out.reward_input)
            out.finished_at = time.monotonic()
        return outs

    async def _one_request(
        self,
        client: AsyncEngineClient,
        prompt: Prompt,
        position: int,
        params: dict[str, Any],
        carried: GeneratedSample | None = None,
    ) -> GeneratedSample:
        prefix = list(carried.response_ids) if carried is not None else []
        reply = await client.generate(
            input_ids=list(prompt.token_ids) + prefix,
            sampling_params=params,
            return_logprob=True,
            return_routed_experts=self.routed_experts is not None,
        )
        meta = reply["meta_info"]
        if self._aborting and (meta.get("finish_reason") or {}).get("type") == UNFINISHED:
            meta.setdefault("output_token_logprobs", [])  # aborted before its first token
        turn = parse_reply(reply)
        out = GeneratedSample(
            prompt=prompt,
            position=position,
            response_ids=prefix + turn.ids,
            # the carried tokens keep the log-probs of the policy that sampled them
            rollout_log_probs=(list(carried.rollout_log_probs) if prefix else []) + turn.log_probs,
            response_text=(carried.response_text if prefix else "") + turn.text,
            finish_reason=turn.finish_reason,
            weight_version=turn.weight_version,
            resumed_tokens=len(prefix),
        )
        if prefix and self.mask_carried:  # sampled by an older policy: out of the loss
            out.loss_mask = [0] * len(prefix) + [1] * len(turn.ids)
        if out.finish_reason == UNFINISHED and self._aborting:
            return out  # cut short by the draw's abort: carried to the next rollout
        if out.finish_reason == "abort":
            finish = reply["meta_info"].get("finish_reason") or {}
            raise EngineError(
                f"generation aborted: {finish.get('message', '')}",
                endpoint="/generate",
                base_url="",
                status_code=None,
            )
        if self.routed_experts is not None:
            out.routed_experts = decode_sample_routed_experts(
                reply["meta_info"],
                self.routed_experts,
                len(prompt.token_ids) + len(turn.ids),
                client.base_url,
            )
        return out

    async def _custom(
        self,
        client: AsyncEngineClient,
        prompt: Prompt,
        position: int,
        k: int,
        params: dict[str, Any],
    ) -> list[GeneratedSample]:
        ctx = GenerateContext(client, client.base_url, self.tokenizer, k)
        where = f"--custom-generate-function-path (sample {k} of prompt {prompt.index})"
        customs = checked_samples(await self.custom_generate(ctx, prompt, dict(params)), where)
        return [
            GeneratedSample(
                prompt=prompt,
                position=position,
                response_ids=[int(t) for t in c.response_ids],
                rollout_log_probs=[float(x) for x in c.rollout_log_probs],
                response_text=c.response_text,
                finish_reason=c.finish_reason,
                weight_version=c.weight_version,
                reward=0.0 if c.reward is None else float(c.reward),
                reward_given=c.reward is not None,
                loss_mask=None if c.loss_mask is None else [int(m) for m in c.loss_mask],
            )
            for c in customs
        ]

    async def score(self, samples: list[GeneratedSample]) -> None:
        """Set the rewards of ``samples`` with one call of the batched reward function (a
        sample whose custom generate function gave its reward is left as is)."""
        samples = [s for s in samples if not s.reward_given]
        if not samples:
            return
        rewards = await self.reward.score([s.reward_input for s in samples])
        for s, reward in zip(samples, rewards, strict=True):
            s.reward = reward

    async def group(
        self,
        prompt: Prompt,
        position: int,
        n: int,
        cfg: SamplingConfig,
        on_sample: Callable[[], None] | None = None,
        carried: list[GeneratedSample] | None = None,
    ) -> list[GeneratedSample]:
        async def one(k: int) -> list[GeneratedSample]:
            result = await self.sample(prompt, position, k, cfg, carried[k] if carried else None)
            if on_sample is not None:
                on_sample()
            return result

        while True:
            try:
                outs = await all_or_cancel(one(k) for k in range(n))
                break
            except EngineError as error:
                # an engine died: the whole group again (its samples then come from one weight
                # version; the finished ones are dropped, so none is counted twice)
                recovery = self.recovery
                if recovery is None or not await recovery.explained(error, "during generation"):
                    raise
                recovery.count_reissued(n)
        samples = [s for out in outs for s in out]
        if self.reward.batch == "group" and not unfinished(samples):
            await self.score(samples)
        return samples

    async def groups(
        self,
        items: list[tuple[Prompt, int]],
        n: int,
        cfg: SamplingConfig,
        on_sample: Callable[[], None] | None = None,
        *,
        carried: dict[int, list[GeneratedSample]] | None = None,
        need: int | None = None,
    ) -> list[list[GeneratedSample]]:
        """All groups of ``items`` ((prompt, position) pairs) concurrently, watched; under
        ``--custom-rm-batch rollout`` scored together at the end. ``--partial-rollout``:
        ``carried`` maps a position to its group as a previous rollout left it, and once
        ``need`` groups finished with a learning signal the engines' requests are aborted (the
        groups still running come back with unfinished samples)."""
        carried = carried or {}
        work = [self.group(p, pos, n, cfg, on_sample, carried.get(pos)) for p, pos in items]
        if need is None:
            groups = await self.watched(all_or_cancel(work))
        else:
            groups = await self.watched(self._until(work, need))
        if self.reward.batch == "rollout":
            await self.score([s for g in groups for s in g])
        return groups

    async def _until(self, work: list[Any], need: int) -> list[list[GeneratedSample]]:
        """The groups of ``work`` in order; after the ``need``-th finished group with a learning
        signal, every engine's requests are aborted and the rest come back as they stand."""
        tasks = [asyncio.ensure_future(w) for w in work]
        pending, passing = set(tasks), 0
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    group = task.result()
                    if not unfinished(group) and self.passes(group):
                        passing += 1
                if passing >= need and pending and not self._aborting:
                    self._aborting = True
                    await asyncio.gather(
                        *(c.abort_request(abort_all=True) for c in self.abort_clients)
                    )
            return [task.result() for task in tasks]
        finally:
            self._aborting = False
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def watched(self, work: Any) -> Any:
        """Await ``work`` while polling the engines; an engine death or a failed request
        (after checking whether an engine died) raises."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_INTERVAL_S)
                if done:
                    try:
                        return task.result()
                    except EngineError:
                        # Explained by an engine's death if one shows within the grace
                        deadline = time.monotonic() + DEATH_GRACE_S
                        while time.monotonic() < deadline:
                            await self.check_alive("during generation")
                            await asyncio.sleep(WATCH_INTERVAL_S / 4)
                        raise
                await self.check_alive("during generation")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def aclose(self) -> None:
        for client in self.clients + self.abort_clients + list(self._rotation_clients.values()):
            await client.aclose()


def _loss_mask(s: GeneratedSample) -> torch.Tensor:
    if s.loss_mask is None:
        return torch.ones(len(s.response_ids), dtype=torch.float32)
    return torch.tensor(s.loss_mask, dtype=torch.float32)


def to_rollout_batch(groups: list[list[GeneratedSample]]) -> RolloutBatch:
    """The trainer's batch: group ``g``'s samples get ``group_index = g``. When some sample has
    a ``loss_mask`` every sample gets one (all ones where none was given)."""
    masked = any(s.loss_mask is not None for group in groups for s in group)
    samples = []
    for g, group in enumerate(groups):
        for s in group:
            if not s.response_ids:
                raise ValueError(f"prompt {s.prompt.index}: the engine returned an empty response")
            tokens = torch.tensor(list(s.prompt.token_ids) + s.response_ids, dtype=torch.long)
            samples.append(
                Sample(
                    tokens=tokens,
                    response_length=len(s.response_ids),
                    reward=s.reward,
                    rollout_log_probs=torch.tensor(s.rollout_log_probs, dtype=torch.float32),
                    group_index=g,
                    weight_version=s.weight_version,
                    routed_experts=s.routed_experts,
                    loss_mask=_loss_mask(s) if masked else None,
                )
            )
    return RolloutBatch(samples)
