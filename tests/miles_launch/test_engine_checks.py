"""Checks the built-in engine runs before work, in-process: weight updates are planned
against the model before any byte is loaded (names, shapes, dtype kinds; atomic), /generate
admission (token ids, context, sampling domains), and one request's failing step ending only
that request."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_testing import greedy_recompute
from miles_launch.builtin_engine import scheduler as scheduler_module
from miles_launch.builtin_engine.generate_io import GenerateInputError, check_admission
from miles_launch.builtin_engine.sampling import SamplingParams, SamplingParamsError
from miles_launch.builtin_engine.scheduler import Request, Scheduler
from miles_launch.builtin_engine.weight_checks import WeightUpdateError, parse_distributed_spec
from miles_launch.builtin_engine.weights import WeightStore
from safetensors.torch import save_file


class _Mixed(torch.nn.Module):
    """A float weight, a bf16 weight, an int and a bool buffer."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 3))
        self.h = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(3, dtype=torch.bool))


def _snapshot(store: WeightStore) -> dict:
    return {n: t.detach().clone() for n, t in store.tensors.items()}


def _unchanged(store: WeightStore, before: dict) -> bool:
    return all(torch.equal(store.tensors[n], t) for n, t in before.items())


@pytest.fixture
def store():
    return WeightStore(_Mixed(), torch.device("cpu"))


def test_float_casts_are_loaded(store):
    update = [("w", torch.ones(2, 3, dtype=torch.float64)), ("h", torch.full((4,), 2.0))]
    assert store.load_named(update) == 2
    assert store.tensors["h"].dtype == torch.bfloat16 and store.tensors["h"].eq(2).all()
    assert store.load_named([("steps", torch.tensor([3, 4], dtype=torch.int32))]) == 1
    assert store.tensors["steps"].tolist() == [3, 4]


@pytest.mark.parametrize(
    "bad,word",
    [
        (("steps", torch.ones(2)), "steps: dtype float32 cannot be loaded into the model's int64"),
        (("w", torch.ones(2, 3, dtype=torch.int64)), "w: dtype int64 .* float32"),
        (("mask", torch.ones(3)), "mask: dtype float32 .* bool"),
        (("w", torch.ones(3, 2)), r"w: shape \(3, 2\) != model's \(2, 3\)"),
        (("nope", torch.ones(1)), "no parameter or buffer named 'nope'"),
    ],
)
def test_a_mismatch_anywhere_loads_nothing(store, bad, word):
    before = _snapshot(store)
    update = [("h", torch.full((4,), 5.0)), bad, ("w", torch.full((2, 3), 7.0))]
    with pytest.raises(WeightUpdateError, match=word):
        store.load_named(update)
    assert _unchanged(store, before)  # not even the entry before the bad one


def test_disk_update_checks_every_file_before_loading_any(store, tmp_path):
    save_file({"w": torch.full((2, 3), 9.0)}, tmp_path / "a.safetensors")
    save_file({"steps": torch.ones(2)}, tmp_path / "b.safetensors")  # float into int64
    before = _snapshot(store)
    with pytest.raises(WeightUpdateError, match="b.safetensors.*steps: dtype float32"):
        store.load_from_disk(str(tmp_path))
    assert _unchanged(store, before)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        store.load_from_disk(str(tmp_path / "a.safetensors"))


def test_distributed_spec_is_checked_for_form_before_anything_is_received():
    names, dtypes, shapes = parse_distributed_spec(
        ["w", "steps"], ["float32", "torch.int32"], [[2, 3], [2]]
    )
    assert dtypes == [torch.float32, torch.int32] and shapes == [[2, 3], [2]]
    for spec, word in (
        ((["w"], ["complex_thing"], [[2, 3]]), r"dtypes\[0\] \(w\): unknown dtype"),
        ((["w"], [7], [[2, 3]]), r"dtypes\[0\] \(w\): unknown dtype 7"),
        ((["w"], ["float32"], [["2", 3]]), r"shapes\[0\] \(w\)"),
        ((["w"], ["float32"], [[-1]]), r"shapes\[0\] \(w\)"),
        ((["w"], ["float32"], [[2**30, 2**30]]), r"shapes\[0\] \(w\): shape .* too large"),
        ((["w", "h"], ["float32"], [[2, 3]]), "differ in length"),
        (("w", ["float32"], [[2, 3]]), "names must be a list"),
        (([3], ["float32"], [[2, 3]]), r"names\[0\] must be a string"),
    ):
        with pytest.raises(WeightUpdateError, match=word):
            parse_distributed_spec(*spec)


# ---- /generate admission -------------------------------------------------------------------
def _params(**kw) -> SamplingParams:
    return SamplingParams.from_request({"max_new_tokens": 4, **kw})


def test_admission_refuses_out_of_vocabulary_ids_and_overlong_requests():
    check_admission([[1, 2, 63]], [_params()], vocab_size=64, context_length=16)
    # input + max_new_tokens == context is served (SGLang refuses only >)
    check_admission([[1] * 10], [_params(max_new_tokens=6)], vocab_size=64, context_length=16)
    for prompts, params, word in (
        ([[1, 64]], [_params()], r"input_ids\[1\] = 64 is outside the vocabulary \[0, 64\)"),
        ([[1], [-1]], [_params(), _params()], r"input_ids\[1\]\[0\] = -1"),
        ([[1] * 16], [_params()], r"input \(16 tokens\) is longer than the model's context"),
        ([[1] * 10], [_params(max_new_tokens=7)], "max_new_tokens 7 with a 10-token input"),
        ([[1]], [_params(stop_token_ids=[99])], "stop_token_ids: 99"),
        ([[1]], [_params(n=5000)], "5000 sequences"),
    ):
        with pytest.raises(GenerateInputError, match=word):
            check_admission(prompts, params, vocab_size=64, context_length=16)


