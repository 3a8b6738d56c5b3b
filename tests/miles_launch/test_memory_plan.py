"""The memory plan on the real ``miles train`` command line (miles_launch.memory_plan; its
arithmetic against independent references is test_memory_estimate.py's): the plan's three
``memory:`` lines, a job over ``--gpu-memory-gib`` refused in one ``error:`` line naming
``--ignore-memory-plan`` (exit 2, nothing started, under 15 s) and run with it, an engine whose
weights exceed its share refused, the colocated and disk-sleep phases and host terms parsed from
a job's flags, Megatron's own flags reaching the layout, a model type it does not count printed
unchecked.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import miles_launch.train as train_module
import pytest
from memory_shapes import SMALL
from miles_core.args import ArgumentError
from miles_launch.cli import main as cli_main
from miles_launch.demo import build_tiny_qwen3, demo_flags, write_demo_prompts
from miles_launch.memory_estimate import GiB, TrainerLayout, trainer_estimate
from miles_launch.model_shape import ModelShape


# ------------------------------------------------------------------ the command line
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("memory") / "tiny-qwen3")


@pytest.fixture
def job(tmp_path, hf_dir, monkeypatch):
    """``run(*flags) -> (exit status, stdout, stderr)`` of ``miles train`` on the demo's job;
    ``reached`` lists the jobs that got past the preflight (``run`` is a stand-in)."""
    prompts = write_demo_prompts(tmp_path / "prompts.jsonl", num_prompts=4)
    reached: list = []
    monkeypatch.setattr(train_module, "run", lambda args: reached.append(args) or [])

    def run(capsys, *flags: str):
        argv = ["train", *demo_flags(hf_dir, prompts, tmp_path / "out" / "m.jsonl"), *flags]
        code = 0
        try:
            cli_main(argv)
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run, reached


def test_plan_prints_the_estimate_unchecked_without_a_gpu(job, capsys):
    run, reached = job
    code, out, err = run(capsys, "--dry-run")
    assert code == 0 and not reached, err
    memory = [line.strip() for line in out.splitlines() if line.strip().startswith("memory:")]
    assert len(memory) == 3, out
    assert memory[0].startswith("memory: trainer GPU ~") and "not checked" in memory[0]
    assert "parameters" in memory[0] and "optimizer" in memory[0] and "activations" in memory[0]
    assert memory[1].startswith("memory: engine GPU: built-in engine, weights")
    assert memory[2].startswith("memory: host per trainer node")


def test_job_over_the_gpu_is_refused_unless_ignored(job, capsys):
    run, reached = job
    start = time.monotonic()
    code, out, err = run(capsys, "--gpu-memory-gib", "0.0001")
    lines = err.strip().splitlines()
    assert code == 2 and not reached and time.monotonic() - start < 15
    assert len(lines) == 1 and lines[0].startswith("error: the memory plan estimates"), err
    assert "--ignore-memory-plan" in lines[0] and "--gpu-memory-gib" in lines[0]
    code, out, err = run(capsys, "--gpu-memory-gib", "0.0001", "--ignore-memory-plan")
    assert code == 0 and len(reached) == 1, err
    assert "over the 104.9 KiB (--gpu-memory-gib)" in out
    code, out, err = run(capsys, "--gpu-memory-gib", "80", "--dry-run")
    assert code == 0 and "fits 80.0 GiB (--gpu-memory-gib)" in out, err


def test_ignore_memory_plan_is_refused_where_nothing_is_checked(job, capsys):
    """Without a CUDA device or --gpu-memory-gib the plan is printed unchecked: the flag that
    skips the check would be inert, so it is an argument error naming it."""
    run, reached = job
    code, out, err = run(capsys, "--ignore-memory-plan")
    lines = err.strip().splitlines()
    assert code == 2 and not reached and len(lines) == 1, err
    assert lines[0].startswith("error: --ignore-memory-plan: the plan checks nothing here")
    assert "--gpu-memory-gib" in lines[0]


def test_gpu_memory_gib_must_be_positive(job, capsys):
    run, reached = job
    code, out, err = run(capsys, "--gpu-memory-gib", "0")
    assert code == 2 and "--gpu-memory-gib must be > 0" in err and not reached


def test_memory_flags_refused_for_a_backend_without_an_estimate():
    from miles_launch.args import JobArgs

    args = SimpleNamespace(
        load_required=False,
        load=None,
        gpu_memory_gib=None,
        ignore_memory_plan=True,
        train_backend="other",
    )
    with pytest.raises(ArgumentError, match="--ignore-memory-plan: the memory plan estimates"):
        JobArgs.validate(args)


def parsed(tmp_path: Path, backend: str, *flags: str):
    """``miles train``'s flags for ``backend`` parsed with every group (no preflight), on a
    Qwen3-shaped config.json written under ``tmp_path``."""
    from miles_core.args import entry_point_groups, parse_args
    from transformers import Qwen3Config

    Qwen3Config(**SMALL, head_dim=16).save_pretrained(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    argv = ["--train-backend", backend, "--hf-checkpoint", str(tmp_path)]
    argv += ["--prompt-data", str(tmp_path / "p.jsonl"), "--rollout-engine", "builtin"]
    return parse_args([*argv, *flags], entry_point_groups("core", backend, "launch"))


def test_colocated_job_has_a_generation_phase_and_sleep_backups(tmp_path):
    """--colocate: the trainer sleeps to pinned host memory (its parameters and optimizer state
    are the host's), SGLang's fraction of the GPU (0.8 under --colocate) is the generation
    phase, and the engine releases its memory while the trainer trains."""
    from miles_launch.memory_plan import job_memory

    args = parsed(
        tmp_path, "fsdp", "--colocate", "--actor-num-gpus-per-node", "2",
        "--gpu-memory-gib", "10", "--max-tokens-per-gpu", "64", "--rollout-engine", "sglang",
    )  # fmt: skip
    job = job_memory(args, use_gpu=False)
    t, host = job.trainer, job.host_per_rank
    assert t.phases["generation"] == pytest.approx(0.8 * 10 * GiB)  # the trainer sleeps
    assert t.peak_phase == "generation" and not job.exceeds()
    backups = t.terms["parameters"] + t.terms["optimizer"]
    assert host.terms == {"sleep backups": backups}
    assert job.host_per_node == 2 * backups
    awake, _ = trainer_estimate(
        ModelShape.from_hf_dir(tmp_path),
        TrainerLayout(backend="fsdp", ranks=2, tokens=64, on_cuda=False, compute_bytes=2),
    )
    assert t.phases["training"] == pytest.approx(awake.phases["training"])


@pytest.mark.extended
def test_megatron_layout_from_its_flags(tmp_path):
    """Megatron's own flags (generated from megatron-core's configs) reach the layout."""
    from miles_launch.memory_plan import job_memory, trainer_layout

    args = parsed(
        tmp_path, "megatron", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "1",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity",
        "full", "--recompute-method", "block", "--recompute-num-layers", "2",
        "--optimizer-cpu-offload", "--no-grad-reduce-in-fp32", "--max-tokens-per-gpu", "128",
    )  # fmt: skip
    lay = trainer_layout(args, on_cuda=True)
    assert (lay.backend, lay.tp, lay.dp, lay.sequence_parallel) == ("megatron", 2, 4, True)
    assert (lay.recompute, lay.recompute_method, lay.recompute_layers) == ("full", "block", 2)
    assert (lay.grad_bytes, lay.optimizer_host_fraction) == (2, 1.0)
    job = job_memory(args, use_gpu=False)
    assert "optimizer" not in job.trainer.terms
    assert set(job.host_per_rank.terms) == {"optimizer (--optimizer-cpu-offload)"}


def test_fsdp_partial_checkpointing_reaches_the_layout(tmp_path):
    """--gradient-checkpointing-layers N is the estimate's block recompute of N layers; past the
    model's layers it is refused (SMALL has 3)."""
    from miles_fsdp.args import FSDPArgs
    from miles_launch.memory_plan import trainer_layout

    flags = ["--gradient-checkpointing", "--gradient-checkpointing-layers", "1"]
    lay = trainer_layout(parsed(tmp_path, "fsdp", *flags), on_cuda=True)
    assert (lay.recompute, lay.recompute_method, lay.recompute_layers) == ("full", "block", 1)
    args = parsed(
        tmp_path, "fsdp", "--gradient-checkpointing", "--gradient-checkpointing-layers", "4"
    )
    with pytest.raises(ArgumentError, match="--gradient-checkpointing-layers 4: the model has 3"):
        FSDPArgs.preflight(args)


