"""Test support for miles-launch: parsing the launcher's flags with miles-core's groups."""

from __future__ import annotations

from pathlib import Path

from miles_core.args import entry_point_groups, parse_args


def parse(tmp_path: Path, *flags: str):
    """Parse ``flags`` with the core and launch groups, with a prompt file and HF dir given."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "1"}\n')
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", str(prompts), *flags]
    return parse_args(argv, entry_point_groups("core", "launch"))
