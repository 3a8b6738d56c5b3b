"""Every layout kind a Megatron job's flags can name is proven by a layout-suite case or refused
in one line at argument time (miles_megatron.layout_kinds).

- The proven tables equal the kinds of the cases the layout suites compare with HF + AdamW
  (test_layouts.py, test_context_parallel.py, test_backend.py), derived from those cases' own
  flags: a kind cannot be listed as proven unless a suite runs it.
- Every kind (each subset of TP, PP, CP, DP on a dense model; of TP, PP, DP, EP on an MoE
  model, at size 2 each) goes through ``miles train``'s real parser with a tiny HF checkpoint:
  a proven kind parses, any other is one ``ArgumentError`` line naming the flags and the kind.
- ``miles train`` itself exits 2 with that one line, before anything starts.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
from miles_core.args import ArgumentError, parse_args
from miles_megatron.layout_kinds import PROVEN_DENSE, PROVEN_MOE, kind_name, layout_kind

DENSE_DIMS = ("tp", "pp", "cp", "dp")
MOE_DIMS = ("tp", "pp", "dp", "ep")


def suite_cases(hf_dirs: dict[str, str]):
    """``(where, world, hf_dir, argv)`` of each layout-suite case compared with HF + AdamW."""
    from cp_ranks import CP_TWO_RANK_RL_LAYOUTS, cp_two_rank_cases, four_rank_cp_cases
    from layout_ranks import four_rank_cases, two_rank_cases
    from megatron_ranks import layout_argv

    llama = hf_dirs["llama"]
    for _, hf, argv in two_rank_cases(hf_dirs):
        if "--use-lora" not in argv:  # the LoRA case checks that adapters trained, not HF
            yield "test_layouts.py", 2, hf, argv
    for _, hf, argv in four_rank_cases(hf_dirs):
        yield "test_layouts.py (extended)", 4, hf, argv
    for _, hf, argv in cp_two_rank_cases(llama):
        yield "test_context_parallel.py", 2, hf, argv
    for _, argv in CP_TWO_RANK_RL_LAYOUTS:  # reference log-probs equal HF's (check_rl)
        yield "test_context_parallel.py", 2, llama, argv
    for _, hf, argv in four_rank_cp_cases(llama):
        yield "test_context_parallel.py (extended)", 4, hf, argv
    # test_backend.py: megatron_ranks.backend_run at TP = 2 on 2 ranks equals HF + AdamW
    yield "test_backend.py", 2, llama, layout_argv(tp=2)


def kind_of_case(world: int, hf_dir: str, argv: list[str]) -> frozenset[str]:
    from megatron_ranks import parse

    args = parse(
        ["--hf-checkpoint", hf_dir, *argv]
    )  # the sizes as the parser resolves them (defaults, ETP)
    return layout_kind(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
        args.expert_model_parallel_size,
        world,
    )


def test_the_proven_kinds_are_the_kinds_the_layout_suites_run(layout_hf_dirs):
    moe_dir = layout_hf_dirs["qwen3_moe"]
    dense, moe = {frozenset()}, {frozenset()}  # one rank: the conformance and HF-parity tests
    for _, world, hf, argv in suite_cases(layout_hf_dirs):
        (moe if hf == moe_dir else dense).add(kind_of_case(world, hf, argv))
    assert dense == set(PROVEN_DENSE), sorted(map(kind_name, dense ^ set(PROVEN_DENSE)))
    assert moe == set(PROVEN_MOE), sorted(map(kind_name, moe ^ set(PROVEN_MOE)))


def every_kind(dims: tuple[str, ...]):
    for n in range(len(dims) + 1):
        yield from (frozenset(c) for c in itertools.combinations(dims, n))


def job_argv(kind: frozenset[str], hf_dir: str, moe: bool) -> list[str]:
    """A ``miles train`` command line of ``kind`` at size 2 in each of its dimensions."""
    size = {d: 2 if d in kind else 1 for d in ("tp", "pp", "cp", "dp", "ep")}
    world = size["tp"] * size["pp"] * size["cp"] * size["dp"]
    argv = ["--train-backend", "megatron", "--hf-checkpoint", hf_dir]
    per_node = min(world, 8)
    argv += ["--actor-num-nodes", str(world // per_node)]
    argv += ["--actor-num-gpus-per-node", str(per_node), "--no-bf16"]
    argv += ["--tensor-model-parallel-size", str(size["tp"])]
    argv += ["--pipeline-model-parallel-size", str(size["pp"])]
    argv += ["--context-parallel-size", str(size["cp"])]
    argv += ["--expert-model-parallel-size", str(size["ep"])]
    if size["tp"] > 1:
        argv.append("--sequence-parallel")
    if moe and size["ep"] > 1 and size["dp"] == 1:  # EP carved from the TP ranks
        argv += ["--expert-tensor-parallel-size", "1"]
    if moe and size["pp"] > 1:  # the all-gather dispatcher is refused at PP > 1
        argv += ["--moe-token-dispatcher-type", "alltoall"]
    return argv


def parse_job(argv: list[str], tmp_path) -> object:
    from miles_launch.train import compose

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "1"}\n')
    argv = [*argv, "--prompt-data", str(prompts)]
    return parse_args(argv, compose(argv))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_every_kind_parses_when_proven_and_is_one_line_otherwise(
    family, layout_hf_dirs, tmp_path, monkeypatch
):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    moe = family == "qwen3_moe"
    dims, proven = (MOE_DIMS, PROVEN_MOE) if moe else (DENSE_DIMS, PROVEN_DENSE)
    refused = walked = 0
    for kind in every_kind(dims):
        argv = job_argv(kind, layout_hf_dirs[family], moe)
        walked += 1
        if kind in proven:
            args = parse_job(argv, tmp_path)
            assert args.train_backend == "megatron", kind_name(kind)
            continue
        with pytest.raises(ArgumentError) as error:
            parse_job(argv, tmp_path)
        message = str(error.value)
        assert "\n" not in message, message
        if moe and "ep" in kind and not kind & {"tp", "dp"}:
            # EP 2 needs 2 ranks besides PP: the sizes check refuses it first
            assert "is not divisible by --expert-tensor-parallel-size" in message, message
            continue
        assert f"is a {kind_name(kind)} layout on" in message, (kind_name(kind), message)
        assert "no test proves" in message, message
        for d, flag in (
            ("tp", "--tensor-model-parallel-size 2"),
            ("pp", "--pipeline-model-parallel-size 2"),
        ):
            assert (flag in message) == (d in kind), (flag, message)
        refused += 1
    assert walked == 2 ** len(dims)
    assert refused == walked - len(proven) - (2 if moe else 0), refused


def test_miles_train_refuses_an_unproven_kind_in_one_line_with_status_2(layout_hf_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "1"}\n')
    argv = job_argv(frozenset({"tp", "pp", "dp"}), layout_hf_dirs["llama"], moe=False)
    done = subprocess.run(
        [sys.executable, "-m", "miles_launch.train", *argv, "--prompt-data", str(prompts)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 on 8 GPUs (DP 2) is a TP x PP x DP layout on a dense model"
        in lines[0]
    ), lines[0]
