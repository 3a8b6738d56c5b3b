"""Programs run on each gloo rank by the multi-rank tests (importable by spawned children)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from full_tensors import full
from miles_fsdp.backend import FSDPBackend
from miles_fsdp.optimizer_step import optimizer_step
from run_args import make_args


def nll_contribution(denominator: int):
    """Token NLL summed over a (B, T) micro-batch, divided by the step's global token count."""

    def loss_of(model, ids: torch.Tensor):
        ids = ids.to(next(model.parameters()).device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        return nll / denominator, {"nll": nll.detach() / denominator}

    return loss_of


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = full(g).detach().clone()
    return out


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def my_rows(data: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of the global batch: rows ``rank::world``."""
    return data[rank::world]


def layout_gradients(rank, world, hf_dir, data, dp_replicate, micro_splits) -> dict:
    """One optimizer step (lr 0) over the global batch ``data`` per micro-batch split, on a
    fresh backend with ``dp_replicate`` replicas: ``{split: {"grads", "loss"}}``."""
    backend = FSDPBackend()
    backend.init(
        make_args(hf_checkpoint=hf_dir, dp_replicate_size=dp_replicate, lr=0.0, clip_grad=0.0)
    )
    rows = my_rows(data, rank, world)
    denominator = data.shape[0] * (data.shape[1] - 1)
    results = {}
    for n_micro in micro_splits:
        micro = list(rows.chunk(n_micro))
        step = optimizer_step(
            backend.model,
            backend.optimizer,
            backend.scheduler,
            micro,
            nll_contribution(denominator),
            dp_size=world,
            clip_grad=0.0,
        )
        results[n_micro] = {"grads": full_grads(backend.model), "loss": step.loss}
    backend.close()
    return results


def gradients_program(rank, world, hf_dir, data, dp_replicate, micro_splits, out_file):
    """:func:`layout_gradients` of one layout; rank 0 saves ``{split: ...}``."""
    results = layout_gradients(rank, world, hf_dir, data, dp_replicate, micro_splits)
    if rank == 0:
        torch.save(results, out_file)


def layouts_gradients_program(rank, world, hf_dir, data, layouts, out_file):
    """:func:`layout_gradients` of several layouts in the same ranks (one spawn):
    ``layouts`` maps ``dp_replicate`` to the splits; rank 0 saves ``{dp_replicate: ...}``."""
    results = {
        dp_replicate: layout_gradients(rank, world, hf_dir, data, dp_replicate, splits)
        for dp_replicate, splits in layouts.items()
    }
    if rank == 0:
        torch.save(results, out_file)


def train_rollouts(backend, data, rollout_ids, rank, world, losses):
    denominator = data.shape[0] * (data.shape[1] - 1)
    for rollout_id in rollout_ids:
        noise = torch.randint(0, data.max().item() + 1, (1,)).item()  # exercises the RNG state
        batch = (data + noise + rollout_id) % (data.max() + 1)
        rows = my_rows(batch, rank, world)
        step = optimizer_step(
            backend.model,
            backend.optimizer,
            backend.scheduler,
            list(rows.chunk(2)),
            nll_contribution(denominator),
            dp_size=world,
            clip_grad=1.0,
        )
        losses.append(step.loss)
        backend.state.global_step += 1
        backend.state.micro_step += 2
        backend.state.next_rollout_id = rollout_id + 1


def optimizer_tensors(backend) -> dict[str, torch.Tensor]:
    out = {}
    for i, state in enumerate(backend.optimizer.state.values()):
        for key, value in state.items():
            v = full(value)
            out[f"{i}.{key}"] = v.detach().clone()
    return out


def resume_program(rank, world, hf_dir, data, save_dir, modes, out_file):
    """Run each of ``modes`` with a fresh backend, in these same ranks; save all results.

    "straight": 3 rollouts. "first": 2 rollouts + save. "resume": load + 1 rollout.
    "resume-no-optim": load with --no-load-optim and record the state without training.
    """
    results = {}
    for mode in modes:
        args = dict(hf_checkpoint=hf_dir, lr_warmup_iters=2, lr_decay_style="cosine")
        args.update(lr_decay_iters=6, save=f"{save_dir}/{mode}")
        if mode.startswith("resume"):
            args["load"] = f"{save_dir}/first"
        if mode == "resume-no-optim":
            args["load_optim"] = False
        if mode == "first":  # committed by close(): exercises --async-save
            args["async_save"] = True
        backend = FSDPBackend()
        start = backend.init(make_args(**args))
        losses: list[float] = []
        if mode == "straight":
            train_rollouts(backend, data, [0, 1, 2], rank, world, losses)
        elif mode == "first":
            train_rollouts(backend, data, [0, 1], rank, world, losses)
            backend.save_model(1)
        elif mode == "resume":
            train_rollouts(backend, data, [start], rank, world, losses)
        results[mode] = {
            "start": start,
            "losses": losses,
            "params": full_params(backend.model),
            "optim": optimizer_tensors(backend),
            "lr": backend.optimizer.param_groups[0]["lr"],
            "scheduler_epoch": backend.scheduler.last_epoch,
        }
        backend.close()
    if rank == 0:
        torch.save(results, out_file)


def export_program(rank, world, hf_dir, out_dir, out_file):
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir))
    params = full_params(backend.model)
    backend.export_hf(out_dir)
    if rank == 0:
        torch.save(params, out_file)
    backend.close()


def rollout_program(rank, world, hf_dir, samples, configs, out_file):
    """Train one rollout per config (fresh backend each); save final weights and metrics."""
    from miles_core.batch import RolloutBatch
    from miles_core.partition import partition_for_dp

    results = {}
    for label, overrides in configs.items():
        backend = FSDPBackend()
        backend.init(make_args(hf_checkpoint=hf_dir, **overrides))
        shards = partition_for_dp(RolloutBatch(samples), world, keep_groups=True)
        metrics = backend.train(0, shards[rank])
        results[label] = {"params": full_params(backend.model), "metrics": metrics}
        backend.close()
    if rank == 0:
        torch.save(results, out_file)


def step_slices_program(rank, world, hf_dir, runs, out_file):
    """One rollout per run ``{label: (samples, flags)}``, each on a fresh backend at DP
    ``world`` (the launcher's shards); the flags go through the launcher's parser too (so
    ``--global-batch-size`` resolves). Rank 0 saves final weights and metrics, and
    :func:`step_records`' weights before each optimizer step and old log-probs (every rank's
    samples)."""
    import tempfile

    import torch.distributed as dist
    from miles_core.args import entry_point_groups, parse_args
    from miles_core.batch import RolloutBatch
    from miles_core.partition import partition_for_dp
    from run_args import TEST_DEFAULTS, command_line

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = f"{tmp}/prompts.jsonl"
        with open(prompts, "w") as f:
            f.write('{"prompt": "1+1?", "label": "2"}\n')
        for label, (samples, flags) in runs.items():
            argv = command_line(**(TEST_DEFAULTS | flags | {"hf_checkpoint": hf_dir}))
            argv += ["--prompt-data", prompts]
            args = parse_args(argv, entry_point_groups("core", "fsdp", "launch"))
            backend = FSDPBackend()
            backend.init(args)
            shards = partition_for_dp(RolloutBatch(samples), world, keep_groups=True)
            with step_records(backend, samples) as records:
                metrics = backend.train(0, shards[rank])
            olds, lps = [None] * world, [None] * world
            dist.all_gather_object(olds, records["old"])
            dist.all_gather_object(lps, records["lp"])
            steps = range(len(records["old"]) - 1)  # the last: after the last step
            results[label] = {
                "params": full_params(backend.model),
                "metrics": metrics,
                "steps": backend.state.global_step,
                "num_steps_per_rollout": args.num_steps_per_rollout,
                "starts": records["weights"][:-1],  # the last: the weights after the rollout
                "old": [{k: v for o in olds for k, v in o[step].items()} for step in steps],
                "lp": [{k: v for o in lps for k, v in o[step].items()} for step in steps],
            }
            backend.close()
    if rank == 0:
        torch.save(results, out_file)


@contextlib.contextmanager
def step_records(backend, data):
    """Within: ``weights``, the full weights before the first optimizer step and after each
    (a collective: every rank trains); ``old`` and ``lp``, per step, by index in ``data``, the
    old and the current log-probs each of this rank's samples' loss read (response-aligned;
    the float64 reference of test_step_slices.py takes the old ones as the step's inputs and
    checks that it clips the tokens the run clipped)."""
    import miles_fsdp.train_step as train_step

    index = {tuple(s.tokens.tolist()): i for i, s in enumerate(data)}
    records = {"weights": [full_params(backend.model)], "old": [{}], "lp": [{}]}
    loss, step = train_step.packed_score_loss, train_step.optimizer_step

    def recording_loss(loss_type, log_probs, entropy, packed, *args, **kwargs):
        old = packed.fields.get("old_log_probs")
        ids = packed.input_ids.reshape(-1).cpu()
        offset = 0
        for length, sl in zip(packed.total_lengths, packed.response_slices(), strict=True):
            sample = index[tuple(ids[offset : offset + length].tolist())]
            if old is not None:
                records["old"][-1][sample] = old.reshape(-1)[sl].double().cpu().clone()
            records["lp"][-1][sample] = log_probs.detach().reshape(-1)[sl].double().cpu()
            offset += length
        return loss(loss_type, log_probs, entropy, packed, *args, **kwargs)

    def recording_step(*args, **kwargs):
        result = step(*args, **kwargs)
        records["weights"].append(full_params(backend.model))
        records["old"].append({})
        records["lp"].append({})
        return result

    train_step.packed_score_loss, train_step.optimizer_step = recording_loss, recording_step
    try:
        yield records
    finally:
        train_step.packed_score_loss, train_step.optimizer_step = loss, step


def uneven_gather_program(rank, world):
    """``full`` of dim-0 shards of 5 rows (3 + 2 on two ranks) and of 1 row (1 + 0) equals the
    whole tensor and ``full_tensor()``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    for rows in (5, 1):
        whole = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
        chunk = -(-rows // world)
        local = whole[rank * chunk : (rank + 1) * chunk].clone()
        d = DTensor.from_local(local, mesh, [Shard(0)], shape=whole.shape, stride=whole.stride())
        assert torch.equal(full(d), whole), (rank, rows)
        assert torch.equal(d.full_tensor(), whole), (rank, rows)
