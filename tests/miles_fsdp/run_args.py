"""Parsed-flag namespaces for driving FSDPBackend in tests (the flags' documented defaults)."""

from __future__ import annotations

from argparse import Namespace

DEFAULTS = dict(
    hf_checkpoint=None,
    save=None,
    load=None,
    save_interval=None,
    no_save_optim=False,
    no_load_optim=False,
    no_load_rng=False,
    async_save=False,
    lr=1e-3,
    min_lr=0.0,
    lr_warmup_iters=0,
    lr_decay_style="constant",
    lr_decay_iters=None,
    weight_decay=0.01,
    adam_beta1=0.9,
    adam_beta2=0.98,
    adam_eps=1e-8,
    clip_grad=1.0,
    fp16=False,
    bf16=False,
    seed=1234,
    dp_replicate_size=1,
    fsdp_cpu_offload=False,
    fsdp_cpu_backend="gloo",
    gradient_checkpointing=False,
    attn_implementation="sdpa",
    keep_fp32_master=True,
    fsdp_compute_dtype="fp32",
)


def make_args(**overrides) -> Namespace:
    unknown = set(overrides) - set(DEFAULTS)
    assert not unknown, f"unknown test flags {unknown}"
    return Namespace(**(DEFAULTS | overrides))
