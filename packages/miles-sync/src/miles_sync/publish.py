"""One publish round, the same in every transfer mode, driven by trainer rank 0.

::

    pause_generation(mode)  ->  flush_cache  ->  begin_weight_update
        -> push the buckets (the mode's transport; other ranks only gather / send)
        -> update_weight_version(new)          exactly one version change per publish
    end_weight_update  ->  continue_generation  (always, also after an error)

The new version is set only after every bucket landed, so a publish that died half-way is
visible from outside: the engine's ``/get_model_info`` still reports the previous version.
The engine's update lock (begin/end) and the pause are always released on the engines that
are still alive; the first failure is raised as :class:`~miles_sync.errors.PublishError` with
the engine's message, and the publish can be retried.
"""

from __future__ import annotations

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

    def _fail(self, step: str, engine: EngineClient, error: Exception) -> PublishError:
        return PublishError(
            f"publish of weight version {self.version}: {step} on {engine.base_url} failed: {error}"
        )

    def open(self) -> None:
        """Pause every engine, flush its cache and open its update window."""
        for engine in self.engines:
            try:
                engine.pause_generation(self.pause_mode)
            except EngineError as error:
                raise self._fail("pause_generation", engine, error) from error
            self._paused.append(engine)
        for engine in self.engines:
            try:
                engine.flush_cache()
            except EngineError as error:
                if error.status_code is None:
                    raise self._fail("flush_cache", engine, error) from error
                # retract / in_place keep their requests: the cache cannot be flushed now; the
                # update calls flush it themselves (flush_cache: true).
                logger.debug("flush_cache on %s deferred: %s", engine.base_url, error.message)
        for engine in self.engines:
            try:
                engine.begin_weight_update()
            except EngineError as error:
                raise self._fail("begin_weight_update", engine, error) from error
            self._begun.append(engine)

    def commit(self) -> None:
        """Set the new weight version on every engine (after every bucket landed)."""
        for engine in self.engines:
            try:
                engine.update_weight_version(self.version, abort_all_requests=False)
            except EngineError as error:
                raise self._fail("update_weight_version", engine, error) from error

    def close(self) -> list[str]:
        """End the update window and continue generation on every engine this round touched.

        Never raises: failures (a dead engine) are logged and returned, so that the error that
        ended the round is the one the caller sees.
        """
        problems: list[str] = []
        for engine in self._begun:
            try:
                engine.end_weight_update()
            except EngineError as error:
                problems.append(f"end_weight_update: {error}")
        for engine in self._paused:
            try:
                engine.continue_generation()
            except EngineError as error:
                problems.append(f"continue_generation: {error}")
        for problem in problems:
            logger.warning("publish of weight version %s: %s", self.version, problem)
        self._begun, self._paused = [], []
        return problems


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
