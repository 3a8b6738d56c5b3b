"""The memory plan's arithmetic (miles_launch.model_shape, miles_launch.memory_estimate) against
independent references on the CPU (the command line that prints and checks it:
test_memory_plan.py).

* parameters: ``ModelShape.total_params()`` of a config.json written by ``save_pretrained``
  equals ``sum(p.numel())`` of the HF model built from that config (dense, MoE, tied, untied);
* state: the FSDP estimate at one rank is the HF model's numel x 4 bytes for parameters and
  gradients, and the real AdamW state's bytes after a step for the optimizer;
* activations: the formula equals a hand derivation for one shape, and is within 2% of the bytes
  autograd saves for a tiny HF layer (the unique storages a saved-tensors hook sees, weights
  excluded), dense and MoE, with and without gradient checkpointing;
* role copies (EMA, reference, critic) and an 8B job's scale.
"""

from __future__ import annotations

import math

import pytest
import torch
from memory_shapes import SMALL, configs, saved_shape
from miles_launch.memory_estimate import (
    GiB,
    TrainerLayout,
    activation_bytes,
    head_bytes,
    state_terms,
    trainer_estimate,
)
from miles_launch.model_shape import ModelShape


# ------------------------------------------------------------------ parameters
@pytest.mark.parametrize("name", ["qwen3-tied", "qwen3-untied", "qwen3-moe", "qwen3-moe-tied"])
def test_parameter_count_is_the_hf_models_numel(name, tmp_path):
    from transformers import AutoModelForCausalLM

    config = configs()[name]
    shape = saved_shape(config, tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    assert shape.tied == config.tie_word_embeddings
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.expert_params() == experts


@pytest.mark.extended
def test_parameter_count_of_other_families(tmp_path):
    """Llama with biases, Qwen2 (q/k/v biases), Qwen2-MoE (shared expert and its gate), Mixtral,
    and DeepSeek-V3's latent attention with dense first layers."""
    from transformers import (
        AutoModelForCausalLM,
        DeepseekV3Config,
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
    )

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=8)
    for i, config in enumerate(
        [
            LlamaConfig(**SMALL, attention_bias=True),
            Qwen2Config(**SMALL, tie_word_embeddings=True),
            Qwen2MoeConfig(
                **SMALL,
                **moe,
                num_experts=4,
                shared_expert_intermediate_size=24,
                decoder_sparse_step=2,
            ),
            MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
            DeepseekV3Config(
                **SMALL,
                **moe,
                n_routed_experts=4,
                n_shared_experts=1,
                first_k_dense_replace=1,
                q_lora_rank=12,
                kv_lora_rank=8,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=8,
                n_group=1,
                topk_group=1,
            ),
        ]
    ):
        shape = saved_shape(config, tmp_path / str(i))
        model = AutoModelForCausalLM.from_config(config)
        assert shape.total_params() == sum(p.numel() for p in model.parameters()), config.model_type


