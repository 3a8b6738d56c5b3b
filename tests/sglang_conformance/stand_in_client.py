"""The test side of the engine stand-in (``stand_in.py``): start it, ask it, stop it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from miles_core.ports import free_port

HERE = Path(__file__).resolve().parent


class StandInEngine:
    """The stand-in as a subprocess on a free port (importing SGLang's modules takes seconds)."""

    def __init__(self, sglang_root: Path, router_root: Path | None, log: Path, timeout=120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.router_available = router_root is not None
        cmd = [sys.executable, str(HERE / "stand_in.py"), "--sglang-root", str(sglang_root)]
        cmd += ["--port", str(self.port)]
        if router_root is not None:
            cmd += ["--router-root", str(router_root)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(log, "a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=self.url, timeout=120.0)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stand-in exited: {log.read_text()[-3000:]}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"stand-in not healthy: {log.read_text()[-3000:]}")
            time.sleep(0.1)

    def digests(self) -> dict[str, list]:
        return self.http.get("/weights_digest").json()

    def version(self) -> str:
        return self.http.get("/get_model_info").json()["weight_version"]

    def reset(self) -> None:
        assert self.http.post("/reset_weights", json={}).status_code == 200

    def parse_server_args(self, argv: list[str]) -> dict:
        """SGLang's ``ServerArgs`` parser on ``argv`` (without ``python -m
        sglang.launch_server``): ``{"unknown": [...], "error": str | None}``."""
        return self.http.post("/parse_server_args", json={"argv": argv}).json()

    def parse_router_args(self, argv: list[str]) -> dict:
        return self.http.post("/parse_router_args", json={"argv": argv}).json()

    def log_tail(self) -> str:
        return self.log.read_text()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.http.close()
