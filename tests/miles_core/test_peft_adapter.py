"""PEFT adapter directories (miles_core.peft_adapter): round trip, what PEFT saves reads back,
what we write loads in ``peft.PeftModel`` with the logits of ``W + (alpha/r) B A`` (float64,
written here), errors naming file and field, and atomic replacement."""

from __future__ import annotations

import json

import pytest
import torch
from miles_core.args import ArgumentError
from miles_core.peft_adapter import (
    PeftAdapter,
    PeftAdapterError,
    check_matches_flags,
    read_peft_adapter,
    write_peft_adapter,
)
from safetensors.torch import load_file, save_file

TARGETS = ("down_proj", "q_proj", "v_proj")
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 saved with ``save_pretrained`` (float32, untied head)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "qwen3"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def random_factors(shapes: dict[str, tuple[int, int]], rank: int = RANK, seed: int = 0):
    """``{module: {lora_A [r, in], lora_B [out, r]}}`` for ``{module: (out, in)}``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        module: {
            "lora_A": torch.randn(rank, fan_in, generator=gen) * 0.2,
            "lora_B": torch.randn(fan_out, rank, generator=gen) * 0.2,
        }
        for module, (fan_out, fan_in) in shapes.items()
    }


def small_adapter(targets: str | tuple[str, ...] = ("q_proj",), **fields) -> PeftAdapter:
    factors = random_factors({"model.layers.0.self_attn.q_proj": (32, 16)})
    return PeftAdapter(RANK, ALPHA, targets, factors, **fields)


def write_with_config(tmp_path, **config_changes):
    """Our adapter directory with ``adapter_config.json`` edited."""
    path = write_peft_adapter(tmp_path / "a", small_adapter())
    config_file = path / "adapter_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | config_changes))
    return path


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("targets", [("v_proj", "q_proj"), r".*layers\.0\..*_proj"])
def test_round_trip(tmp_path, targets):
    from peft import LoraConfig

    adapter = small_adapter(targets, dropout=0.05, base_model="/models/base")
    path = write_peft_adapter(tmp_path / "nested" / "a", adapter)
    back = read_peft_adapter(path)
    assert back.path == path
    assert (back.rank, back.alpha, back.dropout, back.base_model) == (4, 8.0, 0.05, "/models/base")
    assert back.target_modules == (targets if isinstance(targets, str) else tuple(sorted(targets)))
    assert back.scale == 2.0
    assert back.factors.keys() == adapter.factors.keys()
    for module, pair in adapter.factors.items():
        for factor, tensor in pair.items():
            assert torch.equal(back.factors[module][factor], tensor), (module, factor)
    assert sorted(load_file(str(path / "adapter_model.safetensors"))) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    config = LoraConfig.from_pretrained(str(path))
    want = targets if isinstance(targets, str) else set(targets)
    assert (config.r, config.lora_alpha, config.target_modules) == (4, 8.0, want)
    assert sorted(p.name for p in path.parent.iterdir()) == ["a"]  # no temporary left


def test_reads_what_peft_saves(qwen3, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(qwen3)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
    model.save_pretrained(tmp_path / "saved")

    adapter = read_peft_adapter(tmp_path / "saved")
    assert (adapter.rank, adapter.alpha, adapter.target_modules) == (RANK, ALPHA, TARGETS)
    assert adapter.base_model == str(qwen3)
    params = dict(model.named_parameters())
    assert len(adapter.factors) == 2 * len(TARGETS)
    for module, pair in adapter.factors.items():
        for factor, tensor in pair.items():
            want = params[f"base_model.model.{module}.{factor}.default.weight"]
            assert torch.equal(tensor, want.detach()), (module, factor)


def test_written_adapter_loads_in_peft_with_merged_logits(qwen3, tmp_path):
    """PEFT's forward on our directory == the HF model with ``W + (alpha/r) B A`` (float64)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load(dtype):
        return AutoModelForCausalLM.from_pretrained(qwen3, dtype=dtype, attn_implementation="eager")

    reference = load(torch.float64)
    weights = dict(reference.named_parameters())
    shapes = {
        name.removesuffix(".weight"): tuple(w.shape)
        for name, w in weights.items()
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in TARGETS
    }
    assert len(shapes) == 2 * len(TARGETS)
    factors = random_factors(shapes, seed=2)
    write_peft_adapter(tmp_path / "ours", PeftAdapter(RANK, ALPHA, TARGETS, factors))

    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    peft_model = PeftModel.from_pretrained(load(torch.float32), str(tmp_path / "ours"))
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits.double()
        base_logits = reference(input_ids=ids).logits
        for module, pair in factors.items():
            delta = (ALPHA / RANK) * (pair["lora_B"].double() @ pair["lora_A"].double())
            weights[f"{module}.weight"].add_(delta)
        merged_logits = reference(input_ids=ids).logits
    assert (peft_logits - merged_logits).abs().max() < 1e-5
    assert (peft_logits - base_logits).abs().max() > 1e-2  # every module took effect


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": True}, "use_dora is set (DoRA adapters are not supported)"),
        ({"use_rslora": True}, "use_rslora is set"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is set"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is set"),
        ({"layers_to_transform": [0]}, "layers_to_transform is set"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out is set"),
        ({"bias": "lora_only"}, "bias='lora_only' (trained biases are not supported)"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
        ({"r": None}, "no r"),
        ({"target_modules": None}, "no target_modules"),
        ({"r": "4"}, "r='4' is not a positive integer"),
        ({"lora_alpha": "8"}, "lora_alpha='8' is not a number"),
        ({"target_modules": [1]}, "target_modules=[1] is neither"),
        ({"r": 8}, "model.layers.0.self_attn.q_proj has lora_A (4, 16), lora_B (32, 4); r=8"),
    ],
)
def test_bad_config_names_file_and_field(tmp_path, change, message):
    path = write_with_config(tmp_path, **change)
    with pytest.raises(PeftAdapterError) as err:
        read_peft_adapter(path)
    assert str(err.value).startswith(str(path) + "/adapter_")
    assert message in str(err.value)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(PeftAdapterError, match="adapter_config.json: missing \\(not a PEFT"):
        read_peft_adapter(tmp_path)
    path = write_peft_adapter(tmp_path / "a", small_adapter())
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(PeftAdapterError, match="adapter_model.safetensors: missing$"):
        read_peft_adapter(path)
    (path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(PeftAdapterError, match="adapter_model.safetensors: unreadable"):
        read_peft_adapter(path)
    (path / "adapter_config.json").write_text("{r: 4")
    with pytest.raises(PeftAdapterError, match="adapter_config.json: invalid JSON"):
        read_peft_adapter(path)


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"base_model.model.m.lora_A.weight": torch.ones(4, 2)}, "m lacks lora_A or lora_B"),
        ({"base_model.model.m.lora_magnitude_vector": torch.ones(2)}, "unexpected tensor"),
        ({"base_model.model.m.lora_B.bias": torch.ones(2)}, "unexpected tensor"),
        ({}, "no LoRA factors"),
    ],
)
def test_bad_weights_name_the_file(tmp_path, tensors, message):
    path = write_peft_adapter(tmp_path / "a", small_adapter())
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(PeftAdapterError, match=f"adapter_model.safetensors: .*{message}"):
        read_peft_adapter(path)


