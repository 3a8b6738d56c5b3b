"""The weight source of a publish: every pipeline stage's HF-named weights on the ranks the
transport sends from, and the check that a publish delivers exactly the checkpoint's names.

Each stage yields its own layers (:func:`~miles_megatron.hf_weights.iter_hf_weights`: TP shards
merged, experts gathered over EP and unfused to HF names). miles-sync's transports read one
collective source on every trainer rank, so the stages' tensors are moved to the ranks that send:

* ``to_all`` (``ipc``, ``p2p``): every rank holds every stage's tensors. Each tensor is broadcast
  over the pipeline group from its stage, so all ranks iterate the same sequence (the ``p2p``
  round-robin of buckets and the ``ipc`` gather of one bucket per engine TP rank need that).
* otherwise (``broadcast``, ``disk-delta``): global rank 0, the only rank that sends, receives
  the later stages' tensors from its pipeline peers, point to point; every other rank yields its
  own stage's tensors (iterated, not sent).

At PP = 1 the source is the stage's own, unchanged. The ranks that hold the whole model check,
after its last tensor, that the names sent equal the expected set (the HF checkpoint's): a
missing, extra or repeated name raises :class:`PublishNamesError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

#: the transports whose every rank needs every tensor
TO_ALL_MODES = ("ipc", "p2p")


class PublishNamesError(ValueError):
    """The names a publish delivered differ from the checkpoint's."""


def check_names(sent: list[str], expected: Iterable[str], what: str) -> None:
    """Raise :class:`PublishNamesError` unless ``sent`` is ``expected``, each name once."""
    want = set(expected)
    seen = set(sent)
    repeated = sorted({n for n in sent if sent.count(n) > 1}) if len(seen) < len(sent) else []
    missing, extra = sorted(want - seen), sorted(seen - want)
    if missing or extra or repeated:
        raise PublishNamesError(
            f"publish: the weights sent are not {what}'s names: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, not in it {extra[:8]}, repeated {repeated[:8]}"
        )


def _checked(
    source: Iterable[tuple[str, torch.Tensor]], expected: Iterable[str] | None, what: str
) -> Iterator[tuple[str, torch.Tensor]]:
    sent: list[str] = []
    for name, tensor in source:
        sent.append(name)
        yield name, tensor
    if expected is not None:
        check_names(sent, expected, what)


def model_weights(
    stage_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    device: torch.device,
    to_all: bool,
    expected: Iterable[str] | None = None,
    what: str = "the HF checkpoint",
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's ``(hf_name, tensor)`` on the ranks the transport needs (module
    docstring); a collective on every trainer rank. ``stage_weights()``: this stage's source."""
    pp_size = ps.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return _checked(stage_weights(), expected, what)
    if to_all:
        return _checked(_broadcast_stages(stage_weights, device), expected, what)
    whole = dist.get_rank() == 0
    source = _stages_to_first(stage_weights, device)
    return _checked(source, expected, what) if whole else source


def _broadcast_stages(stage_weights, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's tensors on every rank: stage ``s`` broadcasts over each pipeline group."""
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    me = ps.get_pipeline_model_parallel_rank()
    for stage, src in enumerate(ranks):
        if stage == me:
            for name, tensor in stage_weights():
                tensor = tensor.contiguous()
                dist.broadcast_object_list([(name, tensor.shape, tensor.dtype)], src, group)
                dist.broadcast(tensor, src, group)
                yield name, tensor
            dist.broadcast_object_list([None], src, group)
            continue
        while True:
            box = [None]
            dist.broadcast_object_list(box, src, group)
            if box[0] is None:
                break
            name, shape, dtype = box[0]
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src, group)
            yield name, tensor


def _stages_to_first(stage_weights, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Global rank 0: its stage's tensors, then each later stage's from its pipeline peer.
    The peers of rank 0 send theirs; every rank yields its own stage's."""
    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    me = dist.get_rank()
    yield from _sent_to(stage_weights(), 0 if 0 in ranks and me != 0 else None)
    if me != 0:
        return
    for src in ranks[1:]:
        while True:
            box = [None]
            dist.recv_object_list(box, src)
            if box[0] is None:
                break
            name, shape, dtype = box[0]
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, src)
            yield name, tensor


def _sent_to(
    source: Iterable[tuple[str, torch.Tensor]], dst: int | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``source``, each tensor also sent to global rank ``dst`` (None: not sent)."""
    for name, tensor in source:
        if dst is not None:
            tensor = tensor.contiguous()
            dist.send_object_list([(name, tensor.shape, tensor.dtype)], dst)
            dist.send(tensor, dst)
        yield name, tensor
    if dst is not None:
        dist.send_object_list([None], dst)
