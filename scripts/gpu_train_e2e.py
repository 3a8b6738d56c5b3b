#!/usr/bin/env python3
"""``miles train`` end to end on a GPU node: a few rollouts per case, then three checks.

    python3 scripts/gpu_train_e2e.py --out DIR [--cases a,b,...] [--rollouts 3]

Each case is one real job (Ray, trainer actors, built-in engines on the GPUs) run in a child
process of this script, which meanwhile samples ``nvidia-smi`` every 0.2 s. For each case it
records:

* per-phase times per rollout (generate, train, save, sleep/wake/publish) and the train/rollout
  mismatch (``train_rollout_*``, :mod:`miles_core.mismatch`) from the job's metrics JSONL;
* peak GPU memory of the trainer processes and of the engine processes (``nvidia-smi``'s
  per-process use) and per GPU;
* **the engine's weights equal the trainer's after the last publish**: before teardown the
  child reads the first rows of every tensor from each engine (SGLang's
  ``/get_weights_by_name``); the trainer's last checkpoint (saved after the last train step,
  before that publish) is converted to HF names and cast to the engine's dtype, and the two
  must be equal bit for bit.

Models are made here (nothing is downloaded): the demo's tiny Qwen3, and a random model of
Qwen3-0.6B's shape (28 layers, hidden 1024, vocabulary 151,936) with the demo's task. Writes
``DIR/<case>.json`` and ``DIR/summary.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRUNCATE = 2  # rows of each tensor compared

#: case -> (model, flags beyond the common ones)
CASES: dict[str, tuple[str, list[str]]] = {
    "fsdp-tiny-colocate-1gpu": ("tiny", ["--train-backend", "fsdp", "--colocate"]),
    "fsdp-0.6b-colocate-1gpu": ("0.6b", ["--train-backend", "fsdp", "--colocate"]),
    "fsdp-0.6b-colocate-disk": (
        "0.6b",
        ["--train-backend", "fsdp", "--colocate", "--offload-train-target", "disk"],
    ),
    "fsdp-tiny-cpu-offload": (
        "tiny",
        ["--train-backend", "fsdp", "--colocate", "--fsdp-cpu-offload"],
    ),
    "fsdp-0.6b-cpu-offload": (
        "0.6b",
        ["--train-backend", "fsdp", "--colocate", "--fsdp-cpu-offload"],
    ),
    "megatron-tiny-colocate-1gpu": ("tiny", ["--train-backend", "megatron", "--colocate"]),
    "megatron-0.6b-colocate-1gpu": ("0.6b", ["--train-backend", "megatron", "--colocate"]),
    "fsdp-0.6b-colocate-2gpu": (
        "0.6b",
        ["--train-backend", "fsdp", "--colocate", "--actor-num-gpus-per-node", "2"],
    ),
    "fsdp-0.6b-disagg-broadcast": (
        "0.6b",
        ["--train-backend", "fsdp", "--rollout-num-gpus", "1", "--update-weight-mode", "broadcast"],
    ),  # fmt: skip
    "megatron-0.6b-colocate-tp2": (
        "0.6b",
        [
            "--train-backend",
            "megatron",
            "--colocate",
            "--actor-num-gpus-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
        ],
    ),  # fmt: skip
}


def say(message: str) -> None:
    print(f"gpu_train_e2e: {message}", flush=True)


# ---------------------------------------------------------------------------------- material
def build_models(work: Path) -> dict[str, Path]:
    """The tiny demo model and a Qwen3-0.6B-shaped random one (bf16), both with the demo's
    character tokenizer; made once per work directory."""
    import torch
    from miles_launch.demo import CHARS, build_tiny_qwen3
    from miles_launch.tiny_model import save_char_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    models = {"tiny": work / "tiny-qwen3", "0.6b": work / "qwen3-0.6b-shape"}
    if not (models["tiny"] / "config.json").exists():
        build_tiny_qwen3(models["tiny"])
    if not (models["0.6b"] / "config.json").exists():
        say("making a random Qwen3-0.6B-shaped model (bf16)")
        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072,
            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=4096, rope_theta=1_000_000, tie_word_embeddings=True,
            eos_token_id=0, pad_token_id=0, bos_token_id=0, dtype="bfloat16",
        )  # fmt: skip
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen3ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(models["0.6b"], safe_serialization=True)
        save_char_tokenizer(models["0.6b"], CHARS, 151936)
        del model
    return models


def case_flags(model: str, hf: Path, prompts: Path, metrics: Path, save: Path, n: int):
    from miles_launch.demo import demo_flags

    flags = demo_flags(hf, prompts, metrics)
    # the demo's CPU settings, replaced by a GPU job's
    flags[flags.index("--actor-num-gpus-per-node") + 1] = "1"
    flags[flags.index("--fsdp-compute-dtype") + 1] = "bf16"
    flags[flags.index("--num-rollout") + 1] = str(n)
    flags += ["--save", str(save), "--save-interval", str(n), "--no-progress"]
    if model == "0.6b":
        flags[flags.index("--rollout-max-response-len") + 1] = "64"
        flags[flags.index("--lr") + 1] = "1e-5"
    return flags


def fix_backend_flags(flags: list[str]) -> list[str]:
    """Megatron takes --bf16, not the FSDP backend's --fsdp-compute-dtype."""
    if "megatron" in flags:
        i = flags.index("--fsdp-compute-dtype")
        flags[i : i + 2] = ["--bf16"]
    return flags


