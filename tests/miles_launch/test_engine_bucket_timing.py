"""The built-in engine's per-bucket timing line (``--log-level debug``) and the parser the
weight-sync benchmark reads it with: the line the engine logs is the one the parser reads."""

from __future__ import annotations

import logging

from miles_launch.builtin_engine.weight_routes import BUCKET_TIMING, bucket_timings


def test_the_logged_timing_lines_parse_to_their_medians(caplog):
    logger = logging.getLogger("miles_launch.builtin_engine.weight_routes")
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        logger.info("update_weights_from_tensor: not a timing line")
        for decode, queued, load in [(1.0, 2.0, 3.0), (5.0, 0.5, 1.25), (3.0, 1.0, 2.0)]:
            logger.debug(BUCKET_TIMING, 7, 1 << 30, decode, queued, load)
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert bucket_timings(text) == {"requests": 3, "decode": 3.0, "queued": 1.0, "load": 2.0}
    assert bucket_timings("engine ready\n") is None
