"""Routed-experts capture for MoE models (SGLang's ``return_routed_experts``)."""

from __future__ import annotations

import torch


class RoutedExpertsRecorder:
    """Forward hooks on the router (``mlp.gate``) of each MoE decoder layer.

    After a forward over ``N`` tokens, :meth:`take` returns int32 ``[N, num_layers, top_k]``:
    the ids of the experts each token was routed to in each layer (``-1`` for dense layers).
    """

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.top_k = getattr(config, "num_experts_per_tok", None)
        self.shape = (self.num_layers, self.top_k)
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        layers = model.model.layers
        for idx, layer in enumerate(layers):
            mlp = getattr(layer, "mlp", None)
            gate = getattr(mlp, "gate", None)
            if gate is not None and (hasattr(gate, "top_k") or "Moe" in type(mlp).__name__):
                self._handles.append(gate.register_forward_hook(self._hook(idx)))
        if not self._handles or self.top_k is None:
            raise ValueError(
                "--enable-return-routed-experts needs a MoE model (e.g. qwen3_moe) whose "
                "decoder layers have an mlp.gate router"
            )

    def _hook(self, layer_idx: int):
        def hook(module, inputs, output):
            if isinstance(output, tuple) and len(output) == 3:
                indices = output[2]
            else:  # a gate returning router logits only
                logits = output[0] if isinstance(output, tuple) else output
                indices = torch.topk(
                    torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1
                ).indices
            self._captured[layer_idx] = indices.reshape(-1, self.top_k).to("cpu", torch.int32)

        return hook

    def take(self, num_tokens: int) -> torch.Tensor:
        out = torch.full((num_tokens, self.num_layers, self.top_k), -1, dtype=torch.int32)
        for idx, ids in self._captured.items():
            out[:, idx] = ids
        self._captured.clear()
        return out
