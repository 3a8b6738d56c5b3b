"""A decoder LM's shape, read from its HF ``config.json`` alone (no model is built), and the
counts the memory plan (:mod:`miles_launch.memory_plan`) multiplies: parameters by kind and the
bytes one layer saves for backward per token.

Covered (:data:`KNOWN_TYPES`): dense Llama/Mistral/Qwen2/Qwen3 models (grouped-query attention, SwiGLU MLP, RMSNorm,
optional q/k norms and attention biases, tied or untied embeddings) and their MoE variants
(Qwen2/Qwen3-MoE, Mixtral: routed experts, an optional shared expert, dense layers by
``mlp_only_layers`` / ``decoder_sparse_step`` / ``first_k_dense_replace``), and DeepSeek-V3-style
multi-head latent attention (``kv_lora_rank``; Kimi K2 has this shape). A config nested under
``text_config`` is read there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The model types whose layers this module counts (tested against the HF models' numel; Mistral
#: and Kimi K2 are Llama's and DeepSeek-V3's layers). Others (hybrid linear-attention or Mamba
#: layers, ...) raise :class:`ConfigError`: the plan prints no estimate rather than a wrong one.
KNOWN_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "kimi_k2",
)
#: Model types whose attention normalises q and k per head (Qwen3's ``q_norm`` / ``k_norm``).
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
#: Model types whose q/k/v projections carry a bias and ``o_proj`` none, whatever the config says.
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")


class ConfigError(ValueError):
    """The config lacks a field the shape needs (the message names it)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder LM (names as in HF configs); MoE fields are 0 for a dense model."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    shared_expert_gate: bool = False
    sparse_layers: int = 0
    # multi-head latent attention (DeepSeek-V3); kv_lora_rank 0: ordinary attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    # ------------------------------------------------------------------ reading a config
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """The shape of a parsed ``config.json``."""
        if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
            config = {**config["text_config"], "model_type": config.get("model_type", "")}

        def need(key: str) -> int:
            if config.get(key) is None:
                raise ConfigError(f"config.json has no {key}")
            return int(config[key])

        model_type = str(config.get("model_type", ""))
        if model_type not in KNOWN_TYPES:
            raise ConfigError(
                f"model_type {model_type or '(none)'} is not one whose layers the memory plan "
                f"counts ({', '.join(KNOWN_TYPES)})"
            )
        layers, hidden, heads = (
            need("num_hidden_layers"),
            need("hidden_size"),
            need("num_attention_heads"),
        )
        experts = int(
            config.get("num_experts")
            or config.get("n_routed_experts")
            or config.get("num_local_experts")
            or 0
        )
        moe_intermediate = int(config.get("moe_intermediate_size") or 0)
        if experts and not moe_intermediate:  # Mixtral: every MLP is the experts'
            moe_intermediate = need("intermediate_size")
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        if config.get("n_shared_experts"):
            shared = int(config["n_shared_experts"]) * moe_intermediate
        mla = bool(config.get("kv_lora_rank"))
        return cls(
            model_type=model_type,
            layers=layers,
            hidden=hidden,
            intermediate=int(config.get("intermediate_size") or 0),
            vocab=need("vocab_size"),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=model_type in QK_NORM_TYPES,
            qkv_bias=model_type in QKV_BIAS_TYPES or bool(config.get("attention_bias")),
            o_bias=model_type not in QKV_BIAS_TYPES and bool(config.get("attention_bias")),
            experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate=moe_intermediate if experts else 0,
            shared_intermediate=shared if experts else 0,
            shared_expert_gate=bool(shared) and model_type == "qwen2_moe",
            sparse_layers=sum(_sparse(config, i) for i in range(layers)) if experts else 0,
            q_lora_rank=int(config.get("q_lora_rank") or 0) if mla else 0,
            kv_lora_rank=int(config.get("kv_lora_rank") or 0),
            qk_nope_head_dim=int(config.get("qk_nope_head_dim") or 0) if mla else 0,
            qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0) if mla else 0,
            v_head_dim=int(config.get("v_head_dim") or 0) if mla else 0,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelShape:
        """The shape of the model directory's ``config.json``."""
        return cls.from_config(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")))

    # ------------------------------------------------------------------ parameters
    @property
    def dense_layers(self) -> int:
        return self.layers - self.sparse_layers

    def attention_params(self) -> int:
        """One layer's attention: projections, their biases, q/k norms (MLA: its low-rank
        projections and their norms)."""
        h = self.hidden
        if self.kv_lora_rank:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.heads * qk
            else:
                q = h * self.heads * qk
            kv = (
                h * (self.kv_lora_rank + self.qk_rope_head_dim)
                + self.kv_lora_rank
                + self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
            )
            return q + kv + self.heads * self.v_head_dim * h
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        params = h * (q + 2 * kv) + q * h
        params += (q + 2 * kv) if self.qkv_bias else 0
        params += h if self.o_bias else 0
        params += 2 * self.head_dim if self.qk_norm else 0
        return params

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def routed_expert_params(self) -> int:
        """One sparse layer's routed experts (what expert parallelism divides)."""
        return self.experts * 3 * self.hidden * self.moe_intermediate

    def sparse_mlp_params(self) -> int:
        """One sparse layer's MLP besides the routed experts: router, shared expert, its gate."""
        router = self.experts * self.hidden  # DeepSeek's score-correction bias is a buffer
        shared = 3 * self.hidden * self.shared_intermediate
        return router + shared + (self.hidden if self.shared_expert_gate else 0)

    def layer_params(self, sparse: bool) -> int:
        """One decoder layer, its two RMSNorms included (routed experts too when ``sparse``)."""
        mlp = (
            self.sparse_mlp_params() + self.routed_expert_params()
            if sparse
            else self.dense_mlp_params()
        )
        return self.attention_params() + mlp + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """The output projection when it is a weight of its own (0 when tied)."""
        return 0 if self.tied else self.vocab * self.hidden

    def expert_params(self) -> int:
        """Every routed expert of the model."""
        return self.sparse_layers * self.routed_expert_params()

    def total_params(self) -> int:
        """Every parameter (the tied embedding once), as ``sum(p.numel())`` of the HF model."""
        return (
            self.dense_layers * self.layer_params(False)
            + self.sparse_layers * self.layer_params(True)
            + self.embedding_params()
            + self.head_params()
            + self.hidden  # final norm
        )

    def active_params(self) -> int:
        """Parameters one token passes through (the routed experts it is sent to)."""
        per_expert = 3 * self.hidden * self.moe_intermediate
        unused = self.sparse_layers * (self.experts - self.experts_per_token) * per_expert
        return self.total_params() - unused

    # ------------------------------------------------------------------ activations
    def layer_activation_bytes(
        self, sparse: bool, compute_bytes: int = 2, layers: str = "hf", fused_norm: bool = False
    ) -> int:
        """Bytes one decoder layer saves for backward per token, without recompute.

        Counted tensor by tensor as autograd saves them (``c`` the compute dtype's bytes, 2 for
        bf16; ``q``, ``k``, ``v`` the widths ``n_q d``, ``n_kv d``, ``n_kv d``). ``layers="hf"``:
        HF's decoder layer (what the FSDP backend trains):

        * each of the two RMSNorms over ``h``: its fp32 input (``4h``), its normalised output
          (``c h``, saved by the weight multiply) and the product, the next projection's input
          (``c h``): ``(4 + 2c) h``;
        * q/k norms (Qwen3): fp32 input and normalised output: ``(4 + c)(q + k)``;
        * attention: q and k after rotary, v, the output (the flash kernel's saved output, also
          the output projection's input), and its fp32 log-sum-exp: ``c (2q + 2k) + 4 n_q``;
        * dense MLP: gate and up outputs, SiLU(gate) and the product: ``4 c I``;
        * sparse MLP: the router's fp32 logits and probabilities (``8 E``), and per routed copy of
          the token (``k`` of them): its gathered input, the expert MLP's ``4 c I_moe`` and its
          output before the routing-weight multiply: ``k c (2h + 4 I_moe)``; a shared expert adds
          ``4 c I_shared``.

        ``layers="megatron"``: megatron-core's local layer (the Megatron backend): each RMSNorm
        keeps its fp32 input and fp32 normalised output besides its ``c h`` output,
        ``(8 + c) h``; q/k norms both in fp32, ``8 (q + k)``; attention the fused QKV output,
        q and k after rotary, the output, the log-sum-exp and the rotary tables:
        ``c (q + 2k) + c (q + k) + c q + 4 n_q + 4 c d``; the dense MLP the fused gate/up output
        and three ``I``-wide tensors, ``5 c I``; its MoE layer is counted as HF's (not measured).
        Its sdpa path (``--attn-implementation sdpa``, the CPU's) adds a ``T x T`` mask, not
        counted (varlen, a GPU's default, has none).

        ``fused_norm`` (megatron-core's layer on a GPU): ``torch.nn.RMSNorm`` runs torch's
        ``_fused_rms_norm`` kernel on CUDA, whose autograd formula saves the input, the weight
        and the fp32 ``rstd`` (one float per row) instead of the CPU decomposition's fp32 copies:
        each hidden norm keeps its ``c h`` input, ``rstd`` and (for the next projection) its
        ``c h`` output, ``2 (2c h + 4)``; the k norm's input is a view of the fused QKV output
        (already counted), the q norm's the copy megatron's reshape makes of the query, and
        rotary saves only its tables: ``c q + 4 (n_q + n_kv)``.

        MLA counts q/k at ``qk_nope + qk_rope`` and v at ``v_head_dim`` per head. Checked against
        the unique storages autograd saves for one micro-batch (bf16, on the CPU): HF's Qwen3
        layer within 0.3% and Qwen3-MoE layer within 0.6%
        (``tests/miles_launch/test_memory_estimate.py``), megatron-core's Qwen3 layer within 2%
        (``tests/miles_megatron/test_memory_plan_activations.py``). ``scripts/bench_memory_plan.py``
        measures both backends on a GPU node.
        """
        c, h = compute_bytes, self.hidden
        if self.kv_lora_rank:
            qk_dim, v_dim, kv_heads = (
                self.qk_nope_head_dim + self.qk_rope_head_dim,
                self.v_head_dim,
                self.heads,
            )
            rotary = self.qk_rope_head_dim
        else:
            qk_dim, v_dim, kv_heads = self.head_dim, self.head_dim, self.kv_heads
            rotary = self.head_dim
        q, k, v = self.heads * qk_dim, kv_heads * qk_dim, kv_heads * v_dim
        out = self.heads * v_dim
        norms = self._norm_bytes(c, layers, fused_norm)
        if layers == "megatron":
            if not self.qk_norm:
                qk_norm = 0
            elif fused_norm:
                qk_norm = c * q + 4 * (self.heads + kv_heads)
            else:
                qk_norm = 8 * (q + k)
            attention = c * (q + k + v) + c * (q + k) + c * out + 4 * self.heads + 4 * c * rotary
            dense_mlp = 5 * c * self.intermediate
        else:
            qk_norm = (4 + c) * (q + k) if self.qk_norm else 0
            attention = c * (q + k + v + out) + 4 * self.heads
            dense_mlp = 4 * c * self.intermediate
        if sparse:
            mlp = 8 * self.experts + self.experts_per_token * c * (
                2 * h + 4 * self.moe_intermediate
            )
            mlp += 4 * c * self.shared_intermediate
        else:
            mlp = dense_mlp
        return norms + qk_norm + attention + mlp

    def _norm_bytes(self, c: int, layers: str, fused_norm: bool = False) -> int:
        """The two hidden-sized RMSNorms' saved bytes per token (with the projection inputs)."""
        if layers == "megatron" and fused_norm:
            return 2 * (2 * c * self.hidden + 4)
        return 2 * ((8 + c) if layers == "megatron" else (4 + 2 * c)) * self.hidden

    def layer_activation_split(
        self, sparse: bool, compute_bytes: int = 2, layers: str = "hf", fused_norm: bool = False
    ) -> tuple[int, int]:
        """:meth:`layer_activation_bytes` as ``(hidden-sized part, head/MLP-sized part)``: tensor
        parallelism without sequence parallelism divides only the second."""
        total = self.layer_activation_bytes(sparse, compute_bytes, layers, fused_norm)
        hidden_part = self._norm_bytes(compute_bytes, layers, fused_norm)
        return hidden_part, total - hidden_part


def _sparse(config: dict[str, Any], index: int) -> bool:
    """Whether layer ``index`` of an MoE config is a sparse (experts) layer."""
    if index in (config.get("mlp_only_layers") or ()):
        return False
    if index < int(config.get("first_k_dense_replace") or 0):
        return False
    step = int(config.get("decoder_sparse_step") or 1)
    return (index + 1) % step == 0