def test_engine_weights_over_its_fraction_are_refused(tmp_path):
    """SGLang's weights must fit its --sglang-mem-fraction-static of the GPU."""
    from miles_launch.memory_plan import check_memory, job_memory

    flags = ["--rollout-engine", "sglang", "--sglang-mem-fraction-static", "0.05"]
    flags += ["--gpu-memory-gib", str(1 / 1024), "--max-tokens-per-gpu", "8"]
    args = parsed(tmp_path, "fsdp", *flags)  # 1 MiB: the engine may use 51 KiB
    job = job_memory(args, use_gpu=False)
    assert job.engine_weights == 2 * ModelShape.from_hf_dir(tmp_path).total_params()
    assert job.engine_exceeds() and job.engine_room == pytest.approx(0.05 * 2**20)
    assert not job.exceeds()  # the trainer fits
    with pytest.raises(ArgumentError, match="--sglang-mem-fraction-static.*--ignore-memory-plan"):
        check_memory(args, use_gpu=False)
    args.ignore_memory_plan = True
    check_memory(args, use_gpu=False)


def test_a_model_type_it_does_not_count_is_printed_unchecked(tmp_path):
    """A hybrid model (Mamba layers, here nemotron_h) gets no estimate, said so, and no refusal."""
    import json

    from miles_launch.memory_plan import check_memory, plan_memory_lines

    args = parsed(tmp_path, "fsdp", "--gpu-memory-gib", "0.0001")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "nemotron_h"}))
    (line,) = plan_memory_lines(args, use_gpu=False)
    assert line.startswith("memory: no estimate (model_type nemotron_h is not one whose layers")
    assert line.endswith("; not checked")
    check_memory(args, use_gpu=False)
    args.ignore_memory_plan = True  # nothing is checked, so the flag would change nothing
    with pytest.raises(ArgumentError, match="--ignore-memory-plan: the plan checks nothing here"):
        check_memory(args, use_gpu=False)
    with pytest.raises(ValueError, match="model_type nemotron_h"):
        ModelShape.from_hf_dir(tmp_path)


def test_disk_sleep_holds_its_ring_on_the_host(tmp_path):
    from miles_launch.memory_plan import job_memory

    args = parsed(
        tmp_path, "fsdp", "--colocate", "--offload-train-target", "disk",
        "--offload-train-disk-chunk-mb", "64",
    )  # fmt: skip
    job = job_memory(args, use_gpu=False)
    assert job.host_per_rank.terms == {"disk sleep's pinned ring": 4 * 64 * 2**20}
