"""Megatron memory flags: sleep/wake to disk, parameter rematerialisation from the fp32
masters, and the argument rules of the memory flags."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from megatron_offload_ranks import disk_sleep_between_rollouts, remat_round_trip
from megatron_tiny_models import make_tiny_hf
from miles_core.args import ArgumentError


@pytest.mark.slow
def test_disk_sleep_is_invisible_to_training_and_enospc_leaves_the_model_intact(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    disk = tmp_path / "offload"
    disk.mkdir()
    for r in spawn_ranks(disk_sleep_between_rollouts, 2, hf_dir, str(disk), timeout=300):
        assert r["awake"] > 100_000 and r["asleep"] == 0
        # params and optimizer state written (512-byte aligned slots), gradients only freed
        moved = r["awake"] - r["grad_bytes"]
        assert r["grad_bytes"] > 0 and moved <= r["file_bytes"] < moved + (64 << 10)
        assert r["host_bytes"] <= 4 << 20  # the ring (4 chunks of 1 MiB), not a host copy
        assert r["losses_equal"] and r["weights_equal"]
        assert r["enospc"] and "offset" in r["enospc_message"]
        assert r["intact"] and r["still_awake_bytes"]
        assert r["file_removed"]


@pytest.mark.slow
def test_rematerialized_params_are_bit_identical(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    for r in spawn_ranks(remat_round_trip, 2, hf_dir, timeout=300):
        assert "torch.bfloat16" in r["dtypes"]
        assert r["asleep"] == 0
        # the arena holds the optimizer (fp32 masters + moments), never the bf16 parameters
        assert r["host_bytes"] > 0 and r["host_bytes"] < 3 * 2 * r["param_bytes"] + 4096
        assert r["bit_identical"]
        assert r["loss"] == r["plain_loss"]


def _parse(argv):
    from megatron_ranks import parse

    return parse(["--hf-checkpoint", "unused", *argv])


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
        (
            ["--stream-optimizer-state-to-disk", "--optimizer-cpu-offload"],
            "--optimizer-cpu-offload",
        ),
    ],
)  # fmt: skip
def test_memory_flag_rules(argv, message):
    with pytest.raises(ArgumentError, match=message):
        _parse(argv)


@pytest.mark.slow
def test_streamed_optimizer_equals_in_memory_and_resumes(tmp_path):
    from megatron_offload_ranks import streamed_matches_in_memory

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    disk, save = str(tmp_path / "disk"), str(tmp_path / "save")
    for r in spawn_ranks(streamed_matches_in_memory, 2, hf_dir, disk, save, timeout=400):
        assert r["buckets"] >= 2 and r["streamed"] > 0 and r["small"] > 0
        assert r["losses_equal"] and r["names_equal"]
        assert r["state_equal"] == {"master": True, "exp_avg": True, "exp_avg_sq": True}
        assert r["resumed_equal"]
        assert "saved with --stream-optimizer-state-to-disk" in r["in_memory_refused"]


@pytest.mark.slow
def test_optimizer_cpu_offload_reaches_megatron_and_trains(tmp_path):
    from megatron_offload_ranks import cpu_offloaded_optimizer

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    for r in spawn_ranks(cpu_offloaded_optimizer, 2, hf_dir, timeout=300):
        assert r["inner"] == "HybridDeviceOptimizer"
        assert r["config"] == (True, True, 1.0)
        # the CPU half is torch's fused CPU AdamW: the same update up to rounding
        assert r["losses"][0] == r["plain_losses"][0]  # before any step
        assert abs(r["losses"][1] - r["plain_losses"][1]) < 1e-5
        assert 0 < r["max_weight_diff"] < 1e-5 or r["max_weight_diff"] == 0
