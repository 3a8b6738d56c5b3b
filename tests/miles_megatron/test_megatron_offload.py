"""Megatron memory flags: sleep/wake to disk, the streamed optimizer state, parameter
rematerialisation from the fp32 masters, and the argument rules of the memory flags."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from megatron_offload_ranks import bf16_remat_and_streamed, fp32_disk_sleep_and_streamed
from megatron_tiny_models import make_tiny_hf
from miles_core.args import ArgumentError


@pytest.mark.slow
def test_disk_sleep_and_streamed_state_equal_the_plain_run(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    disk, save = str(tmp_path / "disk"), str(tmp_path / "save")
    for r in spawn_ranks(fp32_disk_sleep_and_streamed, 2, hf_dir, disk, save, timeout=400):
        assert r["buckets"] >= 2 and r["streamed"] > 0 and r["small"] > 0
        assert r["awake"] > 100_000 and r["asleep"] == 0
        # params and optimizer state written (512-byte aligned slots), gradients only freed
        moved = r["awake"] - r["grad_bytes"]
        assert r["grad_bytes"] > 0 and moved <= r["file_bytes"] < moved + (64 << 10)
        assert r["host_bytes"] <= 4 << 20  # the ring (4 chunks of 1 MiB), not a host copy
        # 4 steps, a sleep in between: bit-identical to the in-memory optimizer, never asleep
        assert r["losses_equal"] and r["names_equal"] and r["weights_equal"]
        assert r["state_equal"] == {"master": True, "exp_avg": True, "exp_avg_sq": True}
        assert r["enospc"] and "offset" in r["enospc_message"]
        assert r["intact"] and r["still_awake_bytes"]
        assert r["file_removed"]
        assert r["resumed_equal"]
        assert "saved with --stream-optimizer-state-to-disk" in r["in_memory_refused"]


@pytest.mark.slow
def test_bf16_remat_and_streamed_state_are_bit_identical(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    disk, save = str(tmp_path / "disk"), str(tmp_path / "save")
    for r in spawn_ranks(bf16_remat_and_streamed, 2, hf_dir, disk, save, timeout=400):
        assert "torch.bfloat16" in r["dtypes"]
        assert r["asleep"] == 0
        # the arena holds the optimizer (fp32 masters + moments of the DP shard), not the
        # bf16 parameters: 12 bytes per parameter / 2 ranks = 3 x the 2-byte parameter buffer
        assert 0 < r["host_bytes"] < 3 * r["param_bytes"] + (64 << 10)
        assert r["bit_identical"] and r["remat_equal"]
        assert r["resumed_loaded"] and r["resumed_remat_identical"]
        assert r["released"] and r["all_streamed"] and r["streamed_equal"]


def _parse(argv):
    from megatron_ranks import parse

    return parse(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rematerialize-param-from-master-weight", "--offload-train"], "requires --colocate"),
        (
            ["--rematerialize-param-from-master-weight", "--colocate", "--offload-train-target",
             "disk"],
            "requires --offload-train-target cpu",
        ),
        (
            ["--rematerialize-param-from-master-weight", "--colocate", "--no-offload-train"],
            "requires --offload-train",
        ),
        (
            ["--rematerialize-param-from-master-weight", "--colocate",
             "--use-precision-aware-optimizer"],
            "excludes --use-precision-aware-optimizer",
        ),
        (["--use-precision-aware-optimizer"], "needs TransformerEngine"),
        (["--overlap-cpu-optimizer-d2h-h2d"], "requires --optimizer-cpu-offload"),
        (["--optimizer-cpu-offload"], "needs --bf16 or --fp16"),
        (["--optimizer-cpu-offload", "--bf16", "--optimizer-offload-fraction", "1.5"], r"\[0, 1\]"),
        (
            ["--stream-optimizer-state-to-disk", "--optimizer-cpu-offload"],
            "--optimizer-cpu-offload",
        ),
    ],
)  # fmt: skip
def test_memory_flag_rules(argv, message):
    with pytest.raises(ArgumentError, match=message):
        _parse(argv)


def test_optimizer_memory_flags_reach_optimizer_config():
    from miles_megatron.optimizer import optimizer_config

    offload = ["--bf16", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"]
    config = optimizer_config(_parse(offload))
    assert config.optimizer_cpu_offload and config.overlap_cpu_optimizer_d2h_h2d
    assert config.optimizer_offload_fraction == 1.0  # Megatron-LM's default, not core's 0
    config = optimizer_config(_parse([*offload, "--optimizer-offload-fraction", "0.25"]))
    assert config.optimizer_offload_fraction == 0.25
    plain = optimizer_config(_parse(["--bf16"]))
    assert not plain.optimizer_cpu_offload and plain.optimizer_offload_fraction == 0.0
    assert not plain.use_precision_aware_optimizer and plain.bf16


def test_fp16_loss_scale_flags_reach_optimizer_config():
    """The loss-scale flags are miles-core's (shared with the FSDP backend), not generated."""
    from miles_megatron.optimizer import optimizer_config

    dynamic = optimizer_config(
        _parse(["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "50"])
    )
    assert (dynamic.fp16, dynamic.loss_scale, dynamic.initial_loss_scale) == (True, None, 65536)
    assert (dynamic.loss_scale_window, dynamic.hysteresis, dynamic.min_loss_scale) == (50, 2, 1.0)
    fixed = optimizer_config(_parse(["--fp16", "--loss-scale", "1024"]))
    assert fixed.loss_scale == 1024
