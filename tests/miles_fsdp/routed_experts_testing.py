"""Test support of routing replay (R3) against the built-in engine.

Shared by tests/miles_fsdp/test_routing_replay_engine.py, tests/miles_launch/
test_rollout_routing_replay.py and tests/gpu/test_routing_replay_gpu.py (which put this
directory on ``sys.path``):

* the engine side: a generate request with ``return_routed_experts`` and its reply decoded
  here with numpy (SGLang's layout: base64 of little-endian int32 ``[tokens - 1, layers,
  top_k]``), independently of the decoders under test;
* the trainer side: routers perturbed so that their own top-k differs from the engine's while
  the routing weights at the engine's experts stay the same (:func:`perturb_routers`), the
  routers' own choice (:func:`own_top_k`), and the FSDP backend's rollout context.
"""

from __future__ import annotations

import base64
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tiny_models import arch_config, save_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_launch"))

from engine_testing import EngineProcess  # noqa: E402

#: The built-in engine's (and SGLang's) flag to report routed experts.
ENGINE_FLAG = "--enable-return-routed-experts"


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A 1-rank gloo process group in the test process itself, for one module (the FSDP tests'
    conftest has the same fixture; test modules elsewhere import this one)."""
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def moe_config(model_type: str):
    """Tiny MoE configs whose experts and routers matter in the output."""
    config = arch_config(model_type)
    config.initializer_range = 0.3  # experts and router matter in the output
    config.norm_topk_prob = True
    if model_type == "qwen3_moe":
        config.num_experts = 8
    else:  # two MoE layers after the dense one, two groups of 4 experts
        config.n_routed_experts, config.n_group, config.topk_group = 8, 2, 1
        config.num_hidden_layers = 3
        config.mlp_layer_types = ["dense", "sparse", "sparse"]
        config.routed_scaling_factor = 2.5
    return config


def decode_routed(encoded: str, num_layers: int, top_k: int) -> torch.Tensor:
    """``meta_info["routed_experts"]`` as int32 ``[tokens - 1, num_layers, top_k]``."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    return torch.from_numpy(flat.reshape(-1, num_layers, top_k).copy())


@dataclass
class RoutedReply:
    """One ``/generate`` reply with routed experts: what the trainer replays."""

    output_ids: list[int]
    log_probs: torch.Tensor | None  # [response] (float32), when asked for
    routed: torch.Tensor  # int32 [prompt + response - 1, layers, top_k]


def generate_routed(
    engine: EngineProcess, input_ids: list[int], sampling_params: dict, config, logprob=True
) -> RoutedReply:
    """POST /generate with ``return_routed_experts`` (and ``return_logprob``); decode it."""
    body = {
        "input_ids": list(input_ids),
        "sampling_params": sampling_params,
        "return_routed_experts": True,
    }
    if logprob:
        body["return_logprob"] = True
    response = engine.post("/generate", body)
    assert response.status_code == 200, response.text
    reply = response.json()
    meta = reply["meta_info"]
    routed = decode_routed(
        meta["routed_experts"], config.num_hidden_layers, config.num_experts_per_tok
    )
    # every token but the last was fed, prompt included
    assert routed.shape[0] == len(input_ids) + len(reply["output_ids"]) - 1
    log_probs = None
    if logprob:
        log_probs = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    return RoutedReply(reply["output_ids"], log_probs, routed)


def engine_rollout(
    hf_dir: Path, config, prompt: torch.Tensor, sampling_params: dict, *flags: str, timeout=240
):
    """One response sampled by a fresh built-in engine (``ENGINE_FLAG`` plus ``flags``) from
    ``hf_dir``: ``(tokens, log_probs, routed)``, tokens = prompt + response."""
    engine = EngineProcess(hf_dir, ENGINE_FLAG, *flags, timeout=timeout)
    try:
        reply = generate_routed(engine, prompt.tolist(), sampling_params, config)
    finally:
        engine.close()
    tokens = torch.tensor(prompt.tolist() + reply.output_ids)
    return tokens, reply.log_probs, reply.routed


def moe_layers(model) -> list[int]:
    """Indices of the decoder layers with a router."""
    return [i for i, block in enumerate(model.model.layers) if hasattr(block.mlp, "gate")]


def perturb_routers(model, routed: torch.Tensor) -> None:
    """Change the routers' choice, not their weights at the engine's experts ``routed``.

    * softmax top-k with ``norm_topk_prob`` (qwen3_moe): an expert the engine never picked in a
      layer gets 4x the router row of the layer's most used expert. With renormalised top-k
      weights ``w_j = exp(l_j) / sum_{i in chosen} exp(l_i)`` a logit outside the chosen set
      cancels, so the weights at the engine's experts do not move, but the router's own top-k
      now takes that expert wherever its logit is large.
    * sigmoid grouped top-k (glm4_moe_lite): a new ``e_score_correction_bias``, which only
      chooses.
    """
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in moe_layers(model):
            gate = model.model.layers[layer].mlp.gate
            if model.config.model_type == "glm4_moe_lite":
                bias = torch.randn(gate.num_experts, generator=g) * 5
                gate.e_score_correction_bias.copy_(bias)
                continue
            counts = torch.bincount(routed[:, layer].flatten().long(), minlength=gate.num_experts)
            unused = torch.nonzero(counts == 0).flatten()
            assert len(unused) > 0, f"layer {layer}: the engine used every expert"
            gate.weight[unused[0]] = 4.0 * gate.weight[counts.argmax()]


def own_top_k(model, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """The top-k ids (on the CPU) the model's own routers pick for ``tokens`` (one unreplayed
    forward)."""
    seen, handles = {}, []
    for layer in moe_layers(model):

        def hook(module, args, output, layer=layer):
            seen[layer] = output[2].detach().cpu().clone()

        handles.append(model.model.layers[layer].mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=tokens[None].to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def differs(own: dict[int, torch.Tensor], routed: torch.Tensor) -> bool:
    """Whether the routers' own choice ``own`` differs from ``routed`` anywhere (as sets)."""
    return any(
        not torch.equal(ids.sort(-1).values, routed[:, layer].long().sort(-1).values)
        for layer, ids in own.items()
    )


def save_trainer_copy(model, directory: Path) -> Path:
    """``save_pretrained`` plus the word-level tokenizer of tiny_models."""
    model.save_pretrained(directory)
    save_tokenizer(directory, model.config.vocab_size)
    return directory


def rollout_context(backend):
    """The FSDP backend's actor as :mod:`miles_fsdp.train_step` uses it (the backend's own)."""
    return backend._rollout_context()
