"""Megatron-LM's architecture flags, as overrides of what the bridge reads from ``config.json``.

Every flag keeps its Megatron-LM name and meaning and defaults to unset: the value then comes
from the bridge (``--hf-checkpoint``'s ``config.json``). A flag given on the command line wins
over the bridge, key by key. Without ``--hf-checkpoint`` the flags alone describe the model.
:data:`ARCH_FLAG_TARGETS` says where each one lands (docs/miles-megatron.md prints the table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib.util import find_spec
from typing import Any, ClassVar, Literal

from miles_core.args import ArgGroup, ArgumentError, flag
from miles_core.args.parsed import ParsedArgs
from miles_core.args.run_config import group_from_namespace

#: Flag dest -> where it lands in megatron-core.
ARCH_FLAG_TARGETS: dict[str, str] = {
    "num_layers": "TransformerConfig.num_layers",
    "hidden_size": "TransformerConfig.hidden_size",
    "ffn_hidden_size": "TransformerConfig.ffn_hidden_size",
    "num_attention_heads": "TransformerConfig.num_attention_heads",
    "group_query_attention": "off: TransformerConfig.num_query_groups = heads",
    "num_query_groups": "TransformerConfig.num_query_groups (with --group-query-attention)",
    "kv_channels": "TransformerConfig.kv_channels (head size)",
    "swiglu": "TransformerConfig.gated_linear_unit=True, activation_func=silu (off: gelu)",
    "normalization": "TransformerConfig.normalization and the layer spec's norm",
    "norm_epsilon": "TransformerConfig.layernorm_epsilon",
    "position_embedding_type": "GPTModel(position_embedding_type=)",
    "rotary_base": "GPTModel(rotary_base=)",
    "rotary_percent": "GPTModel(rotary_percent=)",
    "max_position_embeddings": "GPTModel(max_sequence_length=max(this, --seq-length))",
    "seq_length": "GPTModel(max_sequence_length=max(this, --max-position-embeddings))",
    "vocab_size": "GPTModel(vocab_size=) after padding",
    "make_vocab_size_divisible_by": "pads vocab_size up to a multiple of this x TP",
    "untie_embeddings_and_output_weights": "GPTModel(share_embeddings_and_output_weights=not)",
    "disable_bias_linear": "TransformerConfig.add_bias_linear=not",
    "add_qkv_bias": "TransformerConfig.add_qkv_bias",
    "qk_layernorm": "TransformerConfig.qk_layernorm and the layer spec",
    "attention_dropout": "TransformerConfig.attention_dropout",
    "hidden_dropout": "TransformerConfig.hidden_dropout",
    "init_method_std": "TransformerConfig.init_method_std",
    "num_experts": "TransformerConfig.num_moe_experts and the MoE layer spec",
    "moe_ffn_hidden_size": "TransformerConfig.moe_ffn_hidden_size",
    "moe_router_topk": "TransformerConfig.moe_router_topk",
    "moe_router_pre_softmax": "TransformerConfig.moe_router_pre_softmax",
    "moe_router_score_function": "TransformerConfig.moe_router_score_function",
    "moe_router_load_balancing_type": "TransformerConfig.moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "TransformerConfig.moe_aux_loss_coeff",
    "moe_token_dispatcher_type": "TransformerConfig.moe_token_dispatcher_type",
    "moe_grouped_gemm": "refused (grouped-GEMM experts have no bridge mapping)",
}

#: Args a model cannot be built without.
REQUIRED_ARCH_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ArchitectureArgs(ArgGroup):
    title: ClassVar[str] = "model architecture (Megatron-LM flags; unset: from --hf-checkpoint)"

    num_layers: int | None = flag(None, help="Transformer layers.")
    hidden_size: int | None = flag(None, help="Hidden size.")
    ffn_hidden_size: int | None = flag(None, help="MLP hidden size (unset: 4 x hidden).")
    num_attention_heads: int | None = flag(None, help="Attention heads.")
    group_query_attention: bool | None = flag(None, help="Grouped-query attention.")
    num_query_groups: int | None = flag(None, help="Key/value head groups (with GQA).")
    kv_channels: int | None = flag(None, help="Head size (unset: hidden / heads).")
    swiglu: bool | None = flag(None, help="SwiGLU MLP (gated, silu).")
    normalization: Literal["RMSNorm", "LayerNorm"] | None = flag(None, help="Norm layer.")
    norm_epsilon: float | None = flag(None, help="Norm epsilon.")
    position_embedding_type: Literal["rope", "learned_absolute", "none"] | None = flag(
        None, help="Position embedding."
    )
    rotary_base: float | None = flag(None, help="RoPE base (HF rope_theta).")
    rotary_percent: float | None = flag(None, help="Fraction of the head rotated by RoPE.")
    max_position_embeddings: int | None = flag(None, help="Longest position the model embeds.")
    seq_length: int | None = flag(None, help="Longest training sequence.")
    vocab_size: int | None = flag(None, help="Vocabulary size before padding.")
    make_vocab_size_divisible_by: int | None = flag(
        None, help="Pad the vocabulary to a multiple of this x TP (unset: 128)."
    )
    untie_embeddings_and_output_weights: bool | None = flag(
        None, help="Separate output layer (HF tie_word_embeddings=false)."
    )
    disable_bias_linear: bool | None = flag(None, help="No biases in linear layers.")
    add_qkv_bias: bool | None = flag(None, help="Biases on q, k, v (qwen2).")
    qk_layernorm: bool | None = flag(None, help="Per-head norm on q and k (qwen3).")
    attention_dropout: float | None = flag(None, help="Attention dropout (bridged: 0).")
    hidden_dropout: float | None = flag(None, help="Hidden dropout (bridged: 0).")
    init_method_std: float | None = flag(None, help="Std of the random weight init.")
    num_experts: int | None = flag(None, help="MoE experts per layer (unset: dense).")
    moe_ffn_hidden_size: int | None = flag(None, help="Expert MLP hidden size.")
    moe_router_topk: int | None = flag(None, help="Experts per token.")
    moe_router_pre_softmax: bool | None = flag(
        None, help="Softmax over all experts before top-k (no renormalisation)."
    )
    moe_router_score_function: Literal["softmax", "sigmoid"] | None = flag(
        None, help="Router score function."
    )
    moe_router_load_balancing_type: str | None = flag(
        None, help="aux_loss, seq_aux_loss, sinkhorn or none."
    )
    moe_aux_loss_coeff: float | None = flag(None, help="Weight of the load-balancing loss.")
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] | None = flag(
        None, help="How tokens reach their experts."
    )
    moe_grouped_gemm: bool | None = flag(
        None, help="Grouped GEMM experts: refused (the experts are per-expert local MLPs)."
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        if args.num_query_groups is not None and args.group_query_attention is False:
            raise ArgumentError("--num-query-groups needs --group-query-attention")
        if args.moe_grouped_gemm:
            raise ArgumentError(
                "--moe-grouped-gemm is not supported: megatron-core's grouped-GEMM experts "
                "(TEGroupedMLP, or GroupedMLP's weight1/weight2) have no bridge mapping and "
                "no grouped path without TransformerEngine; drop the flag (per-expert MLPs)"
            )
        if args.moe_token_dispatcher_type == "flex":
            raise ArgumentError(
                "--moe-token-dispatcher-type flex is not supported by the Megatron backend "
                "(megatron-core's flex dispatcher needs DeepEP/HybridEP); use alltoall or allgather"
            )


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine`` is importable (checked without importing it)."""

    return find_spec("transformer_engine") is not None


