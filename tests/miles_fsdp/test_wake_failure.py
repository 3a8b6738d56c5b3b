"""A wake whose device allocation fails raises WakeFailed (phase, role, stage, bytes) and leaves
the backend asleep and restorable: a retry wakes it with the weights and optimizer state it had
before the sleep, bit for bit. The failure is the allocator's own error (torch.OutOfMemoryError)
raised from miles-offload's test hook just before the k-th allocation of the real wake."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from miles_fsdp.backend import FSDPBackend
from miles_fsdp.optimizer_step import optimizer_step
from miles_offload import allocation
from miles_offload.allocation import WakeFailed
from rank_programs import full_params, nll_contribution
from run_args import make_args
from tiny_models import save_tiny_model
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.slow


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    return [
        _local(v).detach().clone()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


def _nbytes(backend, key: str) -> int:
    """The bytes of the tensor a moved-tensor key names, from its shape and dtype."""
    if key.startswith("optimizer0.state["):
        index, name = int(key.split("[")[1].split("]")[0]), key.rsplit(".", 1)[1]
        params = [p for g in backend.optimizer.param_groups for p in g["params"]]
        t = backend.optimizer.state[params[index]][name]
    else:
        t = dict(backend.model.named_parameters())[key.removeprefix("actor.")]
    t = _local(t)
    return t.numel() * t.element_size()


class _FailAt:
    """Raises the allocator's error just before allocation number ``at`` (0-based) of a wake."""

    def __init__(self, at: int):
        self.at, self.asked = at, []

    def __call__(self, nbytes: int) -> None:
        self.asked.append(nbytes)
        if len(self.asked) - 1 == self.at:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_a_failed_wake_names_the_phase_and_bytes_and_a_retry_restores(
    one_rank_group, tmp_path, monkeypatch, target
):
    hf_dir = str(save_tiny_model(tmp_path / "m"))
    flags = {"offload_train_target": target}
    if target == "disk":
        flags |= {"offload_train": True, "offload_train_disk_dir": str(tmp_path / "off")}
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, **flags))
    data = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(5))
    optimizer_step(  # the optimizer has state to move
        backend.model, backend.optimizer, backend.scheduler, list(data.chunk(2)),
        nll_contribution(data.numel() - data.shape[0]), dp_size=1, clip_grad=1.0,
    )  # fmt: skip
    params_before = full_params(backend.model)
    state_before = _optimizer_state(backend.optimizer)
    n_params = len(list(backend.model.parameters()))
    n_buffers = len([b for b in backend.model.buffers() if b is not None])
    assert state_before and n_params > 2
    # the allocation that fails (the wake allocates the actor's parameters and buffers, then
    # the optimizer state) and its stage
    for at, stage in ((1, "parameters"), (n_params + n_buffers + 1, "optimizer state")):
        backend.sleep()
        hook = _FailAt(at)
        made: list[weakref.ref] = []  # every tensor the failed wake allocated
        real_empty = torch.empty

        def recording_empty(*args, _made=made, _real=real_empty, **kwargs):
            t = _real(*args, **kwargs)
            _made.append(weakref.ref(t))
            return t

        monkeypatch.setattr(allocation, "fault_hook", hook)
        monkeypatch.setattr(torch, "empty", recording_empty)
        with pytest.raises(WakeFailed) as failure:
            backend.wake_up()
        monkeypatch.setattr(torch, "empty", real_empty)
        monkeypatch.setattr(allocation, "fault_hook", None)
        gc.collect()  # released, even while the error (and its traceback's frames) is held
        assert all(ref() is None for ref in made)
        assert len(made) > at if target == "cpu" else not made  # (disk re-grows storages)
        assert len(hook.asked) == at + 1  # the real wake ran up to the failing allocation
        asked = hook.asked[at]
        message = str(failure.value)
        assert asked == _nbytes(backend, failure.value.key)  # the failing tensor's own size
        assert message.startswith(f"wake of actor failed allocating its {stage} (")
        assert f"{asked} bytes" in message and "OutOfMemoryError" in message
        assert failure.value.nbytes == asked and failure.value.stage == stage
        assert backend.asleep  # restorable
        for p in backend.model.parameters():
            local = _local(p)
            if target == "disk":  # every storage freed again; the file holds the values
                assert local.untyped_storage().nbytes() == 0
            else:  # every parameter still points at the host copy
                assert backend.mover._groups[0].store.owns(local)
        backend.wake_up()  # the retry, without the fault
        assert not backend.asleep
        params = full_params(backend.model)
        for name, value in params_before.items():
            assert torch.equal(value, params[name]), name
        state = _optimizer_state(backend.optimizer)
        assert len(state) == len(state_before)
        for a, b in zip(state_before, state):
            assert torch.equal(a, b)
    backend.close()
