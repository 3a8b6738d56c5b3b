"""The contract between a training backend and everything above it.

A backend owns the model on the accelerator. The launcher wraps one instance per trainer rank
(in a Ray actor, or under plain ``torchrun``) and drives it only through these methods; rollout,
reward, the RL loop and engine placement never reach below this line. See docs/contract.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # miles_core.args imports miles_core.backends, which imports this module
    from miles_core.args.parsed import ParsedArgs


@dataclass(frozen=True)
class DataLayout:
    """How this rank takes part in consuming a rollout's data.

    ``dp_rank``/``dp_size`` place the rank in the data-parallel dimension: the launcher splits a
    rollout into ``dp_size`` shards and hands shard ``dp_rank`` to this rank. Ranks that share a
    data-parallel rank (Megatron's TP/CP peers, PP stages) receive the same shard; only the rank
    with ``consumes_data`` reads it (the others receive it through their own collectives).
    """

    dp_rank: int
    dp_size: int
    consumes_data: bool = True

    def __post_init__(self) -> None:
        for name in ("dp_rank", "dp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DataLayout.{name} must be an int, got {value!r}")
        if not isinstance(self.consumes_data, bool):
            raise TypeError(f"DataLayout.consumes_data must be a bool, got {self.consumes_data!r}")
        if self.dp_size < 1:
            raise ValueError(f"DataLayout.dp_size must be >= 1, got {self.dp_size}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"DataLayout.dp_rank {self.dp_rank} outside [0, {self.dp_size})")


class TrainBackend(ABC):
    """One trainer rank's backend. Every method may be called on every rank, in lock step.

    Methods raise on failure; collectives carry timeouts so a failure never becomes a hang, and
    the launcher tears all ranks down when one raises.
    """

    #: Name of the backend (the ``--train-backend`` value and its ``miles.backends`` entry point).
    name: str = ""

    @classmethod
    def arg_groups(cls) -> Sequence[type]:
        """Dataclass argument groups this backend declares (only flags it alone owns)."""
        return ()

    @abstractmethod
    def init(self, args: ParsedArgs, role: str = "actor") -> int:
        """Build model, optimizer and parallel layout for ``role`` ("actor" or "critic") from the
        parsed command line (``args.run_config`` holds its groups, typed).

        The process group and device are already set up. Returns the next rollout id: 0 for a
        fresh run, or the saved ``next_rollout_id`` when ``--load`` resumes a checkpoint.
        """

    @abstractmethod
    def data_layout(self) -> DataLayout:
        """This rank's place in the data-parallel dimension (see :class:`DataLayout`)."""

    @abstractmethod
    def train(self, rollout_id: int, batch: Any) -> dict[str, float]:
        """Consume one rollout's data shard and take its optimizer steps; return metrics."""

    @abstractmethod
    def compute_values(self, batch: Any) -> list[Any]:
        """The critic's per-sample values of this rank's shard ``batch``, before this rollout's
        update: one float32 CPU tensor per sample, response-aligned, in ``batch``'s order.

        Called on the ``"critic"`` role only (``--use-critic``), before its :meth:`train`;
        collective over the critic's ranks. An actor raises ``ValueError``.
        """

    @abstractmethod
    def update_weights(self, engines: Sequence[Any], weights: str | None = None) -> None:
        """Publish weights to ``engines``: ``weights`` ``"actor"`` (the current ones) or
        ``"ema"`` (the EMA's, ``--use-ema``); None: ``--rollout-weights``. A backend without
        the named weights raises ``ValueError``; the critic never publishes (``ValueError``).

        (Re)connects to the engines when their set changed since the previous call.
        """

    @abstractmethod
    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """Write a checkpoint of ``rollout_id``; with ``force_sync`` it is durable on return."""

    @abstractmethod
    def sleep(self) -> None:
        """Move model and optimizer state off the accelerator (to host or disk). Idempotent."""

    @abstractmethod
    def wake_up(self) -> None:
        """Bring back what :meth:`sleep` moved. Idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Release process groups, files and engine connections."""
