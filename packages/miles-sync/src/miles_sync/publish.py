"""One publish round, the same in every transfer mode, driven by trainer rank 0.

::

    pause_generation(mode)  ->  flush_cache  ->  begin_weight_update
        -> push the buckets (the mode's transport; other ranks only gather / send)
        -> update_weight_version(new)          exactly one version change per publish
    end_weight_update  ->  continue_generation  (always, also after an error, unless the
                                                 failure may have left part of the weights)

Each step runs on every engine at once (a thread per engine). The new version is set only
after every bucket landed, so a publish that died half-way is visible from outside: the
engine's ``/get_model_info`` still reports the previous version.
The engine's update lock (begin/end) is always released on the engines that are still alive;
the first failure is raised as :class:`~miles_sync.errors.PublishError` with the engine's
message, and the publish can be retried. The pause is released after a complete round, and
after a failure before any bucket was sent (the engines hold the previous version whole); a
round that failed once the update windows were open (a push or the version change failed)
leaves its engines paused: they may hold part of the new weights under the old version's name,
and no decode step may run on such a mix. A retry's round (which pauses them again) resumes them
once it completed; a caller that does not retry resumes them with ``continue_generation``.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence

from miles_core.engine import EngineClient, EngineError

from miles_sync.errors import PublishError

logger = logging.getLogger(__name__)


class PublishRound:
    """The engine-side bracket of one publish (used by rank 0 only).

    >>> round = PublishRound(engines, version="3", pause_mode="retract")
    >>> round.open()          # pause, flush, begin
    >>> ...                   # push buckets
    >>> round.commit()        # set the version
    >>> round.close()         # end, continue: always call, also after an error
    """

    def __init__(self, engines: Sequence[EngineClient], version: str, pause_mode: str):
        self.engines = list(engines)
        self.version = str(version)
        self.pause_mode = pause_mode
        self._paused: list[EngineClient] = []
        self._begun: list[EngineClient] = []
        self.held: list[EngineClient] = []  # paused engines a failed round left paused
        self.opened = False  # every update window open: buckets may land from here on
        self.committed = False  # every engine has the new version

    def _fail(self, step: str, engine: EngineClient, error: Exception) -> PublishError:
        return PublishError(
            f"publish of weight version {self.version}: {step} on {engine.base_url} failed: {error}"
        )

    def _run(self, step: str, call, record: list | None = None) -> None:
        """``call`` on every engine at once; ``record`` gets those it succeeded on; the first
        failure (in engine order) is raised after every call returned."""
        succeeded, failure = _on_each(call, self.engines)
        if record is not None:
            record.extend(succeeded)
        if failure is not None:
            engine, error = failure
            raise self._fail(step, engine, error) from error

    def open(self) -> None:
        """Pause every engine, flush its cache and open its update window."""
        self._run("pause_generation", lambda e: e.pause_generation(self.pause_mode), self._paused)
        self._run("flush_cache", self._flush)
        self._run("begin_weight_update", lambda e: e.begin_weight_update(), self._begun)
        self.opened = True

    def _flush(self, engine: EngineClient) -> None:
        try:
            engine.flush_cache()
        except EngineError as error:
            if error.status_code is None:
                raise
            # retract / in_place keep their requests: the cache cannot be flushed now; the last
            # bucket's update call flushes it (flush_cache: true).
            logger.debug("flush_cache on %s deferred: %s", engine.base_url, error.message)

    def commit(self) -> None:
        """Set the new weight version on every engine (after every bucket landed)."""
        self._run(
            "update_weight_version",
            lambda e: e.update_weight_version(self.version, abort_all_requests=False),
        )
        self.committed = True

    def close(self) -> list[str]:
        """End the update window on every engine this round touched, and continue generation
        on them unless the round opened and did not commit (module docstring: they stay paused,
        :attr:`held`).

        Never raises: failures (a dead engine) are logged and returned, so that the error that
        ended the round is the one the caller sees.
        """
        problems: list[str] = []
        self.held = self._paused if self.opened and not self.committed else []
        resume = [] if self.held else self._paused
        for step, call, engines in (
            ("end_weight_update", lambda e: e.end_weight_update(), self._begun),
            ("continue_generation", lambda e: e.continue_generation(), resume),
        ):
            _, failure = _on_each(call, engines)
            if failure is not None:
                problems.append(f"{step}: {failure[1]}")
        for problem in problems:
            logger.warning("publish of weight version %s: %s", self.version, problem)
        if self.held:
            logger.warning(
                "publish of weight version %s failed after its update windows opened: %d "
                "engine(s) left paused (their weights may be incomplete) until a publish "
                "completes", self.version, len(self.held),
            )  # fmt: skip
        self._begun, self._paused = [], []
        return problems


def _on_each(
    call: Callable[[EngineClient], object], engines: Sequence[EngineClient]
) -> tuple[list[EngineClient], tuple[EngineClient, EngineError] | None]:
    """``call(engine)`` on every engine at once (a thread each, so that a round over many
    engines costs one HTTP round trip per step, not one per engine). Returns the engines it
    succeeded on and the first failure in engine order (or None)."""

    def outcome(engine: EngineClient) -> EngineError | None:
        try:
            call(engine)
        except EngineError as error:
            return error
        return None

    if len(engines) <= 1:
        errors = [outcome(e) for e in engines]
    else:
        with concurrent.futures.ThreadPoolExecutor(min(len(engines), 64)) as pool:
            errors = list(pool.map(outcome, engines))
    failed = [(e, err) for e, err in zip(engines, errors) if err is not None]
    return [e for e, err in zip(engines, errors) if err is None], (failed[0] if failed else None)


def publish_round(
    engines: Sequence[EngineClient], version: str, pause_mode: str, push: Callable[[], None]
) -> None:
    """Run one complete round on one rank: open, ``push()``, commit, close (always).

    An :class:`EngineError` raised by ``push`` becomes a :class:`PublishError`.
    """
    round_ = PublishRound(engines, version, pause_mode)
    try:
        round_.open()
        try:
            push()
        except EngineError as error:
            raise PublishError(
                f"publish of weight version {version}: pushing weights failed: {error}"
            ) from error
        round_.commit()
    finally:
        round_.close()
