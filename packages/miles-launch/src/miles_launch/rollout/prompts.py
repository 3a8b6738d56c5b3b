"""Prompt sets from JSONL or Parquet and the deterministic order in which rollouts consume them.

A prompt file ending in ``.parquet`` is read with pyarrow (one record per row); any other file
is JSONL (one JSON object per line). In each record ``--input-key`` names the prompt (a string,
or a list of chat messages when ``--apply-chat-template`` is on), ``--label-key`` the label the
reward compares against and ``--metadata-key`` an optional object handed to the reward function
as ``RewardInput.metadata``. The run reads the prompts as one endless stream: position ``p`` is
prompt ``perm_e[p mod N]`` of epoch ``e = p // N`` (``perm_e`` a permutation seeded by
``--seed`` and ``e`` under ``--rollout-shuffle``, the identity otherwise). A rollout takes the
next positions, so a run resumed at a saved position sees exactly the prompts an
uninterrupted run would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch


class PromptDataError(ValueError):
    """A prompt file or line is malformed (the message names the file, line and key)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: its ``index`` among the file's prompts, text, label, token ids and the
    record's ``--metadata-key`` object (empty when absent)."""

    index: int
    text: str
    label: Any
    token_ids: tuple[int, ...]
    metadata: dict = field(default_factory=dict)


def read_records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for each record of ``path``: ``file:line`` of a JSONL file, or
    ``file:row N`` (from 1) of a ``.parquet`` file."""
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as error:
            raise PromptDataError(f"{path}: not a readable Parquet file ({error})") from None
        for row, record in enumerate(table.to_pylist(), start=1):
            yield f"{path}:row {row}", record
        return
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise PromptDataError(f"{where}: invalid JSON ({error.msg})") from None
            yield where, record


def load_prompts(
    path: str | Path,
    tokenizer: Any,
    input_key: str,
    label_key: str | None,
    apply_chat_template: bool,
    metadata_key: str | None = None,
) -> list[Prompt]:
    """Read and tokenize every prompt of ``path`` (errors name ``path:line`` and the key)."""
    path = Path(path)
    prompts: list[Prompt] = []
    for where, record in read_records(path):
        check_record(where, record, input_key, metadata_key)
        raw = record[input_key]
        label = record.get(label_key) if label_key else None
        metadata = (record.get(metadata_key) if metadata_key else None) or {}
        text = render_prompt(raw, tokenizer, apply_chat_template, where)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise PromptDataError(f"{where}: prompt '{input_key}' has no tokens")
        prompts.append(Prompt(len(prompts), text, label, tuple(int(i) for i in ids), metadata))
    if not prompts:
        raise PromptDataError(f"{path}: no prompts")
    return prompts


def check_record(
    where: str,
    record: Any,
    input_key: str,
    metadata_key: str | None,
    label_key: str | None = None,
    label_reader: str | None = None,
) -> None:
    """One record's keys (errors name ``where`` and the flag): an object with ``--input-key``,
    its ``--metadata-key`` an object when present, and, when ``label_reader`` (the flag of the
    reward that reads labels, e.g. ``--rm-type math``) is given, a ``--label-key`` value."""
    if not isinstance(record, dict):
        raise PromptDataError(f"{where}: expected a JSON object")
    if input_key not in record:
        raise PromptDataError(
            f"{where}: no key '{input_key}' (--input-key); keys: {sorted(record)}; point "
            "--input-key at the prompt"
        )
    metadata = record.get(metadata_key) if metadata_key else None
    if metadata is not None and not isinstance(metadata, dict):
        raise PromptDataError(
            f"{where}: '{metadata_key}' (--metadata-key) must be an object, got "
            f"{type(metadata).__name__}"
        )
    if label_reader is None:
        return
    if not label_key:
        raise PromptDataError(f"{label_reader} reads a label, but --label-key is unset")
    if record.get(label_key) in (None, ""):
        found = "is empty" if label_key in record else f"is missing; keys: {sorted(record)}"
        raise PromptDataError(
            f"{where}: the label '{label_key}' (--label-key), which {label_reader} reads, "
            f"{found}; point --label-key at the label, or use a reward without one "
            "(--custom-rm-path, --rm-url)"
        )


def drop_long_prompts(
    prompts: list[Prompt], max_len: int | None, path: str | Path
) -> tuple[list[Prompt], int]:
    """``prompts`` without those longer than ``max_len`` tokens (``--rollout-max-prompt-len``),
    and how many were dropped; every prompt dropped is an error naming the flag."""
    if max_len is None:
        return prompts, 0
    kept = [p for p in prompts if len(p.token_ids) <= max_len]
    if not kept:
        longest = min(len(p.token_ids) for p in prompts)
        raise PromptDataError(
            f"{path}: every prompt is longer than --rollout-max-prompt-len {max_len} tokens "
            f"(the shortest has {longest})"
        )
    return kept, len(prompts) - len(kept)


def render_prompt(raw: Any, tokenizer: Any, apply_chat_template: bool, where: str) -> str:
    """The prompt text: as given, or through the tokenizer's chat template (a string becomes
    one user message; a list is taken as the messages)."""
    if not apply_chat_template:
        if not isinstance(raw, str):
            raise PromptDataError(
                f"{where}: prompt must be a string without --apply-chat-template, got "
                f"{type(raw).__name__}"
            )
        return raw
    messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(messages, list):
        raise PromptDataError(f"{where}: prompt must be a string or a list of messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise PromptDataError(
            f"{where}: --apply-chat-template, but the tokenizer has no chat template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class PromptOrder:
    """Maps stream positions to prompt indices (see the module docstring)."""

    def __init__(self, num_prompts: int, shuffle: bool, seed: int):
        self.num_prompts = num_prompts
        self.shuffle = shuffle
        self.seed = seed
        self._epochs: dict[int, list[int]] = {}

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                self._epochs[epoch] = torch.randperm(self.num_prompts, generator=gen).tolist()
            else:
                self._epochs[epoch] = list(range(self.num_prompts))
        return self._epochs[epoch]

    def index_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_prompts)
        return self._permutation(epoch)[offset]

    def take(self, position: int, count: int) -> list[int]:
        """Prompt indices at positions ``position .. position + count - 1``."""
        return [self.index_at(p) for p in range(position, position + count)]
