"""Prompts, their order across epochs and resumes, rewards, filtering, the trainer batch."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from launch_testing import StubEngine, parse
from miles_core.args import ArgumentError
from miles_launch.async_loop import union_overlap
from miles_launch.demo import CHARS, VOCAB_SIZE
from miles_launch.rollout.filtering import has_signal
from miles_launch.rollout.generate import GeneratedSample, sampling_seed, to_rollout_batch
from miles_launch.rollout.prompts import Prompt, PromptDataError, PromptOrder, load_prompts
from miles_launch.rollout.rewards import (
    RewardInput,
    RewardModel,
    final_answer,
    label_char_fraction,
    math_reward,
)
from miles_launch.tiny_model import save_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return save_char_tokenizer(tmp_path_factory.mktemp("tok"), CHARS, VOCAB_SIZE)  # the demo's


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_prompts_tokenizes_and_keeps_labels(tmp_path, tokenizer):
    path = _write(
        tmp_path / "p.jsonl",
        [json.dumps({"q": "ab c", "a": "3"}), "", json.dumps({"q": "z", "a": "4"})],
    )
    prompts = load_prompts(path, tokenizer, "q", "a", apply_chat_template=False)
    assert [p.text for p in prompts] == ["ab c", "z"]
    assert [p.label for p in prompts] == ["3", "4"]
    assert [p.index for p in prompts] == [0, 1]
    # one id per character; 'a' is id 1 (id 0 is the EOS)
    assert prompts[0].token_ids == (1, 2, 37, 3)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"p.jsonl:2: invalid JSON"),
        ('{"other": "x"}', r"p.jsonl:2: no key 'q' \(--input-key\)"),
        ('["a"]', r"p.jsonl:2: expected a JSON object"),
        ('{"q": ["a"]}', r"p.jsonl:2: prompt must be a string without --apply-chat-template"),
        ('{"q": ""}', r"p.jsonl:2: prompt 'q' has no tokens"),
    ],
)
def test_bad_prompt_lines_name_file_and_line(tmp_path, tokenizer, line, message):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"q": "ok"}), line])
    with pytest.raises(PromptDataError, match=message):
        load_prompts(path, tokenizer, "q", None, apply_chat_template=False)


def test_chat_template_needs_a_template(tmp_path, tokenizer):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"q": "hi"})])
    with pytest.raises(PromptDataError, match="tokenizer has no chat template"):
        load_prompts(path, tokenizer, "q", None, apply_chat_template=True)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}:"
    try:
        (prompt,) = load_prompts(path, tokenizer, "q", None, apply_chat_template=True)
    finally:
        tokenizer.chat_template = None
    assert prompt.text == "<hi>:"


def test_prompt_order_is_a_permutation_per_epoch_and_resumable():
    order = PromptOrder(7, shuffle=True, seed=3)
    stream = order.take(0, 21)
    for epoch in range(3):
        assert sorted(stream[7 * epoch : 7 * epoch + 7]) == list(range(7))
    assert stream[:7] != stream[7:14]  # reshuffled each epoch
    # a fresh order (a resumed run) continues identically from any position
    assert PromptOrder(7, shuffle=True, seed=3).take(9, 12) == stream[9:21]
    assert PromptOrder(7, shuffle=False, seed=3).take(5, 4) == [5, 6, 0, 1]
    assert PromptOrder(7, shuffle=True, seed=4).take(0, 7) != stream[:7]


def _inp(response, label, max_len=8):
    return RewardInput("p", response, label, tuple(range(len(response))), "length", max_len)


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("so the answer is \\boxed{42}", "42", 1.0),
        ("\\boxed{\\frac{1}{2}} hmm", "\\frac{1}{2}", 1.0),
        ("first 3 then 7.", "7", 1.0),
        ("result: 1,000", "1000", 1.0),
        ("x = 0.50", "1/2", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("no number here", "42", 0.0),
        ("\\boxed{ 42 }.", "$42$", 1.0),
    ],
)
def test_math_reward(response, label, reward):
    assert math_reward(_inp(response, label)) == reward


def test_final_answer_prefers_the_last_box():
    assert final_answer("\\boxed{1} then \\boxed{{2}}") == "{2}"
    assert final_answer("1 2 3") == "3"
    assert final_answer("none") is None


def test_label_char_fraction_against_a_count():
    rng = random.Random(0)
    for _ in range(50):
        response = "".join(rng.choice("0123abc ") for _ in range(rng.randint(0, 8)))
        expected = sum(ch in "0123" for ch in response) / 8
        assert label_char_fraction(_inp(response, "0123")) == expected
    assert label_char_fraction(_inp("0000000000", "0")) == 1.0  # only the first 8 count
    with pytest.raises(ValueError, match="non-empty string label"):
        label_char_fraction(_inp("0", None))


def reward_model(tmp_path, *flags):
    """The reward a run with ``flags`` builds (parsed and validated as ``miles train``)."""
    return RewardModel.from_args(parse(tmp_path, *flags))


def test_custom_reward_sync_async_and_bad_values(tmp_path):
    length = reward_model(tmp_path, "--custom-rm-path", "rm_fixtures:response_length")
    assert asyncio.run(length(_inp("abc", None))) == 3
    match = reward_model(tmp_path, "--custom-rm-path", "rm_fixtures:async_label_match")
    assert asyncio.run(match(_inp("x", "x"))) == 1.0
    assert asyncio.run(match(_inp("x", "y"))) == 0.0
    bad = reward_model(tmp_path, "--custom-rm-path", "rm_fixtures:not_a_number")
    with pytest.raises(ValueError, match="returned 'high', not a number"):
        asyncio.run(bad(_inp("x", None)))
    with pytest.raises(
        ArgumentError, match="--custom-rm-path rm_fixtures:missing: rm_fixtures has"
    ):
        reward_model(tmp_path, "--custom-rm-path", "rm_fixtures:missing")
    with pytest.raises(ArgumentError, match="--custom-rm-path no_such_module:f: cannot import"):
        reward_model(tmp_path, "--custom-rm-path", "no_such_module:f")
    with pytest.raises(ValueError, match="no reward: set --rm-type, --custom-rm-path or --rm-url"):
        reward_model(tmp_path)
    assert reward_model(tmp_path, "--rm-type", "math").func is math_reward


def test_reward_key_picks_a_field_of_a_dict_reward(tmp_path):
    flags = ("--custom-rm-path", "rm_fixtures:dict_reward")
    picked = reward_model(tmp_path, *flags, "--reward-key", "accuracy")
    assert asyncio.run(picked(_inp("abcd", None))) == 4.0
    with pytest.raises(
        ValueError, match=r"returned a dict \['accuracy', 'format'\]; set --reward-k"
    ):
        asyncio.run(reward_model(tmp_path, *flags)(_inp("abcd", None)))
    missing = reward_model(tmp_path, *flags, "--reward-key", "score")
    with pytest.raises(
        ValueError, match=r"sample 0 of prompt -1\) returned a dict without 'score'"
    ):
        asyncio.run(missing(_inp("abcd", None)))


@pytest.mark.parametrize("batch", ["group", "rollout"])
def test_batched_custom_reward_is_called_per_group_or_per_rollout(tmp_path, batch):
    import rm_fixtures

    rm_fixtures.BATCH_CALLS.clear()
    reward = reward_model(
        tmp_path, "--custom-rm-path", "rm_fixtures:async_batch_length", "--custom-rm-batch", batch
    )
    prompts = [Prompt(0, "ab", None, (1, 2)), Prompt(1, "cde", None, (3, 4, 5))]
    groups = run_groups(reward, prompts, 3)
    # the stub engine answers a prompt's ids reversed: the rewards are the prompt lengths
    assert [[s.reward for s in g] for g in groups] == [[2.0] * 3, [3.0] * 3]
    if batch == "group":
        assert sorted(rm_fixtures.BATCH_CALLS) == [[0, 0, 0], [1, 1, 1]]
    else:
        assert rm_fixtures.BATCH_CALLS == [[0, 0, 0, 1, 1, 1]]


def test_batched_reward_must_return_one_value_per_input(tmp_path):
    reward = reward_model(
        tmp_path, "--custom-rm-path", "rm_fixtures:one_value", "--custom-rm-batch", "group"
    )
    with pytest.raises(ValueError, match="got 2 inputs and returned 1; expected a list of 2"):
        run_groups(reward, [Prompt(0, "ab", None, (1, 2))], 2)


def test_dynamic_filter_signal():
    assert not has_signal([0.5, 0.5, 0.5])
    assert has_signal([0.5, 0.5, 0.625])
    assert not has_signal([1.0])


def test_sampling_seeds_differ_per_sample_and_are_stable():
    seeds = {sampling_seed(1234, p, k) for p in range(50) for k in range(8)}
    assert len(seeds) == 400
    assert sampling_seed(1234, 7, 3) == sampling_seed(1234, 7, 3)
    assert all(0 <= s < 2**31 for s in seeds)


def test_groups_become_the_trainers_batch():
    prompts = [Prompt(5, "ab", None, (1, 2)), Prompt(9, "c", None, (3,))]

    def sample(p, ids, reward, version):
        lps = [-0.5 * (i + 1) for i in range(len(ids))]
        return GeneratedSample(p, 0, ids, lps, "", "length", version, reward)

    groups = [
        [sample(prompts[0], [4, 5, 0], 1.0, 3), sample(prompts[0], [6], 0.0, 3)],
        [sample(prompts[1], [7, 8], 0.5, 4)],
    ]
    batch = to_rollout_batch(groups)
    assert batch.group_indices == [0, 0, 1]
    assert batch[0].tokens.tolist() == [1, 2, 4, 5, 0]
    assert batch[0].response_length == 3 and batch[0].prompt_length == 2
    assert batch[2].tokens.tolist() == [3, 7, 8]
    assert torch.equal(batch[0].rollout_log_probs, torch.tensor([-0.5, -1.0, -1.5]))
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5]
    assert [s.weight_version for s in batch] == [3, 3, 4]


def test_union_overlap_against_a_fine_grid():
    rng = random.Random(1)
    for _ in range(30):
        intervals = []
        for _ in range(rng.randint(0, 6)):
            a = rng.uniform(0, 10)
            intervals.append((a, a + rng.uniform(0, 3)))
        lo = rng.uniform(0, 8)
        window = (lo, lo + rng.uniform(0, 4))
        step = 1e-3
        grid = sum(
            step
            for i in range(int((window[1] - window[0]) / step))
            if any(a <= window[0] + (i + 0.5) * step < b for a, b in intervals)
        )
        assert union_overlap(intervals, window) == pytest.approx(grid, abs=5e-3)


def _groups_for(items, n=3):
    """Engine stand-in: prompt ``i``'s group has equal rewards when ``i`` is even."""
    out = []
    for prompt, position in items:
        rewards = [0.5] * n if prompt.index % 2 == 0 else [0.0, 1.0, 0.5][:n]
        out.append(
            [GeneratedSample(prompt, position, [1], [-1.0], "", "stop", 1, r) for r in rewards]
        )
    return out


