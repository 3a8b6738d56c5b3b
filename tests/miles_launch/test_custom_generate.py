"""Custom generation and rollout control against the real built-in engine (a subprocess).

The example's calculator-tool episodes (examples/calculator_tool) run through the launcher's
Generator: every tool span is masked and holds exactly the calculator's output, the model's
tokens are masked in, and their rollout log-probs equal a float64 HF forward pass over the
whole multi-turn sequence (so the second turn was generated with the tool output in context).
``--rollout-stop`` / ``--rollout-stop-token-ids`` / ``--rollout-seed`` are parsed from a real
command line and observed in the engine's responses.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from engine_testing import EngineProcess
from launch_testing import parse
from miles_launch.demo import build_tiny_qwen3
from miles_launch.rollout.custom_generate import CustomSample, checked_samples
from miles_launch.rollout.generate import Generator, to_rollout_batch
from miles_launch.rollout.prompts import Prompt, drop_long_prompts, load_prompts
from miles_launch.rollout.rewards import RewardModel

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tool"


@pytest.fixture(scope="module")
def calculator():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import calculator

        yield calculator
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("calc")
    hf = build_tiny_qwen3(root / "tiny-qwen3")
    engine = EngineProcess(hf)
    try:
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64)
        yield engine, AutoTokenizer.from_pretrained(hf), model.eval(), root
    finally:
        engine.close()


def _generate(engine, tokenizer, args, prompts, n):
    from miles_launch.loop import sampling_config
    from miles_launch.rollout.custom_generate import load_generate_function

    async def alive(when):
        pass

    path = args.custom_generate_function_path
    gen = Generator(
        [engine.url],
        RewardModel.from_args(args),
        alive,
        custom_generate=load_generate_function(path) if path else None,
        tokenizer=tokenizer,
    )

    async def run():
        try:
            return await gen.groups([(p, p.index) for p in prompts], n, sampling_config(args))
        finally:
            await gen.aclose()

    return asyncio.run(run())


@pytest.mark.slow
def test_calculator_episodes_mask_tool_tokens_and_score_like_a_forward_pass(
    tmp_path, served, calculator
):
    engine, tokenizer, model, root = served
    prompt_file = calculator.write_prompts(root / "prompts.jsonl", num_prompts=8)
    prompts = load_prompts(prompt_file, tokenizer, "prompt", "label", False)
    args = parse(
        tmp_path,
        "--custom-generate-function-path", "calculator:generate",
        "--rollout-max-response-len", "12",
        "--rollout-temperature", "1.0",
    )  # fmt: skip
    groups = _generate(engine, tokenizer, args, prompts, n=8)
    samples = [s for g in groups for s in g]
    assert len(samples) == 64
    calls = 0
    for s in samples:
        mask = torch.tensor(s.loss_mask)
        called = bool((mask == 0).any())
        calls += called
        assert s.reward_given and s.reward in (0.0, 0.5, 1.0)
        assert (s.reward >= 0.5) == called
        if called:  # one contiguous span holding exactly the calculator's output
            zeros = (mask == 0).nonzero()[:, 0].tolist()
            assert zeros == list(range(zeros[0], zeros[-1] + 1))
            tool = [s.response_ids[i] for i in zeros]
            assert tokenizer.decode(tool) == calculator.tool_output(s.prompt.text)
            assert tokenizer.decode(s.response_ids[: zeros[0]]).endswith(calculator.CALL)
        tokens = torch.tensor([list(s.prompt.token_ids) + s.response_ids])
        with torch.no_grad():
            logits = model(input_ids=tokens).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
        lp = lp[-len(s.response_ids) :]
        got = torch.tensor(s.rollout_log_probs, dtype=torch.float64)
        torch.testing.assert_close(got[mask == 1], lp[mask == 1], atol=2e-4, rtol=0)
    assert calls > 0, "no sample called the calculator"
    batch = to_rollout_batch(groups)
    for sample, s in zip(batch, samples, strict=True):
        assert sample.loss_mask.tolist() == [float(m) for m in s.loss_mask]


@pytest.mark.slow
def test_rollout_stops_and_seed_are_observed_in_the_engines_responses(tmp_path, served):
    engine, tokenizer, _, root = served
    prompts = [Prompt(i, t, "1", tuple(tokenizer.encode(t))) for i, t in enumerate(["ab", "xyz"])]
    stop_id = tokenizer.convert_tokens_to_ids("e")
    common = ["--rollout-max-response-len", "12", "--rm-type", "math"]
    stopped = parse(
        tmp_path, *common, "--rollout-stop", "q", "--rollout-stop-token-ids", str(stop_id)
    )
    samples = [s for g in _generate(engine, tokenizer, stopped, prompts, n=16) for s in g]
    finishes = {s.finish_reason for s in samples}
    assert "stop" in finishes
    for s in samples:
        assert "q" not in s.response_text  # the stop string ends (and is trimmed from) the text
        assert stop_id not in s.response_ids[:-1]
        if s.finish_reason == "length":
            assert len(s.response_ids) == 12
    ended_on_id = [s for s in samples if s.response_ids[-1] == stop_id]
    ended_on_q = [s for s in samples if tokenizer.decode(s.response_ids).endswith("q")]
    assert ended_on_id and ended_on_q
    # --rollout-seed alone decides the sampling: --seed does not change the responses
    runs = [
        [s.response_ids for g in _generate(engine, tokenizer, args, prompts, n=4) for s in g]
        for args in (
            parse(tmp_path, *common, "--seed", "1", "--rollout-seed", "5"),
            parse(tmp_path, *common, "--seed", "2", "--rollout-seed", "5"),
            parse(tmp_path, *common, "--seed", "1", "--rollout-seed", "6"),
        )
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_custom_samples_are_checked():
    where = "f"
    ok = CustomSample([1, 2], [-0.1, 0.0], [1, 0])
    assert checked_samples(ok, where) == [ok]
    bad = [
        ([], "returned no sample"),
        ([{"ids": [1]}], "expected a CustomSample, got dict"),
        (CustomSample([], []), "empty response_ids"),
        (CustomSample([1, 2], [0.0]), "1 rollout_log_probs for 2 response tokens"),
        (CustomSample([1, 2], [0.0, 0.0], [1]), "loss_mask has 1 entries for 2 tokens"),
        (CustomSample([1], [0.0], [2]), "loss_mask must hold only 0 and 1"),
        (CustomSample([1], [0.0], reward=float("nan")), "reward nan"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            checked_samples(value, where)


def test_long_prompts_are_dropped_and_counted():
    prompts = [Prompt(i, "", None, (1,) * length) for i, length in enumerate([3, 9, 4, 12])]
    kept, dropped = drop_long_prompts(prompts, 4, "p.jsonl")
    assert [p.index for p in kept] == [0, 2] and dropped == 2
    assert drop_long_prompts(prompts, None, "p.jsonl") == (prompts, 0)
    with pytest.raises(ValueError, match=r"p.jsonl: every prompt is longer than --rollout-max"):
        drop_long_prompts(prompts, 2, "p.jsonl")


def test_given_rewards_are_kept_and_the_rest_scored_in_one_batched_call():
    """A custom function returning two samples per call, one with its reward: both join the
    group; the batched reward function sees only the other (StubEngine answers generate)."""
    from launch_testing import StubEngine
    from miles_launch.rollout.custom_generate import engine_turn
    from miles_launch.rollout.generate import SamplingConfig

    async def two(ctx, prompt, params):
        turn = await engine_turn(ctx, list(prompt.token_ids), params)
        return [
            CustomSample(turn.ids, turn.log_probs, reward=0.25),
            CustomSample(turn.ids, turn.log_probs, [0] + [1] * (len(turn.ids) - 1)),
        ]

    seen = []

    def batched(inputs):
        seen.append(len(inputs))
        return [7.0] * len(inputs)

    async def alive(when):
        pass

    gen = Generator(["http://127.0.0.1:1"], RewardModel(batched, "b", batch="group"), alive)
    gen.custom_generate = two
    gen.clients = [StubEngine()]
    cfg = SamplingConfig(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
    (group,) = asyncio.run(gen.groups([(Prompt(0, "ab", None, (1, 2)), 0)], 3, cfg))
    assert seen == [3] and len(group) == 6
    assert sorted(s.reward for s in group) == [0.25] * 3 + [7.0] * 3
    batch = to_rollout_batch([group])
    # the sample without a mask gets all ones (a batch has the field on all samples or none)
    assert [s.loss_mask.tolist() for s in batch][:2] == [[1.0, 1.0], [0.0, 1.0]]
