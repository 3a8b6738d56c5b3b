"""``python -m miles_megatron.model_args HF_DIR``: print the MODEL_ARGS line of a model.

For users migrating Megatron-LM launch scripts: the printed flags are exactly what the bridge
derives from ``HF_DIR/config.json``; ``read -ra MODEL_ARGS <<< "$(...)"`` turns it into an array.
"""

from __future__ import annotations

import argparse
import sys

from miles_core.args import ArgumentError

from miles_megatron.arch_args import hf_model_args, model_args_line
from miles_megatron.bridge import BridgeError


def model_args(hf_dir: str) -> str:
    """The MODEL_ARGS line for the HF model in ``hf_dir``."""
    return model_args_line(hf_model_args(hf_dir, {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles model-args", description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", help="HuggingFace model directory (with config.json)")
    ns = parser.parse_args(argv)
    try:
        print(model_args(ns.hf_dir))
    except (ArgumentError, BridgeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
