"""``--attn-implementation varlen`` in the Megatron backend: the packed row's sample boundaries
instead of its block mask, attended per sample (miles_core.varlen_attention), against the masked
path (``sdpa``).

* Model level, float64, a GQA qwen3 (4 heads, 2 groups), one packed row of five samples of
  different lengths plus padding: logits and every parameter's gradient of the varlen path equal
  the masked path's to float64 rounding, at TP=1 (one rank) and TP=2 with sequence parallelism
  (2 gloo ranks). The same comparison with the boundaries dropped (one segment: cu_seqlens
  ``[0, T]``) differs by orders of magnitude more: the check can fail.
* Backend level: one ``MegatronBackend.train`` step (fp32, the backend has no float64 mode)
  under varlen, under varlen with full recompute, and under sdpa gives the same loss and grad
  norm to fp32 rounding, also at PP=2 (2 gloo ranks); with the boundaries dropped in the
  varlen runs they differ well beyond it.
* Argument time: values Megatron cannot honour, and varlen with CP > 1, are one-line errors
  (exit 2). Build time: the default (varlen on a GPU with the kernel, else sdpa; sdpa with CP,
  attention dropout or a foreign core attention) and the refusals of an explicit varlen.
* The boundaries' carrier (``varlen_mask``) is a view of cu_seqlens that reads back exactly, and
  the fallback block mask equals miles-core's ``block_causal_mask``.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_tiny_models import make_tiny_hf
from tolerances import GRAD_REL_ERR
from varlen_ranks import one_step, varlen_vs_masked

pytestmark = pytest.mark.numeric

FLOAT64_REL = 1e-10  # float64 rounding through a 2-layer model, with a wide margin


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(make_tiny_hf("qwen3", tmp_path_factory.mktemp("varlen") / "hf"))


def _check_model_level(result: dict) -> None:
    assert result["resolved"] == "varlen"
    assert result["segments"] == 6  # five samples and the padding
    right, wrong = result["right"], result["no_boundaries"]
    assert right["logits"] < FLOAT64_REL * result["logit_scale"], result
    assert right["grads"] < FLOAT64_REL * result["grad_scale"], result
    # without the boundaries the varlen path attends across samples: far off
    assert wrong["logits"] > 1e-3 * result["logit_scale"], result
    assert wrong["grads"] > 1e-3 * result["grad_scale"], result


def test_varlen_equals_masked_in_float64_at_tp1(hf_dir):
    (result,) = spawn_ranks(varlen_vs_masked, 1, hf_dir, 1, timeout=300)
    _check_model_level(result)


@pytest.mark.extended  # the default suite keeps TP=1 (its time budget)
def test_varlen_equals_masked_in_float64_at_tp2(hf_dir):
    for result in spawn_ranks(varlen_vs_masked, 2, hf_dir, 2, timeout=300):
        _check_model_level(result)


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


@pytest.mark.extended  # the default suite keeps TP=1 (its time budget)
def test_one_train_step_varlen_equals_masked(hf_dir):
    (result,) = spawn_ranks(one_step, 1, hf_dir, 1, False, timeout=300)
    for run in ("varlen", "varlen_recompute"):
        for key in ("loss", "grad_norm"):
            assert _close(result[run][key], result["sdpa"][key], GRAD_REL_ERR), result
    (wrong,) = spawn_ranks(one_step, 1, hf_dir, 1, True, timeout=300)
    assert wrong["sdpa"] == result["sdpa"]  # the masked run is untouched by the patch
    for run in ("varlen", "varlen_recompute"):
        assert not _close(wrong[run]["grad_norm"], wrong["sdpa"]["grad_norm"], 1e-3), wrong


@pytest.mark.extended  # the default suite keeps TP=1 (its time budget)
def test_one_train_step_varlen_equals_masked_at_pp2(hf_dir):
    """Both stages of the 1F1B schedule get the row's boundaries (the last one reports)."""
    for result in spawn_ranks(one_step, 2, hf_dir, 1, False, 2, timeout=300):
        for key in ("loss", "grad_norm"):
            assert _close(result["varlen"][key], result["sdpa"][key], GRAD_REL_ERR), result


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--attn-implementation", "flash_attention_2"], "varlen .* or sdpa"),
        (["--attn-implementation", "eager"], "varlen .* or sdpa"),
        (
            ["--attn-implementation", "varlen", "--context-parallel-size", "2"],
            "varlen with --context-parallel-size 2",
        ),
    ],
)
def test_attn_implementation_refused_at_argument_time(extra, message, capsys):
    from miles_core.args import core_groups, parse_args_or_exit
    from miles_megatron.args import megatron_groups

    groups = [*core_groups(), *megatron_groups()]  # imports megatron-core (its warnings)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        parse_args_or_exit(extra, groups)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_attn_implementation_values_megatron_honours():
    from megatron_ranks import parse

    assert parse([]).attn_implementation is None
    for value in ("varlen", "sdpa"):
        assert parse(["--attn-implementation", value]).attn_implementation == value


