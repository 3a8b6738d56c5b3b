"""Routing replay (R3) through the launcher's rollout: engine flags, requests, decoding, training.

A tiny qwen3_moe is served by the built-in engine started as the launcher starts it (the
command of ``builtin_engine_command`` under ``--use-rollout-routing-replay``). The launcher's
:class:`Generator` samples groups from it; each sample's ``routed_experts`` must equal what the
engine reports for the same request made directly (decoded with numpy by
tests/miles_fsdp/routed_experts_testing.py, not with the launcher's decoder) and what the HF
model's own routers choose for the same tokens. Then the FSDP trainer, whose routers are
perturbed so that its own top-k differs from the engine's (``perturb_routers``), is fed the
launcher's batch: with replay its log-probs equal the engine's, without they do not, and one
training step sees no
engine/trainer mismatch (TIS weight 1). Last, ``miles train`` itself runs one rollout under
the flag on Ray.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_testing import EngineProcess, tiny_qwen3_moe
from engine_testing import save_tokenizer as save_char_tokenizer
from miles_core.args import ArgumentError, entry_point_groups, parse_args
from miles_launch.demo import demo_flags, write_demo_prompts
from miles_launch.engine_launch.builtin_launcher import builtin_engine_command
from miles_launch.engine_launch.sglang_launcher import sglang_server_command
from miles_launch.rollout.generate import Generator, SamplingConfig, to_rollout_batch
from miles_launch.rollout.prompts import Prompt
from miles_launch.rollout.rewards import RewardModel
from miles_launch.rollout.routed_experts import (
    RoutedExpertsError,
    RoutedExpertsLayout,
    decode_sample_routed_experts,
    read_layout,
    routed_experts_layout,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_fsdp"))

from routed_experts_testing import (  # noqa: E402
    ENGINE_FLAG,
    differs,
    generate_routed,
    moe_config,
    one_rank_group,  # noqa: F401 (fixture)
    own_top_k,
    perturb_routers,
    rollout_context,
    save_trainer_copy,
)
from tiny_models import qwen3_config, save_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NUM_EXPERTS = 32  # enough that every layer keeps experts no sample used (perturb_routers)
CFG = SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=-1, seed=3)
PROMPTS = [Prompt(0, "p0", None, (5, 9, 14, 3, 22)), Prompt(1, "p1", None, (40, 2, 17))]
SAMPLES_PER_PROMPT = 2


def fsdp_available() -> bool:
    from miles_core import backends

    return "fsdp" in backends.available()


# ---------------------------------------------------------------------- flags and commands


def parse_train_flags(tmp_path: Path, hf: Path, *flags: str):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", str(prompts), "--rm-type", "math"]
    return parse_args([*argv, *flags], entry_point_groups("core", "fsdp", "launch"))


@pytest.mark.skipif(not fsdp_available(), reason="the FSDP backend parses the launch flags")
def test_engines_are_started_to_report_routed_experts(tmp_path):
    flag = "--enable-return-routed-experts"
    moe = save_tiny_model(tmp_path / "moe", moe_config("qwen3_moe"))
    on = parse_train_flags(tmp_path, moe, "--use-rollout-routing-replay")
    off = parse_train_flags(tmp_path, moe)
    assert builtin_engine_command(on, host="h", port=1, device="cpu").count(flag) == 1
    assert flag not in builtin_engine_command(off, host="h", port=1, device="cpu")
    assert sglang_server_command(on, host="h", port=1).count(flag) == 1
    assert flag not in sglang_server_command(off, host="h", port=1)
    # given as a passthrough flag too: still once
    passthrough = parse_train_flags(
        tmp_path, moe, "--use-rollout-routing-replay", "--sglang-enable-return-routed-experts"
    )
    assert passthrough.sglang_passthrough == {"enable-return-routed-experts": True}
    assert sglang_server_command(passthrough, host="h", port=1).count(flag) == 1


@pytest.mark.skipif(not fsdp_available(), reason="the FSDP backend declares the flag")
def test_the_flag_needs_a_moe_checkpoint(tmp_path):
    dense = save_tiny_model(tmp_path / "dense", qwen3_config())
    parse_train_flags(tmp_path, dense)  # fine without the flag
    with pytest.raises(ArgumentError, match="needs a mixture-of-experts model.*'qwen3'"):
        parse_train_flags(tmp_path, dense, "--use-rollout-routing-replay")
    moe = save_tiny_model(tmp_path / "moe", moe_config("qwen3_moe"))
    args = parse_train_flags(tmp_path, moe, "--use-rollout-routing-replay")
    assert args.use_rollout_routing_replay
    assert routed_experts_layout(args) == RoutedExpertsLayout(num_layers=2, top_k=2)
    args.use_rollout_routing_replay = False
    assert routed_experts_layout(args) is None  # nothing asked of the engines


def test_bad_replies_name_the_flag_and_the_engine():
    layout = RoutedExpertsLayout(num_layers=2, top_k=3)
    rows = np.arange(4 * 2 * 3, dtype="<i4").reshape(4, 2, 3)
    meta = {"routed_experts": base64.b64encode(rows.tobytes()).decode()}
    out = decode_sample_routed_experts(meta, layout, total_length=5, engine="http://e:1")
    assert out.dtype == torch.int32 and torch.equal(out, torch.from_numpy(rows))
    with pytest.raises(RoutedExpertsError, match="http://e:1 has no meta_info.routed_experts"):
        decode_sample_routed_experts({}, layout, 5, "http://e:1")
    with pytest.raises(RoutedExpertsError, match="routed experts for 4 tokens of a 7-token"):
        decode_sample_routed_experts(meta, layout, 7, "http://e:1")
    with pytest.raises(RoutedExpertsError, match="num_experts_per_tok 5"):
        decode_sample_routed_experts(meta, RoutedExpertsLayout(2, 5), 5, "http://e:1")


# ---------------------------------------------------------------------- with an engine


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    """A tiny qwen3_moe served as the launcher serves it under routing replay."""
    config = moe_config("qwen3_moe")
    config.num_experts = NUM_EXPERTS
    hf_dir = save_tiny_model(tmp_path_factory.mktemp("r3") / "engine", config)
    args = parse_train_flags(hf_dir.parent, hf_dir, "--use-rollout-routing-replay")
    cmd = builtin_engine_command(args, host="127.0.0.1", port=0, device="cpu")
    flags = cmd[cmd.index("--device") + 2 :]  # what the launcher adds after the basics
    assert flags == [ENGINE_FLAG]
    engine = EngineProcess(hf_dir, *flags, timeout=240)
    yield hf_dir, engine
    engine.close()


@pytest.fixture(scope="module")
def launcher_groups(moe_engine):
    """The launcher's groups: ``Generator`` as the loop builds it under routing replay."""
    hf_dir, engine = moe_engine

    async def reward(inp) -> float:  # varies within a group: non-zero advantages
        return float(sum(inp.response_ids) % 5)

    async def alive(when: str) -> None:
        assert engine.proc.poll() is None, engine.read_log()

    async def run():
        gen = Generator(
            [engine.url],
            RewardModel(reward, "ids mod 5"),
            alive,
            routed_experts=read_layout(str(hf_dir)),
        )
        try:
            return await gen.groups(
                [(p, p.index) for p in PROMPTS], SAMPLES_PER_PROMPT, CFG, on_sample=None
            )
        finally:
            await gen.aclose()

    return asyncio.run(run())


