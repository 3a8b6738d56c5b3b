"""``--partial-rollout``: argument checks, and two rollouts against the real built-in engine.

The end-to-end test draws through the launcher's own pieces (``draw_groups`` with a
``PartialBuffer``, the ``Generator`` aborting the engine): rollout 1 keeps the first group that
passes and cuts the rest short; the engine's weights are then replaced (``/update_weights_from
_disk``, as a publish would); rollout 2 continues the carried samples, with
``--mask-offpolicy-in-partial-rollout``. A continued sample's tokens are its carried tokens
followed by the continuation; the carried tokens keep the log-probs the engine sampled them
with (the *old* weights') and leave the loss, the continuation's log-probs equal a float64
forward pass of the *new* weights.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_testing import EngineProcess, save_tokenizer, tiny_qwen3
from launch_testing import one_error_line, parse, run_cli
from miles_core import backends
from miles_core.args import ArgumentError
from miles_launch.job import LauncherState
from miles_launch.rollout.draw import draw_groups
from miles_launch.rollout.generate import (
    GeneratedSample,
    Generator,
    SamplingConfig,
    to_rollout_batch,
)
from miles_launch.rollout.partial import PartialBuffer, unfinished
from miles_launch.rollout.prompts import Prompt
from miles_launch.rollout.rewards import RewardModel

VALID = ("--dynamic-filter", "--rollout-batch-size", "2", "--over-sampling-batch-size", "4")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ((), "--partial-rollout requires --over-sampling-batch-size (with --dynamic-filter)"),
        ((*VALID, "--fully-async"), "--partial-rollout cannot be used with --fully-async"),
        (
            (*VALID, "--custom-generate-function-path", "asyncio.sleep"),
            "--partial-rollout cannot be used with --custom-generate-function-path",
        ),
        (
            (*VALID, "--custom-rm-path", "rm_fixtures:async_batch_length"),
            None,  # accepted: per-sample scoring
        ),
        (
            (
                *VALID,
                "--custom-rm-path",
                "rm_fixtures:async_batch_length",
                "--custom-rm-batch",
                "rollout",
            ),
            "--partial-rollout cannot be used with --custom-rm-batch rollout",
        ),
        ((*VALID, "--rollout-stop", "ab"), "--partial-rollout cannot be used with --rollout-stop"),
        ((*VALID, "--rollout-temperature", "0.7"), None),  # the carried keep their log-probs
        ((*VALID, "--mask-offpolicy-in-partial-rollout"), None),
    ],
)
def test_partial_rollout_flag_checks(tmp_path, flags, message):
    if message is None:
        assert parse(tmp_path, "--partial-rollout", *flags).partial_rollout is True
        return
    with pytest.raises(ArgumentError) as info:
        parse(tmp_path, "--partial-rollout", *flags)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_masking_carried_tokens_needs_partial_rollout(tmp_path):
    with pytest.raises(
        ArgumentError, match="^--mask-offpolicy-in-partial-rollout masks the tokens"
    ):
        parse(tmp_path, "--mask-offpolicy-in-partial-rollout")


def test_cli_partial_rollout_error_is_one_line_exit_2():
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    line = one_error_line(run_cli("train", "--train-backend", "fsdp", "--partial-rollout"))
    assert "--partial-rollout requires --over-sampling-batch-size" in line


def _stand_in_groups(items, carried, need, cut):
    """Engine stand-in: every group has a signal; the positions in ``cut`` come back with
    sample 1 unfinished (2 tokens); a carried unfinished sample comes back finished with 3 more
    tokens, a carried finished one as it was (the Generator's behaviour)."""
    out = []
    for prompt, position in items:
        group = []
        for k, reward in enumerate((0.0, 1.0)):
            if position in carried and carried[position][k].finish_reason != "abort":
                group.append(carried[position][k])  # finished before the cut: as it was
                continue
            before = carried[position][k].response_ids if position in carried else []
            cut_short = position in cut and k == 1
            ids = before + ([7, 7] if cut_short else [5, 5, 5])
            finish = "abort" if cut_short else "stop"
            group.append(GeneratedSample(prompt, position, ids, [-1.0] * len(ids), "", finish, 1))
            group[-1].reward, group[-1].resumed_tokens = reward, len(before)
        out.append(group)
    return out


def test_draw_takes_the_carried_groups_first_and_puts_the_cut_short_back():
    prompts = [Prompt(i, str(i), None, (1,)) for i in range(20)]
    buffer, state, calls = PartialBuffer(), LauncherState(0, 0), []

    def draw(cut):
        def generate(items, carried, need):
            calls.append(([pos for _, pos in items], sorted(carried), need))
            return _stand_in_groups(items, carried, need, cut)

        return draw_groups(
            state,
            lambda start, count: [(prompts[start + j], start + j) for j in range(count)],
            generate,
            want=2,
            max_draws=2,
            dynamic_filter=True,
            over_sampling=4,
            partial=buffer,
        )

    kept, info = draw(cut={1, 3})
    assert [g[0].position for g in kept] == [0, 2] and calls[-1] == ([0, 1, 2, 3], [], 2)
    assert [pos for _, pos, _ in buffer.groups] == [1, 3] and state.data_position == 4
    assert info["groups_carried"] == 2 and info["groups_resumed"] == 0
    kept, info = draw(cut=set())
    # the carried groups open the draw and count towards its 4; two fresh prompts follow
    assert calls[-1] == ([1, 3, 4, 5], [1, 3], 2) and state.data_position == 6
    assert [g[0].position for g in kept] == [1, 3] and buffer.groups == []
    assert kept[0][1].response_ids == [7, 7, 5, 5, 5] and kept[0][1].resumed_tokens == 2
    assert info == {
        "groups_dropped": 0,
        "draws": 1,
        "groups_surplus": 2,
        "groups_resumed": 2,
        "groups_carried": 0,
        "samples_continued": 2,
    }


# ---- two rollouts on the built-in engine ----------------------------------------------------
N = 2  # samples per prompt
CFG = SamplingConfig(max_new_tokens=120, temperature=1.0, top_p=1.0, top_k=-1, seed=3)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    for name, seed in (("old", 0), ("new", 1)):
        tiny_qwen3(seed).save_pretrained(root / name)
        tokenizer = save_tokenizer(root / name)
    engine = EngineProcess(root / "old")
    try:
        yield engine, tokenizer, root
    finally:
        engine.close()


def _rollout(engine, buffer, state, prompts, want, over_sampling, seen, mask_carried=False):
    """One synchronous-loop draw with the launcher's pieces; every generated group is also
    appended to ``seen``."""

    async def alive(when):
        pass

    reward = RewardModel(lambda inp: float(inp.sample_index), "k")  # every group has a signal

    def generate(items, carried, need):
        async def run():
            gen = Generator(
                [engine.url], reward, alive, abort_urls=[engine.url], mask_carried=mask_carried
            )
            try:
                return await gen.groups(items, N, CFG, carried=carried, need=need)
            finally:
                await gen.aclose()

        groups = asyncio.run(run())
        seen.extend(groups)
        return groups

    return draw_groups(
        state,
        lambda start, count: [(prompts[start + j], start + j) for j in range(count)],
        generate,
        want=want,
        max_draws=1,
        dynamic_filter=True,
        over_sampling=over_sampling,
        partial=buffer,
    )


def _log_probs(model, prompt_ids, response_ids) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(response_ids)])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]
    return logp.gather(1, torch.tensor(response_ids)[:, None])[:, 0]