def _draw(position, want, max_draws, dynamic_filter, prompts=None, over_sampling=None):
    from miles_launch.job import LauncherState
    from miles_launch.rollout.draw import draw_groups

    prompts = prompts or [Prompt(i, str(i), None, (1,)) for i in range(10)]
    order = PromptOrder(len(prompts), shuffle=False, seed=0)
    state = LauncherState(0, position)
    calls = []

    def items_at(start, count):
        return [(prompts[i], start + j) for j, i in enumerate(order.take(start, count))]

    def generate(items):
        calls.append([pos for _, pos in items])
        return _groups_for(items)

    groups, info = draw_groups(
        state,
        items_at,
        generate,
        want=want,
        max_draws=max_draws,
        dynamic_filter=dynamic_filter,
        over_sampling=over_sampling,
    )
    return [g[0].prompt.index for g in groups], info, state.data_position, calls


def test_without_filter_one_draw_of_the_next_prompts():
    ids, info, position, calls = _draw(8, want=4, max_draws=1, dynamic_filter=False)
    assert ids == [8, 9, 0, 1] and position == 12 and calls == [[8, 9, 10, 11]]
    assert info == {"groups_dropped": 0, "draws": 1}


def test_dynamic_filter_drops_flat_groups_and_draws_again():
    ids, info, position, calls = _draw(0, want=4, max_draws=4, dynamic_filter=True)
    # draws: 0..3 keeps 1,3; 4,5 keeps 5; 6 drops; 7 keeps -> full
    assert ids == [1, 3, 5, 7]
    assert calls == [[0, 1, 2, 3], [4, 5], [6], [7]]
    assert info == {"groups_dropped": 4, "draws": 4} and position == 8
    # the draw limit leaves the rollout short rather than drawing forever
    ids, info, position, _ = _draw(0, want=4, max_draws=2, dynamic_filter=True)
    assert ids == [1, 3, 5] and info["draws"] == 2 and position == 6