@pytest.mark.slow
def test_launcher_samples_carry_the_engines_routed_experts(moe_engine, launcher_groups):
    from miles_launch.rollout.generate import sampling_seed
    from transformers import AutoModelForCausalLM

    hf_dir, engine = moe_engine
    batch = to_rollout_batch(launcher_groups)
    assert len(batch) == len(PROMPTS) * SAMPLES_PER_PROMPT
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for g, group in enumerate(launcher_groups):
        for k, generated in enumerate(group):
            sample = batch[g * SAMPLES_PER_PROMPT + k]
            prompt = generated.prompt
            params = {
                "max_new_tokens": CFG.max_new_tokens,
                "temperature": CFG.temperature,
                "top_p": CFG.top_p,
                "top_k": CFG.top_k,
                "sampling_seed": sampling_seed(CFG.seed, prompt.index, k),
            }
            direct = generate_routed(engine, prompt.token_ids, params, model.config, logprob=False)
            assert sample.tokens.tolist() == list(prompt.token_ids) + direct.output_ids
            assert sample.routed_experts.dtype == torch.int32
            assert torch.equal(sample.routed_experts, direct.routed)
            # and they are the model's own choice for those tokens
            assert not differs(own_top_k(model, sample.tokens[:-1]), sample.routed_experts)


