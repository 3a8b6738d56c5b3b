"""Recipe scripts: --dry-run prints the full command, which the real parser accepts."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from miles_core import backends
from miles_core.args import entry_point_groups, parse_args

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ["run_qwen3_0_6b_fsdp.py", "run_qwen3_30b_a3b_fsdp.py", "run_nemotron_3_nano_4b_fsdp.py"]


@pytest.mark.parametrize("script", RECIPES)
def test_dry_run_prints_the_full_command(tmp_path, script):
    hf = tmp_path / "model"
    hf.mkdir()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    out = subprocess.run(
        [sys.executable, f"scripts/{script}", "--hf-checkpoint", str(hf),
         "--prompt-data", str(prompts), "--save", str(tmp_path / "ckpt"),
         "--dry-run", "--num-rollout", "5"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    argv = shlex.split(line)
    assert argv[:4] == ["miles", "train", "--train-backend", "fsdp"]
    assert argv[argv.index("--hf-checkpoint") + 1] == str(hf)
    assert argv[argv.index("--save") + 1] == str(tmp_path / "ckpt")
    assert argv[-2:] == ["--num-rollout", "5"]  # forwarded last, so it wins
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed: the command is not parsed")
    args = parse_args(argv[2:], entry_point_groups("core", "fsdp", "launch"))
    assert args.train_backend == "fsdp" and args.rm_type == "math"
