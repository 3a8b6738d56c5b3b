"""Programs run on each gloo rank by the roles/LoRA/EMA tests (importable by spawned children)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from full_tensors import full
from miles_fsdp.backend import FSDPBackend
from rank_programs import full_params, my_rows, nll_contribution
from run_args import make_args
from samples import make_samples
from torch.distributed.tensor import DTensor


def my_shard(samples, rank, world):
    from miles_core.batch import RolloutBatch
    from miles_core.partition import partition_for_dp

    return partition_for_dp(RolloutBatch(samples), world, keep_groups=True)[rank]


def full_ema(backend) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in backend.model.named_parameters()}
    out = {}
    for p in backend.ema.params():
        e = backend.ema.state[p]["ema"]
        out[names[id(p)]] = full(e).detach().clone()
    return out


EMA_FLAGS = dict(
    use_ema=True,
    rollout_weights="ema",
    old_policy="ema",
    ema_decay_init=0.3,
    ema_decay_ramp=0.15,
    ema_decay_max=0.4,
    ema_decay_flat_steps=1,
    advantage_estimator="grpo",
    micro_batch_size=4,
)


def ema_program(rank, world, hf_dir, save_dir, out_file):
    """4 rollouts with EMA; publishes; use_weights under an exception; save/load round trips."""
    res: dict = {"params": [], "ema": [], "decay": [], "ppo_kl": []}
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, save=save_dir, save_optim=False, **EMA_FLAGS))
    res["params"].append(full_params(backend.model))
    res["ema"].append(full_ema(backend))
    for rollout_id in range(4):
        metrics = backend.train(rollout_id, my_shard(make_samples(seed=rollout_id), rank, world))
        res["params"].append(full_params(backend.model))
        res["ema"].append(full_ema(backend))
        res["decay"].append(metrics["ema_decay"])
        res["ppo_kl"].append(metrics["ppo_kl"])
    # two publishes of --rollout-weights ema (the weight source the publisher consumes)
    published = []
    for _ in range(2):
        with backend.use_weights(backend.args.rollout_weights):
            published.append(dict(backend.weight_source()))
    res["published"] = published
    res["after_publish"] = {"params": full_params(backend.model), "ema": full_ema(backend)}
    # use_weights restores the actor after an exception
    try:
        with backend.use_weights("ema"):
            res["inside"] = full_params(backend.model)
            raise KeyError("boom")
    except KeyError:
        pass
    res["after_exception"] = full_params(backend.model)
    backend.save_model(3, force_sync=True)
    backend.close()

    # round trip: --no-save-optim above, --no-load-optim here; EMA still restored
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, load=save_dir, load_optim=False, **EMA_FLAGS))
    res["loaded_ema"] = full_ema(backend)
    res["loaded_updates"] = backend.ema.param_groups[0]["updates"]
    backend.close()

    # EMA off: a saved ema/ is ignored
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, load=save_dir))
    res["no_ema_loaded"] = backend.ema is None
    backend.close()

    # legacy checkpoint without ema/: seeded from the loaded actor
    if rank == 0:
        shutil.rmtree(Path(save_dir) / "iter_0000004" / "ema")
    dist.barrier()
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, load=save_dir, **EMA_FLAGS))
    res["legacy_params"] = full_params(backend.model)
    res["legacy_ema"] = full_ema(backend)
    res["legacy_updates"] = backend.ema.param_groups[0]["updates"]
    backend.close()
    if rank == 0:
        torch.save(res, out_file)


#: --eval-weights ema as EMA's only consumer (the actor is published and is the old policy)
EVAL_FLAGS = EMA_FLAGS | dict(rollout_weights="actor", old_policy="actor", eval_weights="ema")


def eval_program(rank, world, hf_dir, out_file):
    """3 rollouts, then evaluate() with the EMA weights; the actor, EMA, module mode and the
    actor's forward before and after; the actor-weight log-probs for contrast."""
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, **EVAL_FLAGS))
    res: dict = {"params": [full_params(backend.model)]}
    for rollout_id in range(3):
        backend.train(rollout_id, my_shard(make_samples(seed=rollout_id), rank, world))
        res["params"].append(full_params(backend.model))
    shard = my_shard(make_samples(seed=7), rank, world)
    probe = shard[0].tokens[None].to(backend.device)
    with torch.no_grad():
        res["probe_before"] = backend.model(input_ids=probe).logits.clone()
    res["ema_before"] = full_ema(backend)
    res["metrics"] = backend.evaluate(shard)
    res["log_probs"] = backend.eval_log_probs(shard)
    res["training_after"] = backend.model.training
    with torch.no_grad():  # a forward after evaluation reads the restored actor shards
        res["probe_after"] = backend.model(input_ids=probe).logits.clone()
    res["params_after"] = full_params(backend.model)
    res["ema_after"] = full_ema(backend)
    backend.args.eval_weights = "actor"
    res["actor_log_probs"] = backend.eval_log_probs(shard)
    res["sources"] = list(shard.source_indices)
    backend.close()
    torch.save(res, f"{out_file}.{rank}")


