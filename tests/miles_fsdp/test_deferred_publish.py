"""An awake FSDP publish over ``ipc`` gathers straight into the bucket it sends (issues #24,
#35). fp32 masters are published as bf16.

2 gloo ranks (real FSDP2 on a CPU mesh), one spawn:

* Bits: an untied model whose MLP width (63) leaves two tensors per layer unevenly sharded
  (FSDP2 pads them: gathered as before, the rest deferred) publishes over ``ipc`` to two real
  built-in engines (each rank leads its own, over CPU shared memory); then, a step before each,
  asleep over ``ipc`` (each shard read from its offload file as its bucket is packed) and awake
  over ``broadcast``. Each engine serves exactly the awake materialised source's bytes (the
  path before deferral), and the publisher's ``--update-weight-verify`` readback passes (it digests
  the deferred tensors' bytes in the bucket).
* Copies: on a model whose tensors all shard evenly, a dispatch mode counts the bytes every op
  writes while the source is iterated and packed: the deferred source writes ``1 + 1/2`` bytes
  per published byte (each shard's cast, one all-gather into the bucket); the materialised one
  writes 4 (an fp32 gather, the cast, the copy into the bucket).

One rank, in process: a tied model (the head left out) publishes the same bits deferred, and
the deferred fill is one cast-copy into the bucket (1 byte written per byte, not 2).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from deferred_publish_programs import publish_program, written_bytes
from miles_fsdp.backend import FSDPBackend
from miles_sync.buckets import pack_bucket
from miles_sync.deferred import DeferredTensor, materialized
from run_args import make_args
from spawn import run_ranks
from tiny_models import qwen3_config, save_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_sync"))

from sync_testing import Engine, free_port  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The 2-rank run. The engines start (in threads) while the ranks build, train and count;
    the ranks wait for them before publishing."""
    tmp = tmp_path_factory.mktemp("deferred")
    even = save_tiny_model(tmp / "even", qwen3_config(), dtype=torch.bfloat16)
    uneven = save_tiny_model(tmp / "ckpt", qwen3_config(intermediate_size=63), dtype=torch.bfloat16)
    ports = [free_port() for _ in range(2)]
    out = tmp / "out.json"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(Engine, uneven, port, 300) for port in ports]
        try:
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            args = (str(even), str(uneven), urls, str(out))
            run_ranks(2, publish_program, *args, timeout=300, shared_memory=True)
        finally:
            for future in starting:
                future.result().close()
    return json.loads(out.read_text())


def test_deferred_ipc_publish_serves_the_materialised_bytes(published):
    rank0 = published[0]
    assert rank0["master_dtypes"] == ["torch.float32"]
    assert 0 < rank0["published"]["deferred"] < len(rank0["ipc"]["reference"])  # and uneven ones
    assert rank0["still_asleep"]
    for mode in ("ipc", "asleep_ipc", "broadcast"):
        ref = rank0[mode]["reference"]
        assert "lm_head.weight" in ref
        assert {d[1] for d in ref.values()} == {"torch.bfloat16"}
        for engine in rank0[mode]["engines"]:
            assert {name: engine[name] for name in ref} == ref, mode
        assert rank0[mode]["verified"]["tensors"] == len(ref), mode
    steps = [rank0[mode]["reference"] for mode in ("ipc", "asleep_ipc", "broadcast")]
    assert steps[0] != steps[1] != steps[2]  # a step in between


def test_asleep_deferred_fill_reads_row_chunks(published):
    """``read_bytes`` bounds each asleep read of a deferred tensor; the rows, read and
    gathered a chunk at a time into their places, give the awake source's bytes."""
    rank0 = published[0]
    chunked = rank0["asleep_chunked"]
    assert chunked["digests"] == rank0["asleep_ipc"]["reference"]
    reads = chunked["reads"]
    assert reads and all(0 < n <= chunked["chunk"] for r in reads.values() for n in r)
    embedding = reads["model.embed_tokens.weight"]
    assert len(embedding) == 16  # the fp32 shard (32 rows of 32) read 2 rows at a time
    assert sum(embedding) == 32 * 32 * 4


def test_deferred_source_writes_each_published_byte_once(published):
    for r in published:
        old, new = r["materialized"], r["deferred"]
        assert old["published"] == new["published"] > 0
        assert old["deferred"] == 0 and new["deferred"] > 0
        assert old["written"] >= 3.9 * old["published"]
        assert new["written"] <= 1.51 * new["published"]


def test_one_rank_tied_deferred_publish(one_rank_group, tmp_path):
    hf_dir = save_tiny_model(
        tmp_path / "m", qwen3_config(vocab_size=63, tie_word_embeddings=True), dtype=torch.bfloat16
    )
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir)))
    try:
        source = backend.weight_source(gather_bytes=1)
        plain = list(source)
        deferred = list(source.deferred())
        assert [n for n, _ in deferred] == [n for n, _ in plain]
        assert "lm_head.weight" not in dict(plain)
        assert all(isinstance(t, DeferredTensor) for _, t in deferred)
        for (name, a), (_, b) in zip(plain, materialized(deferred)):
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
        flat, _ = pack_bucket(deferred)
        assert torch.equal(flat, pack_bucket(plain)[0])
        old = written_bytes(iter(source))
        new = written_bytes(source.deferred())
        assert new["written"] == new["published"] == old["published"]
        assert old["written"] >= 2 * old["published"]
    finally:
        backend.close()


def test_one_rank_asleep_deferred_fill_reads_row_chunks(one_rank_group, tmp_path):
    """Asleep in host memory (``cpu``), one rank: the deferred fills read ``read_bytes`` of
    each shard at a time and cast it into its rows; the bytes are the awake source's."""
    hf_dir = save_tiny_model(tmp_path / "m", qwen3_config(), dtype=torch.bfloat16)
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir), offload_train=True))
    try:
        awake = list(backend.weight_source(gather_bytes=1))
        backend.sleep()
        source = backend.weight_source(gather_bytes=1)
        reads = []

        def read(t, rows=None):
            out = source.read(t, rows)
            reads.append(out.numel() * out.element_size())
            return out

        chunked = dataclasses.replace(source, read=read, read_bytes=3 * 32 * 4)  # 3 fp32 rows
        asleep = list(materialized(chunked.deferred()))
        assert backend.asleep
        assert [n for n, _ in asleep] == [n for n, _ in awake]
        for (name, a), (_, b) in zip(awake, asleep):
            assert b.dtype == torch.bfloat16 and torch.equal(a, b), name
        assert reads and max(reads) == 3 * 32 * 4  # the embedding's 64 rows: 3 at a time
        assert len(reads) > 100
    finally:
        backend.close()
