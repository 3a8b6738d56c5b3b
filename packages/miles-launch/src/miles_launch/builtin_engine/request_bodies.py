"""The request bodies of the built-in engine's control routes, typed as SGLang types them.

SGLang parses each body into an ``io_struct`` request class (a msgspec struct validated through
a pydantic-core schema built from its field types, unknown keys ignored): pydantic's *lax*
mode, so ``"false"``, ``"0"``, ``"no"`` and ``0`` are False, ``"7"`` and ``7.0`` are the int 7,
while ``"maybe"``, ``2`` or a number where a string belongs are refused (400). Each model
here has SGLang's field names, types and defaults (``tests/data/sglang_schema.json`` lists
the names; the semantics are tested against the released wheel's classes). Fields SGLang
reads that the built-in engine has no use for (``selector``, ``torch_empty_cache``,
``is_async``, ...) are parsed with their types and otherwise ignored.

:func:`parse_body` turns a :class:`pydantic.ValidationError` into a :class:`BodyError` whose
message names the field.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)


class BodyError(ValueError):
    """A request body SGLang would refuse (answered with 400, naming the field)."""


def _base64(value: Any) -> Any:
    """SGLang's ``Base64Bytes``: base64 text (or lists of it) decoded to bytes."""
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise ValueError("Expected base64-encoded bytes") from exc
    if isinstance(value, (list, tuple)):
        return type(value)(_base64(item) for item in value)
    return value


class _Body(BaseModel):
    """SGLang's ``BaseReq`` fields; unknown keys are ignored, as SGLang's schema ignores them."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rid: str | None = None
    http_worker_ipc: str | None = None


_Selector = Literal["target", "draft", "all"]


class AbortReq(_Body):
    rid: Annotated[str | None, AfterValidator(lambda rid: rid or "")] = Field(
        None, validate_default=True
    )  # SGLang's __post_init__: no rid is ""
    abort_all: bool = False
    finished_reason: Any = None
    abort_message: str | None = None
    weight_versions: Any = None


class PauseGenerationReqInput(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Body):
    torch_empty_cache: bool = True


class UpdateWeightFromDiskReqInput(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class UpdateWeightsFromTensorReqInput(_Body):
    serialized_named_tensors: Annotated[list[bytes], BeforeValidator(_base64)]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: _Selector = "all"
    torch_empty_cache: bool = False


class UpdateWeightsFromDistributedReqInput(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: _Selector = "all"
    torch_empty_cache: bool = False


class InitWeightsUpdateGroupReqInput(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Body):
    group_name: str = "weight_update_group"


class UpdateWeightVersionReqInput(_Body):
    new_version: str
    abort_all_requests: bool = True


class GetWeightsByNameReqInput(_Body):
    name: str
    truncate_size: int = 100


class ReleaseMemoryOccupationReqInput(_Body):
    tags: list[str] | None = None


class ResumeMemoryOccupationReqInput(_Body):
    tags: list[str] | None = None


class BeginWeightUpdateReqInput(_Body):
    selector: _Selector = "all"


class EndWeightUpdateReqInput(_Body):
    pass


#: The model of each control route's body (SGLang's request class of the same name).
ROUTE_BODIES: dict[str, type[_Body]] = {
    "/abort_request": AbortReq,
    "/pause_generation": PauseGenerationReqInput,
    "/continue_generation": ContinueGenerationReqInput,
    "/update_weights_from_disk": UpdateWeightFromDiskReqInput,
    "/update_weights_from_tensor": UpdateWeightsFromTensorReqInput,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedReqInput,
    "/init_weights_update_group": InitWeightsUpdateGroupReqInput,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupReqInput,
    "/update_weight_version": UpdateWeightVersionReqInput,
    "/get_weights_by_name": GetWeightsByNameReqInput,
    "/release_memory_occupation": ReleaseMemoryOccupationReqInput,
    "/resume_memory_occupation": ResumeMemoryOccupationReqInput,
    "/begin_weight_update": BeginWeightUpdateReqInput,
    "/end_weight_update": EndWeightUpdateReqInput,
}

B = TypeVar("B", bound=_Body)


def parse_body(model: type[B], body: dict, where: str) -> B:
    """``body`` as a ``model``; a refusal is one line naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        message = f"{where}: field {field}: {first['msg']}"
    raise BodyError(message)
