"""--gradient-checkpointing and sleep/wake change when and where, never what. (--fsdp-cpu-offload
changes nothing on a CPU node: its placement is tested in test_build.py.)"""

from __future__ import annotations

import pytest
import torch
from miles_fsdp.backend import FSDPBackend
from miles_fsdp.optimizer_step import optimizer_step
from rank_programs import full_params, nll_contribution
from run_args import make_args
from tiny_models import save_tiny_model

pytestmark = pytest.mark.slow


def _two_steps(hf_dir, data, sleep_between=False, calls=None, **flags):
    """Two optimizer steps; ``calls`` (when given) counts each decoder layer's MLP forwards."""
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, **flags))
    model = backend.model
    if calls is not None:
        for index, layer in enumerate(model.model.layers):  # the MLP runs again in a recompute
            layer.mlp.register_forward_pre_hook(
                lambda *_, i=index: calls.__setitem__(i, calls.get(i, 0) + 1)
            )
    on = (
        model.is_activation_checkpointing
        if hasattr(type(model), "is_activation_checkpointing")
        else model.is_gradient_checkpointing
    )
    assert on == flags.get("gradient_checkpointing", False)
    losses = []
    for _ in range(2):
        if sleep_between:
            for _cycle in range(2):
                backend.sleep()
                backend.sleep()  # idempotent
                assert backend.asleep
                backend.wake_up()
                backend.wake_up()
                assert not backend.asleep
        step = optimizer_step(
            backend.model,
            backend.optimizer,
            backend.scheduler,
            list(data.chunk(2)),
            nll_contribution(data.numel() - data.shape[0]),
            dp_size=1,
            clip_grad=1.0,
        )
        losses.append(step.loss)
    params = full_params(backend.model)
    backend.close()
    return losses, params


def test_gradient_checkpointing_trains_identically(one_rank_group, tmp_path):
    hf_dir = str(save_tiny_model(tmp_path / "m"))
    data = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(5))
    base_losses, base = _two_steps(hf_dir, data)
    calls: dict[int, int] = {}
    losses, params = _two_steps(hf_dir, data, gradient_checkpointing=True)
    assert losses == base_losses
    for name, value in base.items():
        assert torch.equal(value, params[name]), name
    # --gradient-checkpointing-layers 1 of the 2 layers: layer 0 runs its forward again in
    # backward, layer 1 does not; the training is the same either way
    losses, params = _two_steps(
        hf_dir, data, gradient_checkpointing=True, gradient_checkpointing_layers=1, calls=calls
    )
    assert losses == base_losses
    for name, value in base.items():
        assert torch.equal(value, params[name]), name
    assert calls == {0: 2 * 2 * 2, 1: 2 * 2}, calls  # 2 steps x 2 micro-batches (x 2: recompute)


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_sleep_wake_cycles_do_not_change_training(one_rank_group, tmp_path, target):
    hf_dir = str(save_tiny_model(tmp_path / "m"))
    data = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(5))
    base_losses, base = _two_steps(hf_dir, data)
    flags = {"offload_train_target": target}
    if target == "disk":
        flags |= {"offload_train": True, "offload_train_disk_dir": str(tmp_path / "off")}
    losses, params = _two_steps(hf_dir, data, sleep_between=True, **flags)
    assert losses == base_losses
    for name, value in base.items():
        assert torch.equal(value, params[name]), name
