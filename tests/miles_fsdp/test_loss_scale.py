"""fp16 loss scaling (--fp16, --loss-scale, --initial-loss-scale, --min-loss-scale,
--loss-scale-window, --hysteresis): the dynamic schedule against values worked out by hand,
gradients that underflow fp16 without scaling recovered with it (against float64), overflowing
steps skipped, and the schedule saved with a checkpoint."""

from __future__ import annotations

import pytest
import torch
from miles_core.args import ArgumentError
from miles_fsdp.loss_scale import LossScaler
from miles_fsdp.optimizer_step import optimizer_step
from run_args import parse
from torch import nn

pytestmark = pytest.mark.numeric


def test_dynamic_schedule_by_hand():
    scaler = LossScaler(scale=8.0, min_scale=1.0, window=3, hysteresis=2, hysteresis_left=2)
    overflow = [False, False, False, True, True, False, True, True, True]
    # 3 good steps double (16); the 1st overflow only uses up hysteresis, the 2nd halves (8);
    # a good step does not restore hysteresis (only growth does), so each later overflow halves,
    # down to --min-loss-scale.
    expected = [8, 8, 16, 16, 8, 8, 4, 2, 1]
    seen = []
    for found_inf in overflow:
        scaler.update(found_inf)
        seen.append(scaler.scale)
    assert seen == expected


def test_flags_build_the_scaler():
    assert LossScaler.from_args(parse()) is None  # bf16 default: no scaler
    dynamic = LossScaler.from_args(
        parse("--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "7")
    )
    assert (dynamic.scale, dynamic.dynamic, dynamic.window, dynamic.hysteresis) == (
        1024.0,
        True,
        7,
        2,
    )
    fixed = LossScaler.from_args(parse("--fp16", "--loss-scale", "128"))
    assert (fixed.scale, fixed.dynamic) == (128.0, False)
    fixed.update(found_inf=True)
    assert fixed.scale == 128.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--loss-scale", "0"], "--loss-scale must be > 0"),
        (["--initial-loss-scale", "-1"], "--initial-loss-scale must be > 0"),
        (["--loss-scale-window", "0"], "--loss-scale-window must be >= 1"),
        (["--hysteresis", "0"], "--hysteresis must be >= 1"),
    ],
)
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(ArgumentError, match=message):
        parse(*argv)


class HalfLinear(nn.Module):
    """fp32 master weight, fp16 compute (as FSDP's mixed precision casts it)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half() @ self.weight.half().t()


def sgd_step(model: nn.Module, x: torch.Tensor, scaler: LossScaler | None):
    """One optimizer_step with SGD(lr=1), no clipping: the update is minus the gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def loss_of(m, mb):
        loss = m(mb).float().sum()
        return loss, {"loss": loss}

    before = model.weight.detach().clone()
    result = optimizer_step(model, opt, sched, [x], loss_of, 1, 0.0, loss_scaler=scaler)
    return before - model.weight.detach(), result


def test_scaling_recovers_gradients_that_underflow_in_fp16():
    """dL/dW = g^T x with an upstream gradient g = 1e-4 and inputs x ~ 8e-5: even the sum
    of 3 products (< 2.7e-8) rounds to 0 in fp16, so the unscaled fp16 backward loses it; at
    scale 2^14 the products are normal fp16 numbers and the unscaled update matches float64."""
    torch.manual_seed(0)
    weight = torch.zeros(4, 8)  # the update (~2e-8) must not vanish against the weight itself
    x = 1e-4 * (0.65 + 0.25 * torch.rand(3, 8))  # normal fp16 numbers
    tiny = 1e-4

    def model():
        m = HalfLinear(weight)
        forward = m.forward
        m.forward = lambda inp: forward(inp) * tiny
        return m

    reference = torch.full((4, 3), tiny, dtype=torch.float64) @ x.half().double()

    update, _ = sgd_step(model(), x, None)
    assert torch.count_nonzero(update) == 0  # everything underflowed

    scaler = LossScaler(scale=2.0**14, window=1000, hysteresis=2, hysteresis_left=2)
    update, result = sgd_step(model(), x, scaler)
    torch.testing.assert_close(update.double(), reference, rtol=3e-3, atol=0.0)
    assert (scaler.scale, scaler.good_steps) == (2.0**14, 1)
    assert torch.isfinite(torch.tensor(result.grad_norm))


def test_overflowing_step_is_skipped_and_the_scale_backs_off():
    torch.manual_seed(0)
    weight = torch.randn(4, 8)
    x = torch.randn(3, 8)
    scaler = LossScaler(scale=2.0**40, hysteresis=1, hysteresis_left=1)
    model = HalfLinear(weight)
    update, result = sgd_step(model, x, scaler)
    assert not torch.isfinite(torch.tensor(result.grad_norm))
    assert torch.equal(update, torch.zeros_like(update))  # weights untouched
    assert scaler.scale == 2.0**39


def test_schedule_round_trips_through_the_checkpoint(tmp_path):
    saved = LossScaler(scale=512.0, window=10, hysteresis=3, good_steps=4, hysteresis_left=1)
    saved.save(tmp_path)
    loaded = LossScaler(scale=2.0**32, window=10, hysteresis=3, hysteresis_left=3)
    assert loaded.load(tmp_path)
    assert (loaded.scale, loaded.good_steps, loaded.hysteresis_left) == (512.0, 4, 1)
    fixed = LossScaler(scale=64.0, dynamic=False)
    assert not fixed.load(tmp_path) and fixed.scale == 64.0  # --loss-scale given now wins
    assert not LossScaler(scale=1.0).load(tmp_path / "missing")
