"""FSDPBackend: the HF model trained verbatim under PyTorch FSDP2 (``--train-backend fsdp``)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from miles_core import batch_invariant
from miles_core.aggregation import all_reduce_host
from miles_core.args import ArgumentError, ParsedArgs
from miles_core.args.groups.critic import critic_args
from miles_core.contract import DataLayout, TrainBackend
from miles_core.optimizer import optimizer_config, run_optimizer_steps
from miles_offload.device_mover import DeviceMover
from miles_offload.offload_target import OffloadTarget
from miles_sync.ranks import RankContext
from miles_sync.weight_sync import SyncConfig, WeightPublisher
from torch import nn

from miles_fsdp import train_step
from miles_fsdp.adaptations import Adaptation, adaptation_for
from miles_fsdp.adaptations.moe import RoutingReplay, resolve_moe_kernel
from miles_fsdp.args import FSDPArgs
from miles_fsdp.build import BuildPlan, RoleSpec, build_model
from miles_fsdp.checkpoint import Checkpointer, TrainState, export_hf
from miles_fsdp.ema import build_ema
from miles_fsdp.hooks import HookContext, Hooks
from miles_fsdp.loading import (
    HFCheckpointInfo,
    load_config,
    resolve_attn_implementation,
    validate_on_rank0,
)
from miles_fsdp.lora import actor_lora, actor_lora_fixup
from miles_fsdp.loss_scale import LossScaler
from miles_fsdp.mesh import MeshShape, build_mesh, mesh_shape
from miles_fsdp.optimizer import build_optimizer, build_streamed_optimizer, is_streamed
from miles_fsdp.output_head import check_fused_head
from miles_fsdp.precision import PrecisionConfig, precision_of
from miles_fsdp.profiling import TrainProfiler
from miles_fsdp.publish_source import WeightSource
from miles_fsdp.roles import component_names, frozen_role, frozen_sources
from miles_fsdp.true_on_policy import check_true_on_policy_dtype
from miles_fsdp.value_head import critic_config, install_value_head, value_head_fixup


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


class FSDPBackend(TrainBackend):
    """One trainer rank of the FSDP2 backend. See docs/miles-fsdp.md."""

    name = "fsdp"

    @classmethod
    def arg_groups(cls) -> Sequence[type]:
        return (FSDPArgs,)

    def __init__(self) -> None:
        self.args: Any = None
        self.model: nn.Module | None = None
        self.frozen: dict[str, nn.Module] = {}  # "reference", "teacher": frozen roles
        self.ema: Any = None  # EMAOptimizer under --use-ema
        self.mover: Any = None
        self.publisher: Any = None
        self.role = "actor"

    # ------------------------------------------------------------------ init
    def init(self, args: ParsedArgs, role: str = "actor") -> int:
        if role not in ("actor", "critic"):
            raise ValueError(f"FSDPBackend supports roles 'actor' and 'critic', got {role!r}")
        if role == "critic":  # its own flags: --critic-lr, --critic-save, ..., value_loss
            args = critic_args(args)
        self.role = role
        if not args.hf_checkpoint:
            raise ArgumentError("--train-backend fsdp needs --hf-checkpoint (the model directory)")
        self.args = args
        self.device = _device()
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
            self.shape: MeshShape = mesh_shape(world, args.dp_replicate_size)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from exc
        if args.fsdp_cpu_offload and dist.is_initialized():
            if "gloo" not in str(dist.get_backend()) and self.device.type == "cuda":
                raise RuntimeError(
                    "--fsdp-cpu-offload needs a CPU backend in the default process group: "
                    f"init it with backend 'cpu:{args.fsdp_cpu_backend},cuda:nccl'"
                )
        self.mesh = build_mesh(self.shape, self.device.type)
        # CPU collectives of the RL math (counts, denominators) run on gloo.
        self.cpu_group = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self.cpu_group = dist.new_group(backend="gloo")
        self.profiler = TrainProfiler(args)
        torch.manual_seed(args.seed)
        random.seed(args.seed)

        self.info: HFCheckpointInfo = validate_on_rank0(args.hf_checkpoint)
        self.hf_dir = Path(args.hf_checkpoint)
        self.config = load_config(self.hf_dir)
        if args.fused_log_probs:
            check_fused_head(self.config)
        self.adaptation: Adaptation = adaptation_for(self.config.model_type)
        precision = precision_of(args)
        for policy in self.adaptation.precision_policies:
            precision = policy(self.config, precision)
        self.precision: PrecisionConfig = precision
        if args.true_on_policy:  # miles_core.batch_invariant: its own attention
            check_true_on_policy_dtype(
                self.device, precision.compute_dtype, self.info.tensor_dtypes
            )
            self.attn_implementation = batch_invariant.register_hf()
        else:
            self.attn_implementation = resolve_attn_implementation(args.attn_implementation)
        self.moe_kernel = resolve_moe_kernel(
            args.moe_kernel, self.config.model_type, self.device.type
        )
        # R3: one replay read by the routers of every role (built by the same path)
        self.routing_replay = RoutingReplay() if args.use_rollout_routing_replay else None

        # roles (docs/miles-fsdp.md "Roles, LoRA and EMA"): adapters before any checkpoint
        self.component = component_names(args)[0]
        self.lora, self.adapter = actor_lora(args)
        plan = BuildPlan(
            adaptation=self.adaptation,
            precision=precision,
            attn_implementation=self.attn_implementation,
            mesh=self.mesh,
            device=self.device,
            moe_kernel=self.moe_kernel,
            routing_replay=self.routing_replay,
            compile_layers=args.compile_decoder_layers,
            batch_invariant=args.true_on_policy,
        )
        if role == "critic":  # the actor's architecture with a value head (miles_fsdp.value_head)
            trained = RoleSpec(
                role="critic",
                path=self.hf_dir,
                config=critic_config(self.config),
                trainable=True,
                cpu_offload=args.fsdp_cpu_offload,
                fixups=(value_head_fixup(args.seed),),
                gradient_checkpointing=args.gradient_checkpointing,
                checkpoint_layers=args.gradient_checkpointing_layers,
                instance_patches=(install_value_head,),
            )
        else:
            trained = RoleSpec(
                role="actor",
                path=self.hf_dir,
                config=self.config,
                trainable=True,
                cpu_offload=args.fsdp_cpu_offload,
                lora=self.lora,
                fixups=(actor_lora_fixup(self.lora, self.adapter),)
                if self.lora is not None
                else (),
                gradient_checkpointing=args.gradient_checkpointing,
                checkpoint_layers=args.gradient_checkpointing_layers,
            )
        self.model = build_model(plan, trained)
        self.frozen = {
            s.role: build_model(plan, frozen_role(s, self.config)) for s in frozen_sources(args)
        }
        cfg = args.run_config
        opt_config = optimizer_config(cfg.optimizer, cfg.offload, run_optimizer_steps(args))
        if opt_config.streamed is not None:
            self.optimizer, self.scheduler = build_streamed_optimizer(self.model, opt_config)
        else:
            self.optimizer, self.scheduler = build_optimizer(self.model, opt_config)
        self.ema = build_ema(self.model, args)
        self.hooks = Hooks.from_args(args, self._hook_context())
        self.loss_scaler = LossScaler.from_args(args)
        self.checkpointer = Checkpointer(
            self.model, self.optimizer, self.scheduler, loss_scaler=self.loss_scaler
        )
        self.checkpointer.ema = self.ema
        self.checkpointer.adapter_only = self.lora is not None
        self.state = TrainState()
        if args.load:
            loaded = self.checkpointer.load(
                args.load,
                load_optim=args.load_optim,
                load_rng=args.load_rng,
                ckpt_step=args.ckpt_step,
            )
            self.state = loaded if loaded is not None else TrainState()
        return self.state.next_rollout_id

    def _hook_context(self) -> HookContext:
        """Every role's components by name, for custom prepare/loss hooks."""
        c = self.component
        return HookContext(
            args=self.args,
            device=self.device,
            models={c: self.model},
            reference_models={c: self.frozen["reference"]} if "reference" in self.frozen else {},
            teacher_models={c: self.frozen["teacher"]} if "teacher" in self.frozen else {},
            attn_implementation=self.attn_implementation,
            compute_dtype=self.precision.compute_dtype,
        )

    @contextmanager
    def use_weights(self, which: str) -> Iterator[None]:
        """``which`` = ``actor`` (as is) or ``ema`` (EMA swapped into the actor's shards)."""
        with self.ema.use_weights(self.model) if which == "ema" else nullcontext():
            yield

    def evaluation_weights(self):
        """Context for evaluation forwards: the weights ``--eval-weights`` names."""
        return self.use_weights(self.args.eval_weights)

    # ------------------------------------------------------------------ layout
    def data_layout(self) -> DataLayout:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return DataLayout(dp_rank=rank, dp_size=self.shape.world_size)

    # ------------------------------------------------------------------ training
    def _rollout_context(self) -> Any:
        """What :mod:`.train_step` needs: this backend's model, optimizer, roles and hooks."""
        return train_step.RolloutContext(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            args=self.args,
            device=self.device,
            dp_size=self.shape.world_size,
            cpu_group=self.cpu_group,
            attn_implementation=self.attn_implementation,
            compute_dtype=self.precision.compute_dtype,
            routing_replay=self.routing_replay,
            reference=self.frozen.get("reference"),
            ema=self.ema,
            hooks=self.hooks,
            loss_scaler=self.loss_scaler,
            profiler=self.profiler,
            global_step=self.state.global_step,
        )

    def train(self, rollout_id: int, batch: Any) -> dict[str, float]:
        """Train on this rank's shard of rollout ``rollout_id`` (see :mod:`.train_step`)."""
        self.wake_up()
        ctx = self._rollout_context()
        try:
            metrics, steps, micro = train_step.train_rollout(ctx, batch)
        except BaseException:
            self.profiler.stop()  # a trace or memory history open in the window is kept
            raise
        self.state.global_step += steps
        self.state.micro_step += micro
        if self.ema is not None:  # once per rollout, after its optimizer steps
            metrics["ema_decay"] = self.ema.update(self.state.global_step)
        self.state.next_rollout_id = rollout_id + 1
        self.profiler.log(self.state.global_step, metrics)
        return metrics

    def compute_values(self, batch: Any) -> list[torch.Tensor]:
        """The critic's per-sample values ``V_t`` of this rank's shard (float32, CPU,
        response-aligned), before this rollout's update. Critic role only; collective over DP
        ranks."""
        if self.role != "critic":
            raise ValueError(f"compute_values: the {self.role} has no value head")
        self.wake_up()
        return train_step.critic_values(self._rollout_context(), batch)

    # ------------------------------------------------------------------ evaluation
    def eval_log_probs(self, batch: Any) -> list[torch.Tensor]:
        """Per-sample response log-probs (float32, CPU) of this rank's shard ``batch`` at
        ``--rollout-temperature``, under the weights ``--eval-weights`` names (EMA swapped into
        the actor's shards and back), in eval mode (no dropout). Collective over DP ranks."""
        self.wake_up()
        was_training = self.model.training
        self.model.eval()
        try:
            with self.evaluation_weights():
                return train_step.policy_log_probs(self._rollout_context(), batch)
        finally:
            self.model.train(was_training)

    def evaluate(self, batch: Any) -> dict[str, float]:
        """Evaluate the ``--eval-weights`` policy on a batch (every DP rank its shard).

        Returns, over all DP ranks, ``log_prob``: the mean response-token log-prob
        ``sum(log p) / N`` at ``--rollout-temperature``, ``nll = -log_prob`` and ``tokens`` = N
        (response tokens, loss mask ignored). Neither the actor nor EMA changes.
        """
        values = self.eval_log_probs(batch)
        local = torch.tensor(
            [sum(float(v.double().sum()) for v in values), float(sum(v.numel() for v in values))],
            dtype=torch.float64,
        )
        total, tokens = all_reduce_host(local, dist.ReduceOp.SUM, self.cpu_group).tolist()
        log_prob = total / max(tokens, 1.0)
        return {"log_prob": log_prob, "nll": -log_prob, "tokens": tokens}

    # ------------------------------------------------------------------ publishing
    def update_weights(self, engines: Sequence[Any], weights: str | None = None) -> None:
        """Publish weights to ``engines`` through miles-sync (every rank calls).

        ``weights``: ``actor`` or ``ema``; unset: ``--rollout-weights``. An evaluation on the
        engines with ``--eval-weights`` other than ``--rollout-weights`` publishes
        ``weights=args.eval_weights`` before it and the rollout weights again after it.

        A sleeping trainer publishes asleep: the weight source reads each shard from its host
        copy or disk file (:meth:`~miles_offload.device_mover.DeviceMover.read`), a gather
        group at a time, and the optimizer state never comes back to the device. The EMA's
        averages are read in place of the actor's values (nothing is swapped).
        """
        if self.role == "critic":
            raise ValueError("update_weights: the critic never publishes to the engines")
        which = weights or self.args.rollout_weights
        if which not in ("actor", "ema"):
            raise ValueError(f"update_weights: weights must be 'actor' or 'ema', got {which!r}")
        if which == "ema" and self.ema is None:
            raise ValueError("update_weights(weights='ema') needs --use-ema")
        if self.publisher is None:
            self.publisher = WeightPublisher(
                SyncConfig.from_args(self.args), RankContext.from_default_group()
            )
        source = self.weight_source(self.args.update_weight_buffer_size, weights=which)
        self.publisher.update_weights(source, list(engines))

    # ------------------------------------------------------------------ weights
    def weight_source(self, gather_bytes: int = 256 << 20, weights: str = "actor") -> WeightSource:
        """The current weights in checkpoint names/dtypes (collective iteration): the actor's,
        or with ``weights="ema"`` the EMA's averages in the actor's names. Asleep, the source
        reads the host copies (see :meth:`update_weights`)."""
        values = {}
        if weights == "ema":
            values = {
                name: self.ema.state[p]["ema"]
                for name, p in self.model.named_parameters()
                if p in self.ema.state
            }
        return WeightSource(
            model=self.model,
            config=self.config,
            adaptation=self.adaptation,
            tensor_dtypes=self.info.tensor_dtypes,
            default_dtype=self._config_dtype(),
            gather_bytes=gather_bytes,
            device=self.device,
            lora_scale=self.lora.scale if self.lora is not None else None,
            read=self.mover.read if self.asleep else None,
            values=values,
        )

    def _config_dtype(self) -> torch.dtype:
        """The config's dtype (for tensors the checkpoint does not name), bf16 if unset."""
        dtype = getattr(self.config, "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16

    def export_hf(self, out_dir: str | os.PathLike) -> None:
        """Write the current weights as a HF directory loadable by ``from_pretrained``."""
        export_hf(self.weight_source(), self.hf_dir, out_dir)

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """Checkpoint iteration ``rollout_id + 1`` into ``--save`` (the critic: ``--critic-save``).
        A sleeping backend wakes for the save and sleeps again after it."""
        if not self.args.save:
            raise ValueError("save_model needs --save")
        asleep = self.asleep
        self.wake_up()
        self.state.next_rollout_id = max(self.state.next_rollout_id, rollout_id + 1)
        self.checkpointer.save(
            self.args.save,
            rollout_id,
            self.state,
            save_optim=self.args.save_optim,
            async_save=self.args.async_save and not force_sync,
        )
        if force_sync:
            self.checkpointer.finalize()
        if asleep:
            self.sleep()

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Move every role's parameters and buffers, AdamW and EMA state off the device
        (miles-offload's mover: ``--offload-train-target cpu|disk``). Idempotent. Frozen roles
        keep their host copies; models FSDP keeps on the CPU (``--fsdp-cpu-offload``,
        ``--ref-cpu-offload``, ``--teacher-cpu-offload``) never sleep. With
        ``--stream-optimizer-state-to-disk`` the streamed state is in files already: the mover
        moves only the small parameters' on-device AdamW state (``optimizer.state``)."""
        if self.mover is None:
            optimizers = [self.optimizer] + ([self.ema] if self.ema is not None else [])
            self.mover = DeviceMover(
                {self.role: self.model, **self.frozen},
                optimizers,
                frozen=list(self.frozen),
                target=OffloadTarget.from_args(self.args),
                device=self.device,
                role=self.role,
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.mover.sleep()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Bring back what :meth:`sleep` moved. Idempotent. A device allocation that fails
        raises :class:`~miles_offload.allocation.WakeFailed` (phase, role, stage, bytes) with
        the backend still asleep and restorable: a later ``wake_up`` can succeed."""
        if self.mover is not None:
            self.mover.wake_up()

    @property
    def asleep(self) -> bool:
        return self.mover is not None and self.mover.is_asleep

    def close(self) -> None:
        if self.model is not None:
            self.checkpointer.finalize()
            self.profiler.close()
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.mover is not None:
            self.mover.close()
            self.mover = None
        if self.model is not None and is_streamed(self.optimizer):
            self.optimizer.close()  # removes its working bucket files
        self.model = None
        self.frozen = {}
