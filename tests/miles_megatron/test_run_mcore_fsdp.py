"""scripts/run_mcore_fsdp.py: --dry-run prints one recipe's command for either backend, which
the real parser accepts with that backend's groups (nothing is run)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from miles_core import backends
from miles_core.args import entry_point_groups, parse_args

ROOT = Path(__file__).resolve().parents[2]


def dry_run(tmp_path, *flags: str) -> list[str]:
    from megatron_tiny_models import hf_config

    hf = tmp_path / "model"
    hf_config("qwen3").save_pretrained(hf)  # the megatron bridge reads config.json
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    out = subprocess.run(
        [sys.executable, "scripts/run_mcore_fsdp.py", *flags, "--hf-checkpoint", str(hf),
         "--prompt-data", str(prompts), "--save", str(tmp_path / "ckpt"), "--dry-run",
         "--num-rollout", "5"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    return shlex.split(line)


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_one_recipe_either_backend(tmp_path, backend):
    argv = dry_run(tmp_path, "--train-backend", backend)
    assert argv[:4] == ["miles", "train", "--train-backend", backend]
    assert argv.count("--train-backend") == 1
    assert argv[-2:] == ["--num-rollout", "5"]  # forwarded last, so it wins
    if backend not in backends.available():
        pytest.skip(f"the {backend} backend is not installed: the command is not parsed")
    args = parse_args(argv[2:], entry_point_groups("core", backend, "launch"))
    assert args.train_backend == backend and args.num_rollout == 5
    assert args.advantage_estimator == "grpo" and args.lr == 1e-6 and args.bf16
    if backend == "megatron":
        assert args.tensor_model_parallel_size == 2 and args.sequence_parallel
        assert args.recompute_granularity == "full"
    else:
        assert args.gradient_checkpointing


def test_default_backend_is_megatron_and_a_bad_one_is_refused(tmp_path):
    assert dry_run(tmp_path)[:4] == ["miles", "train", "--train-backend", "megatron"]
    out = subprocess.run(
        [sys.executable, "scripts/run_mcore_fsdp.py", "--train-backend", "jax", "--dry-run"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2 and "--train-backend" in out.stderr
