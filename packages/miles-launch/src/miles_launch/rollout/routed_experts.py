"""The engine's routed experts of each sample, for routing replay (R3).

With ``--use-rollout-routing-replay`` (a trainer flag both backends honour) the
launcher starts every engine with ``--enable-return-routed-experts``, every ``/generate``
request sets ``return_routed_experts: true`` (``routed_experts_start_len`` 0: the whole
sequence), and the reply's ``meta_info.routed_experts`` becomes ``Sample.routed_experts``.

Layout. The engine sends base64 of a C-ordered int32 array ``[rows, num_hidden_layers,
num_experts_per_tok]`` (the text config's, as SGLang sizes its capture buffer): row ``t`` holds
the experts each layer's router chose for token ``t`` of prompt + response, for every token the
engine fed to the model, i.e. ``t = 0 .. L - 2`` of the ``L = prompt + response`` tokens (the
final token is sampled, never fed). ``Sample`` keeps those ``L - 1`` rows as they are;
packing (``miles_core.packing.pack_thd``) puts row ``t`` at the sample's token ``t`` and fills
the final token's row with zeros, whose output predicts nothing. Dense layers' rows (``-1``
from the built-in engine) are ignored by the trainer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from miles_core.args import ArgumentError
from miles_core.args.parsed import ParsedArgs
from miles_core.engine import decode_routed_experts
from transformers import AutoConfig

FLAG = "--use-rollout-routing-replay"


class RoutedExpertsError(RuntimeError):
    """An engine reply without usable routed experts while routing replay is on."""


@dataclass(frozen=True)
class RoutedExpertsLayout:
    """The per-token shape of the routed experts: ``[num_layers, top_k]``."""

    num_layers: int  # the text config's num_hidden_layers (dense layers included)
    top_k: int  # num_experts_per_tok


def routing_replay_on(args: ParsedArgs) -> bool:
    """Whether ``--use-rollout-routing-replay`` is set."""
    return bool(args.use_rollout_routing_replay)


@functools.lru_cache(maxsize=8)
def read_layout(hf_checkpoint: str) -> RoutedExpertsLayout:
    """The routed-experts layout of the model at ``hf_checkpoint`` (its ``config.json``).

    Raises :class:`~miles_core.args.ArgumentError` naming the flag when the model is not a
    mixture of experts (no ``num_experts_per_tok``) or its config cannot be read.
    """
    try:
        config = AutoConfig.from_pretrained(hf_checkpoint)
    except (OSError, ValueError, KeyError) as error:
        raise ArgumentError(
            f"{FLAG}: cannot read the model config of --hf-checkpoint {hf_checkpoint}: {error}"
        ) from error
    text = config.get_text_config()
    top_k = getattr(text, "num_experts_per_tok", None)
    num_layers = getattr(text, "num_hidden_layers", None)
    if not top_k or not num_layers:
        raise ArgumentError(
            f"{FLAG} needs a mixture-of-experts model: --hf-checkpoint {hf_checkpoint} is "
            f"model_type {config.model_type!r} without num_experts_per_tok (routing replay "
            "replays the engine's expert choice; a dense model has none)"
        )
    return RoutedExpertsLayout(num_layers=int(num_layers), top_k=int(top_k))


def routed_experts_layout(args: ParsedArgs) -> RoutedExpertsLayout | None:
    """The layout to request and decode with, or None without routing replay."""
    if not routing_replay_on(args):
        return None
    return read_layout(str(args.hf_checkpoint))


def decode_sample_routed_experts(
    meta: dict[str, Any], layout: RoutedExpertsLayout, total_length: int, engine: str
) -> torch.Tensor:
    """int32 ``[total_length - 1, num_layers, top_k]`` from a ``/generate`` reply's
    ``meta_info`` of a sequence of ``total_length`` tokens (prompt + response, as the
    trainer gets them); ``total_length`` rows are accepted too.

    Raises :class:`RoutedExpertsError` naming the flag and ``engine`` (its URL) when the reply
    carries none (an engine started without ``--enable-return-routed-experts``, e.g. a worker
    of an external router, or an SGLang without ``return_routed_experts``), when its size does
    not fit ``layout``, or when its rows do not cover the sequence.
    """
    data = meta.get("routed_experts")
    if not isinstance(data, str):
        raise RoutedExpertsError(
            f"{FLAG}: the /generate reply of {engine} has no meta_info.routed_experts; every "
            "engine serving the rollout must run with --enable-return-routed-experts (SGLang "
            "with return_routed_experts, or the built-in engine; miles sets the flag on the "
            "engines it starts)"
        )
    try:
        routed = decode_routed_experts(data, layout.num_layers, layout.top_k)
    except ValueError as error:
        raise RoutedExpertsError(
            f"{FLAG}: routed experts from {engine} do not fit [tokens, num_hidden_layers "
            f"{layout.num_layers}, num_experts_per_tok {layout.top_k}] of --hf-checkpoint: "
            f"{error}"
        ) from error
    if routed.shape[0] not in (total_length - 1, total_length):
        raise RoutedExpertsError(
            f"{FLAG}: {engine} returned routed experts for {routed.shape[0]} tokens of a "
            f"{total_length}-token sequence (expected {total_length - 1}: every token but the "
            "last)"
        )
    return torch.from_numpy(routed)
