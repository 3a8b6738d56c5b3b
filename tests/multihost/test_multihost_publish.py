"""A publish across hosts, without Ray: a built-in engine on host b, the trainer's publisher on
host a, a third host c. ``broadcast`` in the default suite; ``p2p`` and ``disk-delta`` (with the
launcher's puller command on host b) are ``extended``.

The publisher is given no master address: the weight-update group's store must be advertised
at host a's address (before, it defaulted to 127.0.0.1, and the engine on host b looked for
the store on its own loopback). After the publish the engine's weights equal the trainer's bit
for bit, the engine's log names the master it joined, and a request from host c without the
key is refused.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "multihost-test-key-0123456789"
PORT = 30000

#: Runs on host a: perturb the checkpoint's weights, publish them (the mode and its settings
#: in the last argument; master address left unset), print the version and whether every
#: engine tensor equals the trainer's.
TRAINER = """
import json, sys, torch, xxhash, httpx
from transformers import AutoModelForCausalLM
from miles_sync.weight_sync import SyncConfig, WeightPublisher
hf, url, key, extra = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
with torch.no_grad():
    for i, p in enumerate(model.parameters()):
        p.add_(0.01 * (i + 1))
state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
settings = dict(buffer_size=4096, engine_api_key=key, group_timeout_s=60, hf_checkpoint=hf)
config = SyncConfig(**{**settings, **json.loads(extra)})
publisher = WeightPublisher(config)
version = publisher.update_weights(iter(state.items()), [url])
publisher.close()
engine = httpx.get(url + "/weights_digest", headers={"Authorization": "Bearer " + key}).json()
def digest(t):
    return xxhash.xxh3_128_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy())
equal = all(
    digest(state[name].to(getattr(torch, dtype.split(".")[1]))) == h
    for name, (h, dtype, _) in engine.items() if name in state
)
print(json.dumps({"version": version, "equal": equal, "tensors": len(engine)}))
"""

PROBE = """
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(sys.argv[1] + "/get_model_info", timeout=10)
    print(200)
except urllib.error.HTTPError as e:
    print(e.code)
"""


# broadcast only: the Ray jobs (test_multihost_jobs.py) run p2p and disk-delta across hosts, each
# publish read back from every engine bit for bit
@pytest.mark.parametrize("mode", ["broadcast"])
def test_publish_reaches_an_engine_on_another_host(hosts, material, tmp_path, mode):
    """``disk-delta``: the puller runs on host b as the launcher starts it
    (``puller_command``), the delta directory is shared, the engine loads the puller's copy."""
    from types import SimpleNamespace

    from miles_launch.engine_launch.engine_set import puller_command

    host_a, host_b, host_c = hosts.hosts
    hf, _ = material
    url = f"http://{host_b.address}:{PORT}"
    log = tmp_path / "engine.log"
    engine_cmd = [
        sys.executable, str(ROOT / "tests" / "miles_sync" / "digest_engine.py"),
        "--model-path", str(hf), "--host", host_b.address, "--port", str(PORT),
        "--device", "cpu",
    ]  # fmt: skip
    env = {"MILES_ENGINE_API_KEY": KEY}
    extra: dict = {"mode": mode}
    helpers = []
    with open(log, "wb") as sink:
        engine = hosts.popen(host_b, engine_cmd, stdout=sink, stderr=sink, env_extra=env)
    if mode == "disk-delta":
        shared = tmp_path / "shared"
        extra.update(disk_dir=str(shared), puller_timeout_s=600)
        flags = SimpleNamespace(
            update_weight_disk_dir=str(shared),
            update_weight_local_checkpoint_dir=str(tmp_path / "local-b"),
        )
        with open(tmp_path / "puller.log", "wb") as sink:
            helpers.append(
                hosts.popen(host_b, puller_command(flags, 0, url), stdout=sink, stderr=sink)
            )
    try:
        deadline = time.monotonic() + 600
        status = ""
        while status != "401" and time.monotonic() < deadline:
            assert engine.poll() is None, log.read_text()[-3000:]
            time.sleep(2)
            status = hosts.run(host_c, [sys.executable, "-c", PROBE, url], timeout=60).stdout
            status = status.strip()
        assert status == "401", f"keyless request from host c: {status!r}"
        result = hosts.run(
            host_a,
            [sys.executable, "-c", TRAINER, str(hf), url, KEY, json.dumps(extra)],
            timeout=900,
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr[-4000:] + log.read_text()[-2000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["version"] == 1 and report["tensors"] > 0
        assert report["equal"], report
        joined = [line for line in log.read_text().splitlines() if "joined weight-update" in line]
        if mode == "disk-delta":
            assert not joined  # no group: the engine loaded the puller's local copy
        else:
            assert joined and all(f"at master {host_a.address}:" in line for line in joined)
    finally:
        for process in [engine, *helpers]:
            process.kill()
            process.wait(30)
