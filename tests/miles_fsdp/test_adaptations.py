"""Architecture specs: each test fails when its spec is removed.

MoE specs: weights published after loading carry the per-expert (and ``backbone.``,
``model.language_model.``) names of the released checkpoint with its exact values; Qwen3.5
(dense, MoE; text-only and multimodal checkpoints) also trains a rollout and publishes under
the checkpoint's names after it. Stateful specs: packed logits equal per-sample logits
for hybrid recurrent models, which they do not without the document reset.
"""

from __future__ import annotations

import pytest
import torch
from miles_fsdp.adaptations import adaptation_for
from miles_fsdp.backend import FSDPBackend
from run_args import make_args
from safetensors import safe_open
from tiny_models import arch_config, save_multimodal_qwen3_5, save_tiny_model

pytestmark = [pytest.mark.numeric, pytest.mark.slow]


def backend_for(tmp_path, model_type):
    hf_dir = save_tiny_model(tmp_path / model_type, arch_config(model_type))
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir), attn_implementation="eager"))
    return backend, hf_dir


def checkpoint_tensors(hf_dir) -> dict[str, torch.Tensor]:
    """The language model's tensors on disk (a multimodal checkpoint's vision tower is not
    loaded by the causal LM, so never published)."""
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if ".visual." not in name}


def assert_published_as_on_disk(backend, on_disk):
    published = dict(backend.weight_source(gather_bytes=1 << 10))
    assert published.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert published[name].dtype == tensor.dtype
        assert torch.equal(published[name], tensor), name


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe_lite", "nemotron_h"])
def test_published_weights_use_checkpoint_names(one_rank_group, tmp_path, model_type):
    backend, hf_dir = backend_for(tmp_path, model_type)
    on_disk = checkpoint_tensors(hf_dir)
    assert any(".experts.0." in name for name in on_disk)  # released, per-expert layout
    assert_published_as_on_disk(backend, on_disk)
    backend.close()


QWEN3_5 = {
    "qwen3_5_text": lambda path: save_tiny_model(path, arch_config("qwen3_5_text")),
    "qwen3_5_moe_text": lambda path: save_tiny_model(path, arch_config("qwen3_5_moe_text")),
    "qwen3_5": lambda path: save_multimodal_qwen3_5(path, moe=False),
    "qwen3_5_moe": lambda path: save_multimodal_qwen3_5(path, moe=True),
}


@pytest.mark.parametrize("model_type", sorted(QWEN3_5))
def test_qwen3_5_loads_trains_and_publishes_checkpoint_names(one_rank_group, tmp_path, model_type):
    from miles_core.batch import RolloutBatch
    from samples import make_samples

    hf_dir = QWEN3_5[model_type](tmp_path / model_type)
    on_disk = checkpoint_tensors(hf_dir)
    prefix = "model.language_model." if "_text" not in model_type else "model.layers."
    assert any(name.startswith(prefix) for name in on_disk)
    assert any(".experts.0." in name for name in on_disk) == ("moe" in model_type)
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir), attn_implementation="eager"))
    assert backend.config.model_type == model_type
    assert_published_as_on_disk(backend, on_disk)  # loaded: the checkpoint's names and values

    metrics = backend.train(0, RolloutBatch(make_samples(seed=1)))
    assert torch.isfinite(torch.tensor(metrics["pg_loss"])) and metrics["grad_norm"] > 0
    published = dict(backend.weight_source(gather_bytes=1 << 10))
    assert published.keys() == on_disk.keys()
    moved = [n for n, t in on_disk.items() if not torch.equal(published[n], t)]
    assert any(".mlp." in n for n in moved) and any("linear_attn" in n for n in moved)
    backend.close()


def _packed_vs_separate(model, lengths, vocab=64):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]
    with torch.no_grad():
        separate = torch.cat([model(input_ids=d, use_cache=False).logits for d in docs], dim=1)
        packed = model(
            input_ids=torch.cat(docs, dim=1),
            position_ids=torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
            use_cache=False,
        ).logits
    return packed, separate


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_packed_equals_per_sample_for_stateful_layers(one_rank_group, tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    backend, hf_dir = backend_for(tmp_path, model_type)
    assert adaptation_for(model_type).packing_patches
    packed, separate = _packed_vs_separate(backend.model, [5, 9, 6])
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)

    # Control: the unpatched HF model leaks state across documents, so the check above has teeth.
    plain = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager"
    )
    packed, separate = _packed_vs_separate(plain, [5, 9, 6])
    assert (packed - separate).abs().max() > 1e-3
    backend.close()


def test_qwen3_rms_norm_rounds_once():
    """Patched: equal to the float64 value rounded once to bf16. Unpatched HF rounds twice."""
    from tiny_models import qwen3_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_config(hidden_size=256), dtype=torch.bfloat16)
    norm = model.model.norm
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256) * 0.5 + 1)
    x = torch.randn(64, 256).to(torch.bfloat16)
    x64 = x.double()
    exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    expected = (exact * norm.weight.double()).to(torch.bfloat16)
    with torch.no_grad():
        unpatched = norm(x)
        for patch in adaptation_for("qwen3").model_instance_patches:
            patch(model, model.config)
        patched = norm(x)
    assert not torch.equal(unpatched, expected)  # the HF module rounds twice
    assert torch.equal(patched, expected)
    assert norm.weight.dtype == torch.bfloat16 and dict(model.named_parameters())  # layout kept
