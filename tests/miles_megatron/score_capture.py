"""Test support: the per-token log-probs and entropy a Megatron training step computes, against
a float64 reference's (forced_reference.forced_reference, estimator_reference.reference).

Within :func:`captured_scores`, every call of the training step's loss
(``miles_megatron.train_step.packed_score_loss``, which receives the step's ``[1, T / CP]``
log-probs and entropies of the packed micro-batch this rank scored; FSDP's
``miles_fsdp.train_step`` calls the same function on whole rows) is recorded, then handed to
the real loss unchanged: what is compared is what the step trained on. A call's values are cut
into the samples of its row (identified by their tokens), response-aligned, ``NaN`` where
another CP rank holds the position. :func:`check_scores` holds each rank's values at the
trained tokens (loss mask 1) to the reference's bounds and asserts the coverage: every trained
token of every sample a step trains was compared on some rank (every sample by some step),
every last-stage rank of a DP rank holding samples (every CP rank of it) compared trained
tokens, and (where the case's samples have them) some loss mask has a hole. Each call's
:data:`INPUTS` (the old policy's and the reference model's log-probs of its samples, where the
step reads them) are recorded with them: the float64 reference takes them as the step's inputs
(:func:`step_inputs`), :func:`check_inputs` holds them to float64.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

KEYS = ("log_probs", "entropy")
#: the per-token inputs of the loss a step reads where the run computed them before the step
#: (several steps a rollout: the old policy's log-probs; with a KL loss, the reference model's)
INPUTS = ("old_log_probs", "ref_log_probs")


class ScoreRecorder:
    """Collects the scores of the calls since the last :meth:`take` (one optimizer step)."""

    def __init__(self, data: list) -> None:
        self.index = {tuple(s.tokens.tolist()): i for i, s in enumerate(data)}
        self.current: dict[int, dict[str, list[float]]] = {}
        self.calls = 0

    def record(self, log_probs: torch.Tensor, entropy: torch.Tensor, packed: Any) -> None:
        full = getattr(packed, "full", packed)  # a PackedShard, or a whole row at CP = 1
        positions = getattr(packed, "positions", None)
        rows = {}
        for key, values in zip(KEYS, (log_probs, entropy), strict=True):
            row = torch.full((full.num_tokens,), math.nan, dtype=torch.float64)
            flat = values.detach().reshape(-1).double().cpu()
            if positions is None:
                row[:] = flat
            else:
                row[positions.cpu()] = flat
            rows[key] = row
        for key in INPUTS:
            if key in full.fields:
                rows[key] = full.fields[key].reshape(-1).double().cpu()
        ids = full.input_ids.reshape(-1).cpu()
        offset = 0
        for length, sl in zip(full.total_lengths, full.response_slices(), strict=True):
            sample = self.index[tuple(ids[offset : offset + length].tolist())]
            assert sample not in self.current, ("a sample scored twice in one step", sample)
            self.current[sample] = {k: v[sl].tolist() for k, v in rows.items()}
            offset += length
        self.calls += 1

    def take(self) -> dict[int, dict[str, list[float]]]:
        out, self.current = self.current, {}
        return out


@contextlib.contextmanager
def captured_scores(data: list, backend: str = "megatron") -> Iterator[ScoreRecorder]:
    """Within: the training step's loss of ``backend`` (``miles_megatron.train_step`` or
    ``miles_fsdp.train_step``, each calling ``packed_score_loss`` by that name) records its
    log-probs and entropies (``data``: the samples the run trains on, to name each scored
    sample)."""
    import importlib

    train_step = importlib.import_module(f"miles_{backend}.train_step")
    recorder = ScoreRecorder(data)
    loss = train_step.packed_score_loss

    def recording(loss_type, log_probs, entropy, packed, *args, **kwargs):
        recorder.record(log_probs, entropy, packed)
        return loss(loss_type, log_probs, entropy, packed, *args, **kwargs)

    train_step.packed_score_loss = recording
    try:
        yield recorder
    finally:
        train_step.packed_score_loss = loss


def last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return bool(ps.is_pipeline_last_stage(ignore_virtual=True))


def check_scores(results: list[dict], ref: dict, data: list, what: str, holes: bool) -> int:
    """Each rank's ``scores`` (per step, per sample) within the reference's bounds at the
    trained tokens, with the coverage the module docstring states (``holes``: some loss mask of
    ``data`` has one); returns the number of values compared. A step of ``ref["scores"]`` is a
    list (every sample of ``data``, in order) or a dict by sample index (the samples that step
    trains: no rank may score another there; every sample is some step's)."""
    has_hole = any(0 < s.mask.sum() < s.response_length for s in data)
    assert has_hole == holes, (what, "a loss mask with a hole", holes)
    steps = [w if isinstance(w, dict) else dict(enumerate(w)) for w in ref["scores"]]
    assert set().union(*steps) == set(range(len(data))), (what, "samples no step trains")
    compared = 0
    for k, want in enumerate(steps):
        seen = {
            sample: torch.zeros(data[sample].response_length, dtype=torch.bool) for sample in want
        }
        for rank, r in enumerate(results):
            assert len(r["scores"]) == len(steps), (what, rank, len(r["scores"]))
            mine = 0
            for sample, got in r["scores"][k].items():
                assert sample in want, (what, k, rank, sample, "scored at a step not training it")
                trained = data[sample].mask.bool()
                for key in KEYS:
                    value = torch.tensor(got[key], dtype=torch.float64)
                    held = ~value.isnan() & trained
                    diff = (value - want[sample][key]).abs()
                    bad = held & (diff > want[sample][f"{key}_tol"])
                    assert not bad.any(), (what, k, rank, sample, key, diff[bad].max().item())
                    seen[sample] |= held
                    mine += int(held.sum())
            compared += mine
            assert mine > 0 or not r["scores_tokens"], (what, k, rank, "a rank compared none")
        for sample in want:
            missed = data[sample].mask.bool() & ~seen[sample]
            assert not missed.any(), (what, k, sample, "trained tokens not compared")
    assert compared > 0, what
    return compared


def step_inputs(results: list[dict], steps: int) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Per step, by sample: the :data:`INPUTS` its loss read (float64 tensors of the fp32
    values, response-aligned), from the first rank of ``results`` that scored the sample; the
    ranks that scored it too read the same values."""
    out: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in range(steps)]
    for r in results:
        assert len(r["scores"]) == steps, len(r["scores"])
        for k, step in enumerate(r["scores"]):
            for sample, got in step.items():
                mine = {
                    key: torch.tensor(got[key], dtype=torch.float64) for key in INPUTS if key in got
                }
                held = out[k].setdefault(sample, mine)
                assert held.keys() == mine.keys(), (k, sample, sorted(held), sorted(mine))
                for key, value in mine.items():
                    assert torch.equal(value, held[key]), (k, sample, key, "ranks differ")
    return out


def run_log_probs(results: list[dict], k: int, sample: int) -> list[torch.Tensor]:
    """The log-probs of ``sample`` that step ``k``'s loss read on each rank that scored it
    (float64 tensors of the fp32 values, response-aligned)."""
    return [
        torch.tensor(r["scores"][k][sample]["log_probs"], dtype=torch.float64)
        for r in results
        if sample in r["scores"][k]
    ]


def check_inputs(results: list[dict], want: list[torch.Tensor], data: list, what: str) -> int:
    """Every rank's recorded :data:`INPUTS` (the old policy's and the reference model's
    log-probs of each step's samples) at the trained tokens within ``SCORE_ATOL`` of ``want``
    (per sample, the float64 log-probs of the weights they were computed from: the weights
    before the rollout); returns the number of values compared."""
    from tolerances import SCORE_ATOL

    compared = 0
    for rank, r in enumerate(results):
        for k, step in enumerate(r["scores"]):
            for sample, got in step.items():
                trained = data[sample].mask.bool()
                for key in INPUTS:
                    if key not in got:
                        continue
                    diff = (torch.tensor(got[key], dtype=torch.float64) - want[sample]).abs()
                    bad = trained & (diff > SCORE_ATOL)
                    assert not bad.any(), (what, k, rank, sample, key, diff[bad].max().item())
                    compared += int(trained.sum())
    return compared
