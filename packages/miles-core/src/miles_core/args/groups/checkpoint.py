"""Model input and checkpoint flags (the shared layout is ``miles_core.checkpoint_layout``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from miles_core.args.checks import at_least, requires
from miles_core.args.flags import ArgGroup, ArgumentError, flag
from miles_core.args.parsed import ParsedArgs


@dataclass(frozen=True)
class CheckpointArgs(ArgGroup):
    title: ClassVar[str] = "model and checkpoints"

    hf_checkpoint: str | None = flag(
        None,
        metavar="DIR",
        common=True,
        help="HuggingFace model directory (config, tokenizer, weights): the model the engines "
        "boot from, and the whole model input of the FSDP backend.",
    )
    attn_implementation: (
        Literal["flash_attention_2", "flash_attention_3", "varlen", "sdpa", "eager"] | None
    ) = flag(
        None,
        help="How packed rows attend. varlen: torch's varlen flash kernel over the samples' "
        "boundaries, no mask; sdpa: SDPA with a block-diagonal causal mask. FSDP also takes "
        "flash_attention_2/3 and eager (unset: flash_attention_2 when flash_attn imports on a "
        "GPU, else varlen on a GPU whose torch ships it, else sdpa); Megatron takes varlen and "
        "sdpa (unset: varlen on such a GPU, else sdpa).",
    )
    compile_decoder_layers: bool = flag(
        False,
        help="torch.compile (inductor) each decoder layer's forward, every role's, on either "
        "backend: fuses the elementwise work between the matmuls (norms, RoPE, SiLU x mul, "
        "residuals, casts); attention stays eager. A layer whose compilation fails runs eagerly "
        "after one warning.",
    )
    save: str | None = flag(
        None, metavar="DIR", common=True, help="Directory to write checkpoints into."
    )
    load: str | None = flag(
        None,
        metavar="DIR",
        common=True,
        help="Checkpoint directory to resume from: the parent of the iter_* directories, never "
        "one iteration (latest_checkpointed_iteration.txt picks the step).",
    )
    save_interval: int | None = flag(
        None, metavar="N", common=True, help="Save every N rollouts (requires --save)."
    )
    ckpt_step: int | None = flag(
        None,
        metavar="ITER",
        help="Load this iteration from --load instead of the tracker's latest.",
    )
    save_optim: bool = flag(
        True, help="Save optimizer and LR-scheduler state (--no-save-optim skips both)."
    )
    load_optim: bool = flag(
        True,
        help="Load optimizer state (--no-load-optim skips AdamW only; a saved LR scheduler is "
        "still restored).",
    )
    load_rng: bool = flag(True, help="Restore the RNG states saved with the checkpoint.")
    async_save: bool = flag(False, help="Write checkpoints asynchronously.")
    save_trigger_sentinel: str | None = flag(
        None,
        metavar="PATH",
        help="Creating this file requests a save at the next save point; it is deleted once the "
        "checkpoint is durable (requires --save).",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        requires(args, "save_trigger_sentinel", "save")
        requires(args, "save_interval", "save")
        requires(args, "async_save", "save")
        at_least(args, "save_interval", 1)
        at_least(args, "ckpt_step", 0)
        if args.ckpt_step is not None and not args.load:
            raise ArgumentError("--ckpt-step requires --load")

    @classmethod
    def check_paths(cls, args: ParsedArgs) -> None:
        if args.hf_checkpoint is not None and not Path(args.hf_checkpoint).is_dir():
            raise ArgumentError(f"--hf-checkpoint {args.hf_checkpoint}: no such directory")
        if args.ckpt_step is not None and not Path(args.load).is_dir():
            raise ArgumentError(f"--load {args.load}: no such directory (--ckpt-step given)")
