"""Test support: per-rank bodies of the megatron LoRA tests (importable by spawn children)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from megatron_ranks import build_from_hf, layout_argv


def logits_with_grad(model, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    s = input_ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    positions = torch.arange(s)[None].expand_as(input_ids)
    return model(input_ids, positions, attention_mask=mask)[..., :vocab_size]


def lora_model(hf_dir: str, adapter_dir: str | None, tp: int, extra: list[str] = ()):
    """Megatron model from ``hf_dir`` with LoRA, factors from ``adapter_dir`` (or fresh)."""
    from miles_core.peft_adapter import read_peft_adapter
    from miles_megatron.lora import LoRAConfig, init_fresh, inject_lora, load_factors

    args, margs, model, bridge = build_from_hf(hf_dir, [*layout_argv(tp=tp), *extra])
    if adapter_dir is not None:
        adapter = read_peft_adapter(adapter_dir)
        config = LoRAConfig(adapter.rank, adapter.alpha, 0.0, adapter.target_modules)
        injected = inject_lora(model, bridge, margs, config)
        load_factors(injected, adapter)
    else:
        config = LoRAConfig.from_roles(args.run_config.roles)
        injected = inject_lora(model, bridge, margs, config)
        init_fresh(injected, seed=1234)
    return args, margs, model, bridge, injected, config


def adapter_grads(injected) -> dict[str, torch.Tensor]:
    """Full (TP/EP-gathered) adapter gradients keyed ``<hf module>.lora_A|lora_B``."""
    out = {}
    for _, adapter in injected:
        for factor in ("lora_A", "lora_B"):
            for short, param in getattr(adapter, factor).items():
                out[f"{adapter.hf_names[short]}.{factor}"] = adapter.full_of(factor, param.grad)
    return out


def logits_and_grads_match(
    rank: int,
    world: int,
    hf_dir: str,
    adapter_dir: str,
    input_ids: torch.Tensor,
    loss_weights: torch.Tensor,
    ref_logits: torch.Tensor,
    ref_grads: dict[str, torch.Tensor],
    tps: list[int],
) -> dict[int, dict[str, Any]]:
    """Per TP size: max |megatron - reference| of the logits and of every adapter gradient."""
    out = {}
    for tp in tps:
        _, margs, model, _, injected, _ = lora_model(hf_dir, adapter_dir, tp=tp)
        logits = logits_with_grad(model, input_ids, margs["vocab_size"])
        (logits.float() * loss_weights).sum().backward()
        grads = adapter_grads(injected)
        *_, fresh, _ = lora_model(hf_dir, None, tp=tp)  # PEFT init from --seed
        from miles_megatron.lora import gather_factors

        out[tp] = {
            "fresh": {
                k: {f: t.tolist() for f, t in v.items()} for k, v in gather_factors(fresh).items()
            },
            "logits": (logits.detach() - ref_logits).abs().max().item(),
            "grads": {k: (grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads},
            "grad_scale": {k: ref_grads[k].abs().max().item() for k in ref_grads},
            "extra": sorted(set(grads) - set(ref_grads)),
            "frozen_grads": [
                n
                for n, p in model.named_parameters()
                if p.grad is not None and not getattr(p, "lora_adapter", False)
            ],
        }
    return out


def merged_publish_bf16(rank: int, world: int, hf_dir: str, tp: int) -> dict[str, Any]:
    """A bf16 model (``--bf16``) with fresh A and random B: the merged HF weights the weight
    source publishes and the full factors, as float32 lists (bf16 values are exact in them)."""
    from miles_megatron.hf_weights import iter_hf_weights
    from miles_megatron.lora import gather_factors, merge_into_hf

    _, margs, model, bridge, injected, config = lora_model(hf_dir, None, tp=tp, extra=["--bf16"])
    model.bfloat16()  # what the backend's Float16Module does (torch norms are built in fp32)
    _randomize_b(injected, seed=5)
    factors = gather_factors(injected)
    merged = merge_into_hf(iter_hf_weights(model, bridge, margs), factors, config.scale)
    return {
        "scale": config.scale,
        "merged": {k: (str(v.dtype), v.float().tolist()) for k, v in merged},
        "factors": {
            m: {f: (str(t.dtype), t.float().tolist()) for f, t in p.items()}
            for m, p in factors.items()
        },
    }


LORA_FLAGS = ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8"]


def backend_argv(hf_dir: str, save: str, tp: int, extra: list[str] = ()) -> list[str]:
    from megatron_ranks import BOTH_BACKENDS_FLAGS

    argv = ["--hf-checkpoint", hf_dir, "--save", save, *BOTH_BACKENDS_FLAGS, *LORA_FLAGS]
    return argv + ["--num-steps-per-rollout", "1", *layout_argv(tp=tp), *extra]


def _factor_lists(backend) -> dict[str, list]:
    return {f"{m}.{f}": t[f].tolist() for m, t in backend.lora.factors().items() for f in t}


def _base_params(backend) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for n, p in backend.model.named_parameters()
        if not getattr(p, "lora_adapter", False)
    }


def backend_lora_flow(
    rank: int, world: int, hf_dir: str, adapter_dir: str, save: str, export_dir: str
) -> dict[str, Any]:
    """TP=2: --lora-adapter-path + KL against lora_base, one rollout, sleep/wake x2, a second
    rollout, save, export; a never-slept control; resume at TP=1; flag errors on resume."""
    from backend_reference import samples
    from megatron_ranks import parse
    from miles_core.args import ArgumentError
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    kl = ["--use-kl-loss", "--kl-loss-coef", "0.5", "--lora-adapter-path", adapter_dir]
    out: dict[str, Any] = {}
    batch = RolloutBatch(samples())
    runs = {}
    for sleep in (True, False):
        backend = MegatronBackend()
        backend.init(parse(backend_argv(hf_dir, save if sleep else save + "_c", world, kl)))
        args = backend.args
        base_before = _base_params(backend)
        losses = [backend.train(0, batch)]
        copied = []
        if sleep:
            out["ref_mode"] = args.ref_mode
            out["trainable_only_adapters"] = all(
                getattr(p, "lora_adapter", False) == p.requires_grad
                for p in backend.model.parameters()
            )
            out["buffer_params_adapters"] = all(
                getattr(p, "lora_adapter", False) for b in backend.model.buffers for p in b.params
            )
            out["ref_log_probs"] = [t.tolist() for t in backend.reference_log_probs(batch)]
            for _ in range(2):
                backend.sleep()
                copied.append(backend.sleeper.host_bytes_copied)
                out.setdefault("asleep_bytes", backend.sleeper.device_bytes())
                backend.wake_up()
            out["copied"] = copied
            out["base_bytes"] = sum(
                p.untyped_storage().size()
                for p in backend.model.parameters()
                if not getattr(p, "lora_adapter", False)
            )
            out["adapter_bytes"] = sum(
                p.numel() * p.element_size()
                for p in backend.model.parameters()
                if getattr(p, "lora_adapter", False)
            )
        losses.append(backend.train(1, batch))
        base_after = _base_params(backend)
        runs[sleep] = {
            "losses": [m["loss"] for m in losses],
            "kl": [m["kl_loss"] for m in losses],
            "factors": _factor_lists(backend),
            "base_unchanged": all(torch.equal(base_before[k], base_after[k]) for k in base_after),
        }
        if sleep:
            backend.save_model(1)
            backend.export_adapter(export_dir)
            out["merged"] = {k: v.tolist() for k, v in backend.hf_weights()}
            out["peft_named"] = sorted(k for k, _ in backend.lora.adapter_weights())
        backend.close()
    out["runs"] = [runs[True], runs[False]]
    resumed = MegatronBackend()
    next_id = resumed.init(parse(backend_argv(hf_dir, save + "_r", 1, ["--load", save])))
    out["resumed_next_id"] = next_id
    out["resumed_factors"] = _factor_lists(resumed)
    resumed.close()
    errors = {}
    for label, extra in (
        ("rank", ["--load", save, "--lora-rank", "8"]),
        ("no_lora", ["--load", save]),
    ):
        argv = backend_argv(hf_dir, save + "_e", 1, extra)
        if label == "no_lora":
            argv = [a for a in argv if a != "--use-lora"]
        try:
            MegatronBackend().init(parse(argv))
        except ArgumentError as exc:
            errors[label] = str(exc)
        finally:
            from miles_megatron.parallel import destroy_parallel

            destroy_parallel()
    out["errors"] = errors
    return out


def _randomize_b(injected, seed: int) -> None:
    """Non-zero B (a fresh adapter's B is 0), the same full values at any layout."""
    import zlib

    with torch.no_grad():
        for _, adapter in injected:
            for short, param in adapter.lora_B.items():
                name = adapter.hf_names[short]
                gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
                rows = param.shape[0] * (adapter.tp_size if adapter.parallel == "column" else 1)
                full = torch.randn(rows, param.shape[1], generator=gen) * 0.1
                param.copy_(adapter.shard_of("lora_B", full))


def experts_match_merged_oracle(
    rank: int, world: int, hf_dir: str, input_ids: torch.Tensor, loss_weights: torch.Tensor
) -> dict[str, Any]:
    """qwen3_moe at EP=2, LoRA on every linear (experts included), against a plain model whose
    HF weights are ``W + s B A`` (float64 in this function): logits, and every adapter
    gradient against ``dA = s B^T G``, ``dB = s G A^T`` from the plain model's weight gradient
    ``G`` (chain rule through the merged weight)."""
    from miles_megatron.hf_weights import load_hf_into_model
    from miles_megatron.lora import gather_factors
    from miles_megatron.model_config import build_gpt_model
    from miles_megatron.sharding import iter_global_tensors

    extra = ["--expert-model-parallel-size", str(world), "--moe-token-dispatcher-type", "allgather"]
    args, margs, model, bridge, injected, config = lora_model(hf_dir, None, tp=1, extra=extra)
    _randomize_b(injected, seed=11)
    s = config.scale
    factors = {
        m: {f: t.double() for f, t in p.items()} for m, p in gather_factors(injected, 4).items()
    }
    base = {}
    for name, tensor in iter_global_tensors(model, margs["num_experts"], gated=True):
        base.update(bridge.to_hf(name, tensor, margs))
    merged = {}
    for name, w in base.items():
        pair = factors.get(name.removesuffix(".weight"))
        delta = s * (pair["lora_B"] @ pair["lora_A"]) if pair else 0.0
        merged[name] = (w.double() + delta).to(w.dtype)
    plain = build_gpt_model(margs, args)
    load_hf_into_model(plain, merged, bridge, margs, 1)

    logits = logits_with_grad(model, input_ids, margs["vocab_size"])
    (logits.float() * loss_weights).sum().backward()
    plain_logits = logits_with_grad(plain, input_ids, margs["vocab_size"])
    (plain_logits.float() * loss_weights).sum().backward()
    grads = {}
    for name, g in iter_global_tensors(
        plain, margs["num_experts"], gated=True, tensors=lambda n, p: p.grad
    ):
        grads.update(bridge.to_hf(name, g, margs))
    diffs, expert_modules = {}, 0
    for target, adapter in injected:
        for short in adapter.modules_on:
            module = adapter.hf_names[short]
            expert_modules += target.expert is not None
            g = grads[module + ".weight"].double()
            a, b = factors[module]["lora_A"], factors[module]["lora_B"]
            want = {"lora_A": s * b.t() @ g, "lora_B": s * g @ a.t()}
            for f in ("lora_A", "lora_B"):
                got = adapter.full_of(f, getattr(adapter, f)[short].grad).double()
                diffs[f"{module}.{f}"] = ((got - want[f]).abs().max() / want[f].abs().max()).item()
    return {
        "logits": (logits - plain_logits).abs().max().item(),
        "logits_scale": plain_logits.abs().max().item(),
        "grads": diffs,
        "expert_modules": expert_modules,
    }


def run_programs(
    rank: int, world: int, programs: list[tuple[str, Callable, tuple]]
) -> dict[str, dict[str, Any]]:
    """Run several per-rank bodies ``fn(rank, world, *args)`` in sequence in one spawn, so that
    the ranks import megatron once: ``{label: {"ok", "value" | "error", "seconds"}}``.

    A body that raises is reported under its label (its test fails with the traceback) and the
    next body still runs, with the parallel state torn down in between.
    """
    from miles_megatron.parallel import destroy_parallel

    out = {}
    for label, fn, args in programs:
        start = time.monotonic()
        try:
            out[label] = {"ok": True, "value": fn(rank, world, *args)}
        except Exception:  # noqa: BLE001  (reported to the parent under the label)
            out[label] = {"ok": False, "error": traceback.format_exc()}
        finally:
            destroy_parallel()
        out[label]["seconds"] = time.monotonic() - start
    return out


# ---------------------------------------------------------------- parent side


def peft_adapter(hf_dir, out_dir, targets, seed=7):
    """A PEFT adapter saved with ``save_pretrained`` (random A and B), and the PEFT model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(out_dir)
    return out_dir


def fsdp_lora_model(hf_dir, adapter_dir):
    """The FSDP backend's LoRA model: HF model + miles_fsdp.lora injection + adapter load."""
    from miles_core.peft_adapter import LoRAConfig, read_peft_adapter
    from miles_fsdp.lora import inject_lora, load_adapter_weights
    from transformers import AutoModelForCausalLM

    adapter = read_peft_adapter(adapter_dir)
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    settings = LoRAConfig(adapter.rank, adapter.alpha, 0.0, adapter.target_modules)
    inject_lora(model, settings, on_meta=False)
    load_adapter_weights(model, adapter)
    return model


def inputs():
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(2, 12, 96, generator=torch.Generator().manual_seed(4)) * 0.01
    return ids, weights


def hf_log_probs(hf_dir, samples, temperature=1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=s.tokens[None]).logits[0, :-1] / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, s.tokens[1:, None])[:, 0]
            out.append(lp[-s.response_length :])
    return out


