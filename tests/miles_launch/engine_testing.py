"""Test support for the built-in engine: tiny HF models on disk and a server subprocess."""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import httpx
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHARS = "abcdefghijklmnopqrstuvwxyz ,.!?0123456789"
VOCAB_SIZE = 64  # every id has a token string, so decoding is total


def save_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: id 0 is ``<|endoftext|>`` (EOS), then one id per char,
    then filler tokens ``<t42>`` ... up to VOCAB_SIZE."""
    vocab = {"<|endoftext|>": 0}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    while len(vocab) < VOCAB_SIZE:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(path)
    return fast


def tiny_qwen3(seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # sharper logits than the 0.02-std init, so greedy has no near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model.eval()


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
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return model.eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    """``python -m miles_launch.engine`` on a free port; waits for /health."""

    def __init__(
        self, model_path: Path, *flags: str, api_key: str | None = None, timeout: float = 120.0
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "miles_launch.engine",
            "--model-path",
            str(model_path),
            "--port",
            str(self.port),
        ]
        cmd += list(flags)
        if api_key:
            cmd += ["--api-key", api_key]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.log = open(Path(model_path).parent / f"engine-{self.port}.log", "w+")  # noqa: SIM115
        env = dict(os.environ, OMP_NUM_THREADS="1")
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
        self.close()
        raise TimeoutError(f"engine did not become healthy: {self.read_log()}")

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
