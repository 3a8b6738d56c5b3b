"""scripts/run_mcore_fsdp.py: --dry-run prints one recipe's command for either backend, which
the real parser accepts with that backend's groups; and (extended) the comparison the script is
for: the recipe run on the tiny model with each backend, step for step equal."""

from __future__ import annotations

import json
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


#: What the tiny CPU run changes in the recipe (appended: the later flag wins). Placement: 2
#: gloo ranks (megatron TP 2 x DP 1 with the recipe's sequence parallelism and full recompute;
#: FSDP DP 2) and 1 built-in engine; fp32 so that the backends agree to fp32 rounding; the
#: demo's reward (the tiny model has no chat template and cannot do math); 2 prompts x 4
#: samples in global batches of 4: two optimizer steps, one prompt group each; lr 1e-3 (the
#: second step's metrics follow the first Adam update, whose fp32 spread grows with lr).
TINY_RUN = [
    "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1", "--rollout-engine", "builtin",
    "--no-bf16", "--no-apply-chat-template", "--rm-type", "label-char-fraction",
    "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
    "--rollout-max-response-len", "8", "--global-batch-size", "4", "--lr", "1e-3",
    "--save-interval", "1", "--no-progress",
]  # fmt: skip
BACKEND_TINY_RUN = {
    "megatron": [],
    "fsdp": ["--fsdp-compute-dtype", "fp32", "--attn-implementation", "sdpa"],
}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.numeric
def test_the_recipe_trains_alike_on_both_backends(tmp_path):
    """The recipe's rollout on the tiny model with each backend: the same prompts and samples
    (the engine starts from each backend's published weights, which are the checkpoint's), and
    the rollout's two optimizer steps (``--global-batch-size 4`` of 8 samples) give the same
    gradient norm, entropy and loss to fp32 rounding: each step trains the rollout's slice of
    samples at either data-parallel size (megatron DP 1, FSDP DP 2)."""
    from megatron_cli import megatron_cli_env
    from miles_launch.demo import build_tiny_qwen3, write_demo_prompts

    for backend in ("megatron", "fsdp"):
        if backend not in backends.available():
            pytest.skip(f"the {backend} backend is not installed")
    hf = build_tiny_qwen3(tmp_path / "tiny-qwen3")
    prompts = write_demo_prompts(tmp_path / "prompts.jsonl")
    records = {}
    for backend in ("megatron", "fsdp"):
        metrics = tmp_path / f"{backend}.jsonl"
        out = subprocess.run(
            [sys.executable, "scripts/run_mcore_fsdp.py", "--train-backend", backend,
             "--hf-checkpoint", str(hf), "--prompt-data", str(prompts),
             "--save", str(tmp_path / backend), *TINY_RUN, *BACKEND_TINY_RUN[backend],
             "--metrics-jsonl", str(metrics)],
            capture_output=True, text=True, timeout=900, cwd=ROOT,
            env=megatron_cli_env() if backend == "megatron" else None,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        (records[backend],) = [json.loads(line) for line in metrics.read_text().splitlines()]
    meg, fsdp = records["megatron"], records["fsdp"]
    assert meg["prompt_ids"] == fsdp["prompt_ids"]
    assert meg["rollout"]["reward_mean"] == fsdp["rollout"]["reward_mean"]
    assert meg["rollout"]["response_len_mean"] == fsdp["rollout"]["response_len_mean"]
    assert meg["rollout"]["reward_max"] > meg["rollout"]["reward_min"]  # GRPO has a signal
    assert meg["train"]["steps"] == 2
    for key in ("entropy", "loss"):  # means over the two steps
        m, f = meg["train"][key], fsdp["train"][key]
        assert abs(m - f) <= 1e-5 * max(1.0, abs(f)), (key, meg["train"], fsdp["train"])
    # the last step's grad norm is taken after one Adam step: weights whose first gradient is
    # within fp32 rounding of zero move by up to +-lr depending on that rounding
    # (tests/tolerances.py), which moves the second gradient by O(lr) (measured 1.7e-4 of it at
    # lr 1e-3, 1.4e-3 at lr 1e-2); a step over other samples moves it by O(1) (2.75 vs 2.18)
    m, f = meg["train"]["grad_norm"], fsdp["train"]["grad_norm"]
    assert abs(m - f) <= 1e-3 * f, (meg["train"], fsdp["train"])
    assert (tmp_path / "megatron" / "iter_0000001").is_dir()
    assert (tmp_path / "fsdp" / "iter_0000001").is_dir()