def lora_program(rank, world, hf_dir, adapter_dir, data, save_dir, out_file):
    """LoRA actor: merged publish, one step's grads and AdamW update, lora_base, checkpoint."""
    from miles_fsdp.optimizer_step import optimizer_step
    from miles_fsdp.roles import adapters_disabled

    res: dict = {}
    flags = dict(
        hf_checkpoint=hf_dir,
        use_lora=True,
        lora_rank=4,
        lora_alpha=8.0,
        lora_target_modules=["q_proj", "v_proj", "down_proj"],
        lora_adapter_path=[adapter_dir],
        clip_grad=0.0,
        adam_eps=1e-5,
        save=save_dir,
    )
    backend = FSDPBackend()
    backend.init(make_args(**flags))
    model = backend.model
    res["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    res["initial"] = full_params(model)
    res["published"] = dict(backend.weight_source())
    rows = my_rows(data, rank, world)
    denominator = data.shape[0] * (data.shape[1] - 1)
    ids = rows.to(backend.device)
    # lora_base first: the base model's logits, then adapters and requires_grad come back
    with adapters_disabled(model):
        res["base_logits"] = model(input_ids=ids).logits.detach().clone()
    res["requires_grad_after"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    res["lora_logits"] = model(input_ids=ids).logits.detach().clone()
    optimizer_step(
        model,
        backend.optimizer,
        backend.scheduler,
        [rows],
        nll_contribution(denominator),
        dp_size=world,
        clip_grad=0.0,
    )
    res["grads"] = {
        n: full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None
    }
    res["grad_dtypes"] = {
        n: p.grad.dtype for n, p in model.named_parameters() if p.grad is not None
    }
    res["frozen_grads"] = [
        n for n, p in model.named_parameters() if p.grad is not None and not p.requires_grad
    ]
    res["stepped"] = full_params(model)
    backend.save_model(0, force_sync=True)
    backend.close()

    # adapter-only checkpoint: a fresh run (adapter from the flags) restores the trained one
    # ... then trains a rollout with the KL reference = the actor without its adapter
    backend = FSDPBackend()
    kl = dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2", ref_mode="lora_base")
    kl["advantage_estimator"] = "grpo"
    ema = dict(use_ema=True, eval_weights="ema")  # EMA of a LoRA actor: the adapters only
    backend.init(make_args(load=save_dir, **flags, **kl, **ema))
    names = {id(p): n for n, p in backend.model.named_parameters()}
    res["ema_params"] = sorted(names[id(p)] for p in backend.ema.params())
    res["resumed"] = full_params(backend.model)
    res["kl_metrics"] = backend.train(1, my_shard(make_samples(), rank, world))
    res["kl_trained"] = full_params(backend.model)
    res["kl_requires_grad"] = sorted(
        n for n, p in backend.model.named_parameters() if p.requires_grad
    )
    backend.close()
    res["dtype"] = first_forward_disabled(rank, world, hf_dir, data)
    if rank == 0:
        torch.save(res, out_file)


def first_forward_disabled(rank, world, hf_dir, data):
    """bf16 compute, fp32 master: a first forward with adapters disabled, then a step."""
    from miles_fsdp.optimizer_step import optimizer_step
    from miles_fsdp.roles import adapters_disabled

    backend = FSDPBackend()
    backend.init(
        make_args(hf_checkpoint=hf_dir, use_lora=True, lora_rank=2, fsdp_compute_dtype="bf16")
    )
    model = backend.model
    rows = my_rows(data, rank, world)
    with adapters_disabled(model):
        model(input_ids=rows)
    optimizer_step(
        model,
        backend.optimizer,
        backend.scheduler,
        [rows],
        nll_contribution(data.shape[0] * (data.shape[1] - 1)),
        dp_size=world,
        clip_grad=0.0,
    )
    dtypes = {n: p.grad.dtype for n, p in model.named_parameters() if p.grad is not None}
    param_dtypes = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    backend.close()
    return {"grad": dtypes, "param": param_dtypes}


#: What the prepare hook saw (per process), read back by roles_program.
SEEN: dict = {}


def record_prepare(ctx, batch):
    """--custom-prepare-path hook: runs the teacher under no_grad and records the context."""
    teacher = ctx.teacher_models["model"]
    with torch.no_grad():
        out = teacher(input_ids=batch[0].tokens[None].to(ctx.device)).logits
    SEEN.update(
        models=sorted(ctx.models),
        reference=sorted(ctx.reference_models),
        teacher=sorted(ctx.teacher_models),
        teacher_requires_grad=out.requires_grad,
    )
    return batch


def roles_program(rank, world, hf_dir, ref_dir, ref_adapter, teacher_dir, data, save_dir, out_file):
    """Actor + reference (with adapter) + CPU-offloaded teacher; logits, hooks, KL, sleep;
    a checkpoint and its resume (the frozen roles rebuilt from their sources)."""
    flags = dict(
        hf_checkpoint=hf_dir,
        ref_load=ref_dir,
        ref_mode="ref",
        ref_lora_adapter_path=[ref_adapter],
        teacher_load=teacher_dir,
        teacher_cpu_offload=True,
        custom_prepare_path="role_programs:record_prepare",
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="k2",  # (log p - log ref)^2 / 2 > 0 when the models differ
        advantage_estimator="grpo",
        save=save_dir,
    )
    backend = FSDPBackend()
    backend.init(make_args(**flags))
    rows = my_rows(data, rank, world)
    res: dict = {}

    def logits():
        with torch.no_grad():
            return {
                "actor": backend.model(input_ids=rows).logits.clone(),
                "reference": backend.frozen["reference"](input_ids=rows).logits.clone(),
                "teacher": backend.frozen["teacher"](input_ids=rows).logits.clone(),
            }

    res["logits"] = logits()
    res["frozen"] = {
        role: (m.training, any(p.requires_grad for p in m.parameters()))
        for role, m in backend.frozen.items()
    }
    res["metrics"] = backend.train(0, my_shard(make_samples(), rank, world))
    res["seen"] = dict(SEEN)
    res["trained"] = logits()
    for _ in range(2):
        backend.sleep()
        backend.wake_up()
    res["skipped"] = list(backend.mover.skipped)
    res["after_sleep"] = logits()
    backend.save_model(0, force_sync=True)
    res["actor_keys"] = sorted(backend.model.state_dict())
    backend.close()
    backend = FSDPBackend()  # resume: the actor from the checkpoint, frozen roles from sources
    backend.init(make_args(load=save_dir, **flags))
    res["resumed"] = logits()
    backend.close()
    if rank == 0:
        torch.save(res, out_file)


def full_adam_state(backend) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state (step, exp_avg, exp_avg_sq) per parameter name, as full tensors."""
    names = {id(p): n for n, p in backend.model.named_parameters()}
    out = {}
    for p, state in backend.optimizer.state.items():
        out[names[id(p)]] = {k: full(v).detach().cpu().clone() for k, v in state.items()}
    return out


def device_state_bytes(backend) -> int:
    """Bytes of this rank's shards of every role's parameters and buffers, AdamW and EMA state
    that sit on the backend's device (what a sleep must move off it)."""

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [local(t) for m in (backend.model, *backend.frozen.values()) for t in m.parameters()]
    tensors += [local(t) for m in (backend.model, *backend.frozen.values()) for t in m.buffers()]
    for opt in (backend.optimizer, backend.ema):
        tensors += [local(v) for st in opt.state.values() for v in st.values() if v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors if t.device == backend.device)


def sleep_cycles_program(rank, world, hf_dir, ref_dir, teacher_dir, data, out_file, attn="sdpa"):
    """3 rollouts with every role (EMA, reference, teacher); once never slept, once with a
    sleep/wake after each rollout. Records per cycle the actor, EMA and AdamW state, every
    role's logits, and (on CUDA) the device memory a sleep released against what it had to."""
    results = {}
    for label in ("control", "slept"):
        backend = FSDPBackend()
        backend.init(
            make_args(
                hf_checkpoint=hf_dir,
                ref_load=ref_dir,
                ref_mode="ref",
                teacher_load=teacher_dir,
                custom_prepare_path="role_programs:record_prepare",
                use_kl_loss=True,
                kl_loss_coef=0.1,
                attn_implementation=attn,
                **EMA_FLAGS,
            )
        )
        rows = my_rows(data, rank, world).to(backend.device)
        cycles = []
        for rollout_id in range(3):
            memory = {}
            if label == "slept" and rollout_id > 0:
                backend.sleep()  # left asleep: train() wakes the backend itself
            metrics = backend.train(
                rollout_id, my_shard(make_samples(seed=rollout_id), rank, world)
            )
            memory["asleep_after_train"] = backend.asleep
            if label == "slept":
                memory["must_move"] = device_state_bytes(backend)
                on_cuda = backend.device.type == "cuda"
                if on_cuda:
                    torch.cuda.synchronize()
                    memory["before"] = torch.cuda.memory_allocated(backend.device)
                backend.sleep()
                memory["asleep"] = backend.asleep
                memory["left_on_device"] = device_state_bytes(backend)
                if on_cuda:
                    memory["after"] = torch.cuda.memory_allocated(backend.device)
                backend.wake_up()
            with torch.no_grad():
                roles = {"actor": backend.model, **backend.frozen}
                logits = {r: m(input_ids=rows).logits.cpu() for r, m in roles.items()}
            params = {n: v.cpu() for n, v in full_params(backend.model).items()}
            cycles.append(
                {
                    "logits": logits,
                    "params": params,
                    "ema": {n: v.cpu() for n, v in full_ema(backend).items()},
                    "adam": full_adam_state(backend),
                    "loss": {k: metrics[k] for k in ("pg_loss", "kl_loss", "grad_norm")},
                    "memory": memory,
                }
            )
        results[label] = cycles
        backend.close()
    if rank == 0:
        torch.save(results, out_file)
