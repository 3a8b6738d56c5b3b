"""Engine client: SGLang's HTTP API (real SGLang or the built-in engine), sync and async.

See ``docs/engine-client.md``. The endpoints are written once
(:class:`~miles_core.engine.endpoints.EngineEndpoints`) and sent by either transport.
"""

from miles_core.engine.async_client import AsyncEngineClient
from miles_core.engine.client import EngineClient
from miles_core.engine.errors import EngineConnectionError, EngineError, EngineTimeoutError
from miles_core.engine.payloads import SamplingParams, decode_routed_experts

__all__ = [
    "AsyncEngineClient",
    "EngineClient",
    "EngineConnectionError",
    "EngineError",
    "EngineTimeoutError",
    "SamplingParams",
    "decode_routed_experts",
]
