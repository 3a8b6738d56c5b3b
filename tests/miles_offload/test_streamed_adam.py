"""StreamedAdamW on one process: layout, bitwise equality with torch AdamW, bf16 moments,
checkpoints (re-bucketing, refusals) and a disk that fills up mid-step."""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from miles_core.args import core_groups, parse_args
from miles_offload.optimizer_buckets import ALIGNMENT, Shard, plan_buckets
from miles_offload.streamed_adam import StreamedAdamConfig, StreamedAdamW, from_args
from torch import nn

pytestmark = pytest.mark.numeric

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


class Net(nn.Module):
    """fc1.weight (24 x 16 = 384), fc2.weight (8 x 24 = 192) are streamed; biases stay small."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _groups(model: nn.Module, named: bool) -> list[dict]:
    """Two param groups (weights decay, biases do not), with or without names."""
    decay = [(n, p) for n, p in model.named_parameters() if n.endswith("weight")]
    flat = [(n, p) for n, p in model.named_parameters() if n.endswith("bias")]
    pick = (lambda items: items) if named else (lambda items: [p for _, p in items])
    return [{"params": pick(decay)}, {"params": pick(flat), "weight_decay": 0.0}]


def _streamed(model, tmp_path, **cfg) -> StreamedAdamW:
    config = StreamedAdamConfig(
        disk_dir=str(tmp_path / "work"),
        bucket_numel=cfg.pop("bucket_numel", 100),
        min_numel=cfg.pop("min_numel", 64),
        chunk_mb=1,
        ring_chunks=2,
        **cfg,
    )
    return StreamedAdamW(
        _groups(model, named=True), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, config=config
    )


def _reference(model, foreach=True, fused=None) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        _groups(model, named=False),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        foreach=None if fused else foreach,
        fused=fused,
    )


def _schedule(opt) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def _train(model, opt, sched, step: int, clip: float = 0.05) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 16, generator=g)
    model(x).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _assert_state_equal(opt: StreamedAdamW, model, ref, ref_model) -> None:
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
        rs = ref.state[q]
        if p.numel() >= opt.config.min_numel:
            st = opt.read_state(name)
            assert torch.equal(st["master"], q.detach().reshape(-1)), name
            assert torch.equal(st["exp_avg"], rs["exp_avg"].reshape(-1)), name
            assert torch.equal(st["exp_avg_sq"], rs["exp_avg_sq"].reshape(-1)), name
        else:
            assert torch.equal(opt.state[p]["exp_avg"], rs["exp_avg"]), name
            assert torch.equal(opt.state[p]["exp_avg_sq"], rs["exp_avg_sq"]), name


def test_bucket_layout_is_capped_split_and_4k_aligned():
    shards = [
        Shard(0, "a", (250,), 0, 250),
        Shard(1, "b", (3, 10), 10, 20),
        Shard(2, "c", (7,), 0, 7),
    ]
    buckets = plan_buckets(shards, bucket_numel=100, moment_itemsize=2)
    assert [b.numel for b in buckets] == [100, 100, 77]
    assert [[(s.name, s.start, s.numel) for s in b.segments] for b in buckets] == [
        [("a", 0, 100)],
        [("a", 100, 100)],
        [("a", 200, 50), ("b", 0, 20), ("c", 0, 7)],
    ]
    b_seg = buckets[2].segments[1]
    assert b_seg.global_start == 10  # the shard's own offset in the full parameter
    for b in buckets:
        assert b.nbytes % ALIGNMENT == 0
        end = 0
        for s in b.segments:
            assert all(o % ALIGNMENT == 0 for o in s.offsets)
            assert s.offsets[0] >= end and s.offsets[1] >= s.offsets[0] + 4 * s.numel
            assert s.offsets[2] >= s.offsets[1] + 2 * s.numel
            end = s.offsets[2] + 2 * s.numel
        assert b.nbytes >= end


@pytest.mark.parametrize(
    "kernel", [{"foreach": True}, {"foreach": False}], ids=["foreach", "single"]
)
def test_fp32_bit_identical_to_torch_adamw(tmp_path, kernel):
    """torch's foreach and single-tensor AdamW. (The fused CPU kernel rounds vectorised and
    tail elements differently, so no split of a tensor matches it; tests/gpu covers CUDA's.)"""
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    opt = _streamed(model, tmp_path, **kernel)
    ref = _reference(ref_model, **kernel)
    sched, ref_sched = _schedule(opt), _schedule(ref)
    files = sorted(os.listdir(opt.directory))
    assert files == [f"bucket_{i:05d}.bin" for i in range(len(opt.buckets))] and len(files) == 6
    assert os.path.basename(opt.directory).startswith("streamed-adam-actor-rank00000-")
    for step in range(1, 6):
        _train(model, opt, sched, step)
        _train(ref_model, ref, ref_sched, step)
        _assert_state_equal(opt, model, ref, ref_model)
    assert all(os.path.getsize(os.path.join(opt.directory, f)) % ALIGNMENT == 0 for f in files)
    opt.close()
    assert not os.path.exists(opt.directory)


