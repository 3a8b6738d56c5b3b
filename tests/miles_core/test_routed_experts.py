"""Decoding SGLang's routed-experts field (base64 of little-endian int32)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from miles_core.engine import decode_routed_experts


def test_decode_routed_experts_round_trip():
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 64, size=(5, 3, 2), dtype=np.int32)
    # SGLang's wire form: base64 of the raw little-endian int32 bytes.
    encoded = base64.b64encode(experts.astype("<i4").tobytes()).decode()
    decoded = decode_routed_experts(encoded, num_layers=3, topk=2)
    assert decoded.dtype == np.int32 and decoded.shape == (5, 3, 2)
    np.testing.assert_array_equal(decoded, experts)
    assert decoded[4, 2, 1] == experts.reshape(-1)[-1]


def test_decode_routed_experts_rejects_bad_input():
    with pytest.raises(ValueError, match="not a multiple of"):
        decode_routed_experts(base64.b64encode(b"\0" * 20).decode(), num_layers=3, topk=2)
    with pytest.raises(ValueError, match="not valid base64"):
        decode_routed_experts("%%%", num_layers=1, topk=1)
    assert decode_routed_experts("", num_layers=2, topk=2).shape == (0, 2, 2)
