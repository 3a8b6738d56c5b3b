"""Precision and attention flags of the FSDP backend: --fp16 / --fsdp-compute-dtype /
--no-keep-fp32-master give the documented dtypes and FSDP2 policy (gradients always reduce in
fp32); --attn-implementation passes explicit values through and falls back to sdpa with one
notice line where flash_attn is unavailable."""

from __future__ import annotations

import pytest
import torch
from miles_core.args import core_groups, parse_args
from miles_fsdp.args import fsdp_groups
from miles_fsdp.loading import ATTN_IMPLEMENTATIONS, resolve_attn_implementation
from miles_fsdp.precision import resolve_precision


def flags(*argv):
    args = parse_args(list(argv), [*core_groups(), *fsdp_groups()])
    return resolve_precision(args.fp16, args.fsdp_compute_dtype, args.keep_fp32_master)


@pytest.mark.parametrize(
    "argv, compute, master",
    [
        ([], torch.bfloat16, torch.float32),
        (["--fp16"], torch.float16, torch.float32),
        (["--no-keep-fp32-master"], torch.bfloat16, torch.bfloat16),
        (["--fp16", "--no-keep-fp32-master"], torch.float16, torch.float16),
        (["--fsdp-compute-dtype", "fp32"], torch.float32, torch.float32),
        (["--fp16", "--fsdp-compute-dtype", "bf16"], torch.bfloat16, torch.float32),
    ],
)
def test_precision_from_flags(argv, compute, master):
    precision = flags(*argv)
    assert (precision.compute_dtype, precision.master_dtype) == (compute, master)
    policy = precision.mixed_precision_policy()
    assert policy.reduce_dtype == torch.float32  # gradient reduction always in fp32
    # FSDP casts the unsharded parameters only when the dtypes differ
    assert policy.param_dtype == (None if compute == master else compute)


def test_unknown_compute_dtype_names_the_flag():
    with pytest.raises(ValueError, match="--fsdp-compute-dtype must be one of"):
        resolve_precision(False, "fp8")


@pytest.mark.parametrize("name", ATTN_IMPLEMENTATIONS)
def test_explicit_attention_passes_through(name, capsys):
    assert resolve_attn_implementation(name) == name
    assert capsys.readouterr().out == ""


def test_unknown_attention_names_the_flag():
    with pytest.raises(ValueError, match="--attn-implementation must be one of"):
        resolve_attn_implementation("flex")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback")
def test_unset_attention_on_cpu_is_sdpa_with_one_notice(capsys):
    assert resolve_attn_implementation(None) == "sdpa"
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["miles-fsdp: flash_attn unavailable, using --attn-implementation sdpa"]
