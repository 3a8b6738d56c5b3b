"""Flag-combination rules of miles-core's shared groups: each error, and its valid neighbour."""

from __future__ import annotations

import pytest
from miles_core.args import ArgumentError, core_groups, parse_args


def parse(*argv: str):
    return parse_args(list(argv), core_groups())


def with_real_dirs(tmp_path, argv):
    """Replace each "/name" path in ``argv`` by an existing directory (check_paths runs last)."""

    def real(part: str) -> str:
        if not part.startswith("/"):
            return part
        path = tmp_path / part.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    return [",".join(real(p) for p in token.split(",")) for token in argv]


# (argv, the exact error line). Every rule has one row; each line names the flags at fault.
RULES = [
    # model/checkpoint
    (["--save-trigger-sentinel", "/tmp/s"], "--save-trigger-sentinel requires --save"),
    (["--save-interval", "5"], "--save-interval requires --save"),
    (["--async-save"], "--async-save requires --save"),
    (["--save", "/c", "--save-interval", "0"], "--save-interval must be >= 1, got 0"),
    (["--ckpt-step", "3"], "--ckpt-step requires --load"),
    (["--load", "/c", "--ckpt-step", "-1"], "--ckpt-step must be >= 0, got -1"),
    # optimizer/precision
    (["--fp16", "--bf16"], "--fp16 and --bf16 are mutually exclusive"),
    (["--lr", "-1"], "--lr must be >= 0.0, got -1.0"),
    (["--lr", "1e-6", "--min-lr", "1e-5"], "--min-lr (1e-05) must not exceed --lr (1e-06)"),
    (["--lr-warmup-iters", "-2"], "--lr-warmup-iters must be >= 0, got -2"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1, got 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0.0, got -0.1"),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be in [0.0, 1.0], got 1.5"),
    (["--adam-beta2", "1"], "--adam-beta2 must be < 1"),
    (["--adam-eps", "0"], "--adam-eps must be > 0.0, got 0.0"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0.0, got -1.0"),
    # parallel sizes
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1, got 0"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size must be >= 1, got 0"),
    (["--context-parallel-size", "-1"], "--context-parallel-size must be >= 1, got -1"),
    (["--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be >= 1, got 0"),
    (["--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size must be >= 1, got 0"),
    # batch/algorithm
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--num-steps-per-rollout", "0"], "--num-steps-per-rollout must be >= 1, got 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--max-tokens-per-gpu", "0"], "--max-tokens-per-gpu must be >= 1, got 0"),
    (["--use-dynamic-batch-size"], "--use-dynamic-batch-size requires --max-tokens-per-gpu"),
    (
        ["--global-batch-size", "10", "--micro-batch-size", "4"],
        "--global-batch-size (10) must be a multiple of --micro-batch-size (4)",
    ),
    (
        ["--global-batch-size", "8"],
        "--global-batch-size needs the launcher's --rollout-batch-size and "
        "--n-samples-per-prompt to become optimizer steps; give --num-steps-per-rollout",
    ),
    (["--gamma", "1.1"], "--gamma must be in [0.0, 1.0], got 1.1"),
    (["--lambd", "-0.1"], "--lambd must be in [0.0, 1.0], got -0.1"),
    (["--eps-clip", "0"], "--eps-clip must be > 0.0, got 0.0"),
    (["--eps-clip-high", "0"], "--eps-clip-high must be > 0.0, got 0.0"),
    (["--eps-clip-c", "1.0"], "--eps-clip-c must be > 1.0, got 1.0"),
    (["--value-clip", "-1"], "--value-clip must be >= 0.0, got -1.0"),
    (
        ["--ref-load", "/r", "--kl-coef", "0.1", "--use-kl-loss"],
        "--kl-coef > 0 (KL in the reward) and --use-kl-loss are mutually exclusive",
    ),
    (["--kl-loss-coef", "-1"], "--kl-loss-coef must be >= 0.0, got -1.0"),
    (
        ["--advantage-estimator", "gspo", "--calculate-per-token-loss"],
        "--advantage-estimator gspo cannot be used with --calculate-per-token-loss: GSPO's "
        "objective is a mean over sequences (Zheng et al. 2025, arXiv:2507.18071); a token mean would "
        "weight each sequence by its length",
    ),
    (
        ["--advantage-estimator", "dr_grpo", "--calculate-per-token-loss"],
        "--advantage-estimator dr_grpo cannot be used with --calculate-per-token-loss: Dr. GRPO "
        "sums each response's tokens and averages over the responses (Liu et al. 2025, arXiv:2503.20783)",
    ),
    (
        ["--policy-loss", "cispo", "--eps-clip-c", "3"],
        "--eps-clip-c (dual clip) is PPO's: --policy-loss cispo does not use it",
    ),
    (
        ["--policy-loss", "cispo", "--advantage-estimator", "gspo"],
        "--policy-loss cispo cannot be used with --advantage-estimator gspo: CISPO clips "
        "token-level importance weights, GSPO's ratio is a sequence's",
    ),
    (
        ["--policy-loss", "cispo", "--loss-type", "sft_loss"],
        "--policy-loss cispo shapes --loss-type policy_loss, not sft_loss",
    ),
    (["--entropy-coef", "-1"], "--entropy-coef must be >= 0.0, got -1.0"),
    (["--tis-clip", "0"], "--tis-clip must be > 0.0, got 0.0"),
    (["--tis-clip-low", "3"], "--tis-clip-low (3.0) must be < --tis-clip (2.0)"),
    (["--rollout-temperature", "0"], "--rollout-temperature must be > 0.0, got 0.0"),
    # roles: reference
    (
        ["--ref-load", "/r", "--ref-mode", "lora_base", "--use-lora"],
        "--ref-load needs --ref-mode ref (or no --ref-mode), not lora_base",
    ),
    (["--ref-mode", "ref"], "--ref-mode ref requires --ref-load"),
    (["--ref-lora-adapter-path", "/a"], "--ref-lora-adapter-path requires --ref-load"),
    (["--ref-cpu-offload"], "--ref-cpu-offload requires --ref-load"),
    (["--ref-mode", "lora_base"], "--ref-mode lora_base requires --use-lora"),
    (
        ["--use-kl-loss"],
        "a KL term (--use-kl-loss or --kl-coef > 0) needs a reference, but no --ref-load "
        "(and no --use-lora): pass --ref-load, or --use-lora with --ref-mode lora_base",
    ),
    (
        ["--kl-coef", "0.01", "--use-lora", "--ref-mode", "none"],
        "a KL term (--use-kl-loss or --kl-coef > 0) needs a reference, but --ref-mode none: "
        "pass --ref-load, or --use-lora with --ref-mode lora_base",
    ),
    # roles: teacher
    (
        ["--teacher-load", "/t"],
        "--teacher-load has no built-in consumer: it requires --custom-prepare-path or "
        "--custom-loss-function-path",
    ),
    (["--teacher-lora-adapter-path", "/a"], "--teacher-lora-adapter-path requires --teacher-load"),
    # roles: the custom loss replaces the actor's policy loss, not another --loss-type
    (
        ["--custom-loss-function-path", "m:f", "--loss-type", "sft_loss"],
        "--custom-loss-function-path replaces the actor's --loss-type policy_loss (its batch "
        "carries the old and reference log-probs), not sft_loss",
    ),
    (["--teacher-cpu-offload"], "--teacher-cpu-offload requires --teacher-load"),
    # roles: LoRA and components
    (["--lora-adapter-path", "/a"], "--lora-adapter-path requires --use-lora"),
    (["--use-lora", "--lora-rank", "0"], "--lora-rank must be >= 1, got 0"),
    (["--use-lora", "--lora-alpha", "0"], "--lora-alpha must be > 0.0, got 0.0"),
    (["--use-lora", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1), got 1.0"),
    (
        ["--use-lora", "--lora-adapter-path", "/a", "/b"],
        "--lora-adapter-path takes one value per component (--update-weight-target-module: 1), "
        "got 2",
    ),
    (
        ["--update-weight-target-module", "transformer,transformer_2", "--use-lora"]
        + ["--lora-adapter-path", "/a"],
        "--lora-adapter-path takes one value per component (--update-weight-target-module: 2), "
        "got 1",
    ),
    (
        ["--ref-load", "/r", "--ref-lora-adapter-path", "/a,/b"],
        "--ref-lora-adapter-path takes one value per component (--update-weight-target-module: "
        "1), got 2",
    ),
    (
        ["--update-weight-target-module", "a,a"],
        "--update-weight-target-module names a component twice",
    ),
    # roles: EMA
    (["--rollout-weights", "ema"], "--rollout-weights ema requires --use-ema"),
    (["--eval-weights", "ema"], "--eval-weights ema requires --use-ema"),
    (["--old-policy", "ema"], "--old-policy ema requires --use-ema"),
    (
        ["--use-ema"],
        "--use-ema has no consumer: add --rollout-weights ema, --eval-weights ema or "
        "--old-policy ema",
    ),
    (
        ["--use-ema", "--rollout-weights", "ema", "--ema-decay-max", "2"],
        "--ema-decay-max must be in [0.0, 1.0], got 2.0",
    ),
    # offload
    (
        ["--offload-train-target", "disk"],
        "--offload-train-target disk requires --offload-train (on by default with --colocate)",
    ),
    (
        ["--colocate", "--no-offload-train", "--offload-train-target", "disk"],
        "--offload-train-target disk requires --offload-train (on by default with --colocate)",
    ),
    (
        ["--rematerialize-param-from-master-weight", "--offload-train"],
        "--rematerialize-param-from-master-weight requires --colocate",
    ),
    (
        [
            "--colocate",
            "--offload-train-target",
            "disk",
            "--rematerialize-param-from-master-weight",
        ],
        "--rematerialize-param-from-master-weight requires --offload-train-target cpu",
    ),
    (
        ["--stream-optimizer-state-to-disk", "--optimizer-cpu-offload"],
        "--stream-optimizer-state-to-disk and --optimizer-cpu-offload are mutually exclusive",
    ),
    (
        ["--stream-optimizer-state-to-disk", "--use-lora"],
        "--stream-optimizer-state-to-disk and --use-lora are mutually exclusive",
    ),
    (
        ["--offload-train", "--stream-optimizer-state-to-disk"],
        "--stream-optimizer-state-to-disk under --offload-train requires --offload-train-target "
        "disk",
    ),
    (
        ["--colocate", "--stream-optimizer-state-to-disk"],
        "--stream-optimizer-state-to-disk under --offload-train requires --offload-train-target "
        "disk",
    ),
    (
        ["--offload-train-disk-dir", "/scratch"],
        "--offload-train-disk-dir is used only with --offload-train-target disk or "
        "--stream-optimizer-state-to-disk",
    ),
    (["--offload-train-disk-chunk-mb", "0"], "--offload-train-disk-chunk-mb must be >= 1, got 0"),
    (
        ["--stream-optimizer-bucket-numel", "0"],
        "--stream-optimizer-bucket-numel must be >= 1, got 0",
    ),
    (
        ["--stream-optimizer-min-numel", "-1"],
        "--stream-optimizer-min-numel must be >= 0, got -1",
    ),
    # sync
    (["--update-weight-buffer-size", "0"], "--update-weight-buffer-size must be >= 1, got 0"),
    (
        ["--update-weight-transfer-mode", "ipc"],
        "--update-weight-transfer-mode ipc requires --colocate",
    ),
    (
        ["--colocate", "--update-weight-transfer-mode", "p2p"],
        "--update-weight-transfer-mode p2p is for disaggregated runs, not --colocate "
        "(colocated runs publish over ipc)",
    ),
    (
        ["--colocate", "--update-weight-transfer-mode", "disk-delta"],
        "--update-weight-transfer-mode disk-delta is for disaggregated runs, not --colocate "
        "(colocated runs publish over ipc)",
    ),
    (
        ["--update-weight-transfer-mode", "disk-delta"],
        "--update-weight-transfer-mode disk-delta requires --update-weight-disk-dir",
    ),
    (
        ["--update-weight-disk-dir", "/d"],
        "--update-weight-disk-dir is used only with --update-weight-transfer-mode disk-delta",
    ),
    (
        ["--update-weight-local-checkpoint-dir", "/d"],
        "--update-weight-local-checkpoint-dir is used only with --update-weight-transfer-mode "
        "disk-delta",
    ),
    # placement
    (
        ["--train-backend", "jax"],
        "argument --train-backend: invalid choice 'jax' (choose from fsdp, megatron)",
    ),
]


@pytest.mark.parametrize(("argv", "message"), RULES, ids=[" ".join(a) for a, _ in RULES])
def test_rule(argv, message):
    with pytest.raises(ArgumentError) as err:
        parse(*argv)
    assert str(err.value) == message
    assert "\n" not in str(err.value)


# Valid neighbours of the rules above: the same flags in an allowed combination.
VALID = [
    ["--save", "/c", "--save-trigger-sentinel", "/tmp/s", "--save-interval", "2", "--async-save"],
    ["--fp16"],
    ["--bf16", "--lr", "1e-5", "--min-lr", "1e-6", "--lr-decay-style", "cosine"],
    ["--kl-coef", "0.1", "--ref-load", "/r"],
    ["--use-kl-loss", "--kl-loss-coef", "0.01", "--ref-load", "/r", "--ref-mode", "ref"],
    ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"],
    # micro-batches are formed by tokens then, so --micro-batch-size does not divide anything
    ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "8", "--micro-batch-size", "4"],
    ["--use-ema", "--rollout-weights", "ema"],
    ["--use-ema", "--old-policy", "ema"],
    ["--teacher-load", "/t", "--custom-loss-function-path", "m:f"],
    ["--use-lora", "--lora-adapter-path", "/a"],
    ["--update-weight-target-module", "t1,t2", "--use-lora", "--lora-adapter-path", "/a", "/b"],
    ["--colocate", "--offload-train-target", "disk", "--offload-train-disk-dir", "/s"],
    ["--offload-train", "--offload-train-target", "disk", "--stream-optimizer-state-to-disk"],
    ["--stream-optimizer-state-to-disk"],  # disaggregated: works alone
    ["--colocate", "--rematerialize-param-from-master-weight"],
    ["--update-weight-transfer-mode", "p2p"],
    ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "/d"],
    ["--colocate", "--update-weight-transfer-mode", "ipc"],
    ["--train-backend", "fsdp"],
]


@pytest.mark.parametrize("argv", VALID, ids=[" ".join(a) for a in VALID])
def test_valid_combination(tmp_path, argv):
    parse(*with_real_dirs(tmp_path, argv))


def test_offload_tristates_follow_colocate():
    args = parse()
    assert (args.offload_train, args.offload_rollout) == (False, False)
    args = parse("--colocate")
    assert (args.offload_train, args.offload_rollout) == (True, True)
    assert "offload_train" not in args.explicit_flags
    args = parse("--colocate", "--no-offload-rollout")
    assert (args.offload_train, args.offload_rollout) == (True, False)
    assert "offload_rollout" in args.explicit_flags
    assert parse("--offload-train").offload_train is True


def test_transfer_mode_follows_placement():
    assert parse().update_weight_transfer_mode == "broadcast"
    assert parse("--colocate").update_weight_transfer_mode == "ipc"


@pytest.mark.parametrize(
    ("argv", "mode"),
    [
        ([], "none"),
        (["--ref-load", "/r"], "ref"),
        (["--use-lora", "--use-kl-loss"], "lora_base"),
        (["--use-lora", "--kl-coef", "0.05"], "lora_base"),
        (["--use-lora"], "none"),
        (["--use-lora", "--use-kl-loss", "--ref-load", "/r"], "ref"),
        (["--use-lora", "--ref-mode", "lora_base"], "lora_base"),
    ],
)
def test_ref_mode_derivation(tmp_path, argv, mode):
    assert parse(*with_real_dirs(tmp_path, argv)).ref_mode == mode


def test_expert_tensor_parallel_defaults_to_tensor_parallel():
    assert parse("--tensor-model-parallel-size", "4").expert_tensor_parallel_size == 4
    args = parse("--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "1")
    assert args.expert_tensor_parallel_size == 1
