"""The object a backend's ``update_weights(engines)`` calls: one publish per call, any mode.

>>> publisher = WeightPublisher(SyncConfig.from_args(args), RankContext.from_default_group())
>>> publisher.update_weights(weight_source, engine_urls)   # every trainer rank calls this
3                                                          # the engines' new weight version

Every rank calls :meth:`WeightPublisher.update_weights` with the same engine list and its
(collective) weight source. Rank 0 drives the round (:class:`~miles_sync.publish.PublishRound`);
the mode's transport moves the bytes. The engine set is compared with the previous call's, and
groups are (re)made when it changed. Versions are integers counted by the publisher: each
successful publish advances it by exactly one; a failed publish raises
:class:`~miles_sync.errors.PublishError` on every rank and leaves the counter (and the trainer)
as it was, so calling again retries the same version. With ``SyncConfig.verify``
(``--update-weight-verify``) rank 0 then reads every tensor back from each engine and a
difference fails the publish the same way (:mod:`miles_sync.readback`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from miles_core.args import ArgumentError
from miles_core.args.parsed import ParsedArgs
from miles_core.engine import EngineClient, EngineError

from miles_sync.broadcast import BroadcastTransport, GroupSettings
from miles_sync.deferred import fill_source, materialized
from miles_sync.disk_delta import DeltaWriter, DeltaWriterConfig, wait_for_pullers
from miles_sync.errors import PublishError
from miles_sync.ipc import IpcTransport
from miles_sync.p2p import P2PTransport
from miles_sync.publish import PublishRound
from miles_sync.ranks import RankContext
from miles_sync.readback import SentDigests, engine_dtype, verify_engines

logger = logging.getLogger(__name__)

MODES = ("ipc", "broadcast", "p2p", "disk-delta")


@dataclass
class SyncConfig:
    """What a publish needs; :meth:`from_args` reads it from the parsed flags."""

    mode: str = "broadcast"
    buffer_size: int = 512 * 1024**2
    pause_mode: str = "retract"
    colocate: bool = False
    gpus_per_engine: int = 1
    master_address: str | None = None  # None: the publishing rank's node address
    group_backend: str | None = None  # None: nccl with CUDA, else gloo
    group_timeout_s: float = 600.0
    disk_dir: str | None = None
    hf_checkpoint: str | None = None
    delta_encoding: str = "xor"
    delta_checksum: str = "xxh3-128"
    delta_full_every: int = 0
    puller_timeout_s: float = 600.0
    engine_api_key: str | None = None
    engine_timeout_s: float = 600.0
    verify: bool = False  # read every tensor back from each engine after the publish

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ArgumentError(
                f"--update-weight-transfer-mode must be one of {', '.join(MODES)}, got {self.mode}"
            )
        if self.mode == "p2p" and self.colocate:
            raise ArgumentError("--update-weight-transfer-mode p2p is not for --colocate (use ipc)")
        if self.mode == "disk-delta" and self.colocate:
            raise ArgumentError(
                "--update-weight-transfer-mode disk-delta is not for --colocate (use ipc)"
            )
        if self.mode == "disk-delta" and not self.disk_dir:
            raise ArgumentError(
                "--update-weight-transfer-mode disk-delta requires --update-weight-disk-dir"
            )
        if self.buffer_size < 1:
            raise ArgumentError(f"--update-weight-buffer-size must be >= 1, got {self.buffer_size}")

    @classmethod
    def from_args(cls, args: ParsedArgs, **overrides: Any) -> SyncConfig:
        """From parsed flags (``update_weight_*``, ``pause_generation_mode``, ``colocate``,
        ``hf_checkpoint``; ``rollout_num_gpus_per_engine`` and ``sglang_api_key`` when the
        launcher declares them)."""
        mode = args.update_weight_transfer_mode or ("ipc" if args.colocate else "broadcast")
        # the launcher's flags: its groups are not parsed where the ranks start by other means
        values = dict(
            mode=mode,
            buffer_size=args.update_weight_buffer_size,
            pause_mode=args.pause_generation_mode,
            colocate=args.colocate,
            gpus_per_engine=(
                args.rollout_num_gpus_per_engine if "rollout_num_gpus_per_engine" in args else 1
            ),
            disk_dir=args.update_weight_disk_dir,
            hf_checkpoint=args.hf_checkpoint,
            delta_encoding=args.update_weight_delta_encoding,
            delta_checksum=args.update_weight_delta_checksum,
            engine_api_key=args.sglang_api_key if "sglang_api_key" in args else None,
            verify=args.update_weight_verify,
        )
        values.update(overrides)
        return cls(**values)


class WeightPublisher:
    """Publishes a weight source to a set of engines (see the module docstring)."""

    def __init__(self, config: SyncConfig, ctx: RankContext | None = None):
        self.config = config
        self.ctx = ctx or RankContext.from_default_group()
        self.version: int | None = None  # the engines' version after the last publish
        self._clients: dict[str, EngineClient] = {}
        self._transport = self._make_transport()
        self._writer: DeltaWriter | None = None
        if config.mode == "disk-delta" and self.ctx.is_source:
            self._writer = DeltaWriter(
                DeltaWriterConfig(
                    disk_dir=config.disk_dir,
                    hf_checkpoint=config.hf_checkpoint,
                    encoding=config.delta_encoding,
                    checksum=config.delta_checksum,
                    full_every=config.delta_full_every,
                )
            )
        self.last_stats: dict[str, Any] = {}

    def _make_transport(self):
        c = self.config
        settings = GroupSettings(
            gpus_per_engine=c.gpus_per_engine,
            master_address=c.master_address,
            backend=c.group_backend,
            timeout_s=c.group_timeout_s,
        )
        if c.mode == "ipc":
            return IpcTransport(self.ctx, c.buffer_size, c.gpus_per_engine)
        if c.mode == "broadcast":
            return BroadcastTransport(self.ctx, c.buffer_size, settings)
        if c.mode == "p2p":
            return P2PTransport(self.ctx, c.buffer_size, settings)
        return None  # disk-delta: the writer and the pullers

    def _client(self, engine: str | EngineClient) -> EngineClient:
        if isinstance(engine, EngineClient):
            return engine
        url = engine.rstrip("/")
        if url not in self._clients:
            self._clients[url] = EngineClient(
                url, api_key=self.config.engine_api_key, timeout=self.config.engine_timeout_s
            )
        return self._clients[url]

    def _first_version(self, engines: list[EngineClient]) -> int:
        """Continue after the engines' (or the disk directory's) current integer version."""
        if self._writer is not None and self._writer.latest is not None:
            return self._writer.latest
        versions = []
        for engine in engines:
            try:
                versions.append(int(engine.get_model_info()["weight_version"]))
            except (ValueError, TypeError, KeyError, EngineError):
                versions.append(0)
        return max(versions, default=0)

    def update_weights(
        self, source: Iterable[tuple[str, torch.Tensor]], engines: Sequence[str | EngineClient]
    ) -> int:
        """Publish ``source`` to ``engines`` (every rank calls this); return the new version."""
        clients = [self._client(e) for e in engines]
        if not clients:
            raise ValueError("update_weights needs at least one engine")
        start = time.monotonic()
        previous = self.version
        if self.ctx.is_source and previous is None:
            previous = self._first_version(clients)
        version = self.ctx.broadcast_object(None if previous is None else previous + 1)
        dtypes, sent = self._start_check(clients)
        # ipc: every rank packs every bucket in lock step, so a source's deferred tensors may be
        # filled (all-gathered) straight into the bucket slots; elsewhere tensors are real.
        source = fill_source(source) if self.config.mode == "ipc" else materialized(source)
        if sent is not None:
            source = sent.watch(source)
        try:
            stats = self._publish(source, clients, version)
        except BaseException:
            if self._transport is not None:
                self._transport.reset()  # a failed group is re-made by the retry
            raise
        if self.config.verify:
            error = None
            if sent is not None:
                try:
                    stats["verified"] = verified = verify_engines(clients, dtypes, sent, version)
                    logger.info(
                        "weight version %d verified: %d tensors on %d engines equal the "
                        "trainer's bit for bit (state %s)",
                        version, verified["tensors"], verified["engines"], verified["state"],
                    )  # fmt: skip
                except PublishError as failure:
                    error = str(failure)
            error = self.ctx.broadcast_object(error)
            if error is not None:
                raise PublishError(error)
        self.version = version
        stats.update(version=version, seconds=time.monotonic() - start)
        self.last_stats = stats
        if self.ctx.is_source:
            logger.info("published weight version %d: %s", version, stats)
        return version

    def _start_check(self, clients: list[EngineClient]) -> tuple[dict, SentDigests | None]:
        """``--update-weight-verify`` on rank 0: each engine's dtype, and the recorder of what
        this publish sends (``{}, None`` elsewhere); a failure here fails the publish everywhere."""
        if not self.config.verify:
            return {}, None
        dtypes, sent, error = {}, None, None
        if self.ctx.is_source:
            try:
                dtypes = {c.base_url: engine_dtype(c) for c in clients}
                sent = SentDigests(set(dtypes.values()))
            except (EngineError, PublishError) as failure:
                error = f"--update-weight-verify: {failure}"
        error = self.ctx.broadcast_object(error)
        if error is not None:
            raise PublishError(error)
        return dtypes, sent

    def _publish(self, source, clients: list[EngineClient], version: int) -> dict:
        ctx = self.ctx
        # 1. Connect (collective in p2p: every rank forms its own group).
        start = time.perf_counter()
        error = None
        if self._transport is not None:
            try:
                self._transport.connect(clients)
            except Exception as failure:  # every rank must learn of it, or the others hang
                error = f"{type(failure).__name__}: {failure}"
        error = ctx.first_error(error)
        if error is not None:
            raise PublishError(f"publish of weight version {version}: {error}")

        # 2. disk-delta: write and let the pullers fetch before the pause.
        local_paths: dict[str, str] = {}
        stats: dict[str, Any] = {}
        if self.config.mode == "disk-delta":
            error = None
            if self._writer is not None:
                try:
                    written = self._writer.write(source, version)
                    stats.update(
                        published_bytes=written.published_bytes, full_bytes=written.full_bytes
                    )
                    local_paths = wait_for_pullers(
                        self.config.disk_dir,
                        [c.base_url for c in clients],
                        version,
                        self.config.puller_timeout_s,
                    )
                except PublishError as failure:
                    error = str(failure)
            else:
                for _ in source:
                    pass
            error = ctx.first_error(error)
            if error is not None:
                raise PublishError(error)

        # 3. The round: rank 0 opens it, every rank pushes, rank 0 commits and closes.
        round_ = PublishRound(clients, str(version), self.config.pause_mode)
        phases = stats.setdefault("phases", {})
        mark = start

        def phase(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            phases[name] = round(now - mark, 6)
            mark = now

        phase("prepare")  # connect, and disk-delta's write and pull
        try:
            error = None
            if ctx.is_source:
                try:
                    round_.open()
                except PublishError as failure:
                    error = str(failure)
            error = ctx.broadcast_object(error)
            if error is not None:
                raise PublishError(error)
            phase("open")
            error = None
            try:
                if self.config.mode == "disk-delta":
                    if ctx.is_source:
                        for client in clients:
                            client.update_weights_from_disk(
                                local_paths[client.base_url], flush_cache=True
                            )
                else:
                    stats.update(self._transport.push(source))
            except Exception as failure:  # every rank must learn of it, or the others hang
                error = f"pushing weights failed: {type(failure).__name__}: {failure}"
            error = ctx.first_error(error)
            if error is not None:
                raise PublishError(f"publish of weight version {version}: {error}")
            phase("push")
            if ctx.is_source:
                try:
                    round_.commit()
                except PublishError as failure:
                    error = str(failure)
            error = ctx.broadcast_object(error)
            if error is not None:
                raise PublishError(error)
            phase("commit")
        finally:
            if ctx.is_source:
                round_.close()
        phase("close")
        return stats

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
