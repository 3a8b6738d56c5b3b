"""A Ray cluster of "hosts" made of Linux network namespaces on this machine.

Each host is a network namespace of its own (``ip netns``) with loopback up and one interface,
``mh0``, holding a private address ``10.123.0.<i>/24``; the interfaces are veth pairs whose other
ends sit on a bridge inside one more namespace (the "switch"). Nothing is added to the
namespace the tests run in: every link, address and route lives inside namespaces made here,
and the only route in a host is its own link (the default route points at it, so that
programs that look up "the address towards the outside" find the host's address; such packets
end at the switch).

Host 0 runs the Ray head, the others ``ray start --address <head> --node-ip-address <theirs>``,
each with its own CPU slots (standing in for GPUs). Processes run in a host with
:meth:`NamespaceCluster.run` / :meth:`NamespaceCluster.popen` (``ip netns exec``).
``GLOO_SOCKET_IFNAME=mh0`` is set for every process of a host: gloo would otherwise resolve
the machine's host name to an address the namespace does not have and fall back to loopback.
Ray runs with token authentication (``RAY_AUTH_MODE=token``) and a token of the cluster's own.
:meth:`NamespaceCluster.cut` takes a host off the network (its switch port down) and
:meth:`NamespaceCluster.restore` puts it back.

:meth:`NamespaceCluster.close` kills every process inside the namespaces (``ip netns pids``:
they are all ours) and deletes the namespaces, which removes their links; it runs also when
start-up fails half-way.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.123.0"
IFNAME = "mh0"
RAY_PORT = 6379


class CannotMakeNamespaces(RuntimeError):
    """This machine cannot make network namespaces (the message says why, in one line)."""


def _ip(*argv: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *argv]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip()}")
    return result


def probe() -> None:
    """Raise :class:`CannotMakeNamespaces` unless a namespace can be made here."""
    if shutil.which("ip") is None:
        raise CannotMakeNamespaces("iproute2's `ip` is not installed")
    if os.geteuid() != 0:
        raise CannotMakeNamespaces("network namespaces need root")
    name = f"mhprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        raise CannotMakeNamespaces(f"`ip netns add` failed: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Host:
    name: str  # the network namespace
    address: str
    cpus: int
    ray: subprocess.Popen | None = None


@dataclass
class NamespaceCluster:
    """``cpus_per_host[i]`` CPU slots on host ``i``; host 0 is the Ray head; ``env_extra``: set
    for every process of every host (Ray's nodes too, so their workers inherit it)."""

    cpus_per_host: list[int]
    python: str = sys.executable
    env_extra: dict[str, str] = field(default_factory=dict)
    hosts: list[Host] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = f"mh{os.getpid()}"
        self.switch = f"{tag}-sw"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
        self.ray_dir = self.workdir / "ray"
        self.hosts = [
            Host(f"{tag}-{chr(ord('a') + i)}", f"{SUBNET}.{i + 1}", cpus)
            for i, cpus in enumerate(self.cpus_per_host)
        ]
        self._made: list[str] = []
        self.token = secrets.token_hex(32)

    # ------------------------------------------------------------------ network
    def _make_network(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for i, host in enumerate(self.hosts):
            _ip("netns", "add", host.name)
            self._made.append(host.name)
            port = f"p{i}"
            _ip(
                "link", "add", IFNAME, "netns", host.name, "type", "veth",
                "peer", "name", port, "netns", self.switch,
            )  # fmt: skip
            _ip("link", "set", port, "master", "br0", netns=self.switch)
            _ip("link", "set", port, "up", netns=self.switch)
            _ip("link", "set", "lo", "up", netns=host.name)
            _ip("addr", "add", f"{host.address}/24", "dev", IFNAME, netns=host.name)
            _ip("link", "set", IFNAME, "up", netns=host.name)
            _ip("route", "add", "default", "dev", IFNAME, netns=host.name)

    def _port(self, host: Host) -> str:
        """The switch's end of ``host``'s link."""
        return f"p{self.hosts.index(host)}"

    def cut_command(self, host: Host) -> list[str]:
        """The command that cuts ``host`` off the network (it runs in any of our namespaces):
        its port on the switch goes down, and every packet to or from it is dropped (its
        processes run on, unaware; connections stay open)."""
        return ["ip", "-n", self.switch, "link", "set", self._port(host), "down"]

    def cut(self, host: Host) -> None:
        """Run :meth:`cut_command` here."""
        _ip("link", "set", self._port(host), "down", netns=self.switch)

    def restore(self, host: Host) -> None:
        """Put ``host``'s port back up (the bridge forwards again at once: no STP)."""
        _ip("link", "set", self._port(host), "up", netns=self.switch)

    def env(self, host: Host) -> dict[str, str]:
        """The environment of every process started on ``host``."""
        return {
            **os.environ,
            "GLOO_SOCKET_IFNAME": IFNAME,
            "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray's token authentication, with a token of this cluster's own.
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "PYTHONUNBUFFERED": "1",
            **self.env_extra,
        }

    def _exec(self, host: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.name, *argv]

    def run(self, host: Host, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            self._exec(host, argv),
            env=self.env(host),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    def popen(
        self, host: Host, argv: list[str], env_extra: dict[str, str] | None = None, **kw
    ) -> subprocess.Popen:
        return subprocess.Popen(
            self._exec(host, argv),
            env={**self.env(host), **(env_extra or {})},
            start_new_session=True,
            **kw,
        )

    # ------------------------------------------------------------------ Ray
    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    def _ray_start(self, host: Host, *extra: str) -> None:
        ray = str(Path(self.python).with_name("ray"))
        log = open(self.workdir / f"ray-{host.name}.log", "wb")  # noqa: SIM115 (the child keeps it)
        host.ray = self.popen(
            host,
            [
                ray,
                "start",
                "--block",
                "--disable-usage-stats",
                "--node-ip-address",
                host.address,
                "--num-cpus",
                str(host.cpus),
                "--num-gpus",
                "0",
                "--object-store-memory",
                str(80 * 1024**2),
                *extra,
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def _wait_for_nodes(self, timeout_s: float) -> None:
        """Until Ray lists every host's node alive (a bounded loop)."""
        check = (
            f"import ray, json; ray.init(address='{self.ray_address}', logging_level='ERROR'); "
            "print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() "
            "if n['Alive'])))"
        )
        want = sorted(h.address for h in self.hosts)
        deadline = time.monotonic() + timeout_s
        seen = ""
        while time.monotonic() < deadline:
            for host in self.hosts:
                if host.ray is not None and host.ray.poll() is not None:
                    raise RuntimeError(f"ray on {host.name} exited: {self.ray_log(host)}")
            result = self.run(
                self.head,
                [self.python, "-c", check],
                timeout=120,
                cwd=self.workdir,
            )
            seen = (result.stdout.strip().splitlines() or [""])[-1]
            if result.returncode == 0 and seen == str(want).replace("'", '"'):
                return
            time.sleep(2)
        raise RuntimeError(f"Ray nodes {want} not all alive after {timeout_s:.0f}s (saw {seen})")

    def _start_node(self, host: Host, extra: list[str], timeout_s: float, attempts: int = 3):
        """``ray start`` on ``host`` until it says it started. Ray gives a node 30 s to register
        with the head; on a loaded machine that can pass, so a node that exits is started
        again (``attempts`` times, each bounded by ``timeout_s``)."""
        for attempt in range(1, attempts + 1):
            self._ray_start(host, *extra)
            deadline = time.monotonic() + timeout_s
            while "Ray runtime started" not in self.ray_log(host, 1_000_000):
                if host.ray.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            else:
                return
            failure = self.ray_log(host)
            self._kill_all(host.name)
            if attempt == attempts:
                raise RuntimeError(f"ray on {host.name} did not start: {failure}")

    def ray_log(self, host: Host, chars: int = 2000) -> str:
        path = self.workdir / f"ray-{host.name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    # ------------------------------------------------------------------ lifecycle
    def make_network(self) -> NamespaceCluster:
        """The hosts and their links (no Ray yet)."""
        try:
            self._make_network()
        except BaseException:
            self.close()
            raise
        return self

    def start_ray(self, timeout_s: float = 240.0) -> NamespaceCluster:
        """The Ray head on host 0 and a worker on every other host."""
        try:
            self._start_node(
                self.head,
                ["--head", "--port", str(RAY_PORT), "--include-dashboard=false",
                 "--temp-dir", str(self.ray_dir)],
                timeout_s,
            )  # fmt: skip
            for host in self.hosts[1:]:
                self._start_node(host, ["--address", self.ray_address], timeout_s)
            self._wait_for_nodes(timeout_s)
        except BaseException:
            self._kill_all(*(h.name for h in self.hosts))
            for host in self.hosts:
                host.ray = None
            raise
        return self

    def pids(self, host_or_name: Host | str) -> list[int]:
        name = host_or_name.name if isinstance(host_or_name, Host) else host_or_name
        out = _ip("netns", "pids", name, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def _kill_all(self, *names: str) -> None:
        """SIGTERM, then SIGKILL, every process inside the namespaces ``names`` (all ours)."""
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            for name in names:
                for pid in self.pids(name):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(self.pids(n) for n in names):
                time.sleep(0.5)

    def close(self) -> None:
        """Kill every process in our namespaces, then delete them (bounded waits)."""
        for host in self.hosts:
            if host.ray is not None and host.ray.poll() is None:
                try:
                    os.killpg(host.ray.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        self._kill_all(*self._made)
        for host in self.hosts:
            if host.ray is not None:
                try:
                    host.ray.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)
