"""Model args + parallel/precision flags -> megatron-core ``TransformerConfig``, spec, GPTModel.

Precedence for ``TransformerConfig``: the architecture (:mod:`miles_megatron.arch_args`), then
the parallel sizes, precision and memory flags, then any generated ``TransformerConfig`` flag
given explicitly (:mod:`miles_megatron.generated_flags`), which wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from miles_core.args.parsed import ParsedArgs
from miles_core.precision import train_dtype
from miles_core.user_functions import load_function

from miles_megatron import mcore_compat
from miles_megatron.bridge import padded_vocab_size
from miles_megatron.generated_flags import config_overrides
from miles_megatron.local_spec import local_block_spec
from miles_megatron.packed_attention import resolve_attn_implementation


def params_dtype(args: ParsedArgs) -> torch.dtype:
    """The model's dtype: miles-core's training dtype (``--bf16`` by default, ``--fp16``,
    ``--no-bf16`` for fp32); the distributed optimizer's masters are fp32 regardless."""
    return train_dtype(args)


def transformer_config(margs: Mapping[str, Any], args: ParsedArgs):
    """The ``TransformerConfig`` of the model described by ``margs`` under ``args``' layout."""
    tp = args.tensor_model_parallel_size
    dtype = params_dtype(args)
    kwargs: dict[str, Any] = dict(
        num_layers=margs["num_layers"],
        hidden_size=margs["hidden_size"],
        ffn_hidden_size=margs["ffn_hidden_size"],
        num_attention_heads=margs["num_attention_heads"],
        num_query_groups=margs["num_query_groups"],
        kv_channels=margs["kv_channels"],
        gated_linear_unit=bool(margs.get("swiglu")),
        activation_func=F.silu if margs.get("swiglu") else F.gelu,
        normalization=margs.get("normalization") or "LayerNorm",
        layernorm_epsilon=margs.get("norm_epsilon") or 1e-5,
        add_bias_linear=not margs.get("disable_bias_linear", False),
        add_qkv_bias=bool(margs.get("add_qkv_bias")),
        qk_layernorm=bool(margs.get("qk_layernorm")),
        attention_dropout=margs.get("attention_dropout", 0.1),
        hidden_dropout=margs.get("hidden_dropout", 0.1),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size or tp,
        sequence_parallel=args.sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # on a GPU the parameters are created (and randomly initialised, before the checkpoint
        # overwrites them) there: megatron's CPU init draws every weight in fp32 on the host.
        # perform_initialization stays on: megatron sets the tensor-parallel attributes of a
        # weight only inside its init functions.
        use_cpu_initialization=not torch.cuda.is_available(),
        variable_seq_lengths=args.pipeline_model_parallel_size > 1,
        transformer_impl="local",  # layer_spec builds the local spec (--transformer-impl)
    )
    if margs.get("init_method_std") is not None:
        kwargs["init_method_std"] = margs["init_method_std"]
    if margs.get("num_experts"):
        kwargs["num_moe_experts"] = margs["num_experts"]
        for key in (
            "moe_ffn_hidden_size",
            "moe_router_topk",
            "moe_router_pre_softmax",
            "moe_router_score_function",
            "moe_router_load_balancing_type",
            "moe_aux_loss_coeff",
            "moe_token_dispatcher_type",
        ):
            if margs.get(key) is not None:
                kwargs[key] = margs[key]
        # R3: megatron's routers replay the engine's ids (miles_megatron.routing_replay)
        kwargs["moe_enable_routing_replay"] = bool(args.use_rollout_routing_replay)
    elif kwargs["variable_seq_lengths"]:
        # a dense model has no dispatcher, but megatron rejects its default (allgather) with
        # variable sequence lengths (PP > 1: packed rows differ in length)
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    kwargs.update(config_overrides(args, TransformerConfig))
    return TransformerConfig(**kwargs)


def layer_spec(margs: Mapping[str, Any], config, args: ParsedArgs, vp_stage: int | None = None):
    """The decoder spec: ``--spec MODULE FUNCTION`` or megatron-core's local spec.

    The local (non-TransformerEngine) spec (:mod:`miles_megatron.local_spec`) keeps the bridge's parameter names
    (``input_layernorm``, ``linear_qkv``, ``local_experts.<e>``) and runs on any device.
    """
    if args.spec:
        module_name, function = args.spec
        spec = load_function(f"{module_name}:{function}", "--spec")
        return spec(args, config, vp_stage) if callable(spec) else spec

    return local_block_spec(dict(margs), config, vp_stage)


def gpt_model_kwargs(margs: Mapping[str, Any], args: ParsedArgs) -> dict[str, Any]:
    """GPTModel's arguments besides config and spec (pre/post process come from the stage)."""
    max_len = max(margs.get("max_position_embeddings") or 0, margs.get("seq_length") or 0)
    return dict(
        vocab_size=padded_vocab_size(margs, args.tensor_model_parallel_size),
        max_sequence_length=max_len or 4096,
        position_embedding_type=margs.get("position_embedding_type") or "learned_absolute",
        rotary_base=margs.get("rotary_base") or 10000,
        rotary_percent=margs.get("rotary_percent") or 1.0,
        share_embeddings_and_output_weights=not margs.get("untie_embeddings_and_output_weights"),
        parallel_output=False,
    )


def build_gpt_model(margs: Mapping[str, Any], args: ParsedArgs, config=None):
    """This rank's GPTModel chunk (parallel state must be initialised)."""
    mcore_compat.apply()
    config = config or transformer_config(margs, args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(margs, config, args),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        **gpt_model_kwargs(margs, args),
    )
    resolve_attn_implementation(args, config, model)  # --attn-implementation, on the config
    return model


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """This rank's ``TransformerLayer`` modules of ``model`` (its pipeline stage's), in order:
    what ``--compile-decoder-layers`` compiles (:mod:`miles_core.compiled_layers`)."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no TransformerLayer to compile")
    return layers
