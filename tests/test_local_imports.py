"""Function-local imports carry their reason: an import inside a function is there only for an
optional dependency, a real cycle or to keep argument parsing free of torch, and says which in a
comment on its line or on the comment line above its block of imports (a pragma such as
``# noqa: F401`` alone is no reason). Everything else is imported at the top of its module.

An AST walk of ``packages/*/src`` and ``native/src``; :func:`unreasoned` is also run on a
snippet, so the check is shown to fail where it should."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted(ROOT.glob("packages/*/src")), ROOT / "native" / "src"]

PRAGMA = re.compile(
    r"^(noqa(:\s*[A-Z0-9, ]+)?|type:\s*ignore(\[[^\]]*\])?|pragma:\s*no cover|fmt:\s*\w+)"
)


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line, with pragmas stripped (may be empty)."""
    found: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            parts = [PRAGMA.sub("", p.strip()) for p in tok.string.split("#")]
            found[tok.start[0]] = " ".join(p for p in parts if re.search("[A-Za-z]", p))
    return found


def _local_imports(tree: ast.AST) -> list[tuple[ast.stmt, list[ast.stmt]]]:
    """Each import inside a function body, with the statements of the body it is in."""
    found: list[tuple[ast.stmt, list[ast.stmt]]] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for stmt in block:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)) and in_function:
                    found.append((stmt, block))
                nested = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
                walk(stmt, in_function or nested)

    walk(tree, False)
    return found


def unreasoned(source: str) -> list[int]:
    """Line numbers of the function-local imports of ``source`` that give no reason."""
    lines = source.splitlines()
    comments = _comments(source)
    missing = []
    for node, block in _local_imports(ast.parse(source)):
        end = node.end_lineno or node.lineno
        if any(comments.get(n) for n in range(node.lineno, end + 1)):
            continue
        # the comment line above this import's block (imports and blank lines in between)
        import_lines = {
            n
            for s in block
            if isinstance(s, (ast.Import, ast.ImportFrom))
            for n in range(s.lineno, (s.end_lineno or s.lineno) + 1)
        }
        n = node.lineno - 1
        while n >= 1 and (n in import_lines or not lines[n - 1].strip()):
            n -= 1
        if not (n >= 1 and lines[n - 1].strip().startswith("#") and comments.get(n)):
            missing.append(node.lineno)
    return missing


def test_every_function_local_import_gives_its_reason():
    missing = []
    for source_dir in SOURCES:
        for path in sorted(source_dir.rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            missing += [f"{name}:{line}" for line in unreasoned(path.read_text())]
    assert not missing, (
        "function-local imports without a reason (hoist them, or say why on the line or "
        "the comment line above: optional dependency, cycle, argument parsing free of torch):\n"
        + "\n".join(missing)
    )


SNIPPET = '''
import os


def top_level_is_fine():
    return os.sep


def bare():
    import json

    return json


def pragma_only():
    import json  # noqa: F401


def reasoned_inline():
    import wandb  # optional: --use-wandb


def reasoned_above():
    x = 1
    # cycle: miles_x imports this module
    from miles_x import a
    from miles_x import b

    return a, b, x


def docstring_is_no_reason():
    """Uses json."""
    import json

    class Inner:
        def method(self):
            import csv

            return csv

    return json, Inner
'''


def test_the_check_fails_on_an_import_without_a_reason():
    lines = SNIPPET.splitlines()
    flagged = [lines[n - 1].strip() for n in unreasoned(SNIPPET)]
    assert flagged == ["import json", "import json  # noqa: F401", "import json", "import csv"]
