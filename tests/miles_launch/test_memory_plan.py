"""The memory plan (miles_launch.model_shape, miles_launch.memory_estimate, miles_launch.memory_plan):
its arithmetic against
independent references on the CPU, and its refusal through the real ``miles train`` command line.

* parameters: ``ModelShape.total_params()`` of a config.json written by ``save_pretrained``
  equals ``sum(p.numel())`` of the HF model built from that config (dense, MoE, tied, untied);
* state: the FSDP estimate at one rank is the HF model's numel x 4 bytes for parameters and
  gradients, and the real AdamW state's bytes after a step for the optimizer;
* activations: the formula equals a hand derivation for one shape, and is within 2% of the bytes
  autograd saves for a tiny HF layer (the unique storages a saved-tensors hook sees, weights
  excluded), dense and MoE, with and without gradient checkpointing;
* the command line: a job over ``--gpu-memory-gib`` is one ``error:`` line naming
  ``--ignore-memory-plan`` (exit 2, nothing started); with the flag it runs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from types import SimpleNamespace

import miles_launch.train as train_module
import pytest
import torch
from miles_launch.cli import main as cli_main
from miles_launch.demo import build_tiny_qwen3, demo_flags, write_demo_prompts
from miles_launch.memory_estimate import (
    GiB,
    TrainerLayout,
    activation_bytes,
    head_bytes,
    state_terms,
    trainer_estimate,
)
from miles_launch.model_shape import ModelShape

SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def configs():
    from transformers import Qwen3Config, Qwen3MoeConfig

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    return {
        "qwen3-tied": Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True),
        "qwen3-untied": Qwen3Config(**SMALL, tie_word_embeddings=False),
        "qwen3-moe": Qwen3MoeConfig(**SMALL, **moe, mlp_only_layers=[0]),
        "qwen3-moe-tied": Qwen3MoeConfig(**SMALL, **moe, tie_word_embeddings=True),
    }


def saved_shape(config, tmp_path: Path) -> ModelShape:
    """The shape read back from the config.json ``save_pretrained`` writes (what a run reads)."""
    config.save_pretrained(tmp_path)
    return ModelShape.from_hf_dir(tmp_path)


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
    # megatron-core's layer: norms 2 x (8 + 2) x 1024 = 20480; q/k norms 8 x 3072 = 24576;
    # attention 2 x 4096 + 2 x 3072 + 2 x 2048 + 4 x 16 + 4 x 2 x 128 = 19520; MLP 5 x 2 x 3072
    # = 30720: 95296 bytes; at TP 2 without sequence parallelism the norms stay whole
    assert shape.layer_activation_bytes(False, layers="megatron") == 95296
    mega = TrainerLayout(backend="megatron", ranks=2, tokens=1000, tp=2)
    assert activation_bytes(shape, mega) == 1000 * (28 * (20480 + (95296 - 20480) / 2) + outside)
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


# ------------------------------------------------------------------ the command line
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("memory") / "tiny-qwen3")


@pytest.fixture
def job(tmp_path, hf_dir, monkeypatch):
    """``run(*flags) -> (exit status, stdout, stderr)`` of ``miles train`` on the demo's job;
    ``reached`` lists the jobs that got past the preflight (``run`` is a stand-in)."""
    prompts = write_demo_prompts(tmp_path / "prompts.jsonl", num_prompts=4)
    reached: list = []
    monkeypatch.setattr(train_module, "run", lambda args: reached.append(args) or [])

    def run(capsys, *flags: str):
        argv = ["train", *demo_flags(hf_dir, prompts, tmp_path / "out" / "m.jsonl"), *flags]
        code = 0
        try:
            cli_main(argv)
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run, reached


def test_plan_prints_the_estimate_unchecked_without_a_gpu(job, capsys):
    run, reached = job
    code, out, err = run(capsys, "--dry-run")
    assert code == 0 and not reached, err
    memory = [line.strip() for line in out.splitlines() if line.strip().startswith("memory:")]
    assert len(memory) == 3, out
    assert memory[0].startswith("memory: trainer GPU ~") and "not checked" in memory[0]
    assert "parameters" in memory[0] and "optimizer" in memory[0] and "activations" in memory[0]
    assert memory[1].startswith("memory: engine GPU: built-in engine, weights")
    assert memory[2].startswith("memory: host per trainer node")


def test_job_over_the_gpu_is_refused_unless_ignored(job, capsys):
    run, reached = job
    start = time.monotonic()
    code, out, err = run(capsys, "--gpu-memory-gib", "0.0001")
    lines = err.strip().splitlines()
    assert code == 2 and not reached and time.monotonic() - start < 15
    assert len(lines) == 1 and lines[0].startswith("error: the memory plan estimates"), err
    assert "--ignore-memory-plan" in lines[0] and "--gpu-memory-gib" in lines[0]
    code, out, err = run(capsys, "--gpu-memory-gib", "0.0001", "--ignore-memory-plan")
    assert code == 0 and len(reached) == 1, err
    assert "over the 104.9 KiB (--gpu-memory-gib)" in out
    code, out, err = run(capsys, "--gpu-memory-gib", "80", "--dry-run")
    assert code == 0 and "fits 80.0 GiB (--gpu-memory-gib)" in out, err


def test_gpu_memory_gib_must_be_positive(job, capsys):
    run, reached = job
    code, out, err = run(capsys, "--gpu-memory-gib", "0")
    assert code == 2 and "--gpu-memory-gib must be > 0" in err and not reached


def test_memory_flags_refused_for_a_backend_without_an_estimate():
    from miles_core.args import ArgumentError
    from miles_launch.args import JobArgs

    args = SimpleNamespace(
        load_required=False,
        load=None,
        gpu_memory_gib=None,
        ignore_memory_plan=True,
        train_backend="other",
    )
    with pytest.raises(ArgumentError, match="--ignore-memory-plan: the memory plan estimates"):
        JobArgs.validate(args)


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


def parsed(tmp_path: Path, backend: str, *flags: str):
    """``miles train``'s flags for ``backend`` parsed with every group (no preflight), on a
    Qwen3-shaped config.json written under ``tmp_path``."""
    from miles_core.args import entry_point_groups, parse_args
    from transformers import Qwen3Config

    Qwen3Config(**SMALL, head_dim=16).save_pretrained(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    argv = ["--train-backend", backend, "--hf-checkpoint", str(tmp_path)]
    argv += ["--prompt-data", str(tmp_path / "p.jsonl"), "--rollout-engine", "builtin"]
    return parse_args([*argv, *flags], entry_point_groups("core", backend, "launch"))


def test_colocated_job_has_a_generation_phase_and_sleep_backups(tmp_path):
    """--colocate: the trainer sleeps to pinned host memory (its parameters and optimizer state
    are the host's), SGLang's fraction of the GPU (0.8 under --colocate) is the generation
    phase, and the engine releases its memory while the trainer trains."""
    from miles_launch.memory_plan import job_memory

    args = parsed(
        tmp_path, "fsdp", "--colocate", "--actor-num-gpus-per-node", "2",
        "--gpu-memory-gib", "10", "--max-tokens-per-gpu", "64", "--rollout-engine", "sglang",
    )  # fmt: skip
    job = job_memory(args, use_gpu=False)
    t, host = job.trainer, job.host_per_rank
    assert t.phases["generation"] == pytest.approx(0.8 * 10 * GiB)  # the trainer sleeps
    assert t.peak_phase == "generation" and not job.exceeds()
    backups = t.terms["parameters"] + t.terms["optimizer"]
    assert host.terms == {"sleep backups": backups}
    assert job.host_per_node == 2 * backups
    awake, _ = trainer_estimate(
        ModelShape.from_hf_dir(tmp_path),
        TrainerLayout(backend="fsdp", ranks=2, tokens=64, on_cuda=False, compute_bytes=2),
    )
    assert t.phases["training"] == pytest.approx(awake.phases["training"])


@pytest.mark.extended
def test_megatron_layout_from_its_flags(tmp_path):
    """Megatron's own flags (generated from megatron-core's configs) reach the layout."""
    from miles_launch.memory_plan import job_memory, trainer_layout

    args = parsed(
        tmp_path, "megatron", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "1",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity",
        "full", "--recompute-method", "block", "--recompute-num-layers", "2",
        "--optimizer-cpu-offload", "--no-grad-reduce-in-fp32", "--max-tokens-per-gpu", "128",
    )  # fmt: skip
    lay = trainer_layout(args, on_cuda=True)
    assert (lay.backend, lay.tp, lay.dp, lay.sequence_parallel) == ("megatron", 2, 4, True)
    assert (lay.recompute, lay.recompute_method, lay.recompute_layers) == ("full", "block", 2)
    assert (lay.grad_bytes, lay.optimizer_host_fraction) == (2, 1.0)
    job = job_memory(args, use_gpu=False)
    assert "optimizer" not in job.trainer.terms
    assert set(job.host_per_rank.terms) == {"optimizer (--optimizer-cpu-offload)"}


def test_engine_weights_over_its_fraction_are_refused(tmp_path):
    """SGLang's weights must fit its --sglang-mem-fraction-static of the GPU."""
    from miles_core.args import ArgumentError
    from miles_launch.memory_plan import check_memory, job_memory

    flags = ["--rollout-engine", "sglang", "--sglang-mem-fraction-static", "0.05"]
    flags += ["--gpu-memory-gib", str(1 / 1024), "--max-tokens-per-gpu", "8"]
    args = parsed(tmp_path, "fsdp", *flags)  # 1 MiB: the engine may use 51 KiB
    job = job_memory(args, use_gpu=False)
    assert job.engine_weights == 2 * ModelShape.from_hf_dir(tmp_path).total_params()
    assert job.engine_exceeds() and job.engine_room == pytest.approx(0.05 * 2**20)
    assert not job.exceeds()  # the trainer fits
    with pytest.raises(ArgumentError, match="--sglang-mem-fraction-static.*--ignore-memory-plan"):
        check_memory(args, use_gpu=False)
    args.ignore_memory_plan = True
    check_memory(args, use_gpu=False)


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


def test_a_model_type_it_does_not_count_is_printed_unchecked(tmp_path):
    """A hybrid model (Mamba layers, here nemotron_h) gets no estimate, said so, and no refusal."""
    import json

    from miles_launch.memory_plan import check_memory, plan_memory_lines

    args = parsed(tmp_path, "fsdp", "--gpu-memory-gib", "0.0001")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "nemotron_h"}))
    (line,) = plan_memory_lines(args, use_gpu=False)
    assert line.startswith("memory: no estimate (model_type nemotron_h is not one whose layers")
    assert line.endswith("; not checked")
    check_memory(args, use_gpu=False)
    with pytest.raises(ValueError, match="model_type nemotron_h"):
        ModelShape.from_hf_dir(tmp_path)


def test_disk_sleep_holds_its_ring_on_the_host(tmp_path):
    from miles_launch.memory_plan import job_memory

    args = parsed(
        tmp_path, "fsdp", "--colocate", "--offload-train-target", "disk",
        "--offload-train-disk-chunk-mb", "64",
    )  # fmt: skip
    job = job_memory(args, use_gpu=False)
    assert job.host_per_rank.terms == {"disk sleep's pinned ring": 4 * 64 * 2**20}
