"""Flags that mean the same on both backends, each from a command line parsed by ``miles
train``'s parser and built by each backend's own code.

* The LR of every optimizer step against the schedule's definition in float64 (FSDP:
  ``build_optimizer``; Megatron: ``build_scheduler`` over a param group as megatron-core's
  optimizer makes it from the backend's ``OptimizerConfig``), stepped the way each train step
  does (read the LR, step the optimizer, step the schedule).
* ``--bf16`` (the default) / ``--fp16`` / ``--no-bf16``: the same compute and master dtypes.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from miles_core.args import ArgumentError
from miles_core.args.groups import OffloadArgs, OptimizerArgs
from miles_core.optimizer import optimizer_config, run_optimizer_steps

pytest.importorskip("miles_fsdp")
pytest.importorskip("miles_launch")

LR, MIN_LR = 1e-3, 1e-5
NUM_ROLLOUT, STEPS_PER_ROLLOUT = 10, 2
RUN = NUM_ROLLOUT * STEPS_PER_ROLLOUT
# a handful of float64 roundings of operands no larger than LR (LambdaLR's lr * (lr_at / lr),
# the reference's own lr - (lr - min_lr) * t)
ATOL = 8 * 2.0**-53 * LR


def reference(step: int, warmup: int, decay_iters: int, style: str) -> float:
    """``--lr-warmup-iters``: linear from lr/W at step 0 to lr at step W-1; then over
    ``--lr-decay-iters`` (counted from step 0) linear or half-cosine from lr to min_lr."""
    if step < warmup:
        return LR * (step + 1) / warmup
    if style == "constant":
        return LR
    span = max(1, decay_iters - warmup)
    progress = min(1.0, (step - warmup) / span)
    if style == "linear":
        return LR - (LR - MIN_LR) * progress
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * progress)) / 2


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    """A prompt file and a tiny Qwen3's ``config.json`` (the parser reads the architecture)."""
    from megatron_tiny_models import hf_config

    root = tmp_path_factory.mktemp("lr_job")
    (root / "prompts.jsonl").write_text('{"prompt": "hi", "label": "1"}\n')
    hf_config("qwen3", False).save_pretrained(root / "hf")
    return root


def parse(root, backend: str, *flags: str):
    from miles_launch.train import parse as parse_cli

    prompts = root / "prompts.jsonl"
    argv = ["--train-backend", backend, "--hf-checkpoint", str(root / "hf")]
    argv += ["--prompt-data", str(prompts), "--lr", str(LR), "--min-lr", str(MIN_LR)]
    argv += ["--num-rollout", str(NUM_ROLLOUT), "--num-steps-per-rollout", str(STEPS_PER_ROLLOUT)]
    return parse_cli([*argv, *flags])


def core_config(args):
    """miles-core's optimizer settings of a parsed command line, as both backends build them."""
    cfg = args.run_config
    return optimizer_config(cfg.optimizer, cfg.offload, run_optimizer_steps(args))


def fsdp_lrs(args, steps: int) -> list[float]:
    from miles_fsdp.optimizer import build_optimizer

    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), core_config(args))
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def megatron_lrs(args, steps: int) -> list[float]:
    from miles_megatron.optimizer import build_scheduler
    from miles_megatron.optimizer import optimizer_config as megatron_config

    mcfg = megatron_config(args)

    class Optimizer:  # megatron-core's param group keys (megatron.core.optimizer)
        param_groups = [{"max_lr": mcfg.lr, "min_lr": mcfg.min_lr, "wd_mult": 1.0}]

    optimizer = Optimizer()
    scheduler = build_scheduler(optimizer, core_config(args))
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)  # train_step: after a successful optimizer step
    return lrs


