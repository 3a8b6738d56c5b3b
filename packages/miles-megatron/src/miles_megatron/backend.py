"""``MegatronBackend``: the megatron-core training backend behind miles-core's contract.

Per rank: megatron's parallel state (TP x PP x CP x EP x ETP, DP = rest), the GPTModel chunk
built from the bridge's architecture (local spec), weights from ``--load`` (torch_dist) or else
``--hf-checkpoint`` (converted in memory), megatron-core DDP with contiguous grad buffers and the
distributed optimizer, and the LR schedule. ``train`` runs miles-core's RL math
(:mod:`miles_megatron.train_step`).

Data layout: TP, CP and PP peers share a data-parallel rank; only the (TP 0, CP 0, PP 0) rank of
each DP rank consumes the launcher's shard and broadcasts it to its peers inside :meth:`train`.
At PP > 1 the micro-batches run megatron-core's 1F1B schedule (:mod:`miles_megatron.schedule`),
the loss and log-probs on the last stage.

Hooks (``module:function``): ``--custom-megatron-init-path`` ``f(args, model, optimizer)`` once
after init; ``--custom-megatron-before-log-prob-hook-path`` ``f(args, model, batch)`` before
each log-prob pass; ``--custom-megatron-before-train-step-hook-path``
``f(args, rollout_id, step, model, optimizer)`` before each optimizer step.

Context parallelism (``--context-parallel-size``): each CP rank holds a zig-zag shard of every
packed micro-batch and attends to the whole row through all-gathered keys and values
(:mod:`miles_megatron.context_parallel`); weights are replicated over CP, so a checkpoint saved
at one CP size loads at another and a publish reads one CP replica.

Reference model: with ``--ref-load`` (``--ref-mode ref``) the reference's shards are kept on
the host and swapped in for the reference log-prob pass (:mod:`miles_megatron.reference_model`);
``train`` attaches ``ref_log_probs`` for the KL loss (``--use-kl-loss``). With ``--ref-mode
lora_base`` the reference is the actor with its LoRA adapters off.

LoRA (``--use-lora``, :mod:`miles_megatron.lora`): adapters on the TP linears, base frozen
and read from ``--hf-checkpoint``, adapter-only checkpoints, merged (or adapter-only) publish,
:meth:`MegatronBackend.export_adapter` to a PEFT directory.

Critic (``init(args, "critic")`` under ``--use-critic``): the actor's model with the value head
of :mod:`miles_megatron.value_head` in place of the output layer, built from the namespace of
:func:`miles_core.args.groups.critic.critic_args` (``--critic-lr``, ``--critic-save`` /
``--critic-load``, ``--loss-type value_loss``): its own DDP buffers, optimizer, scheduler,
checkpoint and sleeper, on the megatron parallel state it shares with the actor of the same
rank (:func:`~miles_megatron.parallel.acquire_parallel`), without the actor's
``--custom-megatron-*`` hooks. :meth:`compute_values` scores a rollout; ``train`` fits the
values to the GAE returns; it never publishes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.transformer.module import Float16Module
from miles_core.args import ArgumentError, ParsedArgs
from miles_core.args.groups.critic import critic_args
from miles_core.checkpoint_layout import resolve_load
from miles_core.compiled_layers import compile_layers
from miles_core.contract import DataLayout, TrainBackend
from miles_core.custom_loss import LossHook
from miles_core.user_functions import load_function
from miles_sync.ranks import RankContext
from miles_sync.weight_sync import SyncConfig, WeightPublisher

from miles_megatron.arch_args import resolve_model_args
from miles_megatron.args import megatron_groups
from miles_megatron.bridge import BridgeError, bridge_for
from miles_megatron.checkpoint import finish_saves, load_checkpoint, load_rng, save_checkpoint
from miles_megatron.fp32_params import restore_marked_dtypes
from miles_megatron.hf_weights import HFCheckpoint, iter_hf_weights, load_hf_into_model
from miles_megatron.lora import adapters_disabled
from miles_megatron.lora.actor import ActorLoRA
from miles_megatron.model_config import build_gpt_model, transformer_config, transformer_layers
from miles_megatron.optimizer import build_optimizer, wrap_ddp
from miles_megatron.packed_forward import rollout_log_probs, rollout_values
from miles_megatron.parallel import acquire_parallel, release_parallel
from miles_megatron.publish_source import TO_ALL_MODES, model_weights
from miles_megatron.reference_model import ReferenceModel, wants_reference
from miles_megatron.sleep_wake import sleeper_from_args
from miles_megatron.streamed_optimizer import close_streamed
from miles_megatron.train_step import TrainContext, split_micro_batches, train_rollout
from miles_megatron.value_head import install_value_head

logger = logging.getLogger(__name__)


class _Phases:
    """Rank 0 logs each phase of init with the seconds since init began."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, what: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("megatron backend [%.1fs]: %s", time.perf_counter() - self.start, what)


