"""Routing replay for glm4_moe_lite: sigmoid router, grouped top-k, score-correction bias.

The replayed ids must reach the experts even where the trainer's own router (bias, groups)
would pick others; weights and gradients must be the model's formula at those ids, checked
against float64 math written in the tests (moe_reference.py).
"""

from __future__ import annotations

import pytest
import torch
from miles_core.args import ArgumentError
from miles_fsdp.adaptations.moe import install_routing_replay
from moe_reference import reference_log_probs, sigmoid_topk_weights
from tiny_models import arch_config, qwen3_config

pytestmark = pytest.mark.numeric

NUM_EXPERTS, TOP_K, LAYERS, TOKENS = 8, 2, 3, 10


def glm_config(**overrides):
    """Two groups of 4 experts, one group kept per token; layer 0 dense, 1 and 2 MoE."""
    config = arch_config("glm4_moe_lite")
    config.n_routed_experts = NUM_EXPERTS
    config.num_experts_per_tok = TOP_K
    config.n_group, config.topk_group = 2, 1
    config.num_hidden_layers = LAYERS
    config.mlp_layer_types = ["dense", "sparse", "sparse"]
    config.routed_scaling_factor = 2.5
    config.norm_topk_prob = True
    config.initializer_range = 0.3  # experts and router matter in the output
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def glm_model(config, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():  # a bias large enough to decide the trainer's own choice
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(NUM_EXPERTS) * 2.0)
    return model


def other_group_ids(own: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per token, k distinct experts from the group the router did *not* pick."""
    ids = []
    for row in own:
        other = 1 - int(row[0]) // (NUM_EXPERTS // 2)
        base = other * (NUM_EXPERTS // 2)
        ids.append(base + torch.randperm(NUM_EXPERTS // 2, generator=generator)[:TOP_K])
    return torch.stack(ids)


def capture_expert_ids(model):
    """Forward hooks on the experts modules: the ``top_k_index`` each one was called with."""
    seen: dict[int, torch.Tensor] = {}
    for layer, block in enumerate(model.model.layers):
        if hasattr(block.mlp, "experts"):

            def hook(module, args, layer=layer):
                seen[layer] = args[1].clone()

            block.mlp.experts.register_forward_pre_hook(hook)
    return seen


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_router_weights_and_gradient_match_float64(norm_topk_prob):
    config = glm_config(norm_topk_prob=norm_topk_prob)
    model = glm_model(config)
    replay = install_routing_replay(model, config)
    router = model.model.layers[1].mlp.gate
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(TOKENS, config.hidden_size, generator=g)

    own_logits, own_w, own_ids = router(hidden)  # replay unset: the model's own routing
    replayed = other_group_ids(own_ids, g)
    assert not (replayed.sort(-1).values == own_ids.sort(-1).values).all(-1).any()
    routed = torch.full((TOKENS, LAYERS, TOP_K), -1, dtype=torch.int32)
    routed[:, 1:] = replayed[:, None]
    replay.set(routed)

    h = hidden.clone().requires_grad_()
    logits, weights, ids = router(h)
    assert torch.equal(ids, replayed.long())
    torch.testing.assert_close(logits, own_logits, rtol=0, atol=0)
    ref_h = hidden.double().requires_grad_()
    ref_router = type("Gate", (), {})()
    ref_router.weight = router.weight.detach().double().requires_grad_()
    ref_router.norm_topk_prob, ref_router.routed_scaling_factor = norm_topk_prob, 2.5
    want = sigmoid_topk_weights(ref_router, ref_h, replayed.long())
    torch.testing.assert_close(weights.double(), want, rtol=1e-6, atol=1e-7)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.full((TOKENS,), 2.5))

    upstream = torch.randn(TOKENS, TOP_K, generator=g)
    (weights * upstream).sum().backward()
    (want * upstream.double()).sum().backward()
    assert ref_router.weight.grad.abs().max() > 0
    torch.testing.assert_close(
        router.weight.grad.double(), ref_router.weight.grad, rtol=1e-4, atol=1e-6
    )
    torch.testing.assert_close(h.grad.double(), ref_h.grad, rtol=1e-4, atol=1e-6)

    replay.set(None)  # unset again: back to the model's own routing
    assert torch.equal(router(hidden)[2], own_ids)


def test_replayed_model_log_probs_and_router_gradient_match_float64():
    config = glm_config()
    model = glm_model(config)
    replay = install_routing_replay(model, config)
    seen = capture_expert_ids(model)
    tokens = torch.randint(0, 64, (TOKENS,), generator=torch.Generator().manual_seed(2))

    with torch.no_grad():  # the trainer's own routing
        own_logp = torch.log_softmax(model(input_ids=tokens[None]).logits[0], -1)[:-1]
    own = {layer: ids.clone() for layer, ids in seen.items()}
    assert sorted(own) == [1, 2]
    g = torch.Generator().manual_seed(3)
    routed = torch.full((TOKENS, LAYERS, TOP_K), -1, dtype=torch.int32)  # -1: dense layer 0
    for layer in (1, 2):
        routed[:, layer] = other_group_ids(own[layer], g)
    replay.set(routed)
    logits = model(input_ids=tokens[None]).logits[0]
    for layer in (1, 2):
        assert torch.equal(seen[layer], routed[:, layer].long())
    logp = torch.log_softmax(logits, -1)[:-1].gather(-1, tokens[1:, None]).squeeze(-1)

    reference = glm_model(config, dtype=torch.float64)
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ref_logp, reference = reference_log_probs(reference, tokens, routed)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=1e-5)
    own_logp = own_logp.gather(-1, tokens[1:, None]).squeeze(-1)
    assert (own_logp.double() - ref_logp).abs().max() > 1e-3  # the replay changed the output

    logp.sum().backward()
    ref_logp.sum().backward()
    for layer in (1, 2):
        want = reference.model.layers[layer].mlp.gate.weight.grad
        assert want.abs().max() > 0
        got = model.model.layers[layer].mlp.gate.weight.grad.double()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.grad is None  # a buffer


def test_replay_without_a_router_is_refused():
    config = glm_config(mlp_layer_types=["dense"] * LAYERS)
    with pytest.raises(ValueError, match="found no router"):
        install_routing_replay(glm_model(config), config)
    qwen = qwen3_config()
    with pytest.raises(ArgumentError, match="no routing adapter for model_type 'qwen3'"):
        install_routing_replay(torch.nn.Module(), qwen)


def test_ids_the_routers_cannot_take_are_refused_at_set():
    config = glm_config()
    replay = install_routing_replay(glm_model(config), config)
    assert replay.routers == {1: (NUM_EXPERTS, TOP_K), 2: (NUM_EXPERTS, TOP_K)}
    routed = torch.full((TOKENS, LAYERS, TOP_K), -1, dtype=torch.int32)  # -1: dense layer 0
    routed[:, 1:] = torch.arange(TOP_K, dtype=torch.int32)
    replay.set(routed)
    bad = routed.clone()
    bad[3, 2, 1] = NUM_EXPERTS
    with pytest.raises(ValueError, match=r"--use-rollout-routing-replay: .* outside \[0, 8\)"):
        replay.set(bad)
    with pytest.raises(ValueError, match="takes top_k=2"):
        replay.set(routed[:, :, :1])
    with pytest.raises(ValueError, match=r"must be \[tokens, num_hidden_layers, top_k\]"):
        replay.set(routed[:, :2])
    assert replay.routed is routed  # a refused set keeps the previous ids
