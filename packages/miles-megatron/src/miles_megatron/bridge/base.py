"""The bridge base: HF ``config.json`` -> Megatron-LM architecture args, HF weights <-> megatron.

A bridge speaks Megatron-LM's own vocabulary: :meth:`Bridge.model_args` returns the
architecture flags a Megatron-LM launch script would pass (``num_layers``, ``swiglu``,
``num_query_groups``, ...; see :mod:`miles_megatron.arch_args`), so ``miles model-args``
prints them verbatim and command-line flags override them key by key. Weights go through
:class:`~miles_megatron.bridge.rules.WeightRule` tables; the megatron side is the unsharded
(TP = EP = 1) layout, sharding is :mod:`miles_megatron.sharding`'s job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from miles_megatron.bridge.rules import (
    AttentionShape,
    HFGetter,
    WeightRule,
    match_rule,
    to_hf,
    to_megatron,
)


class BridgeError(ValueError):
    """A config.json field or weight the bridge cannot map (the message names it)."""


def load_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF model directory, as a dict."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise BridgeError(f"--hf-checkpoint {hf_dir}: no config.json")
    with path.open() as f:
        return json.load(f)


def rope_theta(hf: Mapping[str, Any]) -> float:
    """The RoPE base of a transformers 4.x (``rope_theta``) or 5.x (``rope_parameters``) config."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise BridgeError(f"config.json: rope_type {rope_type!r} is not supported by the bridge")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise BridgeError("config.json: no rope_theta (nor rope_parameters.rope_theta)")
    return float(theta)


def attention_shape(margs: Mapping[str, Any]) -> AttentionShape:
    heads = margs["num_attention_heads"]
    groups = margs["num_query_groups"] if margs.get("group_query_attention") else heads
    head_dim = margs.get("kv_channels") or margs["hidden_size"] // heads
    return AttentionShape(num_heads=heads, num_groups=groups, head_dim=head_dim)