def test_bf16_moments_within_bf16_tolerance(tmp_path):
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    opt = _streamed(model, tmp_path, moment_dtype="bf16", foreach=True)
    ref = _reference(ref_model)
    sched, ref_sched = _schedule(opt), _schedule(ref)
    for step in range(1, 6):
        _train(model, opt, sched, step)
        _train(ref_model, ref, ref_sched, step)
    for name, q in zip(("fc1.weight", "fc2.weight"), (ref_model.fc1.weight, ref_model.fc2.weight)):
        st = opt.read_state(name)
        assert st["exp_avg"].dtype == torch.bfloat16
        rs = ref.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            want = rs[key].reshape(-1)
            torch.testing.assert_close(
                st[key].float(), want, rtol=2**-6, atol=1e-3 * want.abs().max().item()
            )
        # 5 updates of size <= lr each, moved by at most a few bf16 ulps of m / sqrt(v)
        assert (st["master"] - q.detach().reshape(-1)).abs().max() < 5 * LR * 2**-5
    assert not torch.equal(model.fc1.weight, ref_model.fc1.weight)  # the rounding is real
    opt.close()


def test_resume_with_another_bucket_size_is_bitwise(tmp_path):
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    opt = _streamed(model, tmp_path)
    ref = _reference(ref_model)
    sched, ref_sched = _schedule(opt), _schedule(ref)
    for step in (1, 2, 3):
        _train(model, opt, sched, step)
        _train(ref_model, ref, ref_sched, step)
    opt.save(str(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / "rank00000" / "manifest.json").read_text())
    assert manifest["moment_dtype"] == "fp32" and manifest["master_dtype"] == "fp32"
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert manifest["params"]["fc1.weight"] == {
        "shape": [24, 16],
        "streamed": True,
        "global_start": 0,
        "local_numel": 384,
        "step": 3,
    }
    assert len(manifest["buckets"]) == 6 and manifest["alignment"] == ALIGNMENT
    opt.close()

    resumed = copy.deepcopy(model)  # the model checkpoint: weights after step 3
    opt2 = _streamed(resumed, tmp_path, bucket_numel=37)
    opt2.load(str(tmp_path / "ckpt"))
    sched2 = _schedule(opt2)
    sched2.load_state_dict(ref_sched.state_dict())  # the backend restores the LR schedule
    for group, lr in zip(opt2.param_groups, sched2.get_last_lr()):
        group["lr"] = lr
    for step in (4, 5):
        _train(resumed, opt2, sched2, step)
        _train(ref_model, ref, ref_sched, step)
    _assert_state_equal(opt2, resumed, ref, ref_model)
    opt2.close()


def test_moment_dtype_mismatch_is_refused(tmp_path):
    model = Net()
    opt = _streamed(model, tmp_path)
    _train(model, opt, _schedule(opt), 1)
    opt.save(str(tmp_path / "ckpt"))
    other = _streamed(copy.deepcopy(model), tmp_path, moment_dtype="bf16")
    with pytest.raises(
        ValueError,
        match="saved as fp32 but this run uses --stream-optimizer-state-moment-dtype bf16",
    ):
        other.load(str(tmp_path / "ckpt"))


def test_checkpoint_without_streaming_is_refused(tmp_path):
    model = Net()
    ckpt = tmp_path / "iter_0000001" / "optimizer"
    ckpt.mkdir(parents=True)
    torch.save(_reference(copy.deepcopy(model)).state_dict(), ckpt / "__0_0.distcp")
    opt = _streamed(model, tmp_path)
    with pytest.raises(
        ValueError, match="written without --stream-optimizer-state-to-disk.*--no-load-optim"
    ):
        opt.load(str(ckpt))


