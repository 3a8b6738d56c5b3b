"""THD packing: a micro-batch's samples concatenated into one row, as varlen attention wants it.

Layout of :func:`pack_thd` for samples of lengths ``L_0, L_1, ...`` (prompt ``P_i`` + response
``R_i``), padded at the end to a multiple of ``pad_multiple`` (128 by default)::

    input_ids     [s0 tokens ........][s1 tokens .....][pad ...]       shape [1, T]
    position_ids  [0 1 ... L_0-1     ][0 1 ... L_1-1  ][0 1 ...]       reset per sample
    cu_seqlens    [0, L_0, L_0+L_1, ..., T]                            int32, the padding is the
                                                                       last segment when present
    sample_ids    [0 0 ... 0         ][1 1 ... 1      ][-1 ... ]

Per-token training tensors are aligned to the position that *predicts* the token: position
``t`` carries ``targets[t] = input_ids[t + 1]`` (within the sample) and the values belonging to
that target token. Response token ``j`` of sample ``i`` (``tokens[P_i + j]``) therefore sits at
packed position ``offset_i + P_i - 1 + j``; ``loss_mask`` is 1 exactly there (where the sample's
loss mask is 1) and 0 at prompt positions, at each sample's last position and in the padding.
This way ``token_log_probs(logits, targets)`` needs no shifting.

The token budget per micro-batch (``--max-tokens-per-gpu`` x ``--context-parallel-size``) bounds
the unpadded length; the padding adds fewer than ``pad_multiple`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_core.batch import RolloutBatch
from miles_core.batch_invariant import HF_ATTENTION_NAME as BATCH_INVARIANT_NAME
from miles_core.varlen_attention import HF_ATTENTION_NAME

PAD_MULTIPLE = 128


@dataclass
class PackedBatch:
    """One packed micro-batch; see the module docstring for the layout."""

    input_ids: torch.Tensor  # long [1, T]
    position_ids: torch.Tensor  # long [1, T]
    targets: torch.Tensor  # long [1, T]
    loss_mask: torch.Tensor  # float32 [1, T]
    sample_ids: torch.Tensor  # long [1, T], -1 in the padding
    cu_seqlens: torch.Tensor  # int32 [num_samples + 1 (+1 when padded)]
    max_seqlen: int
    num_samples: int
    total_lengths: list[int]
    response_lengths: list[int]
    rewards: torch.Tensor  # float32 [num_samples]
    sample_loss_tokens: torch.Tensor  # float32 [num_samples], loss tokens of each sample
    fields: dict[str, torch.Tensor]  # float32 [1, T] each, aligned like loss_mask
    routed_experts: torch.Tensor | None  # int [T, ...] per input token, zeros in the padding
    source_indices: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Padded length ``T``."""
        return int(self.input_ids.shape[1])

    @property
    def num_padding(self) -> int:
        return self.num_tokens - sum(self.total_lengths)

    def response_slices(self) -> list[slice]:
        """For each sample, the packed positions that predict its response tokens."""
        out = []
        offset = 0  # cu_seqlens[i], from the host-side lengths (no device read)
        for length, resp in zip(self.total_lengths, self.response_lengths):
            start = offset + length - resp - 1
            out.append(slice(start, start + resp))
            offset += length
        return out

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor moved to ``device`` (``cu_seqlens`` too)."""

        def mv(t):
            return None if t is None else t.to(device, non_blocking=True)

        return PackedBatch(
            input_ids=mv(self.input_ids),
            position_ids=mv(self.position_ids),
            targets=mv(self.targets),
            loss_mask=mv(self.loss_mask),
            sample_ids=mv(self.sample_ids),
            cu_seqlens=mv(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            num_samples=self.num_samples,
            total_lengths=self.total_lengths,
            response_lengths=self.response_lengths,
            rewards=mv(self.rewards),
            sample_loss_tokens=mv(self.sample_loss_tokens),
            fields={k: mv(v) for k, v in self.fields.items()},
            routed_experts=mv(self.routed_experts),
            source_indices=self.source_indices,
        )


def pack_thd(
    batch: RolloutBatch, pad_multiple: int = PAD_MULTIPLE, pad_token_id: int = 0
) -> PackedBatch:
    """Pack ``batch`` into one row (see the module docstring).

    Packs ``loss_mask``, ``rollout_log_probs`` / ``teacher_log_probs`` (when present) and every
    attached field into ``PackedBatch.fields`` (``loss_mask`` is its own attribute). An empty batch
    packs to ``pad_multiple`` padding tokens (a rank with nothing to do still runs the forward so
    collectives line up), with the fields of the batch it was selected from, all zero.
    """
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    lengths = batch.total_lengths
    used = sum(lengths)
    total = max(-(-used // pad_multiple) * pad_multiple, pad_multiple)
    pad = total - used

    input_ids = torch.full((total,), pad_token_id, dtype=torch.long)
    position_ids = torch.empty(total, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    sample_ids = torch.full((total,), -1, dtype=torch.long)
    loss_mask = torch.zeros(total, dtype=torch.float32)
    template = batch.template  # an empty micro-batch: its batch's first sample
    names = [
        n
        for n in ("rollout_log_probs", "teacher_log_probs")
        if template is not None and getattr(template, n) is not None
    ]
    names += list(batch.field_names)
    fields = {n: torch.zeros(total, dtype=torch.float32) for n in names}
    routed = None
    if template is not None and template.routed_experts is not None:
        first = template.routed_experts
        routed = torch.zeros((total, *first.shape[1:]), dtype=first.dtype)

    offset = 0
    boundaries = [0]
    for i, s in enumerate(batch):
        length, resp = s.total_length, s.response_length
        end = offset + length
        input_ids[offset:end] = s.tokens
        position_ids[offset:end] = torch.arange(length)
        targets[offset : end - 1] = s.tokens[1:]
        sample_ids[offset:end] = i
        pred = slice(end - resp - 1, end - 1)
        loss_mask[pred] = s.mask
        for n in names:
            value = s.fields[n] if n in s.fields else getattr(s, n)
            fields[n][pred] = value.to(torch.float32)
        if routed is not None:
            rows = s.routed_experts.shape[0]
            routed[offset : offset + rows] = s.routed_experts
        offset = end
        boundaries.append(offset)
    if pad:
        position_ids[offset:] = torch.arange(pad)
        boundaries.append(total)
    cu_seqlens = torch.tensor(boundaries, dtype=torch.int32)
    return PackedBatch(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        targets=targets.unsqueeze(0),
        loss_mask=loss_mask.unsqueeze(0),
        sample_ids=sample_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(cu_seqlens.diff().max()),
        num_samples=len(batch),
        total_lengths=lengths,
        response_lengths=batch.response_lengths,
        rewards=batch.rewards,
        sample_loss_tokens=torch.tensor([float(s.mask.sum()) for s in batch], dtype=torch.float32),
        fields={n: v.unsqueeze(0) for n, v in fields.items()},
        routed_experts=routed,
        source_indices=batch.source_indices,
    )


def unpack_response(packed: PackedBatch, values: torch.Tensor) -> list[torch.Tensor]:
    """Split per-position ``values`` (``[1, T]`` or ``[T]``) back into response-aligned
    per-sample tensors (``[R_i]`` each), e.g. to store old log-probs computed on a packed
    forward. The slices are views; gradients flow through them."""
    flat = values.reshape(-1)
    if flat.numel() != packed.num_tokens:
        raise ValueError(
            f"values have {flat.numel()} positions, the packed batch {packed.num_tokens}"
        )
    return [flat[sl] for sl in packed.response_slices()]


def block_causal_mask(packed: PackedBatch) -> torch.Tensor:
    """Boolean ``[1, 1, T, T]``: position ``q`` may attend to ``k`` iff ``k <= q`` and both are in
    the same segment of ``cu_seqlens`` (a sample, or the padding)."""
    total = packed.num_tokens
    segment = torch.repeat_interleave(
        torch.arange(len(packed.cu_seqlens) - 1, device=packed.cu_seqlens.device),
        packed.cu_seqlens.diff().long(),
        output_size=total,
    )
    idx = torch.arange(total, device=segment.device)
    mask = (segment[:, None] == segment[None, :]) & (idx[None, :] <= idx[:, None])
    return mask[None, None]


def packed_attention_kwargs(
    packed: PackedBatch, attn_implementation: str, dtype: torch.dtype = torch.float32
) -> dict:
    """Keyword arguments for a HF causal LM forward (with ``input_ids=packed.input_ids``) that
    keep attention inside each sample.

    * ``flash_attention_2`` / ``flash_attention_3`` and ``miles_varlen`` (torch's varlen flash
      kernel, :mod:`miles_core.varlen_attention`): ``position_ids`` plus the varlen kwargs
      ``cu_seq_lens_q/k`` and ``max_length_q/k`` (no mask is materialised).
    * ``sdpa``: ``position_ids`` plus a boolean 4-D block-diagonal causal ``attention_mask``
      (:func:`block_causal_mask`; transformers passes 4-D masks through unchanged).
    * ``miles_batch_invariant`` (``--true-on-policy``, :mod:`miles_core.batch_invariant`): both
      (the mask for the CPU path, the boundaries for the GPU's packed-row attention).
    * ``eager``: the same mask as an additive float mask of ``dtype`` (0 or dtype's min).

    Always ``use_cache=False``. The mask costs ``T^2`` bytes; prefer flash attention on GPUs.
    """
    kwargs: dict = {"position_ids": packed.position_ids, "use_cache": False}
    varlen = ("flash_attention_2", "flash_attention_3", HF_ATTENTION_NAME, BATCH_INVARIANT_NAME)
    if attn_implementation not in (*varlen, "sdpa", "eager"):
        raise ValueError(
            f"packed sequences support attn_implementation flash_attention_2, flash_attention_3, "
            f"{HF_ATTENTION_NAME}, {BATCH_INVARIANT_NAME}, sdpa or eager, got {attn_implementation!r}"
        )
    if attn_implementation in varlen:
        cu = packed.cu_seqlens.to(device=packed.position_ids.device, dtype=torch.int32)
        kwargs.update(
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=packed.max_seqlen,
            max_length_k=packed.max_seqlen,
        )
    if attn_implementation in ("sdpa", BATCH_INVARIANT_NAME):
        kwargs["attention_mask"] = block_causal_mask(packed).to(packed.position_ids.device)
    if attn_implementation == "eager":
        allowed = block_causal_mask(packed).to(packed.position_ids.device)
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        kwargs["attention_mask"] = torch.where(allowed, zero, torch.finfo(dtype).min)
    return kwargs