def padded_vocab_size(margs: Mapping[str, Any], tensor_parallel_size: int) -> int:
    """Megatron-LM's rule: round the vocabulary up to ``make_vocab_size_divisible_by * TP``."""
    multiple = margs.get("make_vocab_size_divisible_by", 128) * tensor_parallel_size
    vocab = margs["vocab_size"]
    return -(-vocab // multiple) * multiple


class Bridge:
    """One model family. Subclass, set ``model_types``, and register with ``@register_bridge``."""

    #: ``config.json`` ``model_type`` values this bridge handles.
    model_types: ClassVar[tuple[str, ...]] = ()

    # ---- architecture -------------------------------------------------------------------

    def model_args(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """Megatron-LM architecture args (dest names) of a llama-shaped dense decoder."""
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise BridgeError(f"config.json: hidden_act {act!r} (only silu / swiglu is bridged)")
        heads = hf["num_attention_heads"]
        groups = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        return {
            "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"],
            "ffn_hidden_size": hf["intermediate_size"],
            "num_attention_heads": heads,
            "group_query_attention": groups != heads,
            "num_query_groups": groups,
            "kv_channels": head_dim,
            "swiglu": True,
            "normalization": "RMSNorm",
            "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
            "position_embedding_type": "rope",
            "rotary_base": rope_theta(hf),
            "max_position_embeddings": hf.get("max_position_embeddings", 4096),
            "vocab_size": hf["vocab_size"],
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
            "disable_bias_linear": True,
            "add_qkv_bias": False,
            "qk_layernorm": False,
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
        }

    # ---- weights ------------------------------------------------------------------------

    def layer_rules(self, margs: Mapping[str, Any]) -> list[WeightRule]:
        """Rules of one decoder layer (``{layer}`` placeholder): attention + dense MLP."""
        prefix, hf = "decoder.layers.{layer}.", "model.layers.{layer}."
        rules = [
            WeightRule(prefix + "input_layernorm.weight", (hf + "input_layernorm.weight",)),
            WeightRule(
                prefix + "self_attention.linear_qkv.weight",
                tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
                "qkv",
            ),
            WeightRule(
                prefix + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",)
            ),
            WeightRule(
                prefix + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)
            ),
        ]
        if margs.get("add_qkv_bias"):
            rules.append(
                WeightRule(
                    prefix + "self_attention.linear_qkv.bias",
                    tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"),
                    "qkv",
                )
            )
        if margs.get("qk_layernorm"):
            rules += [
                WeightRule(
                    prefix + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",)
                ),
                WeightRule(
                    prefix + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",)
                ),
            ]
        rules += self.mlp_rules(margs)
        return rules

    def mlp_rules(self, margs: Mapping[str, Any]) -> list[WeightRule]:
        prefix, hf = "decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp."
        return [
            WeightRule(
                prefix + "linear_fc1.weight",
                (hf + "gate_proj.weight", hf + "up_proj.weight"),
                "gate_up",
            ),
            WeightRule(prefix + "linear_fc2.weight", (hf + "down_proj.weight",)),
        ]

    def rules(self, margs: Mapping[str, Any]) -> list[WeightRule]:
        """Every rule of the model, embedding to output layer."""
        rules = [
            WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
            WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        ]
        if margs.get("untie_embeddings_and_output_weights"):
            rules.append(WeightRule("output_layer.weight", ("lm_head.weight",), "vocab"))
        return rules + self.layer_rules(margs)

    def megatron_names(self, margs: Mapping[str, Any]) -> list[str]:
        """Global megatron names of every parameter the HF checkpoint fills."""
        names = []
        experts = margs.get("num_experts") or 0
        for rule in self.rules(margs):
            layers = range(margs["num_layers"]) if "{layer}" in rule.megatron else [None]
            for layer in layers:
                if "{expert}" in rule.megatron:
                    names += [rule.megatron.format(layer=layer, expert=e) for e in range(experts)]
                else:
                    names.append(rule.megatron.format(layer=layer))
        return names

    def _rule(
        self, name: str, margs: Mapping[str, Any]
    ) -> tuple[WeightRule, int | None, int | None]:
        found = match_rule(self.rules(margs), name)
        if found is None:
            raise BridgeError(f"{type(self).__name__}: no HF weight for megatron parameter {name}")
        return found

    def to_megatron(
        self, name: str, get_hf: HFGetter, margs: Mapping[str, Any], padded_vocab: int
    ) -> torch.Tensor:
        """The unsharded megatron tensor ``name``, read from HF tensors through ``get_hf``."""
        rule, layer, expert = self._rule(name, margs)
        tensors = [get_hf(n) for n in rule.hf_names(layer, expert)]
        return to_megatron(rule, tensors, attention_shape(margs), padded_vocab)

    def to_hf(
        self, name: str, tensor: torch.Tensor, margs: Mapping[str, Any]
    ) -> list[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs of the unsharded megatron tensor ``name``."""
        rule, layer, expert = self._rule(name, margs)
        parts = to_hf(rule, tensor, attention_shape(margs), margs["vocab_size"])
        return list(zip(rule.hf_names(layer, expert), parts, strict=True))

    def hf_to_megatron_state(
        self, hf_state: Mapping[str, torch.Tensor], margs: Mapping[str, Any], padded_vocab: int
    ) -> dict[str, torch.Tensor]:
        """A whole unsharded megatron state dict from a whole HF state dict."""

        def get(name: str) -> torch.Tensor:
            if name not in hf_state:
                raise BridgeError(f"HF checkpoint has no tensor {name}")
            return hf_state[name]

        return {
            n: self.to_megatron(n, get, margs, padded_vocab) for n in self.megatron_names(margs)
        }

    def megatron_to_hf_state(
        self, state: Mapping[str, torch.Tensor], margs: Mapping[str, Any]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs of an unsharded megatron state dict."""
        for name in self.megatron_names(margs):
            yield from self.to_hf(name, state[name], margs)
