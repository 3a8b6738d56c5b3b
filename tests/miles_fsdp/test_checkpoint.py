"""DCP checkpoints: bitwise resume, --no-load-optim, crash safety, HF export round trip."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from miles_core.checkpoint_layout import read_meta, read_tracker, resolve_load
from rank_programs import export_program, resume_program
from spawn import run_in_sequence, run_ranks
from tiny_models import qwen3_config, save_tiny_model

MODES = ["straight", "first", "resume", "resume-no-optim"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="module")
def data():
    return torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def two_ranks(hf_dir, data, tmp_path_factory):
    """One spawn of 2 ranks runs both multi-rank programs of this module in turn (a fresh
    backend each): the resume modes under ``root/<mode>`` and the HF export of ``root/src``
    (tied embeddings) to ``root/export``."""
    root = tmp_path_factory.mktemp("two_ranks")
    export_src = save_tiny_model(root / "src", qwen3_config(tie_word_embeddings=True))
    calls = [
        (resume_program, (hf_dir, data, str(root), MODES, str(root / "results.pt"))),
        (export_program, (str(export_src), str(root / "export"), str(root / "p.pt"))),
    ]
    run_ranks(2, run_in_sequence, calls, timeout=400)
    return root


@pytest.mark.slow
def test_resume_is_bitwise_and_no_load_optim_keeps_scheduler(two_ranks):
    got = torch.load(two_ranks / "results.pt", weights_only=True)
    straight, first, resumed, no_optim = (got[m] for m in MODES)

    saved = two_ranks / "first"
    assert read_tracker(saved) == 2  # iteration = rollouts trained
    meta = read_meta(saved / "iter_0000002")
    assert (meta.rollout_id, meta.next_rollout_id, meta.global_step) == (1, 2, 2)
    assert meta.backend == "fsdp" and meta.world_size == 2
    assert {p.name for p in (saved / "iter_0000002").iterdir()} == {
        "model",
        "optimizer",
        "lr_scheduler",
        "rng.pt",
        "meta.json",
    }
    assert resumed["start"] == 2
    assert first["losses"] + resumed["losses"] == straight["losses"]
    for name, value in straight["params"].items():
        assert torch.equal(value, resumed["params"][name]), name
    assert straight["optim"].keys() == resumed["optim"].keys()
    for key, value in straight["optim"].items():
        assert torch.equal(value, resumed["optim"][key]), key
    assert straight["lr"] == resumed["lr"]

    # --no-load-optim: weights and scheduler restored, AdamW moments start from scratch
    for name, value in first["params"].items():
        assert torch.equal(value, no_optim["params"][name]), name
    assert no_optim["optim"] == {}
    assert no_optim["scheduler_epoch"] == first["scheduler_epoch"] == 2
    assert no_optim["lr"] == first["lr"] != straight["lr"]


@pytest.mark.slow
def test_export_hf_round_trips_through_from_pretrained(two_ranks):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, out = two_ranks / "src", two_ranks / "export"
    trained = torch.load(two_ranks / "p.pt")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())  # checkpoint names: no separate tied lm_head
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, param in reloaded.named_parameters():
        assert torch.equal(param, trained[name]), name
    assert AutoTokenizer.from_pretrained(str(out)).vocab_size == 64


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from miles_fsdp.backend import FSDPBackend
    from run_args import make_args

    dist.init_process_group("gloo", init_method="file://" + {init!r}, rank=0, world_size=1)
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint={hf!r}, save={save!r}))
    backend.save_model(0)
    real_save = dcp.save

    def save_then_die(state_dict, checkpoint_id):
        real_save(state_dict, checkpoint_id=checkpoint_id)
        if checkpoint_id.endswith({kill_after!r}):
            os.kill(os.getpid(), signal.SIGKILL)

    dcp.save = save_then_die
    backend.save_model(1)
    """
)

LOADER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    from miles_fsdp.backend import FSDPBackend
    from run_args import make_args

    dist.init_process_group("gloo", init_method="file://" + {init!r}, rank=0, world_size=1)
    backend = FSDPBackend()
    print(f"next_rollout_id={{backend.init(make_args(hf_checkpoint={hf!r}, load={save!r}))}}")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", ["model", "optimizer"])
def test_kill_during_save_leaves_previous_iteration_loadable(hf_dir, tmp_path, kill_after):
    save = tmp_path / "ckpt"
    script = KILLER.format(
        tests=os.path.dirname(__file__),
        init=str(tmp_path / "init"),
        hf=hf_dir,
        save=str(save),
        kill_after=kill_after,
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=180, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert read_tracker(save) == 1
    assert (save / "iter_0000002" / "model").is_dir()  # the killed save got this far
    assert not (save / "iter_0000002" / "meta.json").exists()
    resolved = resolve_load(save)
    assert resolved.path == save / "iter_0000001" and resolved.meta.next_rollout_id == 1
    assert (resolved.path / "optimizer" / ".metadata").exists()
    if kill_after == "optimizer":  # and a fresh process resumes from it
        loader = LOADER.format(
            tests=os.path.dirname(__file__), init=str(tmp_path / "init2"), hf=hf_dir, save=str(save)
        )
        proc = subprocess.run([sys.executable, "-c", loader], timeout=180, capture_output=True)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        assert proc.stdout.decode().strip().splitlines()[-1] == "next_rollout_id=1"


def test_export_hf_shards_with_index(tmp_path):
    """Several shards (one in memory at a time), an index, and a from_pretrained round trip."""
    from miles_fsdp.checkpoint import export_hf
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = save_tiny_model(tmp_path / "src")
    state = load_file(str(src / "model.safetensors"))
    export_hf(state.items(), src, tmp_path / "out", max_shard_bytes=20_000)
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[-1].name.endswith(f"-of-{len(shards):05d}.safetensors")
    assert not list((tmp_path / "out").glob(".export-*"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    for name, tensor in state.items():
        assert torch.equal(model.state_dict()[name], tensor), name
