"""Every request the engine client sends conforms to the released SGLang's request classes.

The schema is read off the source of the ``sglang`` wheel the test suite caches
(``tests/sglang_release.py``) by ``scripts/extract_sglang_schema.py``; without a package index
it falls back to ``tests/data/sglang_schema.json`` (the same script's output, committed).
Requests are captured with ``httpx.MockTransport`` and checked against it: method and path of a
real route, body keys among the fields of the route's request class, required fields present,
``sampling_params`` keys among SGLang's ``SamplingParams`` fields.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
import warnings
import zipfile
from dataclasses import fields
from pathlib import Path

import httpx
import pytest
import sglang_release as release
import torch
from miles_core.engine import EngineClient, SamplingParams
from miles_core.engine.endpoints import EngineEndpoints

ROOT = Path(__file__).resolve().parents[2]
FALLBACK = ROOT / "tests" / "data" / "sglang_schema.json"


def load_extractor():
    spec = importlib.util.spec_from_file_location(
        "extract_sglang_schema", ROOT / "scripts" / "extract_sglang_schema.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def schema(request) -> dict:
    """Derived from the cached wheel; the committed JSON only when no index is reachable."""
    try:
        request.getfixturevalue("sglang_release")
    except pytest.skip.Exception as why:
        note = f"SGLang schema from the offline fallback {FALLBACK.name}: {why}"
        warnings.warn(note, stacklevel=1)
        return json.loads(FALLBACK.read_text())
    return load_extractor().schema_of(release.wheel())


FULL_SAMPLING = SamplingParams(
    max_new_tokens=16,
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    min_p=0.05,
    stop=["\n\n"],
    stop_token_ids=[2],
    ignore_eos=False,
    skip_special_tokens=True,
    no_stop_trim=True,
    n=2,
    sampling_seed=7,
)

# Every endpoint method, called with every optional field set.
CALLS = {
    "generate": lambda c: c.generate(
        "hi",
        sampling_params=FULL_SAMPLING,
        return_logprob=True,
        logprob_start_len=0,
        return_routed_experts=True,
        routed_experts_start_len=1,
        rid="r1",
    ),
    "health": lambda c: c.health(),
    "health_generate": lambda c: c.health_generate(),
    "get_model_info": lambda c: c.get_model_info(),
    "get_server_info": lambda c: c.get_server_info(),
    "pause_generation": lambda c: c.pause_generation("retract"),
    "continue_generation": lambda c: c.continue_generation(),
    "flush_cache": lambda c: c.flush_cache(),
    "abort_request": lambda c: c.abort_request("r1", abort_all=True),
    "begin_weight_update": lambda c: c.begin_weight_update("all"),
    "end_weight_update": lambda c: c.end_weight_update(),
    "update_weights_from_disk": lambda c: c.update_weights_from_disk(
        "/ckpt", load_format="auto", weight_version="v2", abort_all_requests=True, flush_cache=True
    ),
    "init_weights_update_group": lambda c: c.init_weights_update_group(
        "127.0.0.1", 29500, 1, 3, group_name="g", backend="gloo"
    ),
    "update_weights_from_distributed": lambda c: c.update_weights_from_distributed(
        ["a", "b"],
        [torch.bfloat16, "float32"],
        [[2, 3], [4]],
        group_name="g",
        load_format="flattened_bucket",
        weight_version="v2",
        flush_cache=False,
        abort_all_requests=True,
    ),
    "destroy_weights_update_group": lambda c: c.destroy_weights_update_group("g"),
    "update_weights_from_tensor": lambda c: c.update_weights_from_tensor(
        ["AAAA", "BBBB"],
        load_format="flattened_bucket",
        weight_version="v2",
        flush_cache=True,
        abort_all_requests=False,
    ),
    "update_weight_version": lambda c: c.update_weight_version("v3", abort_all_requests=False),
    "get_weights_by_name": lambda c: c.get_weights_by_name("lm_head.weight", 4),
    "release_memory_occupation": lambda c: c.release_memory_occupation(["weights", "kv_cache"]),
    "resume_memory_occupation": lambda c: c.resume_memory_occupation(["weights"]),
}


def capture(call) -> list[httpx.Request]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"success": True, "message": ""})

    with EngineClient("http://engine", transport=httpx.MockTransport(handler)) as client:
        call(client)
    return seen


def test_committed_schema_is_the_documented_release():
    committed = json.loads(FALLBACK.read_text())
    assert committed["sglang_version"] == "0.5.23"
    endpoints = committed["endpoints"]
    assert endpoints["/generate"]["request_class"] == "GenerateReqInput"
    # Facts of SGLANG_API.md, as read off the release.
    assert "/get_weight_version" not in endpoints
    assert endpoints["/begin_weight_update"]["fields"][-1] == "selector"
    assert "/model_info" in endpoints and "/get_model_info" in endpoints
    assert "return_routed_experts" in endpoints["/generate"]["fields"]


def test_fallback_is_what_the_script_reads_off_the_wheel(sglang_release):
    """The committed JSON is the script's output for the cached wheel of its release
    (regenerate it with ``python scripts/extract_sglang_schema.py --version X``)."""
    committed = json.loads(FALLBACK.read_text())
    if committed["sglang_version"] != release.SGLANG_VERSION:
        pytest.skip(f"the harness runs sglang {release.SGLANG_VERSION}, the fallback is older")
    assert committed == load_extractor().schema_of(release.wheel())


def test_every_endpoint_method_is_checked():
    public = {
        name
        for name, member in inspect.getmembers(EngineEndpoints, inspect.isfunction)
        if not name.startswith("_")
    }
    assert public == set(CALLS)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_request_conforms_to_sglang(name, schema):
    (request,) = capture(CALLS[name])
    path = request.url.path
    assert path in schema["endpoints"], (
        f"{path} is not a route of sglang {schema['sglang_version']}"
    )
    endpoint = schema["endpoints"][path]
    assert request.method in endpoint["methods"]
    if request.method == "GET":
        assert request.content == b""
        return
    assert request.headers["content-type"] == "application/json"
    body = json.loads(request.content)
    assert isinstance(body, dict)  # `{}` at least: 0.5.23 refuses a missing body
    if endpoint["request_class"] is None:
        # A handler without a body class (flush_cache) reads nothing from it: send nothing.
        assert body == {}
        return
    unknown = set(body) - set(endpoint["fields"])
    assert not unknown, f"{path}: {sorted(unknown)} not fields of {endpoint['request_class']}"
    missing = set(endpoint["required"]) - set(body)
    assert not missing, f"{path}: required {sorted(missing)} not sent"


def allowed_sampling_keys(schema) -> set[str]:
    keys = set(schema["sampling_params"]["fields"])
    if "sampling_params_contract" in schema:  # the JSON gate that answers unknown keys with 400
        keys &= set(schema["sampling_params_contract"]["fields"])
    return keys


def test_sampling_params_keys_are_sglang_fields(schema):
    (request,) = capture(CALLS["generate"])
    sent = json.loads(request.content)["sampling_params"]
    assert set(sent) == {f.name for f in fields(SamplingParams)}  # every field was set
    assert set(sent) <= allowed_sampling_keys(schema)


def test_generate_fields_pass_the_contract_gate(schema):
    """The fields of /generate that SGLang's JSON contract names are accepted by it; the
    others (return_routed_experts) are fields of GenerateReqInput (checked above), which
    the gate lets through because it ignores keys it does not know."""
    if "generate_contract" not in schema:
        pytest.skip("this release has no generated JSON contract")
    (request,) = capture(CALLS["generate"])
    body = json.loads(request.content)
    contract = set(schema["generate_contract"]["fields"])
    assert {"text", "input_ids", "sampling_params", "return_logprob"} <= contract
    assert set(body) <= contract | set(schema["endpoints"]["/generate"]["fields"])


# ---------------------------------------------------------------------------- the extractor


IO_STRUCT_SRC = """
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Annotated
import msgspec