def test_dynamic_filter_with_nothing_kept_uses_the_last_draw():
    flat = [Prompt(2 * i, "p", None, (1,)) for i in range(5)]  # even indices: flat rewards
    ids, info, position, calls = _draw(0, want=2, max_draws=2, dynamic_filter=True, prompts=flat)
    assert calls == [[0, 1], [2, 3]] and ids == [4, 6] and info["groups_dropped"] == 4


def test_over_sampling_draws_n_groups_and_keeps_the_first_that_pass():
    ids, info, position, calls = _draw(0, want=3, max_draws=4, dynamic_filter=True, over_sampling=5)
    # draw 0..4 keeps 1,3; draw 5..9 keeps 5 (full) and counts 7, 9 as surplus
    assert calls == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]] and ids == [1, 3, 5]
    assert info == {"groups_dropped": 5, "draws": 2, "groups_surplus": 2} and position == 10
    # one draw of 6 fills a rollout of 2 with 1 passing group to spare
    ids, info, _, calls = _draw(0, want=2, max_draws=4, dynamic_filter=True, over_sampling=6)
    assert calls == [[0, 1, 2, 3, 4, 5]] and ids == [1, 3] and info["groups_surplus"] == 1
    # nothing passes: the last draw, cut to the rollout's size
    flat = [Prompt(2 * i, "p", None, (1,)) for i in range(8)]
    ids, info, _, _ = _draw(0, 2, 2, True, prompts=flat, over_sampling=3)
    assert ids == [6, 8] and info["groups_dropped"] == 6


