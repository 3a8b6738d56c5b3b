"""The ``miles`` console script: ``miles train [flags]`` (see ``miles train --help``) and
``miles plot RUN_DIR`` (see :mod:`miles_launch.plot`)."""

from __future__ import annotations

import sys

from miles_launch import __version__
from miles_launch.train import main as train_main

USAGE = """usage: miles <command> [flags]

commands:
  train    run an RL job (miles train --help: the common flags; --help-all: every flag)
  plot     draw a run's metrics JSONL as a PNG (miles plot RUN_DIR)
"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        sys.exit(0 if argv else 2)
    if argv[0] == "--version":
        print(f"miles-launch {__version__}")
        return
    command, rest = argv[0], argv[1:]
    if command == "plot":
        # miles_launch.plot is off the CLI's parse path
        from miles_launch.plot import main as plot_main

        plot_main(rest)
        return
    if command != "train":
        print(f"error: unknown command {command!r} (commands: train, plot)", file=sys.stderr)
        sys.exit(2)

    train_main(rest)


if __name__ == "__main__":
    main()