# ---------------------------------------------------------------------------------- child
def child(case: str, out: Path, work: Path, rollouts: int) -> None:
    """Run one job; before teardown read the engines' weights (first rows of every tensor)."""
    import httpx
    from miles_launch.demo import write_demo_prompts
    from miles_launch.job import Job
    from miles_launch.loop import run_sync
    from miles_launch.train import parse
    from safetensors import safe_open

    model, extra = CASES[case]
    hf = build_models(work)[model]
    run_dir = work / case
    run_dir.mkdir(parents=True, exist_ok=True)
    prompts = write_demo_prompts(run_dir / "prompts.jsonl")
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    flags = case_flags(model, hf, prompts, metrics, run_dir / "ckpt", rollouts) + extra
    flags = fix_backend_flags(flags)
    say(f"{case}: miles train {' '.join(flags)}")
    names = []
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            names += list(sf.keys())
    args = parse(flags)
    job = Job.setup(args)
    failed = True
    engine_rows: list[dict[str, list]] = []
    try:
        records = run_sync(job)
        headers = {"Authorization": f"Bearer {job.engines.api_key}"} if job.engines.api_key else {}
        for url in job.engines.urls:
            rows = {}
            with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
                for name in names:
                    r = client.post(
                        "/get_weights_by_name", json={"name": name, "truncate_size": TRUNCATE}
                    )
                    r.raise_for_status()
                    rows[name] = r.json()
            engine_rows.append(rows)
        failed = False
    finally:
        job.teardown(failed=failed)
    result = {"case": case, "flags": flags, "records": records, "engine_rows": engine_rows}
    (out / f"{case}.child.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------- checks
def trainer_weights(case: str, run_dir: Path, hf: Path) -> dict:
    """The trainer's last checkpoint as HF-named tensors."""
    import torch

    ckpt = run_dir / "ckpt"
    latest = sorted(p for p in ckpt.glob("iter_*") if p.is_dir())[-1]
    if "megatron" in case:
        dest = run_dir / "hf_out"
        subprocess.run(
            [sys.executable, "-m", "miles_megatron.convert", "torch-dist-to-hf", "--load",
             str(ckpt), "--hf-checkpoint", str(hf), "--save", str(dest)],
            check=True, cwd=ROOT,
        )  # fmt: skip
        from safetensors.torch import load_file

        return load_file(dest / "model.safetensors")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dest = run_dir / "model.pt"
    dcp_to_torch_save(latest / "model", dest)
    state = torch.load(dest, weights_only=True)
    return state["model"] if isinstance(state.get("model"), dict) else state


def compare(engine_rows: list[dict], trainer: dict, hf: Path) -> dict:
    import torch
    from safetensors import safe_open

    dtypes = {}
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                dtypes[k] = sf.get_slice(k).get_dtype()
    mismatched, missing, checked = [], [], 0
    for rows in engine_rows:
        for name, got in rows.items():
            want = trainer.get(name)
            if want is None and name == "lm_head.weight":
                want = trainer.get("model.embed_tokens.weight")  # tied
            if want is None:
                missing.append(name)
                continue
            dtype = {"BF16": torch.bfloat16, "F16": torch.float16}.get(dtypes[name], torch.float32)
            want = want[:TRUNCATE].to(dtype).float()
            if not torch.equal(torch.tensor(got, dtype=torch.float32), want):
                mismatched.append(name)
            checked += 1
    return {"checked": checked, "mismatched": mismatched, "missing_in_trainer": missing}


# ---------------------------------------------------------------------------------- memory
class GpuSampler(threading.Thread):
    """Peak used memory per GPU and per process (MiB), from nvidia-smi every 0.2 s."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop_event = threading.Event()
        self.gpu_peak: dict[str, int] = {}
        self.proc_peak: dict[int, int] = {}

    def run(self) -> None:
        if shutil.which("nvidia-smi") is None:
            return
        while not self.stop_event.is_set():
            gpus = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True,
            ).stdout  # fmt: skip
            for line in gpus.strip().splitlines():
                i, used = (x.strip() for x in line.split(","))
                self.gpu_peak[i] = max(self.gpu_peak.get(i, 0), int(used))
            procs = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                 "--format=csv,noheader,nounits"],
                capture_output=True, text=True,
            ).stdout  # fmt: skip
            for line in procs.strip().splitlines():
                try:
                    pid, used = (int(x.strip()) for x in line.split(","))
                except ValueError:
                    continue
                self.proc_peak[pid] = max(self.proc_peak.get(pid, 0), used)
                self._names.setdefault(pid, _cmdline(pid))
            self.stop_event.wait(0.2)

    _names: dict[int, str] = {}

    def by_side(self) -> dict[str, int]:
        engine = sum(v for p, v in self.proc_peak.items() if "builtin_engine" in self._names[p])
        trainer = sum(
            v for p, v in self.proc_peak.items() if "builtin_engine" not in self._names[p]
        )
        return {"engine_peak_mib": engine, "trainer_peak_mib": trainer}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# ---------------------------------------------------------------------------------- parent
def parent(cases: list[str], out: Path, work: Path, rollouts: int, timeout: float) -> None:
    summary = []
    build_models(work)
    for case in cases:
        sampler = GpuSampler()
        sampler.start()
        t0 = time.monotonic()
        log = out / f"{case}.log"
        with open(log, "w") as sink:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", case, "--out", str(out), "--work",
                 str(work), "--rollouts", str(rollouts)],
                cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                say(f"{case}: over {timeout:.0f} s; stopping it")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                subprocess.run(["ray", "stop", "--force"], capture_output=True)
        sampler.stop_event.set()
        sampler.join()
        proc.stdout = proc.stderr = log.read_text()[-3000:]
        row = {"case": case, "rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1)}
        row.update(sampler.by_side(), gpu_peak_mib=sampler.gpu_peak)
        child_json = out / f"{case}.child.json"
        if proc.returncode == 0 and child_json.exists():
            result = json.loads(child_json.read_text())
            model = CASES[case][0]
            hf = build_models(work)[model]
            try:
                row["weights"] = compare(
                    result["engine_rows"], trainer_weights(case, work / case, hf), hf
                )
            except Exception as exc:  # noqa: BLE001 - reported in the table
                row["weights"] = {"error": repr(exc)[:300]}
            row["times"] = [r["time"] for r in result["records"]]
            row["reward"] = [round(r["rollout"]["reward_mean"], 3) for r in result["records"]]
            row["weight_versions"] = [r["weight_version"] for r in result["records"]]
            # the train/rollout mismatch of each rollout (miles_core.mismatch), when measured
            row["mismatch"] = [
                {k: v for k, v in r["train"].items() if k.startswith("train_rollout_")}
                for r in result["records"]
            ]
            child_json.unlink()
        else:
            row["error_tail"] = (proc.stderr or proc.stdout)[-1500:]
        (out / f"{case}.json").write_text(json.dumps(row, indent=1))
        summary.append(row)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        say(f"{case}: rc {row['rc']} in {row['seconds']} s")
    print(
        f"{'case':32} {'rc':>3} {'s':>6} {'trainer MiB':>11} {'engine MiB':>10} "
        f"{'|dlogp| mean':>12} weights"
    )
    for row in summary:
        w = row.get("weights", {})
        verdict = (
            f"{w['checked']} equal" if w.get("checked") and not w.get("mismatched") else str(w)[:60]
        )
        diffs = [m.get("train_rollout_logprob_abs_diff") for m in row.get("mismatch", [])]
        diffs = [d for d in diffs if d is not None]
        mismatch = f"{sum(diffs) / len(diffs):.2e}" if diffs else "-"
        print(
            f"{row['case']:32} {row['rc']:>3} {row['seconds']:>6} "
            f"{row.get('trainer_peak_mib', 0):>11} {row.get('engine_peak_mib', 0):>10} "
            f"{mismatch:>12} {verdict}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_out/train_e2e"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/miles-gpu-e2e"))
    parser.add_argument("--cases", default="fsdp-tiny-colocate-1gpu,fsdp-0.6b-colocate-1gpu")
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=400, help="seconds per case")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child, args.out, args.work, args.rollouts)
        return
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    parent(cases, args.out, args.work, args.rollouts, args.timeout)


if __name__ == "__main__":
    main()
