"""A fuzz test of the built-in engine's HTTP surface (hypothesis, loopback, bounded).

Random and malformed bodies go to every endpoint: bytes that are not JSON, JSON that is not
an object, objects whose fields (the endpoint's own names) hold values of any type, huge
numbers, NaN and infinities, /generate requests with random token ids and sampling values,
and weight payloads made of random pickles, pickles naming os.system, and byte-flipped
ForkingPickler dumps. No answer may be a 5xx; afterwards the engine answers /health, serves
a normal /generate exactly as transformers does, and its weights are unchanged (no valid
update is among the cases). The run is bounded by MAX_CASES and BUDGET_S and prints how many
cases ran.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import time
from collections import Counter
from multiprocessing.reduction import ForkingPickler

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from engine_testing import assert_generates  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

MAX_CASES = 400
BUDGET_S = 25.0

GET_PATHS = [
    "/health",
    "/health_generate",
    "/get_model_info",
    "/model_info",
    "/get_server_info",
    "/server_info",
    "/flush_cache",
]
#: POST endpoints and the fields they read (random values go into these names).
FIELDS = {
    "/generate": [
        "sampling_params", "rid", "return_logprob", "logprob_start_len", "stream",
        "return_routed_experts", "routed_experts_start_len",
    ],  # text/input_ids only in _generate_bodies: a valid prompt must not run 128 tokens
    "/update_weights_from_tensor": [
        "serialized_named_tensors", "load_format", "weight_version", "abort_all_requests",
        "flush_cache",
    ],
    "/update_weights_from_disk": ["model_path", "load_format", "weight_version"],
    "/update_weights_from_distributed": [
        "names", "dtypes", "shapes", "group_name", "load_format", "weight_version",
    ],
    "/init_weights_update_group": [
        "master_address", "rank_offset", "world_size", "group_name", "backend",
    ],  # master_port never valid: no case may start a rendezvous
    "/destroy_weights_update_group": ["group_name"],
    "/update_weight_version": ["new_version", "abort_all_requests"],
    "/pause_generation": ["mode"],
    "/continue_generation": [],
    "/abort_request": ["rid", "abort_all"],
    "/flush_cache": [],
    "/end_weight_update": [],
    "/release_memory_occupation": ["tags"],
    "/resume_memory_occupation": ["tags"],
    "/begin_weight_update": None,  # any object is valid (and opens the window): only non-objects
}  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _forking_dump(obj) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@st.composite
def _payload_entries(draw, marker: str, template: bytes):
    kind = draw(st.sampled_from(["bytes", "pickle", "system", "flipped", "text"]))
    if kind == "bytes":
        return _b64(draw(st.binary(max_size=64)))
    if kind == "pickle":
        obj = draw(json_values.map(lambda v: [("w", v)]) | json_values)
        return _b64(pickle.dumps(obj, protocol=draw(st.integers(0, 5))))
    if kind == "system":
        return _b64(pickle.dumps([("w", _Reduce(os.system, f"touch {marker}"))]))
    if kind == "flipped":
        data = bytearray(template)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return _b64(bytes(data))
    return draw(st.text(max_size=16))


@st.composite
def _generate_bodies(draw):
    prompt = draw(
        st.fixed_dictionaries(
            {"input_ids": st.lists(st.integers(-3, 2**40) | st.integers(1, 60), max_size=6)}
        )
        | st.fixed_dictionaries(
            {"text": st.text(max_size=8) | st.lists(st.text(max_size=4), max_size=2)}
        )
    )
    params = {"max_new_tokens": draw(st.integers(0, 3) | json_values)}
    for key in draw(st.sets(st.sampled_from(
        ["temperature", "top_p", "top_k", "min_p", "min_new_tokens", "n", "stop",
         "stop_token_ids", "ignore_eos", "sampling_seed", "frequency_penalty", "bogus"]
    ), max_size=3)):  # fmt: skip
        params[key] = draw(scalars | st.lists(scalars, max_size=3))
    if isinstance(params.get("n"), int) and params["n"] > 4:
        params["n"] = 4
    return {**prompt, "sampling_params": params}


def _cases(marker: str, template: bytes):
    paths = sorted(FIELDS)
    non_object = st.binary(max_size=32).map(lambda b: ("bytes", b)) | json_values.filter(
        lambda v: not isinstance(v, dict)
    ).map(lambda v: ("json", v))

    @st.composite
    def post(draw):
        path = draw(st.sampled_from(paths))
        fields = FIELDS[path]
        options = [non_object]
        if fields is not None:
            options.append(
                st.fixed_dictionaries({}, optional={name: json_values for name in fields}).map(
                    lambda d: ("json", d)
                )
            )
        if path == "/generate":
            options.append(_generate_bodies().map(lambda d: ("json", d)))
        if path == "/update_weights_from_tensor":
            options.append(
                st.fixed_dictionaries(
                    {
                        "serialized_named_tensors": st.lists(
                            _payload_entries(marker, template), min_size=1, max_size=2
                        )
                        | json_values,
                        "load_format": st.sampled_from([None, "direct", "flattened_bucket", "x"]),
                    }
                ).map(lambda d: ("json", d))
            )
        if path == "/init_weights_update_group":
            options = [
                o.map(
                    lambda kb: (
                        (kb[0], {**kb[1], "master_port": "x"}) if isinstance(kb[1], dict) else kb
                    )
                )
                for o in options
            ]
        return ("POST", path, draw(st.one_of(options)))

    get = st.sampled_from(GET_PATHS).map(lambda p: ("GET", p, None))
    return post() | get


def test_fuzzing_the_http_surface_leaves_the_engine_serving_the_same_weights(
    engine, models, tmp_path, capsys
):
    marker = str(tmp_path / "pwned")
    # a real payload to flip bytes in: a tensor under a name the model does not have
    template = _forking_dump([("fuzz.weight", torch.zeros(4, dtype=torch.int64))])
    version = engine.client.get("/get_model_info").json()["weight_version"]
    statuses: Counter = Counter()
    start = time.monotonic()
    ran = [0]

    @settings(
        max_examples=MAX_CASES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_cases(marker, template))
    def one_case(case):
        if time.monotonic() - start > BUDGET_S:
            return
        method, path, body = case
        if method == "GET":
            r = engine.client.get(path, timeout=20)
        else:
            kind, value = body
            content = value if kind == "bytes" else json.dumps(value).encode()
            r = engine.client.post(
                path, content=content, headers={"content-type": "application/json"}, timeout=20
            )
        ran[0] += 1
        statuses[r.status_code] += 1
        assert r.status_code < 500 or (r.status_code == 503 and path.startswith("/health")), (
            method, path, body, r.status_code, r.text,
        )  # fmt: skip
        if r.status_code == 400:
            assert "message" in r.json()["error"], r.text
        # undo what a well-formed control call may have done
        if path in ("/pause_generation", "/release_memory_occupation"):
            assert engine.post("/continue_generation").status_code == 200
            assert engine.post("/resume_memory_occupation").status_code == 200

    one_case()
    elapsed = time.monotonic() - start
    with capsys.disabled():
        print(f"\nengine fuzz: {ran[0]} cases in {elapsed:.1f}s, statuses {dict(statuses)}")
    assert ran[0] >= 100
    engine.post("/update_weight_version", {"new_version": version})
    assert engine.client.get("/health").status_code == 200
    assert not os.path.exists(marker)
    assert_generates(engine, models, "old")
