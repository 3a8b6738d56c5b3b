"""Test support for miles-launch: parsing the launcher's flags with miles-core's groups."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from miles_core.args import entry_point_groups, parse_args


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """``miles ARGV...`` (the real console entry point) in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "miles_launch.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single ``error: ...`` line of an argument error (exit status 2), asserted so."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def parse(tmp_path: Path, *flags: str):
    """Parse ``flags`` with the core and launch groups, with a prompt file and HF dir given."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "1"}\n')
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", str(prompts), *flags]
    return parse_args(argv, entry_point_groups("core", "launch"))


class StubEngine:
    """Answers ``generate`` like an engine: the response is the prompt's ids reversed."""

    base_url = "stub://engine"

    def __init__(self):
        self.sampling_params: list[dict] = []  # of every request

    async def generate(self, input_ids, sampling_params, return_logprob, return_routed_experts):
        self.sampling_params.append(dict(sampling_params))
        ids = list(reversed(input_ids))
        return {
            "text": "".join(chr(ord("a") + (i - 1) % 26) for i in ids),
            "meta_info": {
                "output_token_logprobs": [[-0.5, i] for i in ids],
                "finish_reason": {"type": "length"},
                "weight_version": "1",
            },
        }

    async def aclose(self):
        pass
