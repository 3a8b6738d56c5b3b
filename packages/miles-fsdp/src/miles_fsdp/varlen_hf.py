"""``--attn-implementation varlen``: transformers models attend through
:func:`miles_core.varlen_attention.varlen_causal_attention` (torch's varlen flash kernel on CUDA,
no ``T x T`` mask).

:data:`HF_NAME` is registered with transformers' attention and mask interfaces on import, so a
HF model built with ``attn_implementation=HF_NAME`` reads the varlen keyword arguments
(``cu_seq_lens_q``, ``max_length_q``) that :func:`miles_core.packing.packed_attention_kwargs`
passes for it, as flash attention does.

The attention call is excluded from ``torch.compile`` graphs (``--compile-decoder-layers``): the
sample boundaries change every micro-batch, and the CPU path reads them as Python ints, so tracing
it would recompile the layer for each micro-batch.
"""

from __future__ import annotations

import torch
from miles_core.varlen_attention import HF_ATTENTION_NAME as HF_NAME
from miles_core.varlen_attention import varlen_causal_attention
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS


@torch.compiler.disable
def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``query``: (1, H, T, D)) for one packed row;
    the row's boundaries come in ``cu_seq_lens_q`` / ``max_length_q``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise ValueError(
            f"attn_implementation {HF_NAME!r} needs one packed row with cu_seq_lens_q "
            "(miles_core.packing.packed_attention_kwargs passes it)"
        )
    if kwargs.get("sliding_window") is not None or dropout:
        raise ValueError(f"attn_implementation {HF_NAME!r} has no sliding window or dropout")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    out = varlen_causal_attention(q, k, v, cu, kwargs["max_length_q"], scaling)
    return out.unsqueeze(0), None  # (1, T, H, D), as the other attention functions return


def _register() -> None:
    AttentionInterface.register(HF_NAME, hf_attention_forward)
    # like flash attention: no mask is built, the boundaries travel as cu_seq_lens
    ALL_MASK_ATTENTION_FUNCTIONS.register(
        HF_NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    )


_register()