def explicit_arch_args(args: ParsedArgs) -> dict[str, Any]:
    """The architecture flags set on the command line / YAML (not None)."""
    arch = group_from_namespace(ArchitectureArgs, args)
    values = {field.name: getattr(arch, field.name) for field in fields(ArchitectureArgs)}
    return {name: value for name, value in values.items() if value is not None}


def resolve_model_args(args: ParsedArgs) -> dict[str, Any]:
    """Model args: the bridge's (from ``--hf-checkpoint``) overridden by explicit flags.

    Fills Megatron-LM's derived defaults (``num_query_groups`` = heads without GQA,
    ``ffn_hidden_size`` = 4 x hidden, ``make_vocab_size_divisible_by`` = 128).
    """
    return hf_model_args(args.hf_checkpoint, explicit_arch_args(args))


def hf_model_args(hf_dir: str | None, explicit: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`resolve_model_args` of an HF directory (or None) and the explicit flags."""
    # miles_megatron.bridge is off the CLI's parse path
    from miles_megatron.bridge import bridge_for, load_hf_config

    margs: dict[str, Any] = {}
    if hf_dir:
        hf = load_hf_config(hf_dir)
        margs = bridge_for(hf.get("model_type", "")).model_args(hf)
        margs["model_type"] = hf.get("model_type")
    margs.update(explicit)
    return complete_model_args(margs)


def complete_model_args(margs: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron-LM's derived defaults on top of ``margs``; errors name the missing flag."""
    out = dict(margs)
    missing = [k for k in REQUIRED_ARCH_ARGS if out.get(k) is None]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        raise ArgumentError(f"model architecture incomplete: give --hf-checkpoint or {flags}")
    if not out.get("group_query_attention"):
        out["num_query_groups"] = out["num_attention_heads"]
    out.setdefault("kv_channels", out["hidden_size"] // out["num_attention_heads"])
    if out.get("ffn_hidden_size") is None:
        out["ffn_hidden_size"] = 4 * out["hidden_size"]
    if out.get("make_vocab_size_divisible_by") is None:
        out["make_vocab_size_divisible_by"] = 128
    return out


def model_args_line(margs: Mapping[str, Any]) -> str:
    """The MODEL_ARGS line of a Megatron-LM launch script (booleans as bare flags)."""
    parts: list[str] = []
    for field in fields(ArchitectureArgs):
        value = margs.get(field.name)
        if value is None or value is False:
            continue
        option = "--" + field.name.replace("_", "-")
        if value is True:
            parts.append(option)
        elif field.name == "num_query_groups" and not margs.get("group_query_attention"):
            continue
        else:
            parts += [option, _format(value)]
    return " ".join(parts)


def _format(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    return str(value)