def test_varlen_mask_round_trips_and_block_mask_is_the_packed_rows():
    import torch
    from miles_core.batch import RolloutBatch
    from miles_core.packing import block_causal_mask, pack_thd
    from miles_megatron.packed_attention import block_mask, read_varlen_mask, varlen_mask
    from varlen_ranks import packed_samples

    packed = pack_thd(RolloutBatch(packed_samples()))
    mask = varlen_mask(packed.cu_seqlens, packed.max_seqlen)
    assert mask.dtype == torch.int32 and mask.shape == (
        6 + 1,
        packed.max_seqlen,
    )  # 5 samples, padding
    assert mask.untyped_storage().nbytes() == packed.cu_seqlens.numel() * 4  # a view
    cu, max_seqlen = read_varlen_mask(mask)
    assert torch.equal(cu, packed.cu_seqlens) and max_seqlen == packed.max_seqlen
    assert read_varlen_mask(torch.zeros(1, 1, 4, 4, dtype=torch.bool)) is None
    assert torch.equal(block_mask(cu, packed.num_tokens), ~block_causal_mask(packed))


class _Config:
    context_parallel_size = 1
    attention_dropout = 0.0


class _ForeignLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.core_attention = torch.nn.Identity()


@pytest.mark.parametrize(
    ("requested", "gpu", "config", "model", "expected"),
    [
        (None, False, {}, torch.nn.Module(), "sdpa"),  # no varlen kernel on a CPU
        (None, True, {}, torch.nn.Module(), "varlen"),
        (None, True, {"attention_dropout": 0.1}, torch.nn.Module(), "sdpa"),
        (None, True, {"context_parallel_size": 2}, torch.nn.Module(), "sdpa"),
        (None, True, {}, _ForeignLayer(), "sdpa"),
        ("sdpa", True, {}, torch.nn.Module(), "sdpa"),
        ("varlen", False, {}, torch.nn.Module(), "varlen"),  # per-sample SDPA on a CPU
        ("varlen", True, {"attention_dropout": 0.1}, torch.nn.Module(), "attention dropout"),
        ("varlen", True, {}, _ForeignLayer(), r"\['Identity'\] is not SDPAttention \(--spec\)"),
    ],
)
def test_attn_implementation_resolution(monkeypatch, requested, gpu, config, model, expected):
    from types import SimpleNamespace

    from miles_core.args import ArgumentError
    from miles_megatron import packed_attention as pa
    from miles_megatron.args import ATTN_IMPLEMENTATIONS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr("miles_core.varlen_attention.kernel_available", lambda device: gpu)
    cfg = _Config()
    cfg.__dict__.update(config)
    args = SimpleNamespace(attn_implementation=requested)
    if expected in ATTN_IMPLEMENTATIONS:
        assert pa.resolve_attn_implementation(args, cfg, model) == expected
        wrapped = torch.nn.Module()
        wrapped.module = torch.nn.Module()
        wrapped.module.config = cfg
        assert pa.attn_implementation_of(wrapped) == expected  # through a wrapper
    else:
        with pytest.raises(ArgumentError, match=f"--attn-implementation varlen: .*{expected}"):
            pa.resolve_attn_implementation(args, cfg, model)
