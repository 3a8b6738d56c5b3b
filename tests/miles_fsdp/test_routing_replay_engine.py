"""R3 end to end: the built-in engine's routed experts replayed in the FSDP trainer.

The engine (``python -m miles_launch.engine --enable-return-routed-experts``) samples a
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

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_reference import reference_log_probs
from run_args import make_args
from tiny_models import arch_config, save_tiny_model, save_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_launch"))

from engine_testing import EngineProcess  # noqa: E402

PROMPT_LEN, RESPONSE_LEN = 5, 8


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def moe_config(model_type: str):
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


def engine_rollout(hf_dir: Path, config):
    """One sampled response from the built-in engine: tokens, log-probs, routed experts."""
    from miles_core.engine import decode_routed_experts

    prompt = torch.randint(2, 64, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))
    body = {
        "input_ids": prompt.tolist(),
        "sampling_params": {
            "max_new_tokens": RESPONSE_LEN,
            "temperature": 1.0,
            "ignore_eos": True,
            "sampling_seed": 7,
        },
        "return_logprob": True,
        "return_routed_experts": True,
    }
    engine = EngineProcess(hf_dir, "--enable-return-routed-experts", timeout=240)
    try:
        reply = engine.post("/generate", body).json()
    finally:
        engine.close()
    meta = reply["meta_info"]
    tokens = torch.tensor(prompt.tolist() + reply["output_ids"])
    log_probs = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    routed = decode_routed_experts(
        meta["routed_experts"], config.num_hidden_layers, config.num_experts_per_tok
    )
    assert routed.shape[0] == len(tokens) - 1  # the final token is never fed
    return tokens, log_probs, torch.from_numpy(routed.copy())


def moe_layers(model) -> list[int]:
    return [i for i, block in enumerate(model.model.layers) if hasattr(block.mlp, "gate")]


def perturb_routers(model, routed: torch.Tensor) -> None:
    """Change the router's choice, not its weights at ``routed`` (see the module docstring)."""
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in moe_layers(model):
            gate = model.model.layers[layer].mlp.gate
            if model.config.model_type == "glm4_moe_lite":
                gate.e_score_correction_bias.copy_(torch.randn(gate.num_experts, generator=g) * 5)
                continue
            counts = torch.bincount(routed[:, layer].flatten().long(), minlength=gate.num_experts)
            unused = torch.nonzero(counts == 0).flatten()
            assert len(unused) > 0, f"layer {layer}: the engine used every expert"
            gate.weight[unused[0]] = 4.0 * gate.weight[counts.argmax()]


def own_top_k(model, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """The top-k ids the model's own routers pick for ``tokens`` (one unreplayed forward)."""
    seen, handles = {}, []
    for layer in moe_layers(model):

        def hook(module, args, output, layer=layer):
            seen[layer] = output[2].detach().clone()

        handles.append(model.model.layers[layer].mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=tokens[None], use_cache=False)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe_lite"])
def test_replay_reproduces_the_engine_log_probs(one_rank_group, tmp_path, model_type):
    from miles_core.batch import RolloutBatch, Sample
    from miles_core.log_probs import token_log_probs
    from miles_core.packing import pack_thd
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.rollout_train import RolloutContext, packed_logits
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    config = moe_config(model_type)
    engine_dir = save_tiny_model(tmp_path / "engine", config)
    tokens, engine_logp, routed = engine_rollout(engine_dir, config)

    trainer_dir = tmp_path / "trainer"
    model = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32)
    own_before = own_top_k(model, tokens[:-1])
    perturb_routers(model, routed)
    model.save_pretrained(trainer_dir)
    save_tokenizer(trainer_dir, config.vocab_size)
    own = own_top_k(model, tokens[:-1])
    for layer in own:  # the unperturbed model routes as the engine did
        assert torch.equal(own_before[layer].sort(-1).values, routed[:, layer].sort(-1).values)
    assert any(
        not torch.equal(ids.sort(-1).values, routed[:, layer].sort(-1).values)
        for layer, ids in own.items()
    )

    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(trainer_dir), use_rollout_routing_replay=True))
    ctx = RolloutContext(
        model=backend.model,
        optimizer=backend.optimizer,
        scheduler=backend.scheduler,
        args=backend.args,
        device=backend.device,
        dp_size=1,
        cpu_group=None,
        attn_implementation=backend.attn_implementation,
        compute_dtype=backend.precision.compute_dtype,
        routing_replay=backend.routing_replay,
    )
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
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        assert want.abs().max() > 0
        torch.testing.assert_close(grad.double(), want, rtol=1e-4, atol=1e-6, msg=f"{layer}")

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