def test_rank_alpha_must_match_the_flags(tmp_path):
    adapter = read_peft_adapter(write_peft_adapter(tmp_path / "a", small_adapter()))
    check_matches_flags(adapter, 4, 8)
    with pytest.raises(ArgumentError) as err:
        check_matches_flags(adapter, 16, 32.0)
    assert str(err.value) == (
        f"{tmp_path / 'a' / 'adapter_config.json'}: r=4, lora_alpha=8, but --lora-rank 16 "
        "--lora-alpha 32: pass --lora-rank 4 --lora-alpha 8"
    )
    with pytest.raises(ArgumentError, match="pass --lora-rank 4 --lora-alpha 8"):
        check_matches_flags(adapter, 4, 16.0)


# ---------------------------------------------------------------- atomic writes


def test_rewrite_replaces_an_adapter_directory(tmp_path):
    write_peft_adapter(tmp_path / "a", small_adapter(("q_proj",)))
    (tmp_path / "a" / "README.md").write_text("PEFT's model card")
    second = PeftAdapter(
        8, 16.0, ("o_proj",), random_factors({"model.layers.1.self_attn.o_proj": (16, 32)}, 8)
    )
    write_peft_adapter(tmp_path / "a", second)
    back = read_peft_adapter(tmp_path / "a")
    assert (back.rank, back.target_modules) == (8, ("o_proj",))
    assert list(back.factors) == ["model.layers.1.self_attn.o_proj"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_write_refuses_other_directories_and_leaves_nothing_on_failure(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(PeftAdapterError, match="ckpt: exists and is not an adapter directory"):
        write_peft_adapter(tmp_path / "ckpt", small_adapter())
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["model.safetensors"]

    with pytest.raises(PeftAdapterError, match=r"q_proj has lora_A \(4, 16\).*r=2"):
        write_peft_adapter(
            tmp_path / "b", PeftAdapter(2, 4.0, ("q_proj",), small_adapter().factors)
        )
    with pytest.raises(TypeError):  # fails after the weights were written
        write_peft_adapter(tmp_path / "c", small_adapter(base_model=object()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
