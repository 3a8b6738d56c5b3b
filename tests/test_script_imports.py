"""What CI cannot run still imports only what exists: the benchmark scripts and the GPU tests.

Those run on a GPU node only, so a name they import that a package renamed or removed shows up
there, minutes into a run (``bench_weight_sync.py`` imported ``miles_sync.engine_group.
free_port`` for several releases after it was removed). An AST walk of ``scripts/*.py`` and
``tests/gpu/*.py`` finds every import, at the top or inside a function, of a miles package or of
a sibling helper module (a script beside it, a test helper under ``tests/``), and checks that
each imported name is there: a package's module is imported and asked, a helper's top-level
definitions are read from its source."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = [*sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "tests" / "gpu").glob("*.py"))]
PACKAGES = ("miles_core", "miles_fsdp", "miles_megatron", "miles_launch", "miles_sync")
PACKAGES += ("miles_offload", "miles_native")


def helper_modules() -> dict[str, Path]:
    """Module name -> file of every importable helper beside the checked files: the scripts and
    every module under ``tests/`` (the GPU tests put those directories on ``sys.path``)."""
    found = {p.stem: p for p in sorted((ROOT / "tests").rglob("*.py")) if "gpu" not in p.parts}
    found.update({p.stem: p for p in sorted((ROOT / "tests" / "gpu").glob("*.py"))})
    found.update({p.stem: p for p in sorted((ROOT / "scripts").glob("*.py"))})
    return found


def top_level_names(path: Path) -> set[str]:
    """The names a module's source binds at its top level (defs, classes, assignments, imports,
    and those under a top-level ``if``/``try``)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return names


def imports_of(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import in ``path`` (``name`` None for ``import M``)."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
    return found


def missing_names(paths: list[Path], helpers: dict[str, Path]) -> tuple[list[str], int]:
    """``file:line: what`` for every import of a miles package or helper that does not resolve,
    and how many such imports were checked."""
    missing, checked = [], 0
    helper_names: dict[str, set[str]] = {}
    for path in paths:
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for line, module, name in imports_of(path):
            if module.split(".")[0] in PACKAGES:
                checked += 1
                if importlib.util.find_spec(module) is None:
                    missing.append(f"{where}:{line}: no module {module}")
                elif name is not None and name != "*":
                    mod = importlib.import_module(module)
                    submodule = hasattr(mod, "__path__") and (
                        importlib.util.find_spec(f"{module}.{name}") is not None
                    )
                    if not hasattr(mod, name) and not submodule:
                        missing.append(f"{where}:{line}: {module} has no {name}")
            elif module in helpers and name is not None:
                checked += 1
                if module not in helper_names:
                    helper_names[module] = top_level_names(helpers[module])
                if name not in helper_names[module]:
                    missing.append(f"{where}:{line}: {module} has no {name}")
    return missing, checked


@pytest.mark.slow
def test_scripts_and_gpu_tests_import_only_what_exists():
    missing, checked = missing_names(CHECKED, helper_modules())
    assert checked > 250, checked  # the walk reached the scripts' and GPU tests' imports
    assert not missing, "imports that no longer resolve:\n" + "\n".join(missing)


def test_the_check_finds_a_removed_name(tmp_path):
    helper = tmp_path / "bench_helper.py"
    helper.write_text("import json\nSIZE = 1\n\ndef run():\n    pass\n\nif True:\n    X = 2\n")
    script = tmp_path / "bench_x.py"
    script.write_text(
        "from miles_core.ports import free_port\n"
        "from bench_helper import SIZE, run, X, json\n"
        "def main():\n"
        "    from miles_sync.engine_group import free_port\n"
        "    from miles_core.ports import no_such_name\n"
        "    from miles_core.no_such_module import x\n"
        "    from bench_helper import gone\n"
    )
    missing, checked = missing_names([script], {"bench_helper": helper})
    assert checked == 9
    assert [m.split(": ", 1)[1] for m in missing] == [
        "miles_sync.engine_group has no free_port",
        "miles_core.ports has no no_such_name",
        "no module miles_core.no_such_module",
        "bench_helper has no gone",
    ]
