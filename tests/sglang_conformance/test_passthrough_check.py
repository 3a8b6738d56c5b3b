"""``--sglang-*`` passthrough flags are checked with SGLang's own server parser during argument
validation when sglang is importable (exit 2, one line naming the flag and the version), and
pass with one note when it is not."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import sglang_release
from miles_launch.engine_launch import sglang_flags

HERE = Path(__file__).resolve().parent


def parse_with_sglang(root: Path, tmp_path: Path, cases: list[list[str]]) -> list[dict]:
    """miles' parser on each case, in one process where the release is importable."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    (tmp_path / "hf").mkdir(exist_ok=True)
    base = ["--train-backend", "fsdp", "--hf-checkpoint", str(tmp_path / "hf")]
    base += ["--prompt-data", str(prompts), "--rollout-engine", "sglang"]
    argvs = json.dumps([base + flags for flags in cases])
    cmd = [*sglang_release.python_with_sglang(root), "parse_flags", argvs]
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


GOOD = ["--sglang-ep-size", "8", "--sglang-cuda-graph-bs-decode", "1", "2"]
REFUSED = {
    "--sglang-enable-ep-moe": "--sglang-enable-ep-moe: SGLang 0.5.23 has no server flag",
    "--sglang-cuda-graph-bs": "--sglang-cuda-graph-bs: refused by SGLang 0.5.23's server",
    "--sglang-attention-backend": "--sglang-attention-backend: refused by SGLang 0.5.23's",
}


def test_passthrough_flags_are_checked_by_sglang_before_launch(sglang_release, tmp_path):
    if sglang_release.parent.name != "sglang-0.5.23":
        pytest.skip("the messages below name 0.5.23")
    cases = [
        GOOD + ["--sglang-enable-dp-attention"],
        GOOD + ["--sglang-enable-ep-moe"],
        GOOD + ["--sglang-cuda-graph-bs", "1"],
        GOOD + ["--sglang-attention-backend", "no-such-backend"],
    ]
    accepted, *refused = parse_with_sglang(sglang_release, tmp_path, cases)
    assert accepted["code"] is None, accepted  # SGLang may note a deprecated flag
    assert "error" not in accepted["stderr"] and "--enable-dp-attention" in accepted["stderr"]
    for result, want in zip(refused, REFUSED.values()):
        lines = result["stderr"].strip().splitlines()
        assert result["code"] == 2 and len(lines) == 1, result
        assert lines[0].startswith(f"error: {want}"), lines


def test_without_sglang_flags_pass_unchecked_with_one_note(caplog, monkeypatch):
    monkeypatch.setattr(sglang_flags, "_importable", lambda: False)
    monkeypatch.setattr(sglang_flags, "_noted_unchecked", False)
    with caplog.at_level(logging.WARNING, logger=sglang_flags.__name__):
        sglang_flags.check_with_sglang({"enable-ep-moe": True})
        sglang_flags.check_with_sglang({"no-such-flag": "1"})
    notes = [r.getMessage() for r in caplog.records]
    assert notes == [
        "--sglang-* flags are passed to SGLang unchecked: sglang is not importable here"
    ]
