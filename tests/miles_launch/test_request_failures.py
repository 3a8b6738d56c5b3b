"""A failed generation request ends the rollout with nothing behind it: its sibling requests
are cancelled and awaited before the error is raised (with a plain gather they went on, against
the surviving engines, while the run was already reporting its error and tearing down)."""

from __future__ import annotations

import asyncio
import gc

import pytest
from miles_launch.rollout.generate import all_or_cancel


class Dropped(Exception):
    pass


async def _request(delay: float, fail: bool, log: list[str], name: str):
    try:
        await asyncio.sleep(delay)
    except asyncio.CancelledError:
        log.append(f"{name} cancelled")
        raise
    if fail:
        raise Dropped(name)
    return name


def _run(gather) -> tuple[list[str], list[dict], int]:
    """Run three requests through ``gather`` (the first fails first, the others later), then
    keep the loop going past the others' failure times; what the loop's exception handler saw
    and how many tasks were still pending when ``gather`` raised."""
    log: list[str] = []
    unhandled: list[dict] = []

    async def main() -> int:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx))
        work = [
            _request(0.01, True, log, "first"),
            _request(0.05, True, log, "second"),
            _request(0.05, True, log, "third"),
        ]
        with pytest.raises(Dropped, match="first"):
            await gather(work)
        pending = sum(1 for t in asyncio.all_tasks() if t is not asyncio.current_task())
        await asyncio.sleep(0.1)  # past the siblings' own failures
        gc.collect()  # where asyncio reports an exception nobody retrieved
        return pending

    pending = asyncio.run(main())
    gc.collect()
    return log, unhandled, pending


def test_the_first_failure_cancels_and_awaits_its_siblings():
    log, unhandled, pending = _run(all_or_cancel)
    assert pending == 0
    assert sorted(log) == ["second cancelled", "third cancelled"]
    assert unhandled == []


def test_plain_gather_leaves_them_running():
    """The control: with asyncio.gather the siblings outlive the failure (what the rollout did
    before)."""

    async def plain(work):
        return await asyncio.gather(*work)

    log, _, pending = _run(plain)
    assert pending == 2 and log == []
