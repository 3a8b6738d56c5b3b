"""Built-in engine pieces in-process: the payload allowlist and the sampling rules."""

from __future__ import annotations

import base64
import functools
import io
import math
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp
from miles_launch.builtin_engine.safe_unpickle import UnsafePayloadError, decode_serialized
from miles_launch.builtin_engine.sampling import SamplingParams, SamplingParamsError, choose_token
from miles_launch.builtin_engine.weights import decode_tensor_payload, receive_broadcast
from miles_sync.buckets import dumps_sglang_wire, pack_bucket, to_sglang_metadata


def _forking_b64(obj) -> str:
    mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def test_forking_pickler_payloads_decode_both_formats():
    named = [
        ("a", torch.randn(3, 2)),
        ("b", torch.arange(5, dtype=torch.int64)),
        ("c", torch.randn(4).bfloat16()),
    ]
    direct = decode_tensor_payload([_forking_b64(named)], None)
    assert [(n, torch.equal(t, w)) for (n, t), (_, w) in zip(direct, named)] == [
        ("a", True),
        ("b", True),
        ("c", True),
    ]
    flat, meta = pack_bucket(named)
    for metadata, dump in (
        (meta, _forking_b64),
        (to_sglang_metadata(meta), lambda o: base64.b64encode(dumps_sglang_wire(o)).decode()),
    ):
        payload = dump({"flattened_tensor": flat, "metadata": metadata})
        out = dict(decode_tensor_payload([payload], "flattened_bucket"))
        assert sorted(out) == ["a", "b", "c"]
        assert all(torch.equal(out[n], w) for n, w in named)


def test_broadcast_bucket_in_an_unaligned_order_is_refused_before_receiving():
    """As SGLang's ``FlattenedTensorBucket.empty``: the bucket is laid out densely in the order
    of ``names``; a bf16 tensor of odd length followed by an fp32 one leaves the fp32 one at an
    unaligned offset, refused before the broadcast is joined (no group is needed to see it)."""
    with pytest.raises(ValueError, match="'w'.*not aligned"):
        receive_broadcast(
            None, ["b", "w"], ["bfloat16", "float32"], [[3], [2]], "flattened_bucket", "cpu"
        )


class _Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize(
    "payload",
    [
        _Call(eval, "1 + 1"),
        _Call(functools.partial(print, "x")),
        _Call(getattr, "abc", "upper"),
        _Call(torch.load, "/dev/null"),
    ],
    ids=["eval", "partial", "getattr", "torch.load"],
)
def test_payload_naming_any_other_callable_is_refused(payload):
    data = pickle.dumps([("x", payload)])
    with pytest.raises(UnsafePayloadError, match="not on the allowlist"):
        decode_serialized(data)


def test_garbage_payloads_are_refused():
    with pytest.raises(UnsafePayloadError, match="base64"):
        decode_serialized("not base64 !!!")
    with pytest.raises(UnsafePayloadError):
        decode_serialized(base64.b64encode(b"\x80\x05garbage").decode())
    with pytest.raises(ValueError, match="one entry"):
        decode_tensor_payload([_forking_b64([]), _forking_b64([])], None)
    with pytest.raises(UnsafePayloadError, match="pairs"):
        decode_tensor_payload([_forking_b64({"a": 1})], "direct")


# ---- sampling ------------------------------------------------------------------------------
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _allowed(params: SamplingParams) -> set[int]:
    """Float64 reference of the truncation rules, written out directly."""
    p = [math.exp(z / params.temperature) for z in LOGITS.double().tolist()]
    total = sum(p)
    p = [x / total for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order if params.top_k == -1 else order[: params.top_k])
    mass, kept_p = 0.0, set()
    for i in order:
        if i in keep and mass <= params.top_p * sum(p[j] for j in keep):
            kept_p.add(i)
        if i in keep:
            mass += p[i]
    keep &= kept_p
    top = max(p[i] for i in keep)
    return {i for i in keep if p[i] >= params.min_p * top}


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=3),
        dict(temperature=1.3, top_p=0.6),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=2.0, top_k=4, top_p=0.8, min_p=0.1),
    ],
)
def test_sampling_draws_only_from_the_truncated_set(kw):
    params = SamplingParams(**kw)
    logprobs = torch.log_softmax(LOGITS / params.temperature, dim=-1)
    gen = torch.Generator().manual_seed(0)
    seen = {choose_token(logprobs, params, gen)[0] for _ in range(400)}
    assert seen == _allowed(params)  # every allowed token shows up in 400 draws, none other


def test_greedy_and_logprob():
    params = SamplingParams(temperature=0.0)
    logprobs = torch.log_softmax(LOGITS, dim=-1)
    token, lp = choose_token(logprobs, params, None)
    assert token == 0 and lp == pytest.approx(
        2.0 - math.log(sum(math.exp(z) for z in LOGITS.tolist()))
    )
    assert choose_token(logprobs, params, None, banned=[0])[0] == 1


def test_sampling_params_validation():
    assert SamplingParams.from_request({"stop": "x"}).stop == ["x"]
    assert (
        SamplingParams.from_request(
            {"frequency_penalty": 0.0, "spaces_between_special_tokens": True}
        ).max_new_tokens
        == 128
    )
    for bad, word in (
        ({"nope": 1}, "nope"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n must"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
    ):
        with pytest.raises(SamplingParamsError, match=word):
            SamplingParams.from_request(bad)
