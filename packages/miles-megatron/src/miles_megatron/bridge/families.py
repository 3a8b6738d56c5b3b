"""The bridged families: llama, qwen2, qwen3 (dense) and qwen3_moe."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles_megatron.bridge.base import Bridge, BridgeError
from miles_megatron.bridge.registry import register_bridge
from miles_megatron.bridge.rules import WeightRule


@register_bridge
class LlamaBridge(Bridge):
    """Llama 2/3 (default RoPE), Mistral without sliding window: the base mapping as-is."""

    model_types = ("llama", "mistral")

    def model_args(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise BridgeError("config.json: attention_bias / mlp_bias are not bridged for llama")
        if hf.get("sliding_window"):
            raise BridgeError("config.json: sliding_window attention is not bridged")
        return super().model_args(hf)


@register_bridge
class Qwen2Bridge(Bridge):
    """Qwen2 / Qwen2.5: biases on q, k, v only (``--add-qkv-bias``)."""

    model_types = ("qwen2",)

    def model_args(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        if hf.get("use_sliding_window"):
            raise BridgeError("config.json: use_sliding_window is not bridged")
        return {**super().model_args(hf), "add_qkv_bias": True}


@register_bridge
class Qwen3Bridge(Bridge):
    """Qwen3 dense: per-head RMSNorm on q and k (``--qk-layernorm``), no biases."""

    model_types = ("qwen3",)

    def model_args(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        if hf.get("attention_bias"):
            raise BridgeError("config.json: attention_bias is not bridged for qwen3")
        if hf.get("use_sliding_window"):
            raise BridgeError("config.json: use_sliding_window is not bridged")
        return {**super().model_args(hf), "qk_layernorm": True}


@register_bridge
class Qwen3MoeBridge(Qwen3Bridge):
    """Qwen3-MoE: every layer sparse; softmax router, top-k, optional top-k renormalisation.

    HF computes ``softmax`` over all experts, keeps the top k and renormalises them when
    ``norm_topk_prob``. Megatron's ``--moe-router-pre-softmax`` keeps softmax-then-top-k
    (no renormalisation); without it megatron takes top-k logits then softmax, which equals
    the renormalised HF weights. Experts map to ``SequentialMLP.local_experts.<e>``.
    """

    model_types = ("qwen3_moe",)

    def model_args(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise BridgeError(
                "config.json: mlp_only_layers / decoder_sparse_step != 1 (mixed dense and MoE "
                "layers) are not bridged"
            )
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        if not experts:
            raise BridgeError("config.json: qwen3_moe without num_experts")
        return {
            **super().model_args(hf),
            "num_experts": experts,
            "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_router_topk": hf["num_experts_per_tok"],
            "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
            "moe_router_score_function": "softmax",
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "alltoall",
        }

    def mlp_rules(self, margs: Mapping[str, Any]) -> list[WeightRule]:
        prefix, hf = "decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp."
        expert, hf_expert = prefix + "experts.local_experts.{expert}.", hf + "experts.{expert}."
        return [
            WeightRule(prefix + "router.weight", (hf + "gate.weight",)),
            WeightRule(
                expert + "linear_fc1.weight",
                (hf_expert + "gate_proj.weight", hf_expert + "up_proj.weight"),
                "gate_up",
            ),
            WeightRule(expert + "linear_fc2.weight", (hf_expert + "down_proj.weight",)),
        ]
