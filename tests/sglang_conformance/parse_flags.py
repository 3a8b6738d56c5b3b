"""``python run_with_sglang.py ROOT parse_flags JSON``: miles' own argument parsing and
validation (``miles_launch.train.parse``, which exits 2 after one line on a bad command line)
on each command line of the JSON list, with the released SGLang importable; prints one JSON list
of ``{"code", "stderr"}`` (``code`` None: parsed)."""

from __future__ import annotations

import contextlib
import io
import json
import sys

from miles_launch.train import parse

if __name__ == "__main__":
    results = []
    for argv in json.loads(sys.argv[1]):
        stderr = io.StringIO()
        code = None
        with contextlib.redirect_stderr(stderr):
            try:
                parse(argv)
            except SystemExit as exit_:
                code = exit_.code
        results.append({"code": code, "stderr": stderr.getvalue()})
    print(json.dumps(results))
