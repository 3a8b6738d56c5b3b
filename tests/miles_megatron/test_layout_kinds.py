"""Every layout kind a Megatron job's flags can name is proven by a layout-suite case or refused
in one line at argument time (miles_megatron.layout_kinds).

- The proven tables equal the kinds of the cases the layout suites compare with HF + AdamW
  (test_layouts.py, test_context_parallel.py, test_backend.py), derived from those cases' own
  flags: a kind cannot be listed as proven unless a suite runs it.
- Every kind (each subset of TP, PP, CP, DP on a dense model; of TP, PP, DP, EP on an MoE
  model, at size 2 each) goes through ``miles train``'s real parser with a tiny HF checkpoint:
  every kind the size checks let through is proven today, and parses.
- A kind taken out of the proven table is one ``ArgumentError`` line naming the flags, the
  kind and the proven kinds (``miles train`` prints it and exits 2, as for every argument
  error).
"""

from __future__ import annotations

import itertools

import pytest
from miles_core.args import ArgumentError, parse_args
from miles_megatron.layout_kinds import PROVEN_DENSE, PROVEN_MOE, kind_name, layout_kind

DENSE_DIMS = ("tp", "pp", "cp", "dp")
MOE_DIMS = ("tp", "pp", "dp", "ep")


def suite_cases(hf_dirs: dict[str, str]):
    """``(where, world, hf_dir, argv)`` of each layout-suite case compared with HF + AdamW."""
    from cp_ranks import CP_TWO_RANK_RL_LAYOUTS, cp_two_rank_cases, four_rank_cp_cases
    from layout_ranks import eight_rank_cases, four_rank_cases, sixteen_rank_cases, two_rank_cases
    from megatron_ranks import layout_argv

    llama = hf_dirs["llama"]
    for _, hf, argv in two_rank_cases(hf_dirs):
        if "--use-lora" not in argv:  # the LoRA case checks that adapters trained, not HF
            yield "test_layouts.py", 2, hf, argv
    for _, hf, argv in four_rank_cases(hf_dirs):
        yield "test_layouts.py (extended)", 4, hf, argv
    for _, hf, argv in eight_rank_cases(hf_dirs):
        yield "test_layouts.py (extended)", 8, hf, argv
    for _, hf, argv in sixteen_rank_cases(hf_dirs):
        yield "test_layouts.py (extended)", 16, hf, argv
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
def test_every_kind_the_size_checks_accept_is_proven_and_parses(
    family, layout_hf_dirs, tmp_path, monkeypatch
):
    """Each subset of the dimensions at size 2 through ``miles train``'s parser: every kind the
    size checks let through is in the proven table and parses (EP alone and PP x EP on an MoE
    model are refused by the size checks: EP takes ranks of DP or TP)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    moe = family == "qwen3_moe"
    dims, proven = (MOE_DIMS, PROVEN_MOE) if moe else (DENSE_DIMS, PROVEN_DENSE)
    parsed = set()
    for kind in every_kind(dims):
        argv = job_argv(kind, layout_hf_dirs[family], moe)
        if moe and "ep" in kind and not kind & {"tp", "dp"}:
            with pytest.raises(ArgumentError, match="is not divisible by --expert-tensor"):
                parse_job(argv, tmp_path)
            continue
        args = parse_job(argv, tmp_path)
        assert args.train_backend == "megatron", kind_name(kind)
        parsed.add(kind)
    assert parsed == set(proven), sorted(map(kind_name, parsed ^ set(proven)))
    assert len(parsed) == 2 ** len(dims) - (2 if moe else 0)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_kind_no_suite_proves_is_one_line_naming_the_flags_and_the_kind(
    family, layout_hf_dirs, tmp_path, monkeypatch
):
    """Each multi-dimension kind, taken out of the proven table (as if its suite case were
    removed), is refused by ``miles train``'s parser in one line naming the flags, the GPUs,
    DP, the kind and what is proven; the other kinds still parse."""
    from miles_megatron import layout_kinds

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    moe = family == "qwen3_moe"
    name = "PROVEN_MOE" if moe else "PROVEN_DENSE"
    table = getattr(layout_kinds, name)
    refused = 0
    for kind in [k for k in table if len(k) >= 2]:
        monkeypatch.setattr(layout_kinds, name, {k: v for k, v in table.items() if k != kind})
        with pytest.raises(ArgumentError) as error:
            parse_job(job_argv(kind, layout_hf_dirs[family], moe), tmp_path)
        message = str(error.value)
        assert "\n" not in message, message
        model = "an MoE model" if moe else "a dense model"
        assert f"is a {kind_name(kind)} layout on {model}, which no test proves" in message
        assert f"(DP {2 if 'dp' in kind else 1})" in message, message
        for d, flag in (
            ("tp", "--tensor-model-parallel-size 2"),
            ("pp", "--pipeline-model-parallel-size 2"),
            ("cp", "--context-parallel-size 2"),
            ("ep", "--expert-model-parallel-size 2"),
        ):
            assert (flag in message) == (d in kind), (flag, message)
        assert f", {kind_name(kind)}," not in message  # not listed among the proven
        refused += 1
    assert refused == sum(len(k) >= 2 for k in table) >= 5
