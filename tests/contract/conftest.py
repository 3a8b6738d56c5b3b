"""The backend conformance suite: its rank programs import the megatron tests' spawn harness, the
tiny models and samples, and the sync tests' engine by name."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for folder in (Path(__file__).parent, TESTS / "miles_megatron", TESTS / "miles_sync"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