@pytest.mark.parametrize("decay_iters", [7, None])
@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_both_backends_follow_the_schedule(job_dir, style, warmup, decay_iters):
    flags = ["--lr-decay-style", style, "--lr-warmup-iters", str(warmup)]
    if decay_iters is not None:
        flags += ["--lr-decay-iters", str(decay_iters)]
    span = decay_iters if decay_iters is not None else RUN  # unset: the whole run
    steps = RUN + 3  # past the decay: the floor holds
    want = [reference(s, warmup, span, style) for s in range(steps)]
    if style != "constant":
        assert want[span] == pytest.approx(MIN_LR) and want[warmup] == LR
        assert LR > want[span - 1] > MIN_LR  # still decaying the step before the end
    for backend, lrs in (("fsdp", fsdp_lrs), ("megatron", megatron_lrs)):
        got = lrs(parse(job_dir, backend, *flags), steps)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert abs(g - w) <= ATOL, (backend, step, got, want)


def test_megatron_cosine_decays_over_the_run(job_dir):
    """The issue's case: at step 19 of a 10-rollout x 2-step cosine run, min_lr-ward."""
    args = parse(job_dir, "megatron", "--lr-decay-style", "cosine")
    lr = megatron_lrs(args, RUN)[19]
    assert abs(lr - reference(19, 0, RUN, "cosine")) <= ATOL and lr < 2 * MIN_LR


def test_decaying_without_a_run_length_is_refused():
    with pytest.raises(ArgumentError, match="--lr-decay-style cosine needs --lr-decay-iters"):
        optimizer_config(OptimizerArgs(lr_decay_style="cosine"), OffloadArgs())
    constant = optimizer_config(OptimizerArgs(), OffloadArgs())
    assert constant.lr_at(5) == constant.lr


@pytest.mark.parametrize(
    ("flags", "compute"),
    [([], torch.bfloat16), (["--bf16"], torch.bfloat16), (["--fp16"], torch.float16),
     (["--no-bf16"], torch.float32)],
)  # fmt: skip
def test_precision_flags_mean_the_same_dtypes_on_both_backends(job_dir, flags, compute):
    from miles_fsdp.precision import precision_of
    from miles_megatron.model_config import params_dtype
    from miles_megatron.optimizer import optimizer_config as megatron_config

    fsdp = precision_of(parse(job_dir, "fsdp", *flags))
    assert (fsdp.compute_dtype, fsdp.master_dtype) == (compute, torch.float32)
    args = parse(job_dir, "megatron", *flags)
    mcfg = megatron_config(args)
    assert params_dtype(args) == mcfg.params_dtype == compute
    assert (mcfg.bf16, mcfg.fp16) == (compute == torch.bfloat16, compute == torch.float16)
    assert mcfg.main_params_dtype == torch.float32  # the distributed optimizer's masters


def test_a_backend_dtype_flag_refines_and_never_contradicts(job_dir, capsys):
    from miles_fsdp.precision import precision_of

    refined = precision_of(parse(job_dir, "fsdp", "--fsdp-compute-dtype", "fp32"))
    assert refined.compute_dtype == torch.float32
    agreeing = precision_of(parse(job_dir, "fsdp", "--no-bf16", "--fsdp-compute-dtype", "fp32"))
    assert agreeing.compute_dtype == torch.float32
    with pytest.raises(SystemExit) as exit_info:
        parse(job_dir, "fsdp", "--no-bf16", "--fsdp-compute-dtype", "bf16")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --fsdp-compute-dtype bf16 contradicts --no-bf16 (fp32); give one of them"
    ]