# ------------------------------------------------------------------ state
def test_fsdp_state_at_one_rank_is_the_models_fp32_state(tmp_path):
    """Parameters and gradients: numel x 4 (fp32 masters); optimizer: AdamW's real state."""
    from transformers import AutoModelForCausalLM

    config = configs()["qwen3-untied"]
    shape = saved_shape(config, tmp_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    numel = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    optimizer.step()
    adam = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if t.dim()  # the step counters are scalars
    )
    gpu, host = state_terms(shape, TrainerLayout(backend="fsdp", ranks=1, tokens=8))
    assert gpu == {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer": adam}
    assert not host
    # four shards hold a quarter each; --fsdp-cpu-offload moves all of it to the host
    gpu4, _ = state_terms(shape, TrainerLayout(backend="fsdp", ranks=4, tokens=8))
    assert gpu4["optimizer"] == adam / 4
    gpu_off, host_off = state_terms(
        shape, TrainerLayout(backend="fsdp", ranks=4, tokens=8, fsdp_cpu_offload=True)
    )
    assert not gpu_off and sum(host_off.values()) == 16 * numel / 4


def test_megatron_state_by_hand():
    """TP 2 x PP 2 x DP 2 on 8 ranks, an untied dense model: the fullest stage holds half the
    layers / TP plus one embedding / TP; bf16 params, fp32 grad buffer, 12 bytes / DP."""
    shape = ModelShape(
        model_type="qwen3",
        layers=4,
        hidden=64,
        intermediate=128,
        vocab=1000,
        heads=4,
        kv_heads=2,
        head_dim=16,
        tied=False,
        qk_norm=True,
    )
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 16 + 3 * 64 * 128 + 2 * 64
    assert shape.layer_params(False) == layer
    local = (2 * layer + 1000 * 64) / 2 + 64
    lay = TrainerLayout(backend="megatron", ranks=8, tokens=16, tp=2, pp=2)
    gpu, host = state_terms(shape, lay)
    assert gpu == {"parameters": 2 * local, "gradients": 4 * local, "optimizer": 12 * local / 2}
    offloaded, host = state_terms(
        shape, TrainerLayout(**{**lay.__dict__, "optimizer_host_fraction": 0.5})
    )
    assert offloaded["optimizer"] == host["optimizer (--optimizer-cpu-offload)"] == 3 * local


# ------------------------------------------------------------------ activations
def test_activation_formula_by_hand():
    """Qwen3-0.6B's layer (h 1024, 16 q heads and 8 kv heads of 128, I 3072), bf16, per token:
    norms 2 x (4 + 4) x 1024 = 16384; q/k norms (4 + 2) x (2048 + 1024) = 18432; attention
    2 x (2048 + 1024 + 1024 + 2048) + 4 x 16 = 12352; MLP 4 x 2 x 3072 = 24576: 71744 bytes."""
    shape = ModelShape(
        model_type="qwen3",
        layers=28,
        hidden=1024,
        intermediate=3072,
        vocab=151936,
        heads=16,
        kv_heads=8,
        head_dim=128,
        tied=True,
        qk_norm=True,
    )
    assert shape.layer_activation_bytes(False) == 71744
    lay = TrainerLayout(backend="fsdp", ranks=1, tokens=1000)
    outside = (8 + 6) * 1024
    assert activation_bytes(shape, lay) == 1000 * (28 * 71744 + outside)
    # recompute: each layer's bf16 input, and one layer recomputed in backward
    full = TrainerLayout(backend="fsdp", ranks=1, tokens=1000, recompute="full")
    assert activation_bytes(shape, full) == 1000 * (28 * 2048 + 71744 + outside)
    # --gradient-checkpointing-layers 10: those keep their input, the other 18 everything
    block = TrainerLayout(
        backend="fsdp", ranks=1, tokens=1000, recompute="full", recompute_method="block",
        recompute_layers=10,
    )  # fmt: skip
    assert activation_bytes(shape, block) == 1000 * (10 * 2048 + 18 * 71744 + 71744 + outside)
    # megatron-core's layer: norms 2 x (8 + 2) x 1024 = 20480; q/k norms 8 x 3072 = 24576;
    # attention 2 x 4096 + 2 x 3072 + 2 x 2048 + 4 x 16 + 4 x 2 x 128 = 19520; MLP 5 x 2 x 3072
    # = 30720: 95296 bytes; at TP 2 without sequence parallelism the norms stay whole
    assert shape.layer_activation_bytes(False, layers="megatron") == 95296
    on_cpu = TrainerLayout(backend="megatron", ranks=2, tokens=1000, tp=2, on_cuda=False)
    assert activation_bytes(shape, on_cpu) == 1000 * (28 * (20480 + (95296 - 20480) / 2) + outside)
    # on a GPU torch's fused RMSNorm saves its bf16 input and fp32 rstd: norms 2 x (2 x 2 x 1024
    # + 4) = 8200; q/k norms the query's copy and their rstd, 2 x 2048 + 4 x (16 + 8) = 4192
    # (k's input is a view of the QKV output): 8200 + 4192 + 19520 + 30720 = 62632 bytes
    assert shape.layer_activation_bytes(False, layers="megatron", fused_norm=True) == 62632
    mega = TrainerLayout(backend="megatron", ranks=2, tokens=1000, tp=2)
    assert activation_bytes(shape, mega) == 1000 * (28 * (8200 + (62632 - 8200) / 2) + outside)
    # the dense head: 18 bytes per [tokens, V] element; the fused one its chunks and dW in fp32
    dense = TrainerLayout(backend="fsdp", ranks=1, tokens=16384, fused_head=False)
    assert head_bytes(shape, dense) == 16384 * 151936 * 18
    fused = head_bytes(shape, TrainerLayout(backend="fsdp", ranks=1, tokens=16384))
    assert fused == 4 * 512 * 2**20 + 4 * 151936 * 1024 and fused < head_bytes(shape, dense) / 8


def saved_bytes_per_layer_token(config, tokens: int, checkpointing: bool) -> float:
    """Bytes autograd saves per layer per token in a HF model: the difference between 2 and 4
    layers of the same config, unique storages, parameters excluded."""
    from transformers import AutoModelForCausalLM

    totals = []
    for layers in (2, 4):
        torch.manual_seed(0)
        config.num_hidden_layers = layers
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t, weights=weights, seen=seen):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        ids = torch.randint(0, config.vocab_size, (1, tokens))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=ids)
        totals.append(sum(seen.values()))
    return (totals[1] - totals[0]) / 2 / tokens


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_activation_formula_against_autograd(kind):
    from transformers import Qwen3Config, Qwen3MoeConfig

    sizes = dict(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    if kind == "dense":
        config = Qwen3Config(**sizes)
    else:
        config = Qwen3MoeConfig(
            **sizes, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128
        )
    config._attn_implementation = "sdpa"
    shape = ModelShape.from_config(config.to_dict())
    measured = saved_bytes_per_layer_token(config, 128, checkpointing=False)
    assert shape.layer_activation_bytes(kind == "moe") == pytest.approx(measured, rel=0.02)
    if kind == "dense":  # checkpointing keeps each layer's bf16 input only
        assert saved_bytes_per_layer_token(config, 128, checkpointing=True) == 2 * 256


def test_one_micro_batch_per_step_leaves_fsdp_gradients_out_of_backward():
    shape = ModelShape(
        model_type="qwen3",
        layers=2,
        hidden=64,
        intermediate=128,
        vocab=100,
        heads=4,
        kv_heads=2,
        head_dim=16,
        tied=True,
    )
    several, _ = trainer_estimate(shape, TrainerLayout(backend="fsdp", ranks=1, tokens=64))
    one, _ = trainer_estimate(
        shape, TrainerLayout(backend="fsdp", ranks=1, tokens=64, one_micro_batch=True)
    )
    grads = several.terms["gradients"]
    assert several.phases["training"] - one.phases["training"] == pytest.approx(grads)
    assert one.phases["optimizer step"] == several.phases["optimizer step"]


def test_scale_of_a_large_job_is_sane():
    """An 8B dense model on 8 GPUs: ~16 bytes a parameter over 8 shards plus activations."""
    shape = ModelShape(
        model_type="qwen3",
        layers=36,
        hidden=4096,
        intermediate=12288,
        vocab=151936,
        heads=32,
        kv_heads=8,
        head_dim=128,
        tied=False,
        qk_norm=True,
    )
    gpu, _ = trainer_estimate(
        shape, TrainerLayout(backend="fsdp", ranks=8, tokens=16384, recompute="full")
    )
    state = 16 * shape.total_params() / 8
    assert math.isclose(sum(gpu.terms[k] for k in ("parameters", "gradients", "optimizer")), state)
    assert 20 * GiB < gpu.peak < 40 * GiB


def test_role_copies():
    """EMA: a copy of the fp32 shards; the reference: the model in bf16 over the shards; the
    critic: its own parameters, gradients and AdamW state, without the LM head."""
    shape = ModelShape(
        model_type="qwen3", layers=2, hidden=64, intermediate=128, vocab=1000, heads=4,
        kv_heads=2, head_dim=16, tied=False,
    )  # fmt: skip
    lay = TrainerLayout(backend="fsdp", ranks=4, tokens=8, ema=True, ref="gpu", critic=True)
    gpu, host = trainer_estimate(shape, lay)
    p = shape.total_params()
    assert gpu.terms["EMA"] == gpu.terms["parameters"] == 4 * p / 4
    assert gpu.terms["reference"] == 2 * p / 4
    assert gpu.terms["critic"] == 16 * (p - shape.head_params()) / 4
    _, host = trainer_estimate(shape, TrainerLayout(backend="fsdp", ranks=4, tokens=8, ref="host"))
    assert host.terms == {"reference": 2 * p / 4}
