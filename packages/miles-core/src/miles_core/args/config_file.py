"""``--config file.yaml``: flag values from a YAML mapping.

Keys are flag names without the dashes, in ``kebab-case`` or ``snake_case``
(``offload-train-target`` or ``offload_train_target``); a boolean may also be written in its
``no-`` form (``no-save-optim: true`` is ``save-optim: false``). Values are converted like the command
line's (``lr: 1e-6`` is a float even though YAML reads it as a string; a list flag takes a YAML
list or a comma-separated string). Keys ``sglang-<x>`` / ``router-<x>`` that no group declares are
passthrough (``true`` for a bare flag; ``false`` leaves it out). Any other key is an error naming the
key and the file. Precedence: command line > YAML > declared defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from miles_core.args.flags import ArgumentError, FlagSpec
from miles_core.args.passthrough import PASSTHROUGH_PREFIXES, PassthroughValue


def find_config_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``--config F`` or ``--config=F``), if any."""
    paths = []
    for i, token in enumerate(argv):
        if token == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ArgumentError("argument --config: expected a YAML file path")
            paths.append(argv[i + 1])
        elif token.startswith("--config="):
            paths.append(token.split("=", 1)[1])
    if len(paths) > 1:
        raise ArgumentError(f"argument --config: given {len(paths)} times; pass one YAML file")
    return paths[0] if paths else None


def _convert_scalar(spec: FlagSpec, value: Any, where: str) -> Any:
    base = spec.base_type
    if isinstance(value, bool) or isinstance(value, (list, dict)):
        raise ArgumentError(f"{where}: expected {base.__name__}, got {value!r}")
    if base is str:
        return str(value)
    try:
        converted = base(value)
    except (TypeError, ValueError):
        raise ArgumentError(f"{where}: expected {base.__name__}, got {value!r}") from None
    if base is int and isinstance(value, float) and converted != value:
        raise ArgumentError(f"{where}: expected int, got {value!r}")
    return converted


def _check_choice(spec: FlagSpec, value: Any, where: str) -> None:
    if spec.choices is not None and value not in spec.choices:
        allowed = ", ".join(map(str, spec.choices))
        raise ArgumentError(f"{where}: invalid choice {value!r} (choose from {allowed})")


def convert_config_value(spec: FlagSpec, value: Any, where: str) -> Any:
    """Convert one YAML value to the flag's type; ``where`` prefixes any error message."""
    if value is None:
        if spec.optional:
            return None
        raise ArgumentError(f"{where}: a value is required")
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise ArgumentError(f"{where}: expected true or false, got {value!r}")
        return value
    if spec.kind == "list":
        items = value if isinstance(value, list) else str(value).split(",")
        out = []
        for item in items:
            if isinstance(item, str) and item.strip() == "":
                raise ArgumentError(f"{where}: empty list item")
            converted = _convert_scalar(
                spec, item.strip() if isinstance(item, str) else item, where
            )
            _check_choice(spec, converted, where)
            out.append(converted)
        return out
    converted = _convert_scalar(spec, value, where)
    _check_choice(spec, converted, where)
    return converted


def _passthrough_value(value: Any, where: str) -> PassthroughValue | None:
    if value is True:
        return True
    if value is False or value is None:
        return None
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, dict):
        raise ArgumentError(f"{where}: expected a scalar or a list, got a mapping")
    return str(value)


def load_config(
    path: str, specs: dict[str, FlagSpec]
) -> tuple[dict[str, Any], dict[str, dict[str, PassthroughValue]]]:
    """Read ``path``; return ``({dest: value}, {"sglang_passthrough": {...}, ...})``.

    ``specs`` maps each declared dest (``snake_case``) to its flag.
    """
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ArgumentError(f"--config {path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise ArgumentError(f"--config {path}: not valid YAML{line}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag names to values")
    values: dict[str, Any] = {}
    passthrough: dict[str, dict[str, PassthroughValue]] = {
        d: {} for d in PASSTHROUGH_PREFIXES.values()
    }
    for key, value in data.items():
        where = f"--config {path}: key '{key}'"
        if not isinstance(key, str):
            raise ArgumentError(f"{where}: keys must be flag names")
        dest = key.replace("-", "_")
        if dest == "config":
            raise ArgumentError(f"{where}: a config file cannot name another config file")
        if dest in specs:
            values[dest] = convert_config_value(specs[dest], value, where)
            continue
        negated = specs.get(dest[3:]) if dest.startswith("no_") else None
        if negated is not None and negated.kind == "bool":
            # "no-save-optim: true" reads like the command line's --no-save-optim
            if not isinstance(value, bool):
                raise ArgumentError(f"{where}: expected true or false, got {value!r}")
            values[negated.dest] = not value
            continue
        option = "--" + key.replace("_", "-")
        prefix = next((p for p in PASSTHROUGH_PREFIXES if option.startswith(p)), None)
        if prefix is not None and len(option) > len(prefix):
            converted = _passthrough_value(value, where)
            if converted is not None:
                passthrough[PASSTHROUGH_PREFIXES[prefix]][option[len(prefix) :]] = converted
            continue
        raise ArgumentError(f"--config {path}: unknown key '{key}' (no flag {option})")
    return values, passthrough
