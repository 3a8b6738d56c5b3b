"""The type check of .ci/run (mypy, configured in pyproject.toml) sees through the config groups:
a misspelt field of an argument-group dataclass is an error, the right one has the declared type."""

from __future__ import annotations

from pathlib import Path

from miles_core.args.groups import OptimizerArgs

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = """\
from miles_core.args.groups import OptimizerArgs


def peak_lr(cfg: OptimizerArgs) -> float:
    reveal_type(cfg.lr)
    return cfg.lrr
"""


def _mypy_errors(tmp_path, name: str, text: str):
    """mypy, under the repository's configuration, on ``text`` written to ``tmp_path/name``:
    (the file, mypy's report), asserting that mypy ran and found errors."""
    from mypy import api

    snippet = tmp_path / name
    snippet.write_text(text)
    stdout, stderr, status = api.run(
        [
            str(snippet),
            "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(tmp_path / "mypy_cache"),
        ]
    )  # fmt: skip
    assert stderr == ""
    assert status == 1, stdout
    return snippet, stdout


def test_mypy_reports_a_misspelt_field_of_a_config_group(tmp_path):

    assert "lr" in OptimizerArgs.__dataclass_fields__  # the field the snippet misspells
    snippet, stdout = _mypy_errors(tmp_path, "uses_config.py", SNIPPET)
    lines = stdout.splitlines()
    # the right spelling: mypy reads the group's annotation (flag() itself returns Any)
    assert f'{snippet}:5: note: Revealed type is "float"' in lines, stdout
    # the misspelt one is an error on its line, and the only one
    assert any(
        line.startswith(f"{snippet}:6: error:")
        and '"OptimizerArgs" has no attribute "lrr"' in line
        and "[attr-defined]" in line
        for line in lines
    ), stdout
    assert sum(": error:" in line for line in lines) == 1, stdout


RUN_CONFIG_SNIPPET = """\
from miles_core.args import RunConfig
from miles_core.args.groups import OptimizerArgs


def peak_lr(cfg: RunConfig) -> float:
    reveal_type(cfg.optimizer.lr)
    reveal_type(cfg[OptimizerArgs].lr)
    reveal_type(cfg.get(OptimizerArgs))
    misspelt = cfg.optimizer.lrr
    return misspelt + cfg[OptimizerArgs].lrr
"""


def test_mypy_sees_the_types_of_a_run_config_read(tmp_path):
    """``args.run_config``'s typed properties and ``cfg[Group]`` give the group's declared
    field types; a misspelt field is an error through either."""

    snippet, stdout = _mypy_errors(tmp_path, "uses_run_config.py", RUN_CONFIG_SNIPPET)
    lines = stdout.splitlines()
    assert f'{snippet}:6: note: Revealed type is "float"' in lines, stdout
    assert f'{snippet}:7: note: Revealed type is "float"' in lines, stdout
    group = "miles_core.args.groups.optimizer.OptimizerArgs"
    assert f'{snippet}:8: note: Revealed type is "{group} | None"' in lines, stdout
    errors = [line for line in lines if ": error:" in line]
    assert len(errors) == 2, stdout  # one per misspelt read: lines 9 and 10
    for number, line in zip((9, 10), errors, strict=True):
        assert line.startswith(f"{snippet}:{number}: error:"), stdout
        assert '"OptimizerArgs" has no attribute "lrr"' in line and "[attr-defined]" in line