@pytest.mark.parametrize(
    "raw,word",
    [
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"temperature": float("nan")}, "temperature must be a non-negative finite"),
        ({"temperature": float("inf")}, "temperature"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an int"),
        ({"max_new_tokens": True}, "max_new_tokens must be an int"),
        ({"top_k": "5"}, "top_k must be an int"),
        ({"min_new_tokens": 9, "max_new_tokens": 3}, r"min_new_tokens must be in \[0, max_new"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a bool"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of ints"),
        ({"sampling_seed": -1}, "sampling_seed"),
        ({"frequency_penalty": [1]}, "frequency_penalty"),
    ],
)
def test_sampling_params_outside_their_domain_name_the_field(raw, word):
    with pytest.raises(SamplingParamsError, match=word):
        SamplingParams.from_request(raw)
    with pytest.raises(SamplingParamsError, match="must be an object"):
        SamplingParams.from_request([1, 2])


# ---- one request's failure ---------------------------------------------------------------
def test_a_failing_request_ends_alone_and_the_engine_keeps_serving(models, monkeypatch):
    """The session's tiny model (conftest), run in-process by a scheduler of its own."""
    sched = Scheduler(models["old"][1], models["tokenizer"], torch.device("cpu"))
    real_choose = scheduler_module.choose_token

    def choose(logprobs, params, generator, banned=None):
        if params.sampling_seed == 13:  # this request's sampling fails
            raise RuntimeError("probability tensor contains nan")
        return real_choose(logprobs, params, generator, banned)

    monkeypatch.setattr(scheduler_module, "choose_token", choose)

    def run(reqs_params):
        left, all_done = [len(reqs_params)], threading.Event()

        def on_done(req):
            left[0] -= 1  # on the scheduler thread only
            if not left[0]:
                all_done.set()

        reqs = [
            Request(rid=f"r{i}", prompt_ids=[3, 4, 5], params=p, on_done=on_done)
            for i, p in enumerate(reqs_params)
        ]
        sched.submit(reqs)
        assert all_done.wait(60)
        return reqs

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    failing = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=13)
    sched.start()
    try:
        alone = run([greedy])[0].output_ids
        ok, bad, ok2 = run([greedy, failing, greedy])
        assert bad.finish_reason["type"] == "abort"
        assert "engine error: probability tensor contains nan" in bad.finish_reason["message"]
        assert ok.finish_reason == ok2.finish_reason == {"type": "length", "length": 6}
        assert ok.output_ids == ok2.output_ids == alone
        assert run([greedy])[0].output_ids == alone  # still serving
    finally:
        sched.shutdown()


def test_context_length_and_api_key_flags(monkeypatch):
    from miles_core.args import ArgumentError
    from miles_launch.builtin_engine.__main__ import parse_args
    from miles_launch.engine_launch.api_key import API_KEY_ENV

    with pytest.raises(ArgumentError, match="--context-length must be >= 2, got 1"):
        parse_args(["--model-path", "m", "--context-length", "1"])
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    config = parse_args(["--model-path", "m", "--context-length", "64"])
    assert config.context_length == 64 and config.api_key == "from-env"
    assert parse_args(["--model-path", "m", "--api-key", "flag"]).api_key == "flag"


def test_a_failed_batched_decode_ends_only_the_row_that_fails_again(models):
    """A decode forward fails whenever it feeds position 5: only the request with a 3-token
    prompt gets there (at its last step); the batched step fails, each row is retried alone,
    the other row goes on to the tokens it generates alone."""
    model = models["old"][1]
    sched = Scheduler(model, models["tokenizer"], torch.device("cpu"))
    real_forward = sched._forward
    failed_batches = []

    def forward(tokens, positions, mask, cache):
        if (positions == 5).any():
            failed_batches.append(tokens.shape[0])
            raise RuntimeError("CUDA error: an illegal memory access")
        return real_forward(tokens, positions, mask, cache)

    sched._forward = forward
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = {"short": [3, 4, 5], "long": [7, 8, 9, 10, 11, 12, 13]}
    done, left = threading.Event(), [len(prompts)]

    def on_done(req):
        left[0] -= 1
        if not left[0]:
            done.set()

    reqs = {n: Request(n, ids, params, on_done) for n, ids in prompts.items()}
    sched.start()
    try:
        sched.submit(list(reqs.values()))
        assert done.wait(60)
    finally:
        sched.shutdown()
    assert failed_batches == [2, 1]  # the batched step, then the failing row alone
    assert reqs["short"].finish_reason["type"] == "abort"
    assert "engine error: CUDA error: an illegal" in reqs["short"].finish_reason["message"]
    assert reqs["long"].finish_reason == {"type": "length", "length": 4}
    assert reqs["long"].output_ids == greedy_recompute(model, prompts["long"], 4)
