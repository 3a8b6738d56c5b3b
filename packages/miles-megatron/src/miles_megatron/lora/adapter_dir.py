"""Plain PEFT LoRA adapter directories, read and written without importing peft.

A directory holds ``adapter_config.json`` and ``adapter_model.safetensors``; tensors are named
as PEFT's ``save_pretrained`` names them for a causal LM::

    base_model.model.<HF module>.lora_A.weight   [r, in_features]
    base_model.model.<HF module>.lora_B.weight   [out_features, r]

with ``<HF module>`` the HF checkpoint's module name (``model.layers.0.self_attn.q_proj``).
The layer computes ``y = x W^T + (lora_alpha / r) * x A^T B^T``. Only plain LoRA is accepted:
DoRA, rsLoRA, trained biases, ``modules_to_save``, per-module rank/alpha patterns and
``layers_to_transform`` are rejected naming the file and field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from miles_core.args import ArgumentError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
FACTORS = ("lora_A", "lora_B")


class AdapterDirError(ValueError):
    """A PEFT adapter directory cannot be used; the message names the file and field."""


def peft_key(hf_module: str, factor: str) -> str:
    """``model.layers.0.self_attn.q_proj``, ``lora_A`` -> PEFT's safetensors key."""
    return f"{PEFT_PREFIX}{hf_module}.{factor}.weight"


def split_peft_key(key: str) -> tuple[str, str] | None:
    """PEFT key -> ``(hf_module, "lora_A" | "lora_B")``; None when it is not a LoRA factor."""
    short = key.removeprefix(PEFT_PREFIX)
    for factor in FACTORS:
        suffix = f".{factor}.weight"
        if short.endswith(suffix):
            return short[: -len(suffix)], factor
    return None


@dataclass(frozen=True)
class AdapterDir:
    """A PEFT LoRA adapter: its config fields and full (unsharded) factors per HF module."""

    path: Path
    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]  # a regex (PEFT's string form) or module-name suffixes
    factors: dict[str, dict[str, torch.Tensor]] = field(repr=False)  # hf_module -> {lora_A, lora_B}

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _reject(cfg: dict[str, Any], config_file: Path) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterDirError(f"{config_file}: peft_type {cfg['peft_type']!r} is not LORA")
    for key, what in (
        ("use_dora", "DoRA adapters"),
        ("use_rslora", "rsLoRA scaling"),
        ("modules_to_save", "modules_to_save"),
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
        ("layers_to_transform", "layers_to_transform"),
        ("exclude_modules", "exclude_modules"),
        ("target_parameters", "target_parameters"),
    ):
        if cfg.get(key):
            raise AdapterDirError(f"{config_file}: {key} is set ({what} are not supported)")
    if cfg.get("bias", "none") != "none":
        raise AdapterDirError(f"{config_file}: bias={cfg['bias']!r} (trained biases unsupported)")
    if cfg.get("fan_in_fan_out"):
        raise AdapterDirError(f"{config_file}: fan_in_fan_out is set (Conv1D layouts unsupported)")


def read_adapter_dir(path: str | Path) -> AdapterDir:
    """Read and check a PEFT adapter directory."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise AdapterDirError(f"{config_file}: missing (not a PEFT adapter directory)")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterDirError(f"{config_file}: invalid JSON ({exc})") from exc
    _reject(cfg, config_file)
    for key in ("r", "lora_alpha", "target_modules"):
        if cfg.get(key) is None:
            raise AdapterDirError(f"{config_file}: no {key}")
    weights_file = path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise AdapterDirError(f"{weights_file}: missing")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        parsed = split_peft_key(key)
        if parsed is None:
            raise AdapterDirError(f"{weights_file}: unexpected tensor {key} (plain LoRA only)")
        factors.setdefault(parsed[0], {})[parsed[1]] = tensor
    rank = int(cfg["r"])
    for module, pair in factors.items():
        if set(pair) != set(FACTORS):
            raise AdapterDirError(f"{weights_file}: {module} lacks lora_A or lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterDirError(
                f"{weights_file}: {module} has lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; "
                f"r={rank} needs [r, in] and [out, r]"
            )
    targets = cfg["target_modules"]
    return AdapterDir(
        path=path,
        rank=rank,
        alpha=float(cfg["lora_alpha"]),
        target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
        factors=factors,
    )


def check_matches_flags(adapter: AdapterDir, rank: int, alpha: float) -> None:
    """``--lora-adapter-path``'s ``r`` / ``lora_alpha`` must equal ``--lora-rank`` / ``--lora-alpha``."""
    if adapter.rank != rank or adapter.alpha != float(alpha):
        raise ArgumentError(
            f"{adapter.path / ADAPTER_CONFIG}: r={adapter.rank}, lora_alpha={adapter.alpha:g}, "
            f"but --lora-rank {rank} --lora-alpha {float(alpha):g}: pass "
            f"--lora-rank {adapter.rank} --lora-alpha {adapter.alpha:g}"
        )


def write_adapter_dir(
    path: str | Path,
    factors: dict[str, dict[str, torch.Tensor]],
    rank: int,
    alpha: float,
    target_modules: list[str],
    dropout: float = 0.0,
    base_model: str | None = None,
) -> Path:
    """Write ``factors`` (hf_module -> {lora_A, lora_B}, full tensors) as a PEFT directory.

    ``target_modules`` is written as the module-name suffixes the adapter covers, which is how
    PEFT records a resolved ``all-linear``; ``PeftModel.from_pretrained`` loads the result.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        peft_key(module, factor): pair[factor].detach().cpu().contiguous()
        for module, pair in sorted(factors.items())
        for factor in FACTORS
    }
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path
