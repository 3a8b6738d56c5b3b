"""The actor's LoRA under ``--use-lora``: injection at init, resume checks, publish and export.

* init: the base is read from ``--hf-checkpoint`` (always: checkpoints hold adapters only),
  adapters are attached and filled from ``--lora-adapter-path`` (its ``r`` / ``lora_alpha``
  must equal ``--lora-rank`` / ``--lora-alpha``; its ``target_modules`` decide the targets) or
  freshly initialised from ``--seed``, and the base is frozen before DDP, so only the adapters
  are in the gradient buffers and the distributed optimizer.
* checkpoints: adapter-only torch_dist (:mod:`miles_megatron.lora.checkpoint`); meta.json's
  ``extra["lora"]`` records ``rank`` / ``alpha`` / ``target_modules``, checked on resume.
* publish: merged ``W + (alpha / r) B A`` under the base's HF names (default), or with
  ``--publish-lora-adapter`` the adapter's PEFT-named factors.
* export: :meth:`ActorLoRA.export` writes a PEFT directory (``PeftModel.from_pretrained``
  and the FSDP backend's ``--lora-adapter-path`` load it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from miles_core.args import ArgumentError
from miles_core.args.parsed import ParsedArgs
from miles_core.peft_adapter import (
    PeftAdapter,
    check_matches_flags,
    read_peft_adapter,
    write_peft_adapter,
)

from miles_megatron.lora.checkpoint import adapter_sharded_state_dict
from miles_megatron.lora.layers import LoRAConfig, init_fresh, inject_lora
from miles_megatron.lora.weights import gather_factors, load_factors, merge_into_hf

META_KEY = "lora"

Reader = Callable[[torch.Tensor], torch.Tensor] | None


class ActorLoRA:
    """The adapters of this rank's model and what the backend does with them."""

    def __init__(self, config: LoRAConfig, injected: list, margs: dict, base_model: str) -> None:
        self.config = config
        self.injected = injected
        self.num_experts = margs.get("num_experts")
        self.base_model = base_model

    @classmethod
    def attach(
        cls,
        args: ParsedArgs,
        model: torch.nn.Module,
        bridge: Any,
        margs: dict,
        resume_extra: dict[str, Any] | None = None,
    ) -> ActorLoRA:
        """Inject into ``model`` (base already loaded, before DDP) and fill the adapters.

        ``resume_extra`` (meta.json ``extra`` of the checkpoint being resumed) is checked
        against the flags and decides the targets; its adapter values are loaded afterwards
        with the optimizer state.
        """
        config = LoRAConfig.from_roles(args.run_config.roles)
        adapter = None
        if resume_extra is not None:
            saved = cls.check_resume(config, resume_extra, args.load)
            targets = saved["target_modules"]
            targets = targets if isinstance(targets, str) else tuple(targets)
            config = dataclasses.replace(config, target_modules=targets)
        elif args.lora_adapter_path:
            adapter = read_peft_adapter(args.lora_adapter_path[0])  # one component: the model
            check_matches_flags(adapter, args.lora_rank, args.lora_alpha)
            config = dataclasses.replace(config, target_modules=adapter.target_modules)
        try:
            injected = inject_lora(model, bridge, margs, config)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from exc
        if adapter is not None:
            load_factors(injected, adapter)
        else:
            init_fresh(injected, seed=args.seed)
        return cls(config, injected, margs, args.hf_checkpoint)

    # ---------------------------------------------------------------- checkpoints
    def sharded_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        return adapter_sharded_state_dict(model, self.num_experts)

    def meta(self) -> dict[str, Any]:
        targets = self.config.target_modules
        return {
            "rank": self.config.rank,
            "alpha": self.config.alpha,
            "target_modules": targets if isinstance(targets, str) else list(targets),
        }

    @staticmethod
    def check_resume(config: LoRAConfig, extra: dict[str, Any], load_dir: str) -> dict[str, Any]:
        """A resumed checkpoint must be adapter-only with the flags' rank and alpha."""
        saved = extra.get(META_KEY)
        if saved is None:
            raise ArgumentError(
                f"--load {load_dir}: not a LoRA checkpoint (saved without --use-lora); "
                "start LoRA from --hf-checkpoint (and --lora-adapter-path)"
            )
        if saved["rank"] != config.rank or float(saved["alpha"]) != config.alpha:
            raise ArgumentError(
                f"--load {load_dir}: adapters of r={saved['rank']}, lora_alpha="
                f"{float(saved['alpha']):g}, but --lora-rank {config.rank} --lora-alpha "
                f"{config.alpha:g}: pass --lora-rank {saved['rank']} --lora-alpha "
                f"{float(saved['alpha']):g}"
            )
        return saved

    # ---------------------------------------------------------------- weights
    # ``read`` (here and below): each local factor's values on the device, for a sleeping
    # model (:meth:`~miles_megatron.sleep_wake.SleepWake.read`); None: the parameters.
    def factors(self, read: Reader = None) -> dict[str, dict[str, torch.Tensor]]:
        """Full factors by HF module (collective over TP/EP)."""
        return gather_factors(self.injected, self.num_experts, read)

    def merged(
        self, hf_weights: Iterable[tuple[str, torch.Tensor]], read: Reader = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The base's HF weights with ``(alpha / r) B A`` merged in (collective)."""
        yield from merge_into_hf(hf_weights, self.factors(read), self.config.scale)

    def adapter_weights(self, read: Reader = None) -> Iterator[tuple[str, torch.Tensor]]:
        """PEFT-named full factors (``base_model.model.<module>.lora_A.weight``; collective)."""
        yield from self.peft_adapter(read).peft_tensors().items()

    def peft_adapter(self, read: Reader = None) -> PeftAdapter:
        """The adapter with its full factors (collective); its ``target_modules`` are the
        module-name suffixes it covers, which is how PEFT records a resolved ``all-linear``."""
        factors = self.factors(read)
        return PeftAdapter(
            rank=self.config.rank,
            alpha=self.config.alpha,
            target_modules=tuple(sorted({m.rsplit(".", 1)[-1] for m in factors})),
            factors=factors,
            dropout=self.config.dropout,
            base_model=self.base_model,
        )

    def export(self, out_dir: str | Path, read: Reader = None) -> Path:
        """Write the adapter as a PEFT directory from global rank 0 (collective)."""
        adapter = self.peft_adapter(read)
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_peft_adapter(out_dir, adapter)
        if dist.is_initialized():
            dist.barrier()
        return Path(out_dir)
