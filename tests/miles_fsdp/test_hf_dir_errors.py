"""A bad --hf-checkpoint fails with one clear error naming the file, before any model is built."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from miles_fsdp.loading import HFCheckpointError, validate_hf_dir
from tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("good"))


@pytest.fixture
def hf(good_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(good_dir, path)
    return path


def test_good_dir_records_checkpoint_dtypes(tmp_path):
    path = save_tiny_model(tmp_path / "bf16", dtype=torch.bfloat16)
    info = validate_hf_dir(path)
    assert info.model_type == "qwen3"
    assert info.tensor_dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert "lm_head.weight" in info.tensor_dtypes


def test_not_a_directory(tmp_path):
    with pytest.raises(HFCheckpointError, match="is not a directory"):
        validate_hf_dir(tmp_path / "nope")


def test_missing_config(hf):
    (hf / "config.json").unlink()
    with pytest.raises(HFCheckpointError, match=r"config\.json: missing"):
        validate_hf_dir(hf)


def test_invalid_json_config(hf):
    (hf / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match=r"config\.json: invalid JSON"):
        validate_hf_dir(hf)


def test_unmappable_config(hf):
    config = json.loads((hf / "config.json").read_text())
    config["model_type"] = "no_such_arch"
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match=r"config\.json: transformers cannot map"):
        validate_hf_dir(hf)


def test_config_without_causal_lm(hf):
    config = json.loads((hf / "config.json").read_text())
    config["model_type"] = "clip"
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match=r"config\.json: .*(causal-LM|cannot map)"):
        validate_hf_dir(hf)


def test_no_weights(hf):
    (hf / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match=r"no model\.safetensors or"):
        validate_hf_dir(hf)


def test_truncated_shard(hf):
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: (truncated|corrupt)"):
        validate_hf_dir(hf)


def test_corrupt_header(hf):
    data = bytearray((hf / "model.safetensors").read_bytes())
    data[8:20] = b"garbage!!!!!"
    (hf / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: corrupt"):
        validate_hf_dir(hf)


def _index(hf, weight_map):
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_missing_shard_named_by_index(hf):
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (hf / "model.safetensors").rename(hf / "model-00001-of-00002.safetensors")
    _index(hf, {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)})
    with pytest.raises(HFCheckpointError, match=r"model-00002-of-00002\.safetensors: .*missing"):
        validate_hf_dir(hf)


def test_shard_lacking_indexed_tensor(hf):
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    _index(hf, {n: "model.safetensors" for n in names + ["model.extra.weight"]})
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: lacks 1 tensor"):
        validate_hf_dir(hf)


def test_broken_tokenizer(hf):
    (hf / "tokenizer.json").write_text("{broken")
    with pytest.raises(HFCheckpointError, match=r"tokenizer.*: tokenizer failed to load"):
        validate_hf_dir(hf)
