"""``python run_with_sglang.py ROOT MODULE ARGS...``: run ``python -m MODULE ARGS...`` with the
unpacked SGLang release at ``ROOT`` importable (:func:`sglang_release.register`)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_release import register  # noqa: E402

if __name__ == "__main__":
    root, module, *rest = sys.argv[1:]
    register(root)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
