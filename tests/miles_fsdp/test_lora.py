"""LoRA via PEFT: the adapter's flag checks and targets (the directories themselves are tested in
tests/miles_core/test_peft_adapter.py), and (2 gloo ranks) gradients and the AdamW step against a
dense float64 oracle ``W + (alpha/r) * B @ A``, merged publishing in base names, the lora_base
forward, fp32 gradients after a first forward with adapters disabled, adapter-only checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from miles_core.args import ArgumentError
from miles_core.peft_adapter import LoRAConfig
from miles_fsdp.lora import actor_lora, inject_lora, lora_layers, merge_lora_tensors
from role_programs import lora_program
from run_args import make_args
from spawn import run_ranks
from tiny_models import save_tiny_model
from tolerances import adam_step_atol, assert_within

pytestmark = pytest.mark.numeric

TARGETS = ["q_proj", "v_proj", "down_proj"]
RANK, ALPHA = 4, 8.0
# eps well above the smallest gradients, so fp32 and fp64 agree on g / (|g| + eps)
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.98), 1e-5, 0.01


def save_adapter(hf_dir, out, r=RANK, alpha=ALPHA, seed=5):
    """A PEFT adapter with random non-zero A and B (B is zero at PEFT's init)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf_dir = save_tiny_model(root / "qwen3")
    return hf_dir, save_adapter(str(hf_dir), root / "adapter")


def test_rank_alpha_mismatch_names_flags(dirs):
    args = make_args(use_lora=True, lora_rank=8, lora_alpha=16.0, lora_adapter_path=[str(dirs[1])])
    with pytest.raises(ArgumentError) as err:
        actor_lora(args)
    assert str(err.value).endswith(
        "r=4, lora_alpha=8, but --lora-rank 8 --lora-alpha 16: pass --lora-rank 4 --lora-alpha 8"
    )


def test_string_target_modules_are_one_regex(dirs):
    """A PEFT config's string ``target_modules`` is one regex matched in full, not a suffix."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dirs[0])
    settings = LoRAConfig(RANK, ALPHA, 0.0, r".*layers\.1\.self_attn\.(q|v)_proj")
    inject_lora(model, settings, on_meta=False)
    layers = {id(m) for m in lora_layers(model)}
    wrapped = sorted(n for n, m in model.named_modules() if id(m) in layers)
    assert wrapped == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]


def test_merge_lora_tensors_names_and_values():
    w, a, b = torch.randn(3, 2), torch.randn(1, 2), torch.randn(3, 1)
    named = [
        ("m.base_layer.weight", w),
        ("m.base_layer.bias", torch.ones(3)),
        ("m.lora_A.default.weight", a),
        ("m.lora_B.default.weight", b),
        ("n.weight", torch.zeros(2)),
    ]
    out = dict(merge_lora_tensors(named, 0.5))
    assert list(out) == ["m.weight", "m.bias", "n.weight"]
    torch.testing.assert_close(out["m.weight"], w + 0.5 * b @ a)


def oracle(hf_dir, adapter_dir, data):
    """Float64 dense model with W + s * B @ A: logits, base logits, grads of A/B, AdamW step."""
    from safetensors.torch import load_file
    from torch.func import functional_call
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float64, attn_implementation="eager"
    )
    scale = ALPHA / RANK
    factors = {
        k.removeprefix("base_model.model.").replace(".weight", ".default.weight"): v.double()
        for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()
    }
    leaves = {k: v.clone().requires_grad_(True) for k, v in factors.items()}
    base = dict(model.named_parameters())

    def params():
        out = dict(base)
        for k in leaves:
            if ".lora_A." in k:
                module = k.split(".lora_A.")[0]
                a, b = leaves[k], leaves[k.replace(".lora_A.", ".lora_B.")]
                out[f"{module}.weight"] = base[f"{module}.weight"].detach() + scale * b @ a
        return out

    denominator = data.shape[0] * (data.shape[1] - 1)
    logits = functional_call(model, params(), (data,), {"use_cache": False}).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, 64), data[:, 1:].reshape(-1), reduction="sum")
    (nll / denominator).backward()
    with torch.no_grad():
        base_logits = model(input_ids=data, use_cache=False).logits
        merged = {k: v.detach() for k, v in params().items()}
    grads = {k: v.grad.clone() for k, v in leaves.items()}
    opt = torch.optim.AdamW(list(leaves.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt.step()
    stepped = {k: v.detach() for k, v in leaves.items()}
    return logits.detach(), base_logits, grads, stepped, merged


@pytest.mark.slow
def test_lora_actor_two_ranks(dirs, tmp_path):
    hf_dir, adapter_dir = dirs
    data = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "out.pt"
    run_ranks(
        2,
        lora_program,
        str(hf_dir),
        str(adapter_dir),
        data,
        str(tmp_path / "ckpt"),
        str(out),
        timeout=400,
    )
    res = torch.load(out, weights_only=True)
    logits, base_logits, grads, stepped, merged = oracle(hf_dir, adapter_dir, data)

    assert res["trainable"] == sorted(grads) and len(grads) == 2 * 3 * 2  # 2 layers x 3 targets
    # published: the base checkpoint's names, merged values
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        assert set(res["published"]) == set(f.keys())
    for name, value in res["published"].items():
        torch.testing.assert_close(value.double(), merged[name], atol=2e-6, rtol=0, msg=name)
    # lora_base (rank 0's rows): the base model; afterwards the adapter is back on
    torch.testing.assert_close(res["base_logits"].double(), base_logits[0::2], atol=1e-5, rtol=0)
    torch.testing.assert_close(res["lora_logits"].double(), logits[0::2], atol=1e-5, rtol=0)
    assert res["requires_grad_after"] == res["trainable"]
    # gradients and one AdamW step against the float64 oracle
    for name, g in grads.items():
        torch.testing.assert_close(res["grads"][name].double(), g, atol=1e-6, rtol=1e-4, msg=name)
        atol = adam_step_atol(g, stepped[name], lr=LR, eps=EPS)
        assert_within(res["stepped"][name], stepped[name], atol, f"stepped {name}")
    assert res["frozen_grads"] == [] and sorted(res["grads"]) == res["trainable"]
    for name, v in res["initial"].items():
        if name not in grads:
            torch.testing.assert_close(res["stepped"][name], v, atol=0, rtol=0)
    # adapter-only checkpoint, restored over the flags' adapter
    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "iter_0000001" / "model")).read_metadata()
    saved = set(keys.state_dict_metadata)
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    for name, v in res["stepped"].items():
        torch.testing.assert_close(res["resumed"][name], v, atol=0, rtol=0, msg=name)
    assert res["ema_params"] == res["trainable"]  # EMA never averages the frozen base
    # train() with --ref-mode lora_base: KL against the base, adapters keep training
    assert res["kl_metrics"]["kl_loss"] > 0
    assert res["kl_requires_grad"] == res["trainable"]
    for name in res["trainable"]:
        assert not torch.equal(res["kl_trained"][name], res["resumed"][name]), name
    for name, v in res["resumed"].items():
        if name not in grads:
            torch.testing.assert_close(res["kl_trained"][name], v, atol=0, rtol=0)
    # bf16 compute after a first forward with adapters disabled: gradients stay fp32
    assert res["dtype"]["grad"] and set(res["dtype"]["grad"].values()) == {torch.float32}
    assert set(res["dtype"]["param"].values()) == {torch.float32}
