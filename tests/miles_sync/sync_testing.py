"""Test support for weight sync: a tiny HF model, its bf16 checkpoint, engine subprocesses.

The trainer's model is fp32 (the master copy); the checkpoint, and so the engine, is bf16. A
weight source yields the trainer's tensors cast to the checkpoint dtype, as the FSDP backend's
source does; "bit for bit" means the engine's bf16 bytes equal that cast.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
import xxhash
from miles_core.ports import free_port
from miles_launch.tiny_model import save_char_tokenizer, tiny_qwen3
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

HERE = Path(__file__).parent
VOCAB = 48
CHECKPOINT_DTYPE = torch.bfloat16


def save_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """Character-level tokenizer (:mod:`miles_launch.tiny_model`); id 0 is EOS."""
    return save_char_tokenizer(path, "abcdefghijklmnopqrstuvwxyz .,", VOCAB)


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 (fp32, sharp logits: greedy decoding has no near-ties) whose largest
    tensor (the embedding, 48 x 32 fp32 = 6 KiB; 3 KiB in bf16) is larger than the small
    buckets the tests use."""
    return tiny_qwen3(seed, vocab_size=VOCAB, max_position_embeddings=256, weight_scale=8.0)


def save_checkpoint(model: Qwen3ForCausalLM, path: Path) -> Path:
    """The model as a bf16 HF checkpoint directory (with a tokenizer)."""
    copy = tiny_model()
    copy.load_state_dict(model.state_dict())
    copy.to(CHECKPOINT_DTYPE).save_pretrained(path)
    save_tokenizer(path)
    return path


def train_step(model: Qwen3ForCausalLM, seed: int, frozen: tuple[str, ...] = ()) -> None:
    """One AdamW step on a random next-token batch (parameters named in ``frozen`` stay)."""
    torch.manual_seed(seed)
    params = [p for n, p in model.named_parameters() if not n.startswith(frozen)]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(1, VOCAB, (2, 12))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    model.eval()


def source(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's weights in checkpoint names and dtype."""
    for name, tensor in model.state_dict().items():
        yield name, tensor.detach().to(CHECKPOINT_DTYPE).contiguous()


def expected_digests(model: torch.nn.Module) -> dict[str, list]:
    out = {}
    for name, tensor in source(model):
        raw = tensor.view(-1).view(torch.uint8).numpy()
        out[name] = [xxhash.xxh3_128_hexdigest(raw), str(tensor.dtype), list(tensor.shape)]
    return out


def cast_model(model: torch.nn.Module) -> Qwen3ForCausalLM:
    """A copy of the trainer model in the checkpoint dtype (what the engine should serve)."""
    cast = tiny_model()
    cast.load_state_dict(model.state_dict())
    return cast.to(CHECKPOINT_DTYPE).eval()


def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log-softmax (float64) of the cast trainer model at every position of ``ids``."""
    with torch.no_grad():
        logits = cast_model(model)(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


class Engine:
    """The built-in engine (with ``/weights_digest``) as a subprocess on a free port."""

    def __init__(
        self,
        model_path: Path,
        port: int | None = None,
        timeout: float = 120.0,
        device: str = "cpu",
    ):
        self.model_path = model_path
        self.device = device
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(model_path).parent / f"engine-{self.port}.log"
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        self.proc: subprocess.Popen | None = None
        self.start(timeout)

    def start(self, timeout: float = 120.0) -> None:
        cmd = [sys.executable, str(HERE / "digest_engine.py"), "--model-path", str(self.model_path)]
        cmd += ["--port", str(self.port), "--device", self.device]
        # the long requests of the publish tests (400 tokens) run past config.json's 256
        # positions; the engine admits them only within --context-length (as SGLang does)
        cmd += ["--context-length", "1024"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited: {self.log_path.read_text()[-3000:]}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"engine not healthy: {self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def digests(self) -> dict[str, list]:
        return self.http.get("/weights_digest").json()

    def version(self) -> str:
        return self.http.get("/get_model_info").json()["weight_version"]

    def greedy(self, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
        """Greedy output ids and their logprobs; the reply carries the live weight version."""
        body = {
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        }
        reply = self.http.post("/generate", json=body).json()
        assert reply["meta_info"]["weight_version"] == self.version()
        logprobs = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        return reply["output_ids"], logprobs

    def close(self) -> None:
        self.kill()
        self.http.close()


# ---- trainer ranks -------------------------------------------------------------------------
def _rank_main(rank: int, world_size: int, port: int, out_dir: str, job: dict) -> None:
    """One gloo trainer rank: for each of ``job["rounds"]`` (a seed and a ``SyncConfig``), one
    training step and a publish with a fresh publisher; rank 0 then records every engine's
    weight digests. Writes ``rank<r>.json``: per round the version, stats (and digests), or
    the error that ended the job."""
    import datetime
    import json
    import traceback

    import torch.distributed as dist
    from miles_sync.ranks import RankContext
    from miles_sync.weight_sync import SyncConfig, WeightPublisher

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    result: dict = {"rounds": []}
    try:
        model = tiny_model(0)
        for round_ in job["rounds"]:
            train_step(model, round_["seed"])
            config = SyncConfig(**round_["config"])
            publisher = WeightPublisher(config, RankContext.from_default_group())
            done = {"version": publisher.update_weights(source(model), job["engines"])}
            done["stats"] = publisher.last_stats
            publisher.close()
            dist.barrier()  # every rank's share has landed before the digests are read
            if rank == 0:
                done["digests"] = [
                    httpx.get(f"{url}/weights_digest", timeout=60).json() for url in job["engines"]
                ]
            result["rounds"].append(done)
    except Exception as error:  # reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_ranks(world_size: int, out_dir: Path, job: dict, timeout: float = 240.0) -> list[dict]:
    """Spawn ``world_size`` gloo ranks running :func:`_rank_main`; their results in rank order."""
    import json

    import torch.multiprocessing as mp
    from rank_context import in_environ, rank_context

    rank_context()
    context = mp.start_processes(
        in_environ(_rank_main),
        args=(world_size, free_port(), str(out_dir), job),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    # Wait on the processes themselves, not on ``context.join``: the ``torch_shm_manager`` that a
    # rank starts for the file_system strategy inherits the rank's exit-sentinel pipe and keeps
    # it open while the engine still maps the shared buckets.
    deadline = time.monotonic() + timeout
    while any(process.exitcode is None for process in context.processes):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"trainer ranks did not finish in {timeout}s")
        time.sleep(0.2)
    codes = [process.exitcode for process in context.processes]
    assert codes == [0] * world_size, f"trainer ranks exited with {codes}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
