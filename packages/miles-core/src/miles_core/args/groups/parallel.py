"""Model-parallel sizes. Backends without a dimension reject sizes > 1 in their own group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from miles_core.args.checks import at_least
from miles_core.args.flags import ArgGroup, flag
from miles_core.args.parsed import ParsedArgs

PARALLEL_SIZE_DESTS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


@dataclass(frozen=True)
class ParallelArgs(ArgGroup):
    title: ClassVar[str] = "parallel sizes"

    tensor_model_parallel_size: int = flag(
        1, metavar="TP", common=True, help="Tensor-parallel size."
    )
    pipeline_model_parallel_size: int = flag(
        1, metavar="PP", common=True, help="Pipeline-parallel size."
    )
    context_parallel_size: int = flag(
        1,
        metavar="CP",
        common=True,
        help="Context-parallel size (the token budget is CP x --max-tokens-per-gpu).",
    )
    expert_model_parallel_size: int = flag(1, metavar="EP", help="Expert-parallel size.")
    expert_tensor_parallel_size: int | None = flag(
        None,
        metavar="ETP",
        help="Tensor-parallel size inside experts (unset: --tensor-model-parallel-size).",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        for dest in PARALLEL_SIZE_DESTS:
            at_least(args, dest, 1)

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        if args.expert_tensor_parallel_size is None:
            args.expert_tensor_parallel_size = args.tensor_model_parallel_size
