"""miles_megatron tests: the test-support modules (shim, spawned ranks, tiny models) import by name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