@pytest.mark.slow
@pytest.mark.skipif(not fsdp_available(), reason="the FSDP backend is not installed")
def test_trainer_replays_the_launchers_samples(
    one_rank_group,  # noqa: F811
    moe_engine,
    launcher_groups,
    tmp_path,
):
    from miles_core.log_probs import token_log_probs
    from miles_core.packing import pack_thd, unpack_response
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.train_step import packed_logits
    from run_args import make_args
    from transformers import AutoModelForCausalLM

    hf_dir, _ = moe_engine
    batch = to_rollout_batch(launcher_groups)
    engine_logp = [s.rollout_log_probs for s in batch]

    # the trainer's copy: same weights, routers perturbed to pick differently (same weights
    # at the engine's experts)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    perturb_routers(model, torch.cat([s.routed_experts for s in batch]))
    trainer_dir = save_trainer_copy(model, tmp_path / "trainer")
    assert any(differs(own_top_k(model, s.tokens[:-1]), s.routed_experts) for s in batch)

    backend = FSDPBackend()
    backend.init(
        make_args(
            hf_checkpoint=str(trainer_dir),
            use_rollout_routing_replay=True,
            use_tis=True,
            advantage_estimator="grpo",
        )
    )
    ctx = rollout_context(backend)
    packed = pack_thd(batch)

    def response_log_probs() -> list[torch.Tensor]:
        with torch.no_grad():
            logp = token_log_probs(packed_logits(ctx, packed), packed.targets, 1.0)
        return unpack_response(packed, logp)

    for got, want in zip(response_log_probs(), engine_logp, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)

    ctx.routing_replay = None  # the trainer's own (perturbed) top-k
    backend.routing_replay.set(None)
    own = torch.cat(response_log_probs())
    assert (own - torch.cat(engine_logp)).abs().max() > 1e-2

    # one training step on the launcher's batch, with replay (the backend's own path)
    metrics = backend.train(0, batch)
    assert metrics["tis"] == pytest.approx(1.0, abs=1e-4)  # exp(trainer - engine log-prob)
    assert metrics["tis_clipfrac"] == 0.0
    assert metrics["grad_norm"] > 0
    backend.close()


@pytest.mark.extended
@pytest.mark.skipif(not fsdp_available(), reason="the FSDP backend is not installed")
def test_miles_train_with_routing_replay(tmp_path):
    """The whole path: ``miles train`` on Ray (2 gloo FSDP ranks, 1 built-in engine) of a tiny
    qwen3_moe under the flag. The engine is started with ``--enable-return-routed-experts``
    (its log's command line), the trainer's MoE weights reach it (the first publish), and the
    rollout trains: the FSDP backend refuses samples without routed experts under the flag,
    and its log-probs match the engine's (TIS weight 1; same weights, so same routing)."""
    hf = tmp_path / "moe"
    tiny_qwen3_moe(0).save_pretrained(hf)
    save_char_tokenizer(hf)
    prompts = write_demo_prompts(tmp_path / "prompts.jsonl", num_prompts=4)
    metrics = tmp_path / "metrics.jsonl"
    flags = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4"]
    flags += ["--use-rollout-routing-replay", "--use-tis", "--no-progress"]
    cmd = [sys.executable, "-m", "miles_launch.train", *demo_flags(hf, prompts, metrics), *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    engine_log = re.search(r"engine 0: \S+ \(pid \d+, log (\S+)\)", output)
    assert engine_log, output[-2000:]
    command = Path(engine_log.group(1)).read_text().splitlines()[0]
    assert "miles_launch.builtin_engine" in command and "--enable-return-routed-experts" in command
    (record,) = [r for r in map(json.loads, metrics.read_text().splitlines()) if "train" in r]
    assert record["train"]["tis"] == pytest.approx(1.0, abs=1e-4)
    assert record["train"]["tis_clipfrac"] == 0.0
