"""Test support: the spawned bodies of the custom-spec tests (``--spec custom_spec_ranks
fp32_norm_spec``: an fp32 RMSNorm under ``--bf16``, trained, saved and resumed)."""

from __future__ import annotations

from typing import Any

import torch
from megatron_ranks import BOTH_BACKENDS_FLAGS, parse


class Fp32RMSNorm(torch.nn.Module):
    """An RMSNorm whose weight stays fp32 under ``--bf16`` (``mark_param_dtype``), normalising
    in fp32; same parameter name as torch's (``weight``), so the bridge loads it."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        from miles_megatron.fp32_params import mark_param_dtype

        super().__init__()
        self.eps = eps
        self.weight = mark_param_dtype(torch.nn.Parameter(torch.ones(hidden_size)), torch.float32)
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        return torch.nn.functional.rms_norm(x.float(), shape, self.weight, self.eps).to(x.dtype)


def fp32_norm_spec(args, config, vp_stage):
    """A ``--spec`` function: the local block spec with each layer's input norm swapped for
    :class:`Fp32RMSNorm`."""
    import dataclasses

    from miles_megatron.arch_args import resolve_model_args
    from miles_megatron.local_spec import local_block_spec

    block = local_block_spec(resolve_model_args(args), config, vp_stage)
    layers = [
        dataclasses.replace(
            spec, submodules=dataclasses.replace(spec.submodules, input_layernorm=Fp32RMSNorm)
        )
        for spec in block.layer_specs
    ]
    return dataclasses.replace(block, layer_specs=layers)


def _adam_states(backend) -> dict[str, list]:
    """Per parameter name: this rank's optimizer shard, exp_avg and exp_avg_sq (numpy), read
    through the distributed optimizer's group lists (model params -> their shards), not its
    ``model_param_group_index_map``."""
    from miles_megatron.optimizer import distributed_optimizers

    names = {p: n for n, p in backend.model.named_parameters()}
    out = {}
    for opt in distributed_optimizers(backend.optimizer):
        pairs = [
            *zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True),
            *zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True),
        ]
        for params, shards in pairs:
            for param, shard in zip(params, shards, strict=True):
                state = opt.optimizer.state[shard]
                tensors = (shard, state["exp_avg"], state["exp_avg_sq"])
                out[names[param]] = [t.detach().cpu().numpy().copy() for t in tensors]
    return out


def custom_spec_run(rank: int, world: int, hf_dir: str, save: str) -> dict:
    """``--spec custom_spec_ranks fp32_norm_spec`` under ``--bf16``: one rollout (2 optimizer
    steps) through DDP and the distributed optimizer, a save, and a resume from it. Returns
    the dtypes of the input norms and the other weights, whether the norms moved and to values
    bf16 cannot hold, which parameters the distributed optimizer holds as fp32 parameters and
    which as 16-bit ones with fp32 masters, the dtypes the checkpoint stores, and whether the
    resumed optimizer state equals the saved one."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch
    from miles_core.partition import partition_for_dp
    from miles_megatron.backend import MegatronBackend
    from miles_megatron.optimizer import distributed_optimizers
    from torch.distributed.checkpoint import FileSystemReader

    argv = ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, "--bf16"]
    argv += ["--spec", "custom_spec_ranks", "fp32_norm_spec"]
    backend = MegatronBackend()
    backend.init(parse(argv + ["--save", save]))
    named = list(backend.model.named_parameters())
    norms = {n: p for n, p in named if "input_layernorm" in n}
    before = {n: p.detach().clone() for n, p in norms.items()}
    # each DP rank its own shard of the rollout, as the launcher gives it
    backend.train(0, partition_for_dp(RolloutBatch(samples()), world)[rank])
    names = {p: n for n, p in named}
    groups: dict[str, list[str]] = {"fp32": [], "float16": []}
    for opt in distributed_optimizers(backend.optimizer):
        for kind, per_group in (
            ("fp32", opt.model_fp32_groups),
            ("float16", opt.model_float16_groups),
        ):
            groups[kind] += [names[p] for group in per_group for p in group]
    out = {
        "norm_dtypes": sorted({str(p.dtype) for p in norms.values()}),
        "norm_count": len(norms),
        "other_dtypes": sorted({str(p.dtype) for n, p in named if n not in norms}),
        "norms_moved": all(not torch.equal(p, before[n]) for n, p in norms.items()),
        "norms_beyond_bf16": all(
            not torch.equal(p.detach(), p.detach().bfloat16().float()) for p in norms.values()
        ),
        "norm_names": sorted(norms),
        "optimizer_fp32_params": groups["fp32"],  # this rank's DP share
        "optimizer_float16_params": groups["float16"],
    }
    saved_states = _adam_states(backend)
    backend.save_model(0, force_sync=True)
    metadata = FileSystemReader(f"{save}/iter_0000001").read_metadata().state_dict_metadata
    out["saved_dtypes"] = {
        key: str(meta.properties.dtype)
        for key, meta in metadata.items()
        if hasattr(meta, "properties") and "layers" in key and key.endswith("weight")
    }
    backend.close()
    resumed = MegatronBackend()
    resumed.init(parse(argv + ["--load", save]))
    loaded_states = _adam_states(resumed)
    resumed.close()
    out["resumed_state_names"] = sorted(loaded_states) == sorted(saved_states)
    out["resumed_state_equal"] = {
        name: all((a == b).all() for a, b in zip(saved_states[name], loaded, strict=True))
        for name, loaded in loaded_states.items()
    }
    return out


def check_custom_spec(ranks: list[dict]) -> None:
    """:func:`custom_spec_run`'s results: the marked norms are fp32 everywhere (model, the
    distributed optimizer's fp32 groups, checkpoint), the rest bf16 with fp32 masters, and the
    optimizer state resumes bit for bit."""
    norms = set(ranks[0]["norm_names"])
    assert len(norms) == 2  # one input norm per layer: the spec's swapped module
    fp32 = {n for r in ranks for n in r["optimizer_fp32_params"]}
    float16 = {n for r in ranks for n in r["optimizer_float16_params"]}
    assert fp32 == norms and not norms & float16 and float16
    for r in ranks:
        assert r["norm_dtypes"] == ["torch.float32"] and r["other_dtypes"] == ["torch.bfloat16"]
        assert r["norms_moved"] and r["norms_beyond_bf16"]  # fp32 updates, not bf16-rounded
        saved = r["saved_dtypes"]
        norm_key = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"  # input norm
        assert saved[norm_key] == "torch.float32", saved
        model_keys = [k for k in saved if not k.startswith("optimizer.") and k != norm_key]
        assert model_keys and all(saved[k] == "torch.bfloat16" for k in model_keys), saved
        optimizer_keys = [k for k in saved if k.startswith("optimizer.state.")]
        assert optimizer_keys and all(saved[k] == "torch.float32" for k in optimizer_keys)
        assert r["resumed_state_names"] and all(r["resumed_state_equal"].values())