def test_group_filter_counts_drops_only_when_enabled():
    from miles_launch.rollout.filtering import GroupFilter

    flat = [GeneratedSample(Prompt(0, "", None, (1,)), 0, [1], [0.0], "", "", 1, 0.5)] * 2
    on, off = GroupFilter(True), GroupFilter(False)
    assert not on.keep(flat) and on.dropped == 1
    assert off.keep(flat) and off.dropped == 0


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "estimators"


def test_dynamic_sampling_filter_path_replaces_the_rule(tmp_path, monkeypatch):
    """--dynamic-sampling-filter-path hooks:keep_mixed_groups (the example): a group with a
    learning signal but no sample at the full reward is dropped, which the default keeps."""
    from miles_core.args import ArgumentError
    from miles_launch.job import LauncherState
    from miles_launch.rollout.draw import draw_groups
    from miles_launch.rollout.filtering import group_filter

    monkeypatch.syspath_prepend(str(EXAMPLES))
    flag = ["--dynamic-sampling-filter-path", "hooks:keep_mixed_groups"]
    args = parse(tmp_path, "--dynamic-filter", *flag)
    rewards = {0: [0.5, 0.5, 0.5], 1: [0.0, 0.5, 0.25], 2: [1.0, 0.0, 0.5]}  # by index % 3
    prompts = [Prompt(i, str(i), None, (1,)) for i in range(9)]

    def generate(items):
        return [
            [GeneratedSample(p, pos, [1], [-1.0], "", "stop", 1, r) for r in rewards[p.index % 3]]
            for p, pos in items
        ]

    def draw(dynamic_filter):
        kept, info = draw_groups(
            LauncherState(0, 0), lambda start, n: [(prompts[i], i) for i in range(start, start + n)],
            generate, want=2, max_draws=5, dynamic_filter=dynamic_filter,
        )  # fmt: skip
        return [g[0].prompt.index for g in kept], info["groups_dropped"]

    assert draw(group_filter(args)) == ([2, 5], 4)  # 0, 1, 3, 4 dropped
    assert draw(True) == ([1, 2], 1)  # the default rule keeps 1 (rewards not all equal)
    with pytest.raises(
        ArgumentError, match="--dynamic-sampling-filter-path requires --dynamic-filter"
    ):
        parse(tmp_path, *flag)
    with pytest.raises(ArgumentError, match="hooks has no function nope"):
        parse(tmp_path, "--dynamic-filter", "--dynamic-sampling-filter-path", "hooks:nope")
    args.dynamic_sampling_filter_path = "rm_fixtures:group_size"  # a number, not a bool
    with pytest.raises(ValueError, match="--dynamic-sampling-filter-path: expected True or False"):
        group_filter(args).keep(generate([(prompts[1], 1)])[0])


