"""A sleep whose host allocation fails raises SleepFailed (phase, role, stage, bytes) and leaves
the state awake and intact; the sleep succeeds once memory is there, and the wake after it
gives back every value bit for bit.

The failure is the kernel's own: the process's address space is capped (``RLIMIT_AS``) a few
MiB above what it maps, so the pinned arena's ``mmap`` fails with ENOMEM (a subprocess, so the
cap never touches the test runner). The cap is placed for the arena of one group (the model's
parameters, or the optimizer state once the parameters' arena fits) from the tensors' sizes.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

#: Fails the sleep at the parameters' arena, then at the optimizer state's (the parameters'
#: fitting), then sleeps and wakes with the memory back. Prints one JSON line.
SCRIPT = textwrap.dedent(
    """
    import json, resource, torch
    from miles_offload.allocation import SleepFailed
    from miles_offload.device_mover import DeviceMover

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 4096)  # 16 MiB of weight, 16 KiB of bias
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

    def values():
        out = [p.detach().clone() for p in model.parameters()]
        return out + [v.clone() for p in model.parameters() for v in opt.state[p].values()]

    def mapped():
        with open("/proc/self/status") as f:
            line = next(l for l in f if l.startswith("VmSize:"))
        return int(line.split()[1]) * 1024

    before = values()
    ids = [id(p) for p in model.parameters()]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    mover = DeviceMover({"actor": model}, [opt], role="actor")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    failures = []
    for room in (0, params):  # room for no arena, then for the parameters' one; 8 MiB slack
        resource.setrlimit(resource.RLIMIT_AS, (mapped() + room + (8 << 20), hard))
        try:
            mover.sleep()
            failure = {"raised": None}
        except SleepFailed as error:
            cause = error.__cause__
            failure = {
                "raised": type(error).__name__, "message": str(error), "stage": error.stage,
                "role": error.role, "nbytes": error.nbytes,
                "errno": cause.errno if isinstance(cause, OSError) else None,
            }
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # before any other allocation
        failure["asleep"] = mover.is_asleep
        failure["intact"] = all(torch.equal(a, b) for a, b in zip(before, values()))
        failure["same_objects"] = [id(p) for p in model.parameters()] == ids
        failures.append(failure)
    mover.sleep()  # with the memory back
    out = {"failures": failures, "asleep": mover.is_asleep}
    out["moved"] = all(mover._groups[0].store.owns(p) for p in model.parameters())
    mover.wake_up()
    out["round_trip"] = all(torch.equal(a, b) for a, b in zip(before, values()))
    print(json.dumps(out))
    """
)

#: The arenas asked for: the parameters (weight 4096 x 1024 and bias 4096, fp32), and AdamW's
#: state (exp_avg and exp_avg_sq of each, plus two 0-dim fp32 ``step`` counters, each in a
#: 512-byte slot of its own: the store's alignment; the other sizes are multiples of 512).
PARAMS = (4096 * 1024 + 4096) * 4
STATE = 2 * PARAMS + 2 * 512


def test_a_failed_sleep_names_the_phase_and_bytes_and_leaves_the_state_intact():
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    stages = [("parameters and buffers", PARAMS), ("optimizer state", STATE)]
    for failure, (stage, asked) in zip(out["failures"], stages, strict=True):
        assert failure["raised"] == "SleepFailed", failure
        assert failure["nbytes"] == asked and failure["stage"] == stage, failure
        assert failure["role"] == "actor"
        message = failure["message"]
        assert message.startswith(f"sleep of actor failed allocating its {stage} (")
        assert f"({asked} bytes) asked" in message
        assert "the state stays awake and intact" in message and "OSError" in message
        assert failure["errno"] == errno.ENOMEM  # the kernel's refusal of the arena's mmap
        # awake and intact: the same parameter objects, every value as before
        assert not failure["asleep"] and failure["intact"] and failure["same_objects"]
    # restorable: the sleep made once memory is back moves it, and the wake brings it back
    assert out["asleep"] and out["moved"] and out["round_trip"]