def check_lora_flow(r: dict, hf_dir: str, export: Path, targets: list[str]) -> None:
    """The parent's checks of :func:`backend_lora_flow`'s result (CPU and GPU tests)."""
    from backend_reference import samples
    from miles_core.peft_adapter import read_peft_adapter
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert r["ref_mode"] == "lora_base"
    assert r["trainable_only_adapters"] and r["buffer_params_adapters"]
    sleeping, control = r["runs"]
    assert sleeping["base_unchanged"]
    assert sleeping["losses"] == control["losses"] and sleeping["factors"] == control["factors"]
    assert sleeping["kl"][0] != 0.0  # the adapter moves the actor away from lora_base
    assert r["asleep_bytes"] == 0
    first, second = r["copied"]
    assert first - second == r["base_bytes"] > second  # the base travels once
    assert second <= 4 * r["adapter_bytes"]  # adapters + their Adam state
    for got, want in zip(r["ref_log_probs"], hf_log_probs(hf_dir, samples()), strict=True):
        assert (torch.tensor(got) - want).abs().max() < 1e-5
    assert r["resumed_next_id"] == 2 and r["resumed_factors"] == sleeping["factors"]
    assert "pass --lora-rank 4 --lora-alpha 8" in r["errors"]["rank"]
    assert "needs --use-lora" in r["errors"]["no_lora"]

    # the exported directory: PEFT keys of the targeted modules only, the trained values
    exported = read_peft_adapter(export)
    assert sorted(exported.target_modules) == sorted(targets)
    assert len(exported.factors) == 2 * len(targets)
    assert r["peft_named"] == sorted(load_file(str(export / "adapter_model.safetensors")))
    for module, pair in exported.factors.items():
        for factor, tensor in pair.items():
            assert tensor.tolist() == sleeping["factors"][f"{module}.{factor}"]

    # merged publish == W + (alpha / r) B A in the checkpoint dtype, bit for bit
    base = load_file(f"{hf_dir}/model.safetensors")
    merged = {k: torch.tensor(v) for k, v in r["merged"].items()}
    assert sorted(merged) == sorted(base)
    for name, w in base.items():
        pair = exported.factors.get(name.removesuffix(".weight"))
        want = w if pair is None else (w + 2.0 * (pair["lora_B"] @ pair["lora_A"])).to(w.dtype)
        assert torch.equal(merged[name], want), name

    # the reverse direction: PEFT and the FSDP backend load the export; same model as merged
    ids, _ = inputs()
    hf = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    peft_logits = PeftModel.from_pretrained(hf, str(export))(input_ids=ids).logits
    fsdp_logits = fsdp_lora_model(hf_dir, export)(input_ids=ids).logits
    plain = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    plain.load_state_dict(merged, strict=False)
    with torch.no_grad():
        merged_logits = plain(input_ids=ids).logits
    assert (peft_logits - merged_logits).abs().max() < 1e-5
    assert (fsdp_logits - merged_logits).abs().max() < 1e-5
