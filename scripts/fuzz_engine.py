"""Fuzz the built-in engine's HTTP surface with many cases (the test suite runs a few hundred).

Starts ``python -m miles_launch.builtin_engine`` on a tiny Qwen3 with an API key set, sends
``--cases`` cases of ``tests/miles_launch/engine_fuzzing.py`` (malformed bodies on every
route, wrong keys, and valid weight payloads of the served checkpoint with one field mutated,
over the tensor, bucket, disk and distributed routes), then checks that the engine answers
/health, that every tensor equals the checkpoint, that the weight version is unchanged and
that greedy generation equals transformers'. Prints the number of cases run and their
statuses; exits 1 on any failure.

Usage::

    python scripts/fuzz_engine.py                 # 10,000 cases
    python scripts/fuzz_engine.py --cases 20000 --budget-s 3600
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "miles_launch"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--budget-s", type=float, default=7200.0, help="stop after this many seconds")
    args = p.parse_args(argv)
    if args.cases < 1:
        p.error(f"--cases must be >= 1, got {args.cases}")

    from engine_fuzzing import Checkpoint, assert_serves_the_checkpoint, run_fuzz
    from engine_testing import EngineProcess, assert_generates, save_tokenizer, tiny_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = tiny_qwen3(0)
        model.save_pretrained(root / "old")
        tokenizer = save_tokenizer(root / "old")
        models = {"old": (root / "old", model), "tokenizer": tokenizer, "references": {}}
        engine = EngineProcess(
            root / "old", "--max-running-requests", "3", api_key="fuzz-key-0", timeout=900
        )
        try:
            version = engine.client.get("/get_model_info").json()["weight_version"]
            ckpt = Checkpoint(model.state_dict(), root / "old", root / "scratch")
            marker = str(root / "pwned")
            started = time.monotonic()
            stats = run_fuzz(engine, ckpt, marker, args.cases, args.budget_s)
            assert not os.path.exists(marker), "a payload ran code"
            assert_serves_the_checkpoint(engine, ckpt, version)
            assert_generates(engine, models, "old")
        finally:
            engine.close()
    print(
        f"engine fuzz: {stats['cases']} cases in {time.monotonic() - started:.0f} s, no 5xx; "
        f"statuses {dict(sorted(stats['statuses'].items()))}; "
        f"{sum(stats['mutated'].values())} mutated payloads ({stats['accepted']} valid, undone); "
        f"refusals reached {dict(stats['refusals'])}; afterwards /health 200, every tensor "
        "equal to the checkpoint, version unchanged, greedy output equal to transformers'"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
