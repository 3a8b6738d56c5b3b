"""Test support for the built-in engine: tiny HF models on disk and a server subprocess."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import httpx
import torch
from miles_core.ports import free_port
from miles_launch import tiny_model
from miles_launch.engine_launch.api_key import API_KEY_ENV
from miles_launch.tiny_model import save_char_tokenizer
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 64  # every id has a token string, so decoding is total


def save_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The character-level tokenizer of :mod:`miles_launch.tiny_model`: id 0 is
    ``<|endoftext|>`` (EOS), then one id per character, then fillers up to VOCAB_SIZE."""
    return save_char_tokenizer(path, vocab_size=VOCAB_SIZE)


def tiny_qwen3(seed: int):
    """A 2-layer Qwen3 (hidden 32) with sharpened weights: greedy decoding has no near-ties."""
    return tiny_model.tiny_qwen3(seed, vocab_size=VOCAB_SIZE, weight_scale=8.0)


def tiny_qwen3_moe(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    return tiny_model.sharpen(Qwen3MoeForCausalLM(config), 8.0).eval()


class EngineProcess:
    """``python -m miles_launch.builtin_engine`` on a free port; waits for /health."""

    def __init__(
        self, model_path: Path, *flags: str, api_key: str | None = None, timeout: float = 120.0
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "miles_launch.builtin_engine",
            "--model-path",
            str(model_path),
            "--port",
            str(self.port),
        ]
        cmd += list(flags)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.log = open(Path(model_path).parent / f"engine-{self.port}.log", "w+")  # noqa: SIM115
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop(API_KEY_ENV, None)
        if api_key:  # through the environment, as the launcher passes it (not in `ps`)
            env[API_KEY_ENV] = api_key
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.client = httpx.Client(base_url=self.url, timeout=60.0, headers=headers)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}: {self.read_log()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        log = self.read_log()
        self.close()
        raise TimeoutError(f"engine did not become healthy: {log}")

    def read_log(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return self.client.post(path, json={} if body is None else body, **kw)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def serialize(obj) -> str:
    """What SGLang's MultiprocessingSerializer sends: ForkingPickler dump, base64."""
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers' own generate, greedy, one prompt at a time."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=0,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def greedy_recompute(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference without a KV cache or EOS: each token is the argmax of a full forward pass
    over everything so far (what ``ignore_eos`` greedy decoding must produce)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


# ---- requests to a served engine (the built-in engine tests) ------------------------------
PROMPTS = ["hello world", "ab", "the quick brown fox jumps", "0123"]


def generate(engine: EngineProcess, prompt, max_new_tokens=16, **extra):
    """POST /generate, greedy unless ``sampling_params`` says otherwise; asserts 200."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    params.update(extra.pop("sampling_params", {}))
    r = engine.post("/generate", {"text": prompt, "sampling_params": params, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def reference(models: dict, which: str, prompts=tuple(PROMPTS), max_new_tokens=16):
    """transformers' greedy generations of ``models[which]`` (memoised in ``models``)."""
    key = (which, tuple(prompts), max_new_tokens)
    if key not in models["references"]:
        tok, model = models["tokenizer"], models[which][1]
        models["references"][key] = [
            hf_greedy(model, tok.encode(p), max_new_tokens) for p in prompts
        ]
    return models["references"][key]


def assert_generates(engine: EngineProcess, models: dict, which: str) -> None:
    """The engine serves ``models[which]``: its greedy outputs equal transformers'."""
    got = [o["output_ids"] for o in generate(engine, PROMPTS)]
    assert got == reference(models, which)


def long_request(engine: EngineProcess, n=150, rid=None) -> dict:
    """A greedy request of exactly ``n`` tokens (EOS ignored)."""
    body = {
        "text": "hello",
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    if rid:
        body["rid"] = rid
    return engine.post("/generate", body).json()


def wait_controls(engine: EngineProcess, count=1, timeout=30) -> None:
    """Wait until ``count`` control operations (a weight update...) wait in the scheduler."""
    deadline = time.monotonic() + timeout
    while engine.client.get("/get_server_info").json()["num_controls"] < count:
        assert time.monotonic() < deadline, "the control operation never reached the scheduler"
        time.sleep(0.01)


def wait_running(engine: EngineProcess, count=1, timeout=30) -> None:
    """Wait until the engine runs ``count`` requests."""
    deadline = time.monotonic() + timeout
    while engine.client.get("/get_server_info").json()["num_requests"] < count:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)
