"""Test time-outs on a shared machine.

A time-out in a test is a safety net against a hang, not a speed requirement. Under pytest-xdist
a test shares the machine with the other workers' tests, so its processes may get 1/N of the
cores they would have alone: :func:`scaled` stretches a time-out by the number of workers.
"""

from __future__ import annotations

import os


def slowdown() -> float:
    """How many tests share the machine: xdist's worker count (1 outside xdist)."""
    return max(1.0, float(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def scaled(seconds: float) -> float:
    return seconds * slowdown()
