"""Model recipes: the ``miles train`` command of a tuned job, with local paths filled in.

A recipe script (``scripts/run_<model>_fsdp.py``) holds the model's flags grouped as in the
seeds' launch scripts (placement, rollout, algorithm, optimizer, engine, checkpoint) and calls
:func:`recipe_main`, which adds ``--hf-checkpoint``, ``--prompt-data`` and ``--save`` from its
own command line, appends any further flags (they win, being later), and either prints the
full command (``--dry-run``) or runs it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence


def recipe_command(
    groups: dict[str, Sequence[str]],
    hf_checkpoint: str,
    prompt_data: str,
    save: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """``miles train`` followed by every group's flags, the paths and ``extra``."""
    cmd = ["miles", "train"]
    for flags in groups.values():
        cmd += list(flags)
    cmd += ["--hf-checkpoint", hf_checkpoint, "--prompt-data", prompt_data, "--save", save]
    return cmd + list(extra)


def recipe_main(description: str, groups: dict[str, Sequence[str]], default_save: str) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--hf-checkpoint", required=True, help="local HF model directory")
    parser.add_argument(
        "--prompt-data", required=True, help="JSONL prompts with 'prompt' and 'label' keys"
    )
    parser.add_argument("--save", default=default_save, help="checkpoint directory")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    ours, extra = parser.parse_known_args()
    cmd = recipe_command(groups, ours.hf_checkpoint, ours.prompt_data, ours.save, extra)
    if ours.dry_run:
        print(shlex.join(cmd))
        return
    print("$ " + shlex.join(cmd), flush=True)
    argv = [sys.executable, "-m", "miles_launch.train", *cmd[2:]]
    os.execv(sys.executable, argv)
