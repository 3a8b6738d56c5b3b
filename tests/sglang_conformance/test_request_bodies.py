"""The built-in engine's control-route bodies parse as SGLang's HTTP server parses them.

Every route's model (:mod:`miles_launch.builtin_engine.request_bodies`) is compared with the
released SGLang's own request class of the same name (its ``io_struct`` source, validated
through its pydantic-core schema as its FastAPI server does): the same field names and
defaults, and for one corpus of values in every field (``"false"``, ``"0"``, ``2``, ``1.5``,
``None``, base64 and not, ...) the same accept/refuse decision and the same parsed value.
"""

from __future__ import annotations

import functools

import pytest
from miles_launch.builtin_engine.request_bodies import ROUTE_BODIES, BodyError, parse_body

#: A valid value of every required field of the routes' bodies.
REQUIRED = {
    "model_path": "/m",
    "serialized_named_tensors": ["YQ=="],
    "names": ["w"],
    "dtypes": ["float32"],
    "shapes": [[2, 3]],
    "master_address": "10.0.0.1",
    "master_port": 29500,
    "rank_offset": 1,
    "world_size": 2,
    "new_version": "v1",
    "name": "w",
}
CORPUS = [
    "false", "true", "False", "0", "1", "no", "yes", "off", "on", "maybe", "",
    0, 1, 2, -1, 0.0, 1.0, 1.5, "7", "7.0", 2**70, None, True, False,
    [], {}, ["a"], [1], [[1, 2]], [["1", 2.0]], "YQ==", ["YQ=="], ["not base64!"], [1, "YQ=="],
    "abort", "retract", "in_place", "target", "draft", {"a": 1},
]  # fmt: skip


@pytest.fixture(scope="module")
def sglang_classes(sglang_release):
    from sglang_conformance.request_classes import request_classes

    return request_classes(sglang_release, sorted({m.__name__ for m in ROUTE_BODIES.values()}))


@functools.cache
def _adapter(cls):
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def _sglang_parse(cls, body):
    import msgspec
    from pydantic import ValidationError

    try:
        return msgspec.structs.asdict(_adapter(cls).validate_python(body))
    except ValidationError:
        return None


def _ours(model, body):
    try:
        return parse_body(model, body, "route").model_dump()
    except BodyError:
        return None


@pytest.mark.parametrize("route", sorted(ROUTE_BODIES))
def test_route_bodies_parse_as_sglangs_request_classes(route, sglang_classes):
    import msgspec

    model = ROUTE_BODIES[route]
    theirs = sglang_classes[model.__name__]
    fields = [f.name for f in msgspec.structs.fields(theirs)]
    assert sorted(fields) == sorted(model.model_fields), route
    required = {k: v for k, v in REQUIRED.items() if k in fields}
    base = _sglang_parse(theirs, required)
    assert base is not None and _ours(model, required) == base  # defaults agree
    refused = 0
    for field in fields:
        for value in CORPUS:
            body = {**required, field: value}
            expected = _sglang_parse(theirs, body)
            assert _ours(model, body) == expected, (route, field, value, expected)
            refused += expected is None
    assert refused > len(fields)  # the corpus reaches refusals in every route
    if route == "/abort_request":  # the case: "false" asks for nothing
        assert _ours(model, {"abort_all": "false"})["abort_all"] is False
