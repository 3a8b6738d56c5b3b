"""float64 references of MoE models whose routers follow given expert ids (routing replay).

Each MoE block of the HF model (loaded in float64) is replaced by the formula written out here,
with the experts of token ``t`` in layer ``l`` read from ``routed[t, l]`` and the routing
weights from the router's own parameters at those experts:

* softmax top-k (qwen3_moe): ``p = softmax(h Wg^T)``, ``w_j = p[e_j]`` (``/ sum_j p[e_j]`` when
  ``norm_topk_prob``);
* sigmoid grouped top-k (glm4_moe_lite): ``s = sigmoid(h Wg^T)``, ``w_j = s[e_j]`` (``/ (sum_j
  s[e_j] + 1e-20)`` when ``norm_topk_prob``) ``* routed_scaling_factor`` — the correction bias
  and the groups only choose experts, so they do not appear;

then ``out = sum_j w_j * W_down[e_j] (silu(g) * u)``, ``[g; u] = W_gate_up[e_j] h``, plus
``down(silu(gate h) * up h)`` of the shared experts where the block has them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_topk_weights(gate, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = torch.softmax(h @ gate.weight.T, dim=-1).gather(-1, ids)
    return w / w.sum(-1, keepdim=True) if gate.norm_topk_prob else w


def sigmoid_topk_weights(gate, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = torch.sigmoid(h @ gate.weight.T).gather(-1, ids)
    if gate.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * gate.routed_scaling_factor


ROUTER_WEIGHTS = {"qwen3_moe": softmax_topk_weights, "glm4_moe_lite": sigmoid_topk_weights}


def routed_experts_out(experts, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    """``sum_j w[:, j] * W_down[e_j] (silu(g) * u)`` over the k slots, one token at a time."""
    out = torch.zeros_like(h)
    for j in range(ids.shape[1]):
        gate_up = torch.einsum("toh,th->to", experts.gate_up_proj[ids[:, j]], h)
        g, u = gate_up.chunk(2, dim=-1)
        y = torch.einsum("thi,ti->th", experts.down_proj[ids[:, j]], F.silu(g) * u)
        out = out + w[:, j : j + 1] * y
    return out


def shared_experts_out(mlp, h: torch.Tensor) -> torch.Tensor:
    """The shared experts' dense gated MLP: ``W_down (silu(W_gate h) * W_up h)``."""
    act = F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)
    return act @ mlp.down_proj.weight.T


def replace_moe_blocks(model, routed: torch.Tensor) -> int:
    """Swap every MoE block's forward for the written-out formula; return how many."""
    weights_of = ROUTER_WEIGHTS[model.config.model_type]
    replaced = 0
    for layer, block in enumerate(model.model.layers):
        mlp = block.mlp
        if not hasattr(mlp, "experts"):
            continue  # a dense layer

        def forward(hidden, mlp=mlp, layer=layer):
            shape = hidden.shape
            h = hidden.reshape(-1, shape[-1])
            ids = routed[:, layer].long()
            out = routed_experts_out(mlp.experts, h, ids, weights_of(mlp.gate, h, ids))
            if hasattr(mlp, "shared_experts"):
                out = out + shared_experts_out(mlp.shared_experts, h)
            return out.reshape(shape)

        mlp.forward = forward
        replaced += 1
    return replaced


def reference_log_probs(model_or_dir, tokens: torch.Tensor, routed: torch.Tensor):
    """float64 per-token log-probs of ``tokens[1:]`` with routing ``routed`` [T, layers, k].

    ``model_or_dir``: an HF directory (loaded in float64, eager attention) or a float64 model.
    Returns ``(log_probs, model)``; call ``log_probs.sum().backward()`` for reference grads.
    """
    from transformers import AutoModelForCausalLM

    model = model_or_dir
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(
            model_or_dir, dtype=torch.float64, attn_implementation="eager"
        )
    model.double()  # also the routers some models keep in fp32 (_keep_in_fp32_modules_strict)
    assert replace_moe_blocks(model, routed) > 0
    logits = model(input_ids=tokens[None], use_cache=False).logits[0]
    logp = torch.log_softmax(logits, -1)[:-1].gather(-1, tokens[1:, None]).squeeze(-1)
    return logp, model
