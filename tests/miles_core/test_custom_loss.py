"""miles_core.custom_loss, the one place both backends load and call
``--custom-loss-function-path``: the second parameter's name picks logits or scores, and what a
hook returns is checked (a pair; a 0-d floating contribution with a gradient; scalar parts),
each wrong shape one error naming the flag. The numbers a hook gives through each backend are
tested against float64 in tests/miles_megatron/test_megatron_loss_type.py and
tests/miles_fsdp/test_hooks.py."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch
from miles_core.args import ArgumentError
from miles_core.custom_loss import LossHook, LossHookContext, TokenScores

HOOKS = """
import torch

def on_logits(ctx, logits, packed, config, denominator):
    return (logits.sum() / denominator, {"n": 1.0, "t": torch.tensor([2.0])})

def on_scores(ctx, scores, packed, config, denominator):
    return scores.log_probs.sum() / denominator, {}

def misnamed(ctx, values, packed, config, denominator):
    raise AssertionError("refused when loaded")

def returns(ctx, scores, packed, config, denominator):
    return ctx.args.result(scores.log_probs)
"""


@pytest.fixture
def hooks_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "loss_hooks_under_test.py").write_text(textwrap.dedent(HOOKS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "loss_hooks_under_test"


def test_the_second_parameter_picks_logits_or_scores(hooks_module):
    assert LossHook.from_args(SimpleNamespace(custom_loss_function_path=None)) is None
    logits = LossHook.from_args(
        SimpleNamespace(custom_loss_function_path=f"{hooks_module}:on_logits")
    )
    scores = LossHook.from_args(
        SimpleNamespace(custom_loss_function_path=f"{hooks_module}:on_scores")
    )
    assert logits.wants_logits and not scores.wants_logits
    spec = f"{hooks_module}:misnamed"
    with pytest.raises(ArgumentError) as info:
        LossHook.from_args(SimpleNamespace(custom_loss_function_path=spec))
    assert str(info.value) == (
        f"--custom-loss-function-path {spec}: the second parameter must be named logits or "
        "scores (got values)"
    )

    ctx = LossHookContext(args=None, device=torch.device("cpu"))
    x = torch.ones(1, 3, 5, requires_grad=True)
    contribution, parts = logits(ctx, x, None, None, 5.0)
    assert contribution.item() == 3.0 and contribution.requires_grad
    assert {k: (v.shape, v.item()) for k, v in parts.items()} == {
        "loss": (torch.Size([]), 3.0),  # the contribution, added
        "n": (torch.Size([]), 1.0),
        "t": (torch.Size([]), 2.0),
    }


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (lambda lp: lp.sum(), "returned a torch.float32 tensor of shape (), expected a pair"),
        (lambda lp: (lp, {}), "the contribution is a torch.float32 tensor of shape (1, 4)"),
        (lambda lp: (lp.sum().long(), {}), "the contribution is a torch.int64 tensor"),
        (lambda lp: (lp.sum().detach(), {}), "the contribution carries no gradient"),
        (lambda lp: (lp.sum(), [1.0]), "parts is a list, expected a dict"),
        (lambda lp: (lp.sum(), {"x": lp}), "part 'x' is a torch.float32 tensor of shape (1, 4)"),
        (lambda lp: (lp.sum(), {"x": "1"}), "part 'x' is a str"),
        (lambda lp: (lp.sum(), {"loss": 1.0}), "a part named 'loss' would hide the contribution"),
    ],
)
def test_what_a_hook_returns_is_checked(hooks_module, result, message):
    spec = f"{hooks_module}:returns"
    hook = LossHook.from_args(SimpleNamespace(custom_loss_function_path=spec))
    ctx = LossHookContext(args=SimpleNamespace(result=result), device=torch.device("cpu"))
    log_probs = torch.zeros(1, 4, requires_grad=True)
    with pytest.raises((TypeError, ValueError)) as info:
        hook(ctx, TokenScores(log_probs, torch.zeros(1, 4)), None, None, 4.0)
    assert str(info.value).startswith(f"--custom-loss-function-path {spec}: ")
    assert message in str(info.value)
