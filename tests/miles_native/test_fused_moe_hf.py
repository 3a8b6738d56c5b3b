"""transformers' batched experts on the fused kernels ("miles_fused") vs their own eager loop.

Runs the kernels under the Triton interpreter (see test_fused_moe.py for why the variable is
set at collection).
"""

import copy
import os
import sys

import pytest
import torch

if "miles_native.kernels" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("miles_native.kernels")
from miles_native.kernels.fused_moe import INTERPRETED  # noqa: E402
from miles_native.kernels.hf_experts import (  # noqa: E402
    register_fused_experts,
    use_fused_experts,
)

pytestmark = [
    pytest.mark.numeric,
    pytest.mark.skipif(not INTERPRETED, reason="kernels were imported for the GPU in this process"),
]
transformers = pytest.importorskip("transformers")


def rel_err(got, want):
    return ((got - want).norm() / want.norm()).item()


def tiny_qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).float()


@pytest.mark.slow  # mostly transformers' import and model build
def test_tiny_qwen3_moe_trains_the_same_fused_and_eager():
    eager = tiny_qwen3_moe()
    eager.set_experts_implementation("eager")
    fused = copy.deepcopy(eager)
    use_fused_experts(fused)
    experts = fused.model.layers[0].mlp.experts
    assert experts.config._experts_implementation == "miles_fused"
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 5), generator=gen) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, fused)]
    for step, ids in enumerate(batches):
        losses = []
        for model, opt in zip((eager, fused), opts):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
            if step == 0:  # every parameter's gradient, the routers' included
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                if model is eager:
                    want_grads = grads
            opt.step()
        assert abs(losses[0] - losses[1]) < 1e-5 * abs(losses[0]), step
        if step == 0:
            for name, grad in grads.items():
                assert rel_err(grad, want_grads[name]) < 1e-5, name
    for (name, p_eager), p_fused in zip(eager.named_parameters(), fused.parameters()):
        assert rel_err(p_fused, p_eager) < 1e-5, name


@pytest.mark.parametrize(
    ("module", "config_cls", "experts_cls", "num_experts_key"),
    [
        ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeExperts", "num_experts"),
        ("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteExperts", "n_routed_experts"),
    ],
)
def test_other_architectures_experts_match_their_eager_loop(
    module, config_cls, experts_cls, num_experts_key
):
    modeling = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    config = getattr(transformers, config_cls)(
        hidden_size=32, moe_intermediate_size=16, num_experts_per_tok=2, **{num_experts_key: 5}
    )
    register_fused_experts()
    torch.manual_seed(2)
    eager = getattr(modeling, experts_cls)(config)
    with torch.no_grad():
        eager.gate_up_proj.normal_(0, 0.2)
        eager.down_proj.normal_(0, 0.2)
    eager.config = copy.copy(config)
    eager.config._experts_implementation = "eager"
    fused = copy.deepcopy(eager)
    fused.config = copy.copy(config)
    fused.config._experts_implementation = "miles_fused"

    x = torch.randn(9, 32)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(9)])  # expert 4 gets no token
    weights = torch.rand(9, 2)
    results = []
    for experts in (eager, fused):
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts(xi, ids, wi)
        out.backward(torch.cos(out.detach()))
        results.append([out, xi.grad, wi.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    for name, want, got in zip(("out", "x", "weights", "gate_up", "down"), *results):
        assert rel_err(got, want) < 1e-5, name


def test_unsupported_experts_are_refused_by_name():
    model = tiny_qwen3_moe()
    use_fused_experts(model)
    model.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(NotImplementedError, match="Qwen3MoeExperts has has_bias"):
        model(input_ids=torch.zeros(1, 3, dtype=torch.long))