# ---------------------------------------------------------------------- Parquet, metadata


def test_parquet_prompts_equal_their_jsonl(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"q": "ab c", "a": "3", "meta": {"source": "x", "level": 1}},
        {"q": "z", "a": "4", "meta": {"source": "y", "level": 2}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    _write(tmp_path / "p.jsonl", [json.dumps(r) for r in rows])
    from_parquet = load_prompts(tmp_path / "p.parquet", tokenizer, "q", "a", False, "meta")
    from_jsonl = load_prompts(tmp_path / "p.jsonl", tokenizer, "q", "a", False, "meta")
    assert from_parquet == from_jsonl
    assert [p.metadata for p in from_parquet] == [r["meta"] for r in rows]
    assert from_parquet[0].token_ids == (1, 2, 37, 3)


def test_parquet_errors_name_file_and_row(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"q": "a"}, {"q": ""}]), tmp_path / "p.parquet")
    with pytest.raises(PromptDataError, match=r"p.parquet:row 2: prompt 'q' has no tokens"):
        load_prompts(tmp_path / "p.parquet", tokenizer, "q", None, False)
    (tmp_path / "bad.parquet").write_text('{"q": "a"}\n')
    with pytest.raises(PromptDataError, match=r"bad.parquet: not a readable Parquet file"):
        load_prompts(tmp_path / "bad.parquet", tokenizer, "q", None, False)


def test_metadata_key_must_hold_an_object(tmp_path, tokenizer):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"q": "a"}), json.dumps({"q": "b", "m": 3})])
    with pytest.raises(PromptDataError, match=r"p.jsonl:2: 'm' \(--metadata-key\) must be an obj"):
        load_prompts(path, tokenizer, "q", None, False, "m")
    (first,) = load_prompts(
        _write(path, [json.dumps({"q": "a"})]), tokenizer, "q", None, False, "m"
    )
    assert first.metadata == {}


def stub_generator(reward):
    from miles_launch.rollout.generate import Generator

    async def alive(when):
        pass

    gen = Generator(["http://127.0.0.1:1"], reward, alive)
    gen.clients = [StubEngine()]
    return gen


def run_groups(reward, prompts, n):
    from miles_launch.rollout.generate import SamplingConfig

    cfg = SamplingConfig(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
    gen = stub_generator(reward)
    return asyncio.run(gen.groups([(p, p.index) for p in prompts], n, cfg))


def test_the_reward_function_sees_the_prompts_metadata():
    seen = []

    async def reward(inp):
        seen.append(inp.metadata)
        return 0.0

    prompts = [Prompt(0, "ab", None, (1, 2), {"id": "first"}), Prompt(1, "c", None, (3,))]
    run_groups(RewardModel(reward, "records metadata"), prompts, 2)
    assert sorted(map(str, seen)) == sorted(map(str, [{"id": "first"}] * 2 + [{}] * 2))
