"""The rollout batch: one rollout's samples, validated once, as the backends consume them.

A :class:`Sample` is one prompt + response token sequence with what the rollout produced for it
(reward, loss mask, rollout log-probs, ...). Per-response-token tensors are *response-aligned*:
element ``j`` belongs to response token ``j``, i.e. to ``tokens[prompt_length + j]``.

A :class:`RolloutBatch` holds the samples of one rollout (or of one shard / micro-batch of it) and
remembers, in ``source_indices``, where each of its samples sits in the batch it was selected
from. Values the trainer computes later (old log-probs, reference log-probs, values, advantages,
returns) are attached as named response-aligned fields with :meth:`RolloutBatch.with_fields`; they
travel with the samples through :meth:`RolloutBatch.select`, partitioning and packing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch


class BatchError(ValueError):
    """A sample of a rollout batch is malformed; the message names the sample and the field."""


@dataclass(frozen=True)
class Sample:
    """One prompt + response sequence of a rollout.

    Attributes:
        tokens: int64 ``[L]``, prompt followed by response (``L = prompt_length + response_length``).
        response_length: number of response tokens at the end of ``tokens`` (``1..L-1``; the
            prompt has at least one token, which predicts the first response token).
        reward: scalar reward of the whole response.
        loss_mask: ``[response_length]``, 1 for response tokens that train (0 e.g. for tool output
            in multi-turn rollouts). Defaults to all ones.
        rollout_log_probs: ``[response_length]`` log-probs the inference engine reported (for TIS).
        teacher_log_probs: ``[response_length]`` log-probs of a teacher model (distillation).
        routed_experts: int ``[L or L - 1, num_layers, top_k]`` experts the engine routed each
            token to (routing replay). The engine never forwards the final token, so ``L - 1`` rows
            are accepted; packing fills the final row with zeros, which can only affect the last
            token's own output, and that predicts nothing.
        group_index: prompt group (the samples generated from one prompt share it).
        weight_version: version of the weights that generated the response, if known.
        fields: extra response-aligned tensors attached by the trainer (see ``with_fields``).
    """

    tokens: torch.Tensor
    response_length: int
    reward: float
    loss_mask: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    group_index: int = 0
    weight_version: int | None = None
    fields: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def total_length(self) -> int:
        return int(self.tokens.numel())

    @property
    def prompt_length(self) -> int:
        return self.total_length - self.response_length

    @property
    def mask(self) -> torch.Tensor:
        """The loss mask as float32 ``[response_length]`` (all ones when none was given)."""
        if self.loss_mask is None:
            return torch.ones(self.response_length, dtype=torch.float32)
        return self.loss_mask.to(torch.float32)


def _check_response_tensor(i: int, name: str, value: torch.Tensor | None, length: int) -> None:
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise BatchError(f"sample {i}: field '{name}' must be a torch.Tensor, got {type(value)}")
    if value.dim() != 1 or value.numel() != length:
        raise BatchError(
            f"sample {i}: field '{name}' has shape {tuple(value.shape)}, "
            f"expected [{length}] (one value per response token)"
        )
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise BatchError(f"sample {i}: field '{name}' contains NaN or inf")


def validate_sample(i: int, s: Sample) -> None:
    """Raise :class:`BatchError` naming sample ``i`` and the field when ``s`` is malformed."""
    if not isinstance(s.tokens, torch.Tensor) or s.tokens.dim() != 1:
        raise BatchError(f"sample {i}: field 'tokens' must be a 1-D tensor")
    if s.tokens.is_floating_point():
        raise BatchError(f"sample {i}: field 'tokens' must hold integer token ids")
    if not 1 <= s.response_length < s.total_length:
        raise BatchError(
            f"sample {i}: field 'response_length' is {s.response_length}, expected "
            f"1..{s.total_length - 1} (len(tokens) - 1: the prompt needs at least one token)"
        )
    if not math.isfinite(float(s.reward)):
        raise BatchError(f"sample {i}: field 'reward' is {s.reward}")
    _check_response_tensor(i, "loss_mask", s.loss_mask, s.response_length)
    if s.loss_mask is not None and not bool(((s.loss_mask == 0) | (s.loss_mask == 1)).all()):
        raise BatchError(f"sample {i}: field 'loss_mask' must contain only 0 and 1")
    _check_response_tensor(i, "rollout_log_probs", s.rollout_log_probs, s.response_length)
    _check_response_tensor(i, "teacher_log_probs", s.teacher_log_probs, s.response_length)
    for name, value in s.fields.items():
        _check_response_tensor(i, name, value, s.response_length)
    if s.routed_experts is not None:
        re = s.routed_experts
        if re.is_floating_point() or re.dim() < 1:
            raise BatchError(f"sample {i}: field 'routed_experts' must be an integer tensor")
        if re.shape[0] not in (s.total_length, s.total_length - 1):
            raise BatchError(
                f"sample {i}: field 'routed_experts' has {re.shape[0]} rows, expected "
                f"{s.total_length} or {s.total_length - 1} (one per token)"
            )


class RolloutBatch(Sequence[Sample]):
    """A validated, immutable list of samples.

    ``source_indices[k]`` is the index, in the batch this one was selected from, of sample ``k``
    (``range(len)`` for a fresh batch). ``template`` is the first sample, or for an empty
    selection the first sample of the batch it was selected from (``None`` for a batch built
    empty): an empty micro-batch still names the fields and optional values of its batch, so
    its packed padding carries them (zero) like any other micro-batch.
    """

    def __init__(self, samples: Sequence[Sample], source_indices: Sequence[int] | None = None):
        self.samples: tuple[Sample, ...] = tuple(samples)
        for i, s in enumerate(self.samples):
            validate_sample(i, s)
        if source_indices is None:
            source_indices = range(len(self.samples))
        self.source_indices: tuple[int, ...] = tuple(int(i) for i in source_indices)
        if len(self.source_indices) != len(self.samples):
            raise BatchError("source_indices must have one entry per sample")
        self._check_consistent_fields()
        self.template: Sample | None = self.samples[0] if self.samples else None

    def _check_consistent_fields(self) -> None:
        if not self.samples:
            return
        first = self.samples[0]
        optional = ("loss_mask", "rollout_log_probs", "teacher_log_probs", "routed_experts")
        for name in optional:
            has = getattr(first, name) is not None
            for i, s in enumerate(self.samples):
                if (getattr(s, name) is not None) != has:
                    raise BatchError(
                        f"sample {i}: field '{name}' is {'missing' if has else 'present'} "
                        f"while sample 0 {'has' if has else 'lacks'} it"
                    )
        names = set(first.fields)
        for i, s in enumerate(self.samples):
            if set(s.fields) != names:
                raise BatchError(
                    f"sample {i}: fields {sorted(s.fields)} differ from sample 0's {sorted(names)}"
                )

    # Sequence protocol
    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self.select(range(len(self))[i])
        return self.samples[i]

    def __repr__(self) -> str:
        return f"RolloutBatch({len(self)} samples, {self.total_tokens} tokens)"

    # Shapes and counts
    @property
    def total_lengths(self) -> list[int]:
        return [s.total_length for s in self.samples]

    @property
    def response_lengths(self) -> list[int]:
        return [s.response_length for s in self.samples]

    @property
    def total_tokens(self) -> int:
        return sum(self.total_lengths)

    @property
    def num_loss_tokens(self) -> int:
        """Number of response tokens with loss mask 1."""
        return int(sum(float(s.mask.sum()) for s in self.samples))

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor([float(s.reward) for s in self.samples], dtype=torch.float32)

    @property
    def group_indices(self) -> list[int]:
        return [s.group_index for s in self.samples]

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(self.template.fields) if self.template is not None else ()

    def response_field(self, name: str) -> list[torch.Tensor]:
        """Per-sample response-aligned tensors of ``name``: an attached field, ``loss_mask``
        (float, ones when absent), ``rollout_log_probs`` or ``teacher_log_probs``."""
        if name == "loss_mask":
            return [s.mask for s in self.samples]
        if name in ("rollout_log_probs", "teacher_log_probs"):
            out = [getattr(s, name) for s in self.samples]
            if any(v is None for v in out):
                raise BatchError(f"batch has no field '{name}'")
            return out
        if self.samples and name not in self.samples[0].fields:
            raise BatchError(f"batch has no field '{name}' (attached: {list(self.field_names)})")
        return [s.fields[name] for s in self.samples]

    # Derived batches
    @classmethod
    def _validated(
        cls, samples: tuple[Sample, ...], source_indices: tuple[int, ...], template: Sample | None
    ) -> RolloutBatch:
        """A batch of samples taken from an already validated batch (no re-validation);
        ``template``: that batch's (see the class docstring)."""
        batch = cls.__new__(cls)
        batch.samples, batch.source_indices = samples, source_indices
        batch.template = samples[0] if samples else template
        return batch

    def select(self, indices: Sequence[int]) -> RolloutBatch:
        """The samples at ``indices`` (in that order); ``source_indices`` map back to ``self``."""
        indices = [int(i) for i in indices]
        return RolloutBatch._validated(
            tuple(self.samples[i] for i in indices),
            tuple(self.source_indices[i] for i in indices),
            self.template,
        )

    def with_fields(self, **fields: Sequence[torch.Tensor]) -> RolloutBatch:
        """A copy with response-aligned tensors attached, one list entry per sample, e.g.
        ``batch.with_fields(old_log_probs=[...], advantages=[...])``. Validated like the rest."""
        for name, values in fields.items():
            if len(values) != len(self):
                raise BatchError(
                    f"field '{name}' has {len(values)} entries for {len(self)} samples"
                )
        samples = [
            replace(s, fields={**s.fields, **{n: v[i] for n, v in fields.items()}})
            for i, s in enumerate(self.samples)
        ]
        out = RolloutBatch(samples, self.source_indices)
        if not samples and self.template is not None:  # the empty batch names the fields too
            zero = torch.zeros(self.template.response_length)
            out.template = replace(
                self.template, fields={**self.template.fields, **dict.fromkeys(fields, zero)}
            )
        return out


def group_members(group_indices: Sequence[int]) -> dict[int, list[int]]:
    """Map each group index to the positions of its samples, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_indices):
        groups.setdefault(int(g), []).append(i)
    return groups
