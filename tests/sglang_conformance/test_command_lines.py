"""Every SGLang command line miles builds parses with the released SGLang's own ``ServerArgs``
parser, and every router command line with the released sglang-router's own parser (both run in
the engine stand-in process, from the unpacked wheels; see tests/sglang_release.py)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
from miles_core.args import entry_point_groups, parse_args
from miles_launch.engine_launch.router import router_command
from miles_launch.engine_launch.sglang_launcher import sglang_server_command
from miles_launch.recipes import recipe_command

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "scripts").glob("run_*.py") if p.name != "run_demo.py")
#: The passthrough examples of the seeds' training-backends.md that the release still has
#: (its --sglang-enable-ep-moe is gone from 0.5.23: see test_removed_flag_is_unknown).
SEED_EXAMPLES = [
    "--sglang-enable-dp-attention", "--sglang-dp-size", "8",
    "--sglang-mem-fraction-static", "0.7", "--sglang-log-level", "INFO",
    "--sglang-context-length", "32768",
]  # fmt: skip
CASES = {
    "defaults": [],
    "colocate": ["--colocate"],
    "offload-rollout": ["--colocate", "--offload-rollout"],
    "routing-replay": ["--use-rollout-routing-replay"],
    "seed-passthrough-examples": SEED_EXAMPLES,
    "true-on-policy": ["--true-on-policy"],
    "tensor-parallel": ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
                        "--sglang-cuda-graph-bs-decode", "1", "2", "4"],
}  # fmt: skip


def parse(tmp_path: Path, flags: list[str]):
    """Our parser on ``flags`` with a prompt file and a small MoE config (routing replay
    reads it) given."""
    from transformers import Qwen3MoeConfig

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "1"}\n')
    hf = tmp_path / "hf"
    Qwen3MoeConfig(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2).save_pretrained(hf)
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", str(prompts), *flags]
    argv += ["--rollout-engine", "sglang"]
    return parse_args(argv, entry_point_groups("core", "fsdp", "launch"))


def server_argv(args) -> list[str]:
    cmd = sglang_server_command(args, host="127.0.0.1", port=30000, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    return cmd[3:]


def assert_parses(reply: dict, argv: list[str]) -> None:
    assert (reply["unknown"], reply["error"]) == ([], None), f"{argv}: {reply}"


def test_the_api_key_reaches_sglang_through_its_config_file(sglang_engine, tmp_path):
    """--sglang-api-key: SGLang's own parser, merging the --config YAML the engine host writes
    (as prepare_server_args does), reads the key; argv does not carry it."""
    from miles_launch.engine_launch.process import SECRET_FILE, write_secret_file
    from miles_launch.engine_launch.sglang_launcher import sglang_secret_config

    key = 'k3y: "quoted" #and-a-hash'  # YAML-special characters survive the quoting
    args = parse(tmp_path, ["--sglang-api-key", key])
    path = write_secret_file(sglang_secret_config(args))
    argv = [str(path) if a == SECRET_FILE else a for a in server_argv(args)]
    assert key not in " ".join(argv)
    reply = sglang_engine.parse_server_args(argv)
    assert_parses(reply, argv)
    assert reply["api_key"] == key
    assert sglang_engine.parse_server_args(server_argv(parse(tmp_path, [])))["api_key"] is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_server_command_line_parses(case, sglang_engine, tmp_path):
    argv = server_argv(parse(tmp_path, CASES[case]))
    assert_parses(sglang_engine.parse_server_args(argv), argv)


@pytest.mark.parametrize("script", RECIPES)
def test_recipe_server_command_line_parses(script, sglang_engine, tmp_path):
    recipe = runpy.run_path(str(ROOT / "scripts" / script))
    groups = recipe["GROUPS"] if "GROUPS" in recipe else recipe["groups"]("fsdp")
    (tmp_path / "hf").mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi", "label": "1"}\n')
    cmd = recipe_command(groups, str(tmp_path / "hf"), str(tmp_path / "prompts.jsonl"), "/s")
    argv = cmd[2:] + ["--rollout-engine", "sglang"]
    args = parse_args(argv, entry_point_groups("core", "fsdp", "launch"))
    argv = server_argv(args)
    assert_parses(sglang_engine.parse_server_args(argv), argv)


def test_true_on_policy_switches_reach_sglang_s_parser(sglang_engine, tmp_path):
    """--true-on-policy: SGLang's own parser reads its on-policy target, deterministic
    inference and a deterministic attention backend; a backend the job names itself wins."""
    reply = sglang_engine.parse_server_args(server_argv(parse(tmp_path, ["--true-on-policy"])))
    assert (reply["unknown"], reply["error"]) == ([], None), reply
    assert reply["rl_on_policy_target"] == "fsdp"
    assert reply["enable_deterministic_inference"] is True
    assert reply["attention_backend"] == "fa3"
    own = ["--true-on-policy", "--sglang-attention-backend", "triton"]
    argv = server_argv(parse(tmp_path, own))
    assert argv.count("--attention-backend") == 1
    assert sglang_engine.parse_server_args(argv)["attention_backend"] == "triton"
    plain = sglang_engine.parse_server_args(server_argv(parse(tmp_path, [])))
    assert plain["rl_on_policy_target"] is None and plain["enable_deterministic_inference"] is False


def test_removed_flag_is_unknown(sglang_engine, tmp_path):
    """The parser is able to refuse: a flag the release dropped, and an abbreviation that has
    become ambiguous (--cuda-graph-bs: 0.5.23 has -decode and -prefill)."""
    args = parse(tmp_path, ["--sglang-enable-ep-moe"])
    reply = sglang_engine.parse_server_args(server_argv(args))
    assert reply["unknown"] == ["--enable-ep-moe"]
    args = parse(tmp_path, ["--sglang-cuda-graph-bs", "1", "2"])
    assert (
        "ambiguous option: --cuda-graph-bs"
        in sglang_engine.parse_server_args(server_argv(args))["error"]
    )


@pytest.mark.parametrize(
    "flags", [[], ["--router-balance-abs-threshold", "0", "--router-policy", "cache_aware"]]
)
def test_router_command_line_parses(flags, sglang_engine, tmp_path):
    if not sglang_engine.router_available:
        pytest.skip("sglang-router's wheel was not fetched: router command lines unchecked")
    args = parse(tmp_path, flags)
    cmd = router_command(
        args, host="127.0.0.1", port=8000, worker_urls=["http://10.0.0.5:30001"], python="python"
    )
    assert cmd[:3] == ["python", "-m", "sglang_router.launch_router"]
    assert_parses(sglang_engine.parse_router_args(cmd[3:]), cmd[3:])
    bad = sglang_engine.parse_router_args(cmd[3:] + ["--policy", "no_such_policy"])
    assert "invalid choice" in bad["error"]
