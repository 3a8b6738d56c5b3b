"""An engine (or router) process on its node, with its log and death detection.

:class:`ProcessHost` runs inside a small Ray actor placed on the engine's bundle: it picks a
free port there, starts the command in its own session with stdout and stderr in a log file,
and answers :meth:`ProcessHost.poll` (exit status or None) and :meth:`ProcessHost.log_tail`.
The driver turns an exit into :class:`EngineDied`, whose message carries the log tail.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from miles_core.ports import free_port

from miles_launch.engine_launch.api_key import redact_argv
from miles_launch.placement import node_ip

#: Lines of the log quoted when a process dies.
TAIL_LINES = 30


class EngineDied(RuntimeError):
    """An engine or router process exited; the message names it and quotes its log tail."""


def exit_description(returncode: int) -> str:
    """``"exit status 3"`` or ``"killed by SIGKILL"``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def read_tail(path: str | os.PathLike, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a text file ('' when missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


#: In a command line, where :meth:`ProcessHost.start` puts the path of the private file it writes
#: (a secret the program reads from a file rather than from its argv, visible to ``ps``).
SECRET_FILE = "{miles-secret-file}"


def write_secret_file(text: str) -> Path:
    """``text`` in a new file only this user can read (mode 0600, in a 0700 directory)."""
    directory = Path(tempfile.mkdtemp(prefix="miles-secret-"))
    path = directory / "config.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


class ProcessHost:
    """One child process and its log (``ray.remote``-wrapped by the engine set)."""

    def __init__(self, name: str, log_dir: str | None = None):
        self.name = name
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="miles-engines-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{name}.log"
        self.process: subprocess.Popen | None = None
        self.secret_path: Path | None = None

    def endpoint(self) -> tuple[str, int]:
        """This node's IP and a free port on it (outside the ephemeral range: no socket the
        kernel numbers takes it before the engine binds it)."""
        return node_ip(), free_port()

    def start(
        self, cmd: list[str], env: dict[str, str], secret: str | None = None
    ) -> tuple[int, str]:
        """Start ``cmd`` with ``env`` added; returns (pid, log path). ``secret``: written to a
        private file on this node whose path replaces :data:`SECRET_FILE` in ``cmd`` (removed
        when the process is stopped)."""
        if secret is not None:
            self.secret_path = write_secret_file(secret)
            cmd = [str(self.secret_path) if a == SECRET_FILE else a for a in cmd]
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps it)
        log.write(f"$ {' '.join(redact_argv(cmd))}\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        log.close()
        return self.process.pid, str(self.log_path)

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        return None if self.process is None else self.process.poll()

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        return read_tail(self.log_path, lines)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``timeout``; returns the exit status."""
        try:
            return self._stop(timeout)
        finally:
            if self.secret_path is not None:
                shutil.rmtree(self.secret_path.parent, ignore_errors=True)
                self.secret_path = None

    def _stop(self, timeout: float) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(timeout)
        except ProcessLookupError:
            return self.process.poll()
