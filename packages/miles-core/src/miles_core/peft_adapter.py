"""Plain PEFT LoRA adapter directories, read and written without importing peft.

A directory holds ``adapter_config.json`` and ``adapter_model.safetensors``; tensors are named
as PEFT's ``save_pretrained`` names them for a causal LM::

    base_model.model.<HF module>.lora_A.weight   [r, in_features]
    base_model.model.<HF module>.lora_B.weight   [out_features, r]

with ``<HF module>`` the HF checkpoint's module name (``model.layers.0.self_attn.q_proj``).
An adapted linear computes ``y = x W^T + (lora_alpha / r) * x A^T B^T``; merged, its weight is
``W + (lora_alpha / r) * B @ A``.

Only plain LoRA is accepted: DoRA, rsLoRA, trained biases, ``modules_to_save``, per-module
rank/alpha patterns, ``layers_to_transform``, ``exclude_modules``, ``target_parameters`` and
Conv1D (``fan_in_fan_out``) layouts are rejected, naming the file and the field. Both backends
(miles-fsdp and miles-megatron) read and write adapters through this module, so a directory
one writes the other (and ``peft.PeftModel.from_pretrained``) loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from miles_core.args import ArgumentError
from miles_core.args.groups import RolesArgs

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
FACTORS = ("lora_A", "lora_B")
ALL_LINEAR = "all-linear"

Factors = dict[str, dict[str, torch.Tensor]]  # HF module -> {"lora_A": A, "lora_B": B}

# config fields that change what the adapter computes; set (truthy) -> rejected
_UNSUPPORTED = (
    ("use_dora", "DoRA adapters"),
    ("use_rslora", "rsLoRA scaling"),
    ("modules_to_save", "modules_to_save"),
    ("rank_pattern", "per-module ranks"),
    ("alpha_pattern", "per-module alphas"),
    ("layers_to_transform", "layers_to_transform"),
    ("exclude_modules", "exclude_modules"),
    ("target_parameters", "target_parameters"),
    ("fan_in_fan_out", "Conv1D (fan_in_fan_out) layouts"),
)


@dataclass(frozen=True)
class LoRAConfig:
    """``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-target-modules``: what both
    backends inject.

    ``target_modules`` follows PEFT: ``("all-linear",)``, module-name suffixes (a module
    ``model.layers.0.self_attn.q_proj`` matches ``q_proj``), or (from a loaded adapter's config)
    one regex string matched in full. Made by :meth:`from_roles` (the defaults are the roles
    group's) or from a loaded adapter.
    """

    rank: int
    alpha: float
    dropout: float
    target_modules: str | tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_roles(cls, roles: RolesArgs) -> LoRAConfig:
        """The LoRA flags of the parsed roles group (``args.run_config.roles``)."""
        return cls(
            rank=roles.lora_rank,
            alpha=float(roles.lora_alpha),
            dropout=roles.lora_dropout,
            target_modules=tuple(roles.lora_target_modules),
        )

    def with_targets(self, target_modules: str | tuple[str, ...]) -> LoRAConfig:
        """These flags with another target set (a loaded adapter's, so its weights fit)."""
        return dataclasses.replace(self, target_modules=target_modules)


class PeftAdapterError(ValueError):
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
class PeftAdapter:
    """A plain LoRA adapter: PEFT's config fields and its full (unsharded) factors.

    ``rank`` / ``alpha`` / ``dropout`` / ``base_model`` are PEFT's ``r`` / ``lora_alpha`` /
    ``lora_dropout`` / ``base_model_name_or_path``. ``target_modules`` is PEFT's string form (a
    regex matched in full, or ``"all-linear"``) or a sorted tuple of module-name suffixes.
    ``path`` is the directory it was read from (None for one built in memory).
    """

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]
    factors: Factors = field(repr=False)
    dropout: float = 0.0
    base_model: str | None = None
    path: Path | None = None

    @property
    def scale(self) -> float:
        """``lora_alpha / r``: the factor of ``B @ A`` in the adapted weight."""
        return self.alpha / self.rank

    @property
    def config_file(self) -> Path:
        return (self.path or Path(".")) / ADAPTER_CONFIG

    @property
    def weights_file(self) -> Path:
        return (self.path or Path(".")) / ADAPTER_WEIGHTS

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        """The factors under PEFT's keys, modules in sorted order, ``lora_A`` before ``lora_B``."""
        return {
            peft_key(module, factor): pair[factor]
            for module, pair in sorted(self.factors.items())
            for factor in FACTORS
        }


def _check_config(cfg: Any, config_file: Path) -> None:
    if not isinstance(cfg, dict):
        raise PeftAdapterError(f"{config_file}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise PeftAdapterError(f"{config_file}: peft_type {cfg['peft_type']!r} is not LORA")
    for key, what in _UNSUPPORTED:
        if cfg.get(key):
            raise PeftAdapterError(f"{config_file}: {key} is set ({what} are not supported)")
    if cfg.get("bias", "none") != "none":
        raise PeftAdapterError(
            f"{config_file}: bias={cfg['bias']!r} (trained biases are not supported)"
        )
    for key in ("r", "lora_alpha", "target_modules"):
        if cfg.get(key) is None:
            raise PeftAdapterError(f"{config_file}: no {key}")
    rank = cfg["r"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise PeftAdapterError(f"{config_file}: r={rank!r} is not a positive integer")
    alpha = cfg["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise PeftAdapterError(f"{config_file}: lora_alpha={alpha!r} is not a number")
    targets = cfg["target_modules"]
    if not isinstance(targets, str) and not (
        isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)
    ):
        raise PeftAdapterError(
            f"{config_file}: target_modules={targets!r} is neither a string nor a list of names"
        )


def check_factors(factors: Factors, rank: int, weights_file: Path) -> None:
    """Every module has a 2-D ``lora_A`` of shape ``[r, in]`` and ``lora_B`` of ``[out, r]``."""
    for module, pair in factors.items():
        if set(pair) != set(FACTORS):
            raise PeftAdapterError(f"{weights_file}: {module} lacks lora_A or lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise PeftAdapterError(
                f"{weights_file}: {module} has lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; "
                f"r={rank} needs [r, in] and [out, r]"
            )


def read_peft_adapter(path: str | Path) -> PeftAdapter:
    """Read and check a PEFT adapter directory (``save_pretrained`` output, or ours)."""
    path = Path(path)
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise PeftAdapterError(f"{config_file}: missing (not a PEFT adapter directory)")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise PeftAdapterError(f"{config_file}: invalid JSON ({exc})") from exc
    _check_config(cfg, config_file)
    weights_file = path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise PeftAdapterError(f"{weights_file}: missing")
    try:
        tensors = load_file(str(weights_file))
    except SafetensorError as exc:
        raise PeftAdapterError(f"{weights_file}: unreadable safetensors ({exc})") from exc
    factors: Factors = {}
    for key, tensor in tensors.items():
        parsed = split_peft_key(key)
        if parsed is None:
            raise PeftAdapterError(f"{weights_file}: unexpected tensor {key} (plain LoRA only)")
        factors.setdefault(parsed[0], {})[parsed[1]] = tensor
    if not factors:
        raise PeftAdapterError(f"{weights_file}: no LoRA factors")
    rank = cfg["r"]
    check_factors(factors, rank, weights_file)
    targets = cfg["target_modules"]
    return PeftAdapter(
        rank=rank,
        alpha=float(cfg["lora_alpha"]),
        target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
        factors=factors,
        dropout=float(cfg.get("lora_dropout") or 0.0),
        base_model=cfg.get("base_model_name_or_path"),
        path=path,
    )


def peft_config(adapter: PeftAdapter) -> dict[str, Any]:
    """``adapter_config.json`` of ``adapter``: what ``LoraConfig.from_pretrained`` reads."""
    targets = adapter.target_modules
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": adapter.base_model,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": adapter.dropout,
        "target_modules": targets if isinstance(targets, str) else sorted(targets),
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


def _foreign_entries(path: Path) -> list[str]:
    """What an existing ``path`` holds besides an adapter (PEFT also writes a README.md)."""
    if not path.is_dir():
        return [path.name]
    ours = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md")
    return sorted(p.name for p in path.iterdir() if p.name not in ours)


def write_peft_adapter(path: str | Path, adapter: PeftAdapter) -> Path:
    """Write ``adapter`` as a PEFT directory at ``path``, atomically; returns ``path``.

    Both files are written into a temporary sibling directory that is then renamed to
    ``path``, so ``path`` never holds a half-written adapter (while an existing one is being
    replaced, ``path`` is absent between two renames). An existing adapter directory at
    ``path`` is replaced; any other existing ``path`` (a file, or a directory holding other
    files) is refused rather than deleted.
    """
    path = Path(path)
    check_factors(adapter.factors, adapter.rank, path / ADAPTER_WEIGHTS)
    foreign = _foreign_entries(path) if path.exists() else []
    if foreign:
        raise PeftAdapterError(
            f"{path}: exists and is not an adapter directory ({foreign[0]}); refusing to replace it"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tensors = {k: t.detach().cpu().contiguous() for k, t in adapter.peft_tensors().items()}
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(adapter), indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; an adapter directory is not
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            path.rename(old / path.name)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def check_matches_flags(adapter: PeftAdapter, rank: int, alpha: float) -> None:
    """``--lora-adapter-path``'s ``r`` / ``lora_alpha`` must equal ``--lora-rank`` /
    ``--lora-alpha`` (an :class:`ArgumentError` naming the flags to pass)."""
    if adapter.rank != rank or adapter.alpha != float(alpha):
        raise ArgumentError(
            f"{adapter.config_file}: r={adapter.rank}, lora_alpha={adapter.alpha:g}, "
            f"but --lora-rank {rank} --lora-alpha {float(alpha):g}: pass "
            f"--lora-rank {adapter.rank} --lora-alpha {adapter.alpha:g}"
        )