def test_from_args_reads_the_flags(tmp_path):
    args = parse_args(
        [
            "--stream-optimizer-state-to-disk",
            "--offload-train-disk-dir",
            str(tmp_path),
            "--stream-optimizer-state-moment-dtype",
            "bf16",
            "--stream-optimizer-bucket-numel",
            "300",
            "--stream-optimizer-min-numel",
            "100",
            "--lr",
            "3e-4",
            "--adam-beta2",
            "0.98",
            "--weight-decay",
            "0.05",
        ],
        core_groups(),
    )
    model = Net()
    opt = from_args(model.named_parameters(), args)
    assert opt.config.moment_dtype == "bf16" and opt.config.foreach is True
    assert [len(b.segments) for b in opt.buckets] == [1, 2]  # 384 + 192 elements, cap 300
    assert opt.directory.startswith(str(tmp_path))
    assert (
        opt.param_groups[0]["betas"] == (0.9, 0.98) and opt.param_groups[0]["weight_decay"] == 0.05
    )
    assert [n for _, n, _ in opt._small] == ["fc1.bias", "fc2.bias"]
    opt.close()


DISK_FULL_SCRIPT = textwrap.dedent(
    """
    import json, resource, signal, sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_streamed_adam import Net, _digests, _schedule, _streamed, _train
    from pathlib import Path
    tmp = Path(sys.argv[1])
    torch.manual_seed(0)
    model = Net()
    opt = _streamed(model, tmp, bucket_numel=1024)  # 12 KiB per bucket file
    sched = _schedule(opt)
    _train(model, opt, sched, 1)
    opt.save(str(tmp / "ckpt"))
    torch.save(model.state_dict(), tmp / "model_step1.pt")
    saved = _digests(tmp / "ckpt" / "rank00000")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))  # the disk is "full" at 8 KiB
    out = {"saved": saved}
    try:
        _train(model, opt, sched, 2)
    except OSError as e:
        out.update(errno=e.errno, filename=e.filename, message=str(e))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        _train(model, opt, sched, 3)
    except RuntimeError as e:
        out["again"] = str(e)
    print(json.dumps(out))
    """
)


def _digests(path) -> dict[str, str]:
    return {
        f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in sorted(os.listdir(path))
    }


@pytest.mark.slow
def test_disk_full_mid_step_raises_and_keeps_the_checkpoint(tmp_path):
    here = os.path.dirname(__file__)
    proc = subprocess.run(
        [sys.executable, "-c", DISK_FULL_SCRIPT, str(tmp_path), here],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["errno"] == errno.EFBIG
    assert out["filename"].endswith("/bucket_00000.bin") and "-rank00000-" in out["filename"]
    assert "streamed AdamW step 2 failed" in out["message"]
    assert "offset 8192" in out["message"] and "resume from the last checkpoint" in out["message"]
    assert "a previous step failed" in out["again"]

    # the checkpoint of step 1 is intact and resumes into the state of torch AdamW after step 1
    ckpt = tmp_path / "ckpt" / "rank00000"
    torch.manual_seed(0)
    ref_model = Net()
    ref = _reference(ref_model)
    _train(ref_model, ref, _schedule(ref), 1)
    model = Net()
    model.load_state_dict(torch.load(tmp_path / "model_step1.pt"))
    opt = _streamed(model, tmp_path, bucket_numel=1024)
    opt.load(str(tmp_path / "ckpt"))
    _assert_state_equal(opt, model, ref, ref_model)
    assert _digests(ckpt) == out["saved"]
    opt.close()


def test_sleep_and_wake_keep_training_bitwise(tmp_path):
    """DeviceMover moves the small parameters' state (the buckets are already on disk)."""
    from miles_offload.device_mover import DeviceMover
    from miles_offload.offload_target import OffloadTarget

    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    opt = _streamed(model, tmp_path)
    ref = _reference(ref_model)
    sched, ref_sched = _schedule(opt), _schedule(ref)
    mover = DeviceMover(
        {"actor": model}, [opt], OffloadTarget("disk", disk_dir=str(tmp_path), chunk_mb=1)
    )
    for step in (1, 2, 3):
        _train(model, opt, sched, step)
        _train(ref_model, ref, ref_sched, step)
        mover.sleep()
        mover.wake_up()
    _assert_state_equal(opt, model, ref, ref_model)
    mover.close()
    opt.close()
