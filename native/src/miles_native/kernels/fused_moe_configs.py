"""Block sizes of the fused MoE kernels: dataclasses, defaults and the cached tuning table.

A :class:`FusedMoEConfig` holds one launch configuration per kernel. ``block_m`` is shared by
every kernel that walks the aligned rows (it is the padding granule of :mod:`moe_align`); the
two expert-weight-gradient kernels reduce over an expert's rows and have their own tiles.

Lookup order (:func:`get_config`): the tuning table for this device (``configs/<device>.json``,
written by ``scripts/tune_fused_moe.py``), keyed by the layer shape and dtype, taking the
token-count bucket nearest in log scale; otherwise the defaults for CUDA or for the Triton
interpreter (CPU). Table layout::

    {"device": "NVIDIA H200",
     "entries": {"E=128,H=2048,I=768,k=8,dtype=bfloat16": {"16384": <FusedMoEConfig dict>, ...}}}
"""

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class GemmConfig:
    """Tile of a row-blocked grouped GEMM (rows come from ``FusedMoEConfig.block_m``)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class WeightGradConfig:
    """Tile of an expert-weight-gradient kernel; ``block_k`` rows are reduced per step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FusedMoEConfig:
    block_m: int
    gate_up: GemmConfig  # forward x @ w1^T with the SiLU-and-mul epilogue
    down: GemmConfig  # forward act @ w2^T scaled by the routing weight
    down_bwd: GemmConfig  # backward dy @ w2 with the SiLU-and-mul backward epilogue
    dx: GemmConfig  # backward dh @ w1
    dw_gate_up: WeightGradConfig
    dw_down: WeightGradConfig

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "FusedMoEConfig":
        gemm = {"gate_up", "down", "down_bwd", "dx"}
        wgrad = {"dw_gate_up", "dw_down"}
        missing = ({"block_m"} | gemm | wgrad) - set(data)
        if missing:
            raise ValueError(f"fused MoE config lacks field(s) {sorted(missing)}")
        return cls(
            block_m=int(data["block_m"]),
            **{name: GemmConfig(**data[name]) for name in gemm},
            **{name: WeightGradConfig(**data[name]) for name in wgrad},
        )


def default_config(device_type: str, dtype: torch.dtype) -> FusedMoEConfig:
    """Untuned defaults: modest tiles for CUDA, tiny ones for the interpreter (fast on CPU)."""
    if device_type != "cuda":
        gemm = GemmConfig(block_n=32, block_k=32, num_warps=1, num_stages=1)
        wgrad = WeightGradConfig(block_m=32, block_n=32, block_k=16, num_warps=1, num_stages=1)
        return FusedMoEConfig(16, gemm, gemm, gemm, gemm, wgrad, wgrad)
    if dtype == torch.float32:
        gemm = GemmConfig(block_n=64, block_k=32, num_warps=4, num_stages=2)
        wgrad = WeightGradConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)
        return FusedMoEConfig(64, gemm, gemm, gemm, gemm, wgrad, wgrad)
    gemm = GemmConfig(block_n=128, block_k=64, num_warps=4, num_stages=3)
    wgrad = WeightGradConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return FusedMoEConfig(64, GemmConfig(64, 64, 4, 3), gemm, gemm, gemm, wgrad, wgrad)


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype) -> str:
    return (
        f"E={num_experts},H={hidden},I={inter},k={top_k},dtype={str(dtype).removeprefix('torch.')}"
    )


def device_table_path(device_name: str) -> Path:
    """``configs/<device name with spaces as underscores>.json``, e.g. ``NVIDIA_H200.json``."""
    return CONFIG_DIR / (device_name.replace(" ", "_") + ".json")


@functools.cache
def load_table(path: Path) -> dict[str, dict[int, FusedMoEConfig]]:
    """Read a tuning table; an absent file is an empty table."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return {
            key: {int(tokens): FusedMoEConfig.from_dict(cfg) for tokens, cfg in buckets.items()}
            for key, buckets in data["entries"].items()
        }
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"bad fused MoE tuning table {path}: {err}") from err


def save_table(path: Path, device_name: str, entries: dict[str, dict[int, FusedMoEConfig]]):
    """Write a tuning table (merging into what the file already holds)."""
    merged = {key: dict(buckets) for key, buckets in load_table(path).items()}
    for key, buckets in entries.items():
        merged.setdefault(key, {}).update(buckets)
    data = {
        "device": device_name,
        "entries": {
            key: {str(t): cfg.to_dict() for t, cfg in sorted(buckets.items())}
            for key, buckets in sorted(merged.items())
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    load_table.cache_clear()


def get_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device,
) -> FusedMoEConfig:
    """The tuned config for this shape on this device if the table has one, else the default."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        buckets = load_table(device_table_path(name)).get(
            shape_key(num_experts, hidden, inter, top_k, dtype)
        )
        if buckets:
            target = math.log(max(num_tokens, 1))
            nearest = min(buckets, key=lambda t: abs(math.log(t) - target))
            return buckets[nearest]
    return default_config(device.type, dtype)
