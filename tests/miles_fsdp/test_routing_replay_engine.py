"""R3 end to end: the built-in engine's routed experts replayed in the FSDP trainer.

The engine (``python -m miles_launch.builtin_engine --enable-return-routed-experts``) samples a
response from a tiny MoE and returns its log-probs and routed experts. The trainer loads the
same weights except for a perturbed router, chosen so that its own top-k differs from the
engine's while the routing weights at the engine's experts stay the same:

* qwen3_moe (softmax top-k, ``norm_topk_prob``): an expert the engine never picked in a layer
  gets 4x the router row of the layer's most used expert. With renormalised top-k weights
  ``w_j = exp(l_j) / sum_{i in chosen} exp(l_i)`` a logit outside the chosen set cancels, so
  the weights at the engine's experts do not move, but the trainer's own top-k now takes it.
* glm4_moe_lite (sigmoid, grouped top-k): a new ``e_score_correction_bias``, which only chooses.

With replay the trainer's log-probs equal the engine's; without it they do not; and the
router's gradient equals a float64 reference written in the test (moe_reference.py) at the
engine's experts.
"""

from __future__ import annotations

import pytest
import torch
from full_tensors import full
from moe_reference import reference_log_probs
from routed_experts_testing import (
    differs,
    engine_rollout,
    moe_config,
    moe_layers,
    own_top_k,
    perturb_routers,
    rollout_context,
    save_trainer_copy,
)
from run_args import make_args
from tiny_models import save_tiny_model
from tolerances import assert_within, grad_atol

pytestmark = pytest.mark.numeric

PROMPT_LEN, RESPONSE_LEN = 5, 8
SAMPLING = {
    "max_new_tokens": RESPONSE_LEN,
    "temperature": 1.0,
    "ignore_eos": True,
    "sampling_seed": 7,
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe_lite"])
def test_replay_reproduces_the_engine_log_probs(one_rank_group, tmp_path, model_type):
    from miles_core.batch import RolloutBatch, Sample
    from miles_core.log_probs import token_log_probs
    from miles_core.packing import pack_thd
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.train_step import packed_logits
    from transformers import AutoModelForCausalLM

    config = moe_config(model_type)
    engine_dir = save_tiny_model(tmp_path / "engine", config)
    prompt = torch.randint(2, 64, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))
    tokens, engine_logp, routed = engine_rollout(engine_dir, config, prompt, SAMPLING)

    model = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32)
    own_before = own_top_k(model, tokens[:-1])
    perturb_routers(model, routed)
    trainer_dir = save_trainer_copy(model, tmp_path / "trainer")
    assert not differs(own_before, routed)  # the unperturbed model routes as the engine did
    assert differs(own_top_k(model, tokens[:-1]), routed)

    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(trainer_dir), use_rollout_routing_replay=True))
    ctx = rollout_context(backend)
    sample = Sample(tokens=tokens, response_length=RESPONSE_LEN, reward=1.0, routed_experts=routed)
    packed = pack_thd(RolloutBatch([sample]))
    response = slice(PROMPT_LEN - 1, PROMPT_LEN - 1 + RESPONSE_LEN)
    logp = token_log_probs(packed_logits(ctx, packed), packed.targets, 1.0)[0, response]
    torch.testing.assert_close(logp.detach(), engine_logp, rtol=0, atol=2e-5)

    # the router's gradient: the float64 formula at the engine's experts (final row as packed)
    logp.sum().backward()
    as_packed = packed.routed_experts[: len(tokens)]
    ref_logp, reference = reference_log_probs(str(trainer_dir), tokens, as_packed)
    torch.testing.assert_close(ref_logp[response], engine_logp.double(), rtol=0, atol=2e-5)
    ref_logp[response].sum().backward()
    for layer in moe_layers(reference):
        want = reference.model.layers[layer].mlp.gate.weight.grad
        grad = backend.model.model.layers[layer].mlp.gate.weight.grad
        grad = full(grad)
        assert want.abs().max() > 0
        assert_within(grad, want, grad_atol(want), f"router gradient of layer {layer}")

    # without replay the trainer routes by its own (perturbed) top-k: not the engine's numbers
    ctx.routing_replay = None
    backend.routing_replay.set(None)
    with torch.no_grad():
        own_logp = token_log_probs(packed_logits(ctx, packed), packed.targets, 1.0)[0, response]
    assert (own_logp - engine_logp).abs().max() > 1e-2

    ctx.routing_replay = backend.routing_replay
    bare = pack_thd(RolloutBatch([Sample(tokens=tokens, response_length=RESPONSE_LEN, reward=1.0)]))
    with pytest.raises(ValueError, match="samples carry no routed_experts"):
        packed_logits(ctx, bare)
    backend.close()
