"""Architecture specs: each test fails when its spec is removed.

MoE specs: weights published after loading carry the per-expert (and ``backbone.``) names of the
released checkpoint with its exact values. Stateful specs: packed logits equal per-sample logits
for hybrid recurrent models, which they do not without the document reset.
"""

from __future__ import annotations

import pytest
import torch
from miles_fsdp.adaptations import adaptation_for
from miles_fsdp.backend import FSDPBackend
from run_args import make_args
from safetensors import safe_open
from tiny_models import arch_config, save_tiny_model

pytestmark = pytest.mark.slow


def backend_for(tmp_path, model_type):
    hf_dir = save_tiny_model(tmp_path / model_type, arch_config(model_type))
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir), attn_implementation="eager"))
    return backend, hf_dir


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe_lite", "nemotron_h"])
def test_published_weights_use_checkpoint_names(one_rank_group, tmp_path, model_type):
    backend, hf_dir = backend_for(tmp_path, model_type)
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        on_disk = {name: f.get_tensor(name) for name in f.keys()}
    assert any(".experts.0." in name for name in on_disk)  # released, per-expert layout
    published = dict(backend.weight_source(gather_bytes=1 << 10))
    assert published.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert published[name].dtype == tensor.dtype
        assert torch.equal(published[name], tensor), name
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