@pytest.mark.slow
def test_unfinished_samples_continue_in_the_next_rollout_keeping_their_log_probs(served):
    from transformers import AutoModelForCausalLM

    engine, tokenizer, root = served
    texts = ["hello world", "ab", "the quick brown fox", "0123", "xyz", "abc def", "q", "zz"]
    prompts = [Prompt(i, t, None, tuple(tokenizer.encode(t))) for i, t in enumerate(texts)]
    buffer, state = PartialBuffer(), LauncherState(0, 0)

    # rollout 1: 4 groups drawn, the first that passes is kept, the running ones are cut short
    seen1: list = []
    kept1, info1 = _rollout(engine, buffer, state, prompts, 1, 4, seen1)
    assert len(kept1) == 1 and not unfinished(kept1[0])
    assert info1["groups_carried"] == len(buffer.groups) >= 1
    assert info1["groups_resumed"] == 0 and state.data_position == 4
    assert 1 + info1["groups_surplus"] + info1["groups_carried"] == 4
    carried = {pos: [list(s.response_ids) for s in group] for _, pos, group in buffer.groups}
    old_records = {
        pos: [(s.finish_reason, list(s.rollout_log_probs), s.weight_version) for s in group]
        for _, pos, group in buffer.groups
    }
    cut = [ids for group in carried.values() for ids in group]
    assert any(ids for ids in cut), "nothing was generated before the abort"

    # the publish: the engine now serves other weights, weight version 2
    r = engine.post(
        "/update_weights_from_disk", {"model_path": str(root / "new"), "weight_version": "2"}
    )
    assert r.status_code == 200 and r.json()["success"], r.text

    # rollout 2: the carried groups first, then fresh prompts; nothing is cut short (want = draw)
    seen2: list = []
    kept2, info2 = _rollout(engine, buffer, state, prompts, 4, 4, seen2, mask_carried=True)
    n_carried = len(carried)
    assert info2["groups_resumed"] == n_carried and info2["groups_carried"] == 0
    assert buffer.groups == [] and state.data_position == 4 + (4 - n_carried)
    assert [g[0].position for g in kept2[:n_carried]] == list(carried)

    new = AutoModelForCausalLM.from_pretrained(root / "new", dtype=torch.float64).eval()
    continued = 0
    for group in kept2[:n_carried]:
        pos = group[0].position
        for k, s in enumerate(group):
            finish, old_lps, old_version = old_records[pos][k]
            prefix = carried[pos][k]
            if finish != "abort":  # finished before the abort: kept as generated, version 1
                assert s.response_ids == prefix and s.rollout_log_probs == old_lps
                assert s.weight_version == old_version and s.resumed_tokens == 0
                continue
            assert s.finish_reason in ("stop", "length")
            assert s.response_ids[: len(prefix)] == prefix and s.resumed_tokens == len(prefix)
            assert len(s.response_ids) <= CFG.max_new_tokens
            assert s.weight_version == 2
            want = _log_probs(new, s.prompt.token_ids, s.response_ids)
            got = torch.tensor(s.rollout_log_probs, dtype=torch.float64)
            assert len(got) == len(s.response_ids)
            n = len(prefix)
            # the continuation: sampled by the new weights
            torch.testing.assert_close(got[n:], want[n:], rtol=0, atol=1e-5)
            assert s.loss_mask == ([0] * n + [1] * (len(s.response_ids) - n) if n else None)
            if prefix:
                continued += 1
                # the carried tokens: the old weights' log-probs as the engine returned them,
                # not the new policy's
                assert s.rollout_log_probs[:n] == old_lps[:n]
                assert not torch.allclose(want[:n], got[:n], atol=1e-3)
    assert continued >= 1
    # the trainer's batch: the carried tokens out of the loss, every continuation in it
    batch = to_rollout_batch(kept2)
    masks = batch.response_field("loss_mask")
    for s, mask in zip((s for g in kept2 for s in g), masks, strict=True):
        assert mask.tolist() == [0.0] * s.resumed_tokens + [1.0] * (
            len(s.response_ids) - s.resumed_tokens
        )
    # fresh groups of rollout 2 were generated by the new weights only
    for group in kept2[n_carried:]:
        assert all(s.resumed_tokens == 0 and s.weight_version == 2 for s in group)