class MegatronBackend(TrainBackend):
    name = "megatron"

    @classmethod
    def arg_groups(cls) -> Sequence[type]:
        return megatron_groups()

    def __init__(self) -> None:
        self.args: Any = None
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.global_step = 0
        self._publisher: Any = None
        self._async_saves: Any = None  # megatron-core AsyncCallsQueue under --async-save
        self.lora: Any = None  # miles_megatron.lora.actor.ActorLoRA under --use-lora
        self._checkpoint_names: list[str] | None = None  # what every publish must deliver
        self.role = "actor"

    # ------------------------------------------------------------------ init
    def init(self, args: ParsedArgs, role: str = "actor") -> int:
        if role not in ("actor", "critic"):
            raise ArgumentError(
                f"the megatron backend trains roles 'actor' and 'critic', not {role!r}"
            )
        if role == "critic":  # its own flags: --critic-lr, --critic-save, ..., value_loss
            args = critic_args(args)
        self.role = role
        self.args = args
        self._loss_hook = LossHook.from_args(args)  # the actor's: critic_args clears the flag
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        phase = _Phases()
        self.margs = resolve_model_args(args)
        self.bridge = bridge_for(self.margs.get("model_type") or "")
        phase("creating megatron's process groups")
        acquire_parallel(args, self.margs)
        config = transformer_config(self.margs, args)
        phase(f"building the {self.margs.get('model_type') or 'GPT'} model")
        model = build_gpt_model(self.margs, args, config)
        resumed = self._resolve_load()
        hf = None
        try:
            hf = HFCheckpoint(args.hf_checkpoint) if args.hf_checkpoint else None
        except BridgeError:
            if resumed is None or args.use_lora:
                raise
        # a publish delivers exactly these names (unchecked beside an architecture-only dir)
        self._checkpoint_names = hf.names() if hf is not None else None
        if resumed is None or args.use_lora:  # LoRA checkpoints hold the adapters only
            if not args.hf_checkpoint:
                raise ArgumentError("megatron backend needs --hf-checkpoint or --load")
            phase(f"loading the HF weights of {args.hf_checkpoint}")
            load_hf_into_model(
                model,
                hf,
                self.bridge,
                self.margs,
                args.tensor_model_parallel_size,
            )
        if args.use_lora:
            extra = resumed.meta.extra if resumed is not None else None
            self.lora = ActorLoRA.attach(args, model, self.bridge, self.margs, extra)
        elif resumed is not None and "lora" in resumed.meta.extra:
            raise ArgumentError(f"--load {args.load}: a LoRA adapter checkpoint needs --use-lora")
        if role == "critic":  # after the HF load (the LM head's weights are not the critic's)
            install_value_head(model, args.seed)
        if args.compile_decoder_layers:  # compiled at the first forward, inside the recompute
            compile_layers(transformer_layers(model))
        model = model.to(self.device)
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
            restore_marked_dtypes(model)
        phase("wrapping the model in DDP and building the optimizer")
        self.model = wrap_ddp(model, config, args)
        self.optimizer, self.scheduler = build_optimizer(self.model, args)
        name = "megatron" if role == "actor" else role
        self.sleeper = sleeper_from_args(self.model, self.optimizer, args, name=name, role=role)
        next_rollout_id = 0
        if resumed is not None:
            phase(f"loading the checkpoint {resumed.path}")
            load_checkpoint(
                resumed.path,
                self.model,
                self.optimizer,
                self.scheduler,
                args.load_optim,
                model_sd=self.lora.sharded_state_dict(self.model) if self.lora else None,
            )
            next_rollout_id = resumed.meta.next_rollout_id
            self.global_step = resumed.meta.global_step
        self.reference = None
        if wants_reference(args):
            phase(f"loading the reference model {args.ref_load}")
            self.reference = ReferenceModel.load(
                self.model, args.ref_load, self.bridge, self.margs, args.tensor_model_parallel_size
            )
        self._before_log_prob = self._hook("custom_megatron_before_log_prob_hook_path")
        self._before_train_step = self._hook("custom_megatron_before_train_step_hook_path")
        init_hook = self._hook("custom_megatron_init_path")
        if init_hook is not None:
            init_hook(args, self.model, self.optimizer)
        if args.async_save:
            self._async_saves = AsyncCallsQueue(persistent=False)
        if resumed is not None and args.load_rng:
            load_rng(resumed.path)  # last: nothing in init draws after it
        phase("ready")
        return next_rollout_id

    def _resolve_load(self):
        if not getattr(self.args, "load", None):
            return None

        return resolve_load(self.args.load, getattr(self.args, "ckpt_step", None))

    def _hook(self, dest: str):
        """The ``--custom-megatron-*`` hook ``dest`` names; the actor's only (not the critic's)."""
        path = getattr(self.args, dest, None) if self.role == "actor" else None
        return load_function(path, "--" + dest.replace("_", "-")) if path else None

    # ------------------------------------------------------------------ data
    def data_layout(self) -> DataLayout:
        return DataLayout(
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            consumes_data=ps.get_tensor_model_parallel_rank() == 0
            and ps.get_pipeline_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0,
        )

    def _share_with_model_parallel_peers(self, batch: Any) -> Any:
        """The batch of the (TP 0, PP 0, CP 0) rank of this DP rank, on all its peers.

        Broadcast over the PP group, then CP, then TP: a group whose source holds nothing yet
        passes ``None`` along, which a later broadcast overwrites.
        """
        steps = (
            (ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_first_rank()),
            (ps.get_context_parallel_group(), ps.get_context_parallel_global_ranks()[0]),
            (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()),
        )
        for group, src in steps:
            if dist.get_world_size(group) > 1:
                box = [batch]
                dist.broadcast_object_list(box, src=src, group=group)
                batch = box[0]
        return batch

    # ------------------------------------------------------------------ train
    def train(self, rollout_id: int, batch: Any) -> dict[str, float]:
        finish_saves(self._async_saves, blocking=False)  # publish writes that are done
        batch = self._share_with_model_parallel_peers(batch)
        ctx = self._context()
        if self.reference is not None or self._lora_base_reference:
            batch = batch.with_fields(ref_log_probs=self.reference_log_probs(batch, ctx))
        metrics = train_rollout(ctx, rollout_id, batch)
        self.global_step += int(metrics["steps"])
        interval = getattr(self.args, "ref_update_interval", None)
        if self.reference is not None and interval and (rollout_id + 1) % interval == 0:
            self.reference.update_from(self.model)
        return metrics

    def compute_values(self, batch: Any) -> list[torch.Tensor]:
        """The critic's per-sample values ``V_t`` of this rank's shard (float32, CPU,
        response-aligned), before this rollout's update, on every rank of the DP rank (the
        launcher reads the data-consuming one's). Critic role only; collective."""
        if self.role != "critic":
            raise ValueError(f"compute_values: the {self.role} has no value head")
        self.wake_up()
        batch = self._share_with_model_parallel_peers(batch)
        index = {src: i for i, src in enumerate(batch.source_indices)}
        micro_batches = split_micro_batches(self._context(), batch)
        return rollout_values(self.model, micro_batches, len(batch), index, self.device)

    @property
    def _lora_base_reference(self) -> bool:
        return self.lora is not None and getattr(self.args, "ref_mode", None) == "lora_base"

    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """The reference policy in the actor's modules: ``--ref-load``'s weights swapped in
        and/or the LoRA adapters off (``lora_base``; also with ``ref``: the reference has none)."""
        with contextlib.ExitStack() as stack:
            if self.reference is not None:
                stack.enter_context(self.reference.swapped_in(self.model))
            if self.lora is not None:
                stack.enter_context(adapters_disabled(self.model))
            yield

    def reference_log_probs(self, batch: Any, ctx: Any = None) -> list[torch.Tensor]:
        """Per-sample response log-probs of the reference policy (``--ref-load`` or, with
        ``--ref-mode lora_base``, the actor without its adapters)."""
        ctx = ctx or self._context()
        if ctx.before_log_prob_hook is not None:
            ctx.before_log_prob_hook(self.args, self.model, batch)
        index = {src: i for i, src in enumerate(batch.source_indices)}
        with self._reference_weights():
            return rollout_log_probs(
                self.model,
                split_micro_batches(ctx, batch),
                len(batch),
                index,
                ctx.vocab_size,
                self.args.rollout_temperature,
                self.device,
                fused=self.args.fused_log_probs,
            )

    def _context(self):
        return TrainContext(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            args=self.args,
            device=self.device,
            vocab_size=self.margs["vocab_size"],
            dp_size=ps.get_data_parallel_world_size(),
            dp_group_gloo=ps.get_data_parallel_group_gloo(),
            cp_size=ps.get_context_parallel_world_size(),
            dp_cp_group_gloo=ps.get_data_parallel_group_gloo(with_context_parallel=True),
            cp_group=(
                ps.get_context_parallel_group()
                if ps.get_context_parallel_world_size() > 1
                else None
            ),
            before_log_prob_hook=self._before_log_prob,
            before_train_step_hook=self._before_train_step,
            loss_hook=self._loss_hook,
        )

    # ------------------------------------------------------------------ weights
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights of this PP stage, TP-merged, experts EP-gathered and unfused (a
        collective over the stage's TP/EP groups; :meth:`publish_weights` joins the stages).

        Under ``--use-lora``: the base with ``(alpha / r) B A`` merged in, in the base's dtype.
        Asleep, the base and the factors are read from their host copies or files.
        """
        read = self._asleep_read()
        base = iter_hf_weights(self.model, self.bridge, self.margs, read=read)
        return self.lora.merged(base, read) if self.lora is not None else base

    def _asleep_read(self):
        """:meth:`~miles_megatron.sleep_wake.SleepWake.read` while asleep, else None."""
        return self.sleeper.read if self.sleeper.asleep else None

    def publish_weights(self, to_all: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """What :meth:`update_weights` sends (collective on every rank): every stage's
        :meth:`hf_weights` on global rank 0, or with ``to_all`` (the ``ipc`` and ``p2p``
        transports) on every rank (:mod:`miles_megatron.publish_source`); their names are
        checked against ``--hf-checkpoint``'s. With ``--publish-lora-adapter``: the PEFT-named
        adapter factors (one stage: LoRA runs at PP = 1)."""
        if self.role == "critic":
            raise ValueError("publish_weights: the critic never publishes to the engines")
        if self.lora is not None and getattr(self.args, "publish_lora_adapter", False):
            return self.lora.adapter_weights(self._asleep_read())
        return model_weights(
            self.hf_weights,
            self.device,
            to_all,
            self._checkpoint_names,
            f"--hf-checkpoint {self.args.hf_checkpoint}",
        )

    def export_adapter(self, out_dir: str) -> None:
        """Write the actor's adapter as a PEFT directory (collective; rank 0 writes); asleep,
        the factors are read from their host copies or files."""
        if self.lora is None:
            raise ValueError("export_adapter needs --use-lora")
        try:
            self.lora.export(out_dir, self._asleep_read())
        finally:
            self.sleeper.drop_reads()

    def update_weights(self, engines: Sequence[Any], weights: str | None = None) -> None:
        """Publish the HF-named weights to ``engines`` through miles-sync (every rank calls).

        ``weights``: ``"actor"`` or unset (``--rollout-weights``, ``actor``: this backend keeps
        no EMA); ``"ema"`` raises ``ValueError``.

        miles-sync's transports read one collective source on every rank; :meth:`publish_weights`
        brings every pipeline stage's tensors to the ranks the mode sends from (rank 0 for
        ``broadcast`` and ``disk-delta``, every rank for ``ipc`` and ``p2p``).

        A sleeping model publishes asleep (:meth:`~miles_megatron.sleep_wake.SleepWake.read`:
        each parameter from its host copy or file, moved to the device, TP-merged and sent
        stage by stage as awake; the optimizer state stays on the target), with the ``cpu`` and
        ``disk`` targets at every TP/PP/EP layout; under
        ``--rematerialize-param-from-master-weight`` each DDP bucket is rebuilt from the fp32
        masters on the host, one at a time. ``--use-lora`` publishes asleep too: the frozen
        base from its retained pinned host copy, a tensor at a time, and the adapter factors
        (in the DDP buffers) from the target, gathered over TP/EP and merged on the fly
        exactly as awake (``--publish-lora-adapter``: the factors alone); nothing wakes.
        """
        if self.role == "critic":
            raise ValueError("update_weights: the critic never publishes to the engines")
        which = weights or getattr(self.args, "rollout_weights", "actor")
        if which != "actor":
            raise ValueError(
                f"update_weights(weights={which!r}): the Megatron backend publishes 'actor' "
                "only (it keeps no EMA)"
            )
        if self._publisher is None:
            self._publisher = WeightPublisher(
                SyncConfig.from_args(self.args), RankContext.from_default_group()
            )
        to_all = self._publisher.config.mode in TO_ALL_MODES
        try:
            self._publisher.update_weights(self.publish_weights(to_all), list(engines))
        finally:
            self.sleeper.drop_reads()

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """Iteration ``rollout_id + 1``. Under ``--async-save`` (unless ``force_sync``) only the
        staging happens here and the tracker moves once the background write is done; the
        previous async save is always finished first. ``force_sync``: durable on return.
        Asleep (the critic under ``--colocate`` sleeps between its phases): wakes, saves
        synchronously (an async write would read the state after it sleeps again), sleeps."""
        if self.sleeper.asleep:
            self.wake_up()
            try:
                self.save_model(rollout_id, force_sync=True)
            finally:
                self.sleep()
            return

        if not self.args.save:
            raise ValueError(
                "save_model needs --critic-save"
                if self.role == "critic"
                else "save_model needs --save"
            )
        finish_saves(self._async_saves)
        save_checkpoint(
            self.args.save,
            rollout_id,
            self.model,
            self.optimizer,
            self.scheduler,
            self.args.save_optim,
            {"global_step": self.global_step, **({"lora": self.lora.meta()} if self.lora else {})},
            async_queue=None if force_sync else self._async_saves,
            model_sd=self.lora.sharded_state_dict(self.model) if self.lora else None,
        )

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Release the model's and optimizer's device memory (:mod:`miles_megatron.sleep_wake`)."""
        self.sleeper.sleep()

    def wake_up(self) -> None:
        self.sleeper.wake_up()

    def close(self) -> None:
        if self._async_saves is not None:
            finish_saves(self._async_saves)
            self._async_saves = None
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        if getattr(self, "sleeper", None) is not None:
            self.sleeper.close()
        if self.optimizer is not None:
            close_streamed(self.optimizer)
        release_parallel()
        self.model = self.optimizer = self.scheduler = None
