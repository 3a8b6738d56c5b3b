"""Fuzzing the built-in engine's HTTP surface (hypothesis strategies and the case runner).

Shared by ``test_engine_fuzz.py`` (a bounded run in the default suite, a longer one under
``extended``) and ``scripts/fuzz_engine.py`` (10,000+ cases). Random and malformed bodies go
to every endpoint, with the engine's API key set: bytes that are not JSON, JSON that is not an
object, objects whose fields (the endpoint's own names) hold values of any type, huge numbers,
NaN and infinities, /generate requests with random token ids and sampling values, wrong
``Authorization`` headers, and weight payloads: random pickles, pickles naming os.system,
byte-flipped ForkingPickler dumps, and **valid payloads of the served checkpoint's own
tensors with one field mutated** (a tensor's name, storage offset, size, stride, dtype, segment
handle or size, class; a bucket metadata object's field set to another value or deleted), and
disk updates from broken copies of the checkpoint. No answer may be a 5xx; a refused weight
update leaves the weight version as it was; an accepted one (a mutation can still be a valid
update, e.g. a stride of 0) is undone by loading the checkpoint's tensors again.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import shutil
import time
from collections import Counter
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from miles_sync.buckets import pack_bucket
from torch.multiprocessing import reductions

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


# ---- valid payloads of the checkpoint's own tensors, one field mutated ----------------------
#: Fields a mutation of a direct payload may change (of one tensor).
TENSOR_FIELDS = (
    "name",
    "offset",
    "size",
    "stride",
    "dtype",
    "handle",
    "storage_size",
    "grad",
    "class",
)
META_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8,
           torch.bool, torch.int8, torch.complex64]  # fmt: skip
odd_values = (
    json_values
    | st.sampled_from(_DTYPES)
    | st.lists(st.integers(-3, 70), max_size=4).map(torch.Size)
    | st.integers(-(2**63), 2**63)
)


class Checkpoint:
    """The served checkpoint's tensors, and the disk copies a disk update may be sent. Each
    payload shares fresh copies (torch unlinks a segment once its receiver let it go)."""

    def __init__(self, state: dict[str, torch.Tensor], model_dir: Path, scratch: Path):
        self.tensors = {n: t.detach().clone().contiguous() for n, t in state.items()}
        self.names = sorted(self.tensors)
        self.disk_dirs = _broken_copies(model_dir, scratch)

    def share(self, names) -> dict:
        """``{name: (tensor, (manager, handle, size))}``: fresh shared copies (keep the
        tensors alive until the request is answered)."""
        previous = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            out = {}
            for n in names:
                t = self.tensors[n].clone()
                out[n] = (t, t.untyped_storage()._share_filename_cpu_())
            return out
        finally:
            mp.set_sharing_strategy(previous)

    def restore_payload(self) -> str:
        previous = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            return _b64(_forking_dump([(n, t.clone()) for n, t in self.tensors.items()]))
        finally:
            mp.set_sharing_strategy(previous)


def _broken_copies(model_dir: Path, scratch: Path) -> list[str]:
    """The checkpoint itself, and copies whose safetensors file is truncated, has its header
    bytes flipped, or is missing; a file path and a path that does not exist."""
    source = next(model_dir.glob("*.safetensors"))
    data = source.read_bytes()
    out = [str(model_dir), str(source), str(scratch / "nowhere")]
    for kind in ("truncated", "header", "empty"):
        d = scratch / f"ckpt-{kind}"
        d.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
        if kind == "truncated":
            (d / source.name).write_bytes(data[: len(data) // 2])
        elif kind == "header":
            flipped = bytearray(data)
            for i in range(8, min(len(flipped), 200), 7):
                flipped[i] ^= 0x5A
            (d / source.name).write_bytes(bytes(flipped))
        out.append(str(d))
    return out


def _tensor_reduce(tensor: torch.Tensor, handles: tuple, change: dict):
    """``rebuild_tensor(cls, rebuild_typed_storage(rebuild_storage_filename(...), dtype),
    (offset, size, stride, requires_grad))`` of a shared tensor, fields replaced by ``change``:
    the pickle ForkingPickler writes, written by hand."""
    manager, handle, size = handles
    v = {
        "handle": handle, "storage_size": size, "dtype": tensor.dtype, "offset": 0,
        "size": tuple(tensor.shape), "stride": tensor.stride(), "grad": False,
        "class": torch.Tensor,
    }  # fmt: skip
    v.update(change)
    storage = _Reduce(
        reductions.rebuild_storage_filename, torch.UntypedStorage, manager, v["handle"],
        v["storage_size"],
    )  # fmt: skip
    typed = _Reduce(reductions.rebuild_typed_storage, storage, v["dtype"])
    meta = (v["offset"], _Reduce(torch.Size, v["size"]), v["stride"], v["grad"])
    return _Reduce(reductions.rebuild_tensor, v["class"], typed, meta)


@st.composite
def _mutated_tensor_update(draw, ckpt: Checkpoint):
    """``(build, what)``: ``build()`` makes an /update_weights_from_tensor body from fresh
    shared copies of checkpoint tensors with one field mutated, and returns it with the
    tensors to keep alive until the answer."""
    names = draw(st.lists(st.sampled_from(ckpt.names), min_size=1, max_size=3, unique=True))
    if draw(st.booleans()):  # direct
        target = draw(st.sampled_from(names))
        field = draw(st.sampled_from(TENSOR_FIELDS))
        change: dict = {}
        other = None
        if field == "offset":
            change["offset"] = draw(st.integers(-4, 4096) | odd_values)
        elif field == "size":
            change["size"] = draw(
                st.lists(st.integers(-2, 4096), max_size=4).map(tuple) | odd_values
            )
        elif field == "stride":
            change["stride"] = draw(
                st.lists(st.integers(-2, 64), max_size=4).map(tuple) | odd_values
            )
        elif field == "dtype":
            change["dtype"] = draw(st.sampled_from(_DTYPES) | odd_values)
        elif field == "handle":
            other = draw(st.sampled_from(names))  # another live segment of this payload
            if draw(st.booleans()):
                change["handle"] = draw(st.binary(max_size=24) | odd_values)
        elif field == "storage_size":
            change["storage_size"] = draw(st.integers(-1, 1 << 44) | odd_values)
        elif field == "grad":
            change["grad"] = draw(odd_values)
        elif field == "class":
            change["class"] = draw(st.sampled_from([torch.nn.Parameter, torch.float32, torch.Size]))
        label = (
            draw(st.sampled_from(ckpt.names) | st.text(max_size=12) | odd_values)
            if field == "name"
            else target
        )

        def build():
            shared = ckpt.share(names)
            if other is not None and "handle" not in change:
                change["handle"] = shared[other][1][1]
            items = [
                (
                    label if n == target else n,
                    _tensor_reduce(*shared[n], change if n == target else {}),
                )
                for n in names
            ]
            try:
                data = pickle.dumps(items, protocol=4)
            except Exception:  # a value pickle cannot write: send it as text instead
                data = repr(items).encode()
            return {"serialized_named_tensors": [_b64(data)]}, shared

        return build, f"direct.{field}"
    i = draw(st.integers(0, len(names) - 1))
    field = draw(st.sampled_from(META_FIELDS))
    delete = draw(st.integers(0, 4)) == 0
    value = None if delete else draw(odd_values | st.integers(-64, 4096))

    def build():
        flat, meta = pack_bucket([(n, ckpt.tensors[n].clone()) for n in names])
        if delete:
            delattr(meta[i], field)
        else:
            setattr(meta[i], field, value)
        previous = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            data = _forking_dump({"flattened_tensor": flat, "metadata": meta})
        finally:
            mp.set_sharing_strategy(previous)
        body = {"serialized_named_tensors": [_b64(data)], "load_format": "flattened_bucket"}
        return body, flat

    return build, f"bucket.{field}" + (".deleted" if delete else "")


def _wrong_authorization():
    """Header values that do not carry the key (printable ASCII, as HTTP headers are)."""
    token = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40)
    printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
    return printable.map(str.strip) | st.tuples(
        st.sampled_from(["Bearer ", "bearer ", "Bearer", "Basic "]), token
    ).map(lambda parts: "".join(parts).strip())  # (h11 refuses surrounding whitespace)


# ---- running cases ---------------------------------------------------------------------------
def run_fuzz(engine, ckpt: Checkpoint, marker: str, max_cases: int, budget_s: float) -> dict:
    """Send up to ``max_cases`` cases (stopping after ``budget_s`` seconds) to ``engine`` (an
    ``EngineProcess`` whose client carries the key). Returns counts: ``cases``, ``statuses``,
    ``mutated`` (per mutated field), ``refusals`` (per kind of refusal reached), ``accepted``
    (mutated updates the engine found valid, each undone)."""
    template = _forking_dump([("fuzz.weight", torch.zeros(4, dtype=torch.int64))])
    version = engine.client.get("/get_model_info").json()["weight_version"]
    stats = {"cases": 0, "statuses": Counter(), "mutated": Counter(), "refusals": Counter()}
    stats["accepted"] = 0
    start = time.monotonic()
    routes = _cases(marker, template)
    mutated = _mutated_tensor_update(ckpt).map(
        lambda bw: ("MUTATED", "/update_weights_from_tensor", bw)
    )
    disk = st.sampled_from(ckpt.disk_dirs).map(
        lambda d: ("POST", "/update_weights_from_disk", ("json", {"model_path": d}))
    )
    auth = _wrong_authorization().map(lambda h: ("AUTH", "/get_model_info", h))
    # one_of draws its branches evenly: about half the cases go to every route's fields, a
    # third are mutated payloads, the rest disk copies and wrong keys
    cases = st.one_of(routes, routes, routes, mutated, mutated, disk | auth)

    @settings(
        max_examples=max_cases,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def one_case(case):
        if time.monotonic() - start > budget_s:
            return
        method, path, body = case
        if method == "AUTH":  # a wrong Authorization header never reaches a handler
            r = engine.client.get(path, headers={"authorization": body}, timeout=20)
            assert r.status_code == 401, (body, r.status_code)
        elif method == "GET":
            r = engine.client.get(path, timeout=20)
        elif method == "MUTATED":
            build, what = body
            stats["mutated"][what] += 1
            request, keep = build()
            # inside an update window: a case may have closed it, or another test opened one
            assert engine.post("/begin_weight_update").status_code == 200
            r = engine.post(path, {**request, "weight_version": "fuzzed"}, timeout=20)
            del keep
        else:
            kind, value = body
            content = value if kind == "bytes" else json.dumps(value).encode()
            r = engine.client.post(
                path, content=content, headers={"content-type": "application/json"}, timeout=20
            )
        stats["cases"] += 1
        stats["statuses"][r.status_code] += 1
        assert r.status_code < 500 or (r.status_code == 503 and path.startswith("/health")), (
            method, path, body, r.status_code, r.text,
        )  # fmt: skip
        if r.status_code == 400:
            message = r.json()["error"]["message"]
            for word in ("reaches past", "metadata[", "not on the allowlist", "shape", "field ",
                         "shared-memory", "dtype", "not callable", "budget"):  # fmt: skip
                if word in message:
                    stats["refusals"][word] += 1
        if method == "MUTATED":
            now = engine.client.get("/get_model_info").json()["weight_version"]
            if r.status_code == 200:  # a valid update after all: undo it
                stats["accepted"] += 1
                restore(engine, ckpt, version)
            else:
                assert now == version, (body[1], r.text)  # refused: nothing was loaded
        # undo what a well-formed control call may have done
        if path in ("/pause_generation", "/release_memory_occupation"):
            assert engine.post("/continue_generation").status_code == 200
            assert engine.post("/resume_memory_occupation").status_code == 200
        if path == "/update_weight_version" and r.status_code == 200:
            engine.post("/update_weight_version", {"new_version": version})

    one_case()
    engine.post("/end_weight_update")  # an open window would hold back the next updates' check
    stats["elapsed_s"] = time.monotonic() - start
    return stats


def restore(engine, ckpt: Checkpoint, version: str) -> None:
    assert engine.post("/begin_weight_update").status_code == 200
    r = engine.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [ckpt.restore_payload()], "weight_version": version},
    )
    assert r.status_code == 200, r.text


def assert_serves_the_checkpoint(engine, ckpt: Checkpoint, version: str) -> None:
    """/health answers, the version is ``version``, every tensor equals the checkpoint's."""
    assert engine.client.get("/health").status_code == 200
    assert engine.client.get("/get_model_info").json()["weight_version"] == version
    for name, tensor in ckpt.tensors.items():
        r = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 1 << 30})
        assert r.status_code == 200, r.text
        got = torch.tensor(r.json(), dtype=torch.float32)
        assert torch.equal(got, tensor.float()), name