#: (backend, flags, what the one-line refusal names): flags a backend would accept and ignore
#: (or crash on at init), refused by ``miles train``'s parser with exit status 2
REFUSED = [
    ("fsdp", ["--bf16", "--optimizer-cpu-offload"], "--optimizer-cpu-offload is not honoured by --train-backend fsdp"),
    ("fsdp", ["--colocate", "--rematerialize-param-from-master-weight"], "--rematerialize-param-from-master-weight is not honoured by --train-backend fsdp"),
    ("fsdp", ["--update-weight-target-module", "a", "b"], "--update-weight-target-module: the FSDP backend trains a causal LM, one component, got 2"),
    ("megatron", ["--update-weight-target-module", "a", "b"], "--update-weight-target-module: the Megatron backend trains a causal LM, one component, got 2"),
    ("megatron", ["--custom-prepare-path", "m:f"], "--custom-prepare-path is not honoured by --train-backend megatron"),
    ("megatron", ["--actor-num-gpus-per-node", "2", "--context-parallel-size", "2", "--custom-loss-function-path", "m:f"], "--context-parallel-size 2 with --custom-loss-function-path: the hook gets a whole packed row"),
    ("fsdp", ["--loss-type", "sft_loss", "--custom-loss-function-path", "m:f"], "--custom-loss-function-path replaces the actor's --loss-type policy_loss"),
    ("megatron", ["--loss-type", "sft_loss", "--custom-loss-function-path", "m:f"], "--custom-loss-function-path replaces the actor's --loss-type policy_loss"),
    # the backend's LoRA and reference limits, found only at its init before (minutes in)
    ("megatron", ["--use-lora", "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"], "--use-lora with --pipeline-model-parallel-size 2 is not supported by --train-backend megatron yet"),
    ("megatron", ["--use-lora", "--kl-coef", "0.1"], "--kl-coef 0.1 under --train-backend megatron needs a reference model (--ref-load)"),
    ("megatron", ["--teacher-load", "REF", "--custom-loss-function-path", "m:f"], "--teacher-load is not honoured by --train-backend megatron"),
    ("megatron", ["--optimizer", "sgd"], "--optimizer sgd: the Megatron backend takes adam"),
    ("megatron", ["--virtual-pipeline-model-parallel-size", "2"], "--virtual-pipeline-model-parallel-size: megatron-core's TransformerConfig.virtual_pipeline_model_parallel_size is not among the fields the Megatron backend honours"),
    ("megatron", ["--use-megatron-fsdp"], "--use-megatron-fsdp: megatron-core's DistributedDataParallelConfig.use_megatron_fsdp is not among"),
    ("megatron", ["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex is not supported by the Megatron backend"),
    ("fsdp", ["--use-rollout-logprobs", "--use-tis"], "--use-tis with --use-rollout-logprobs: the old policy is the engine's"),
    ("megatron", ["--use-rollout-logprobs", "--use-tis"], "--use-tis with --use-rollout-logprobs: the old policy is the engine's"),
    ("fsdp", ["--use-rollout-logprobs", "--use-ema", "--old-policy", "ema"], "--use-rollout-logprobs with --old-policy ema"),
]  # fmt: skip
SFT_IGNORES = [
    (["--use-kl-loss", "--ref-load", "REF"], "--use-kl-loss"),
    (["--use-tis"], "--use-tis"),
    (["--use-rollout-logprobs"], "--use-rollout-logprobs"),
    (["--entropy-coef", "0.01"], "--entropy-coef 0.01"),
    (["--kl-coef", "0.1", "--ref-load", "REF"], "--kl-coef 0.1"),
]
for _backend in ("fsdp", "megatron"):
    for _flags, _what in SFT_IGNORES:
        REFUSED.append((_backend, ["--loss-type", "sft_loss", *_flags], f"--loss-type sft_loss ignores {_what}"))  # fmt: skip


@pytest.mark.parametrize(("backend", "flags", "message"), REFUSED)
def test_a_flag_the_backend_would_ignore_is_refused_in_one_line(
    job_dir, capsys, backend, flags, message
):
    flags = [str(job_dir / "hf") if f == "REF" else f for f in flags]
    with pytest.raises(SystemExit) as exit_info:
        parse(job_dir, backend, *flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


#: A value that makes each declared not-honoured flag active on the command line.
ACTIVE_VALUE = {"teacher_load": "REF", "custom_prepare_path": "m:f"}
ACTIVE_VALUE["ref_lora_adapter_path"] = "REF"
#: What else a flag needs before a backend would read it (else the shared checks refuse it first).
CONTEXT = {
    "teacher_load": ["--custom-loss-function-path", "m:f"],  # the custom loss reads the teacher
    "rematerialize_param_from_master_weight": ["--colocate"],  # it acts during sleep
    "use_ema": ["--rollout-weights", "ema"],  # --use-ema needs a consumer of the EMA
    "ref_lora_adapter_path": ["--ref-load", "REF"],  # the reference's adapters
}


def _docs_refusals() -> set[tuple[str, str]]:
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "args.md").read_text()
    section = docs.split("## Which backend honours which shared flag", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(--[a-z0-9-]+)`[^|]* \| (fsdp|megatron) \|", section, re.M)
    assert rows, "docs/args.md has no refusal table"
    return set(rows)


def test_the_docs_table_is_the_declarations_and_each_row_is_refused(job_dir, capsys):
    """docs/args.md's per-backend table equals what the backends declare; walking it, each
    flag made active under its backend is refused in one line naming the flag and backend."""
    from miles_core.args.checks import option as flag_option
    from miles_fsdp import args as fsdp_args
    from miles_megatron import args as megatron_args

    declared = {(flag_option(d), "fsdp") for d, _ in fsdp_args.NOT_HONOURED}
    declared |= {(option, "fsdp") for _, option in fsdp_args.UNSUPPORTED_PARALLEL}
    declared |= {(flag_option(d), "megatron") for d, _ in megatron_args.NOT_HONOURED}
    assert _docs_refusals() == declared
    parallel = {option for _, option in fsdp_args.UNSUPPORTED_PARALLEL}
    for option, backend in sorted(declared):
        dest = option.removeprefix("--").replace("-", "_")
        value = "2" if option in parallel else ACTIVE_VALUE.get(dest)
        argv = [option] if value is None else [option, value]
        argv += CONTEXT.get(dest, [])
        argv = [str(job_dir / "hf") if f == "REF" else f for f in argv]
        with pytest.raises(SystemExit) as exit_info:
            parse(job_dir, backend, *argv)
        assert exit_info.value.code == 2, option
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and option in err[0] and backend.lower() in err[0].lower(), err


def test_the_honoured_forms_of_those_flags_parse(job_dir):
    parse(job_dir, "megatron", "--bf16", "--optimizer-cpu-offload", "--optimizer", "adam")
    parse(job_dir, "megatron", "--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1", "--moe-token-dispatcher-type", "alltoall")  # fmt: skip
    for backend in ("fsdp", "megatron"):
        parse(job_dir, backend, "--update-weight-target-module", "model", "--loss-type", "sft_loss")
        assert parse(job_dir, backend, "--use-rollout-logprobs").use_rollout_logprobs
    parse(
        job_dir, "fsdp", "--teacher-load", str(job_dir / "hf"), "--custom-loss-function-path", "m:f"
    )
    for backend in ("fsdp", "megatron"):  # both run the custom loss hook
        assert parse(
            job_dir, backend, "--custom-loss-function-path", "m:f"
        ).custom_loss_function_path


def test_both_backends_take_the_contracts_update_weights_and_compute_values():
    """``update_weights(engines, weights=)`` and ``compute_values`` as the contract declares
    them; Megatron (no EMA) refuses ``weights="ema"`` before touching an engine."""
    import inspect

    from miles_core.contract import TrainBackend
    from miles_fsdp.backend import FSDPBackend
    from miles_megatron.backend import MegatronBackend

    contract = inspect.signature(TrainBackend.update_weights).parameters
    for cls in (FSDPBackend, MegatronBackend):
        params = inspect.signature(cls.update_weights).parameters
        assert list(params) == list(contract), cls
        assert params["weights"].default is None
        assert "compute_values" not in getattr(cls, "__abstractmethods__", ())
    with pytest.raises(ValueError, match="publishes 'actor' only"):
        MegatronBackend().update_weights([], weights="ema")
