"""How often the engines are watched during generation, and the shortest
``--engine-health-timeout`` that watch honours (a light module: the argument check reads it).

The watch ticks once per :data:`WATCH_INTERVAL_S` of generation (``W``). At each tick an
engine's last ``/health`` 200 is compared with the timeout ``T`` *before* a new probe starts,
and a probe starts only once the last answer is :func:`probe_interval` old (``P = min(5 s,
T/4)``). A probe therefore starts at most ``P + W`` after the last answer, and its own answer
(taking ``d``) is seen by the tick after it lands: a healthy engine reaches an age of up to
``P + W + d`` at a tick. It is counted hung by mistake unless ``T > P + W + d``, i.e. (``P =
T/4``) ``d < 3T/4 - W``. At ``T = 2W`` an answer half a tick late already counts a healthy
engine as hung; at ``T = 3W`` an answer may be a whole tick late (``d < 1.25 W``), which an
engine busy with a decode step on a loaded host can be. Hence :data:`MIN_HEALTH_TIMEOUT_S`.
"""

from __future__ import annotations

#: Seconds between two watch ticks of one generation (process alive? ``/health`` fresh?).
WATCH_INTERVAL_S = 1.0
#: Seconds between two ``/health`` probes of one engine during generation (at most; a quarter
#: of ``--engine-health-timeout`` when that is shorter).
PROBE_INTERVAL_S = 5.0
#: The shortest ``--engine-health-timeout``: three watch ticks (module docstring).
MIN_HEALTH_TIMEOUT_S = 3 * WATCH_INTERVAL_S


def probe_interval(health_timeout_s: float) -> float:
    """Seconds after an engine's last ``/health`` answer before the next probe starts."""
    return min(PROBE_INTERVAL_S, health_timeout_s / 4)
