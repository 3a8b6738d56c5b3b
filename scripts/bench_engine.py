"""Throughput of the built-in engine vs ``model.generate`` (batched), same model, same prompts.

    uv run python scripts/bench_engine.py --out bench_engine.json            # tiny Qwen3, CPU
    uv run python scripts/bench_engine.py --model-path /models/Qwen3-0.6B --device cuda --out gpu.json

Both sides decode greedily, ``--max-new-tokens`` tokens per prompt with EOS ignored, so they
produce the same number of tokens; the table also reports how many sequences agree token
for token. Engine time is wall time of one batched ``/generate`` call over HTTP (the server
is started first and warmed up); ``model.generate`` time is one batched call in-process.
Prints a table and writes JSON (``--out``). Not a timed assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from miles_core.ports import free_port


def build_tiny_model(path: Path, vocab: int, hidden: int, layers: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=0,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    words = {"<eos>": 0, **{f"w{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


def bench_engine(args, model_path: Path, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    port = free_port()
    cmd = [sys.executable, "-m", "miles_launch.builtin_engine", "--model-path", str(model_path)]
    cmd += ["--port", str(port), "--device", args.device, "--dtype", args.dtype]
    cmd += ["--max-running-requests", str(args.max_running_requests)]
    proc = subprocess.Popen(cmd)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}")
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not become healthy")
            time.sleep(0.5)
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
        client.post(
            "/generate", json={"input_ids": prompts[:2], "sampling_params": params}
        )  # warm-up
        start = time.perf_counter()
        out = client.post(
            "/generate", json={"input_ids": prompts, "sampling_params": params}
        ).json()
        elapsed = time.perf_counter() - start
        return elapsed, [o["output_ids"] for o in out]
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=60)


def bench_hf(args, model_path: Path, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(args.device).eval()
    ids = torch.tensor(prompts, device=args.device)  # equal lengths: no padding needed
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), **kw)  # warm-up
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return elapsed, out[:, ids.shape[1] :].tolist()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=None, help="HF model dir; default: build a small Qwen3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--tiny-vocab", type=int, default=2048)
    p.add_argument("--tiny-hidden", type=int, default=256)
    p.add_argument("--tiny-layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write results as JSON here")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_path = Path(args.model_path) if args.model_path else Path(tmp) / "tiny-qwen3"
        if args.model_path is None:
            build_tiny_model(model_path, args.tiny_vocab, args.tiny_hidden, args.tiny_layers)
        vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(
            1, vocab, (args.num_prompts, args.prompt_len), generator=gen
        ).tolist()
        engine_s, engine_out = bench_engine(args, model_path, prompts)
        hf_s, hf_out = bench_hf(args, model_path, prompts)

    tokens = args.num_prompts * args.max_new_tokens
    same = sum(a == b for a, b in zip(engine_out, hf_out))
    rows = [
        {
            "system": "built-in engine (HTTP, continuous batching)",
            "seconds": engine_s,
            "tokens": tokens,
        },
        {"system": "transformers model.generate (batched)", "seconds": hf_s, "tokens": tokens},
    ]
    for row in rows:
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
    print(f"{'system':<46} {'seconds':>9} {'tokens':>8} {'tokens/s':>10}")
    for row in rows:
        print(
            f"{row['system']:<46} {row['seconds']:>9.2f} {row['tokens']:>8d} {row['tokens_per_s']:>10.1f}"
        )
    print(f"sequences identical token for token: {same}/{args.num_prompts}")
    result = {
        "config": vars(args),
        "device_name": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "rows": rows,
        "identical_sequences": same,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