class BaseReq(msgspec.Struct, kw_only=True):
    rid: Optional[str] = None

class UpdateReq(BaseReq, kw_only=True):
    model_path: str
    flush_cache: bool = True
    kind: ClassVar[str] = "x"

@dataclass
class GenReq:
    text: Optional[str] = None
    hidden: int = field(default=0, init=False)
    needed: int = field()
    extra: list = field(default_factory=list)
"""

SAMPLING_SRC = """
class SamplingParams:
    def __init__(self, max_new_tokens: int = 128, stop=None, *, n: int = 1) -> None:
        self.max_new_tokens = max_new_tokens
"""

SERVER_SRC = """
import os
@app.api_route("/generate", methods=["POST", "PUT"])
async def generate_request(obj: GenReq, request: Request):
    pass

@app.post("/update")
async def update(obj: Annotated[UpdateReq, Body()], request: Request):
    pass

@app.get("/health")
@app.get("/health_generate")
async def health(request: Request):
    pass

@app.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(timeout: float = Query(0.0, ge=0.0)):
    pass

@app.post(os.environ.get("ROUTE", "/api/generate"))
async def computed(request: Request):
    pass

@app.post("/v1/completions")
async def openai(request: Request):
    pass
"""


def test_extractor_reads_classes_routes_and_init(tmp_path):
    extractor = load_extractor()
    wheel = tmp_path / "sglang-9.8.7-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(extractor.IO_STRUCT, IO_STRUCT_SRC)
        archive.writestr(extractor.SAMPLING_PARAMS, SAMPLING_SRC)
        archive.writestr(extractor.HTTP_SERVER, SERVER_SRC)
    output = tmp_path / "schema.json"
    extractor.main(["--package", str(wheel), "--output", str(output)])
    schema = json.loads(output.read_text())

    assert schema["sglang_version"] == "9.8.7"
    endpoints = schema["endpoints"]
    assert set(endpoints) == {"/generate", "/update", "/health", "/health_generate", "/flush_cache"}
    assert endpoints["/generate"]["methods"] == ["POST", "PUT"]
    assert endpoints["/generate"]["fields"] == ["text", "needed", "extra"]
    assert endpoints["/generate"]["required"] == ["needed"]
    # Inherited fields first; ClassVar skipped; Annotated[..., Body()] resolved.
    assert endpoints["/update"]["fields"] == ["rid", "model_path", "flush_cache"]
    assert endpoints["/update"]["required"] == ["model_path"]
    assert endpoints["/health"]["request_class"] is None
    assert endpoints["/flush_cache"]["query"] == ["timeout"]
    assert schema["sampling_params"]["fields"] == ["max_new_tokens", "stop", "n"]
    assert "sampling_params_contract" not in schema
