"""Extract SGLang's HTTP request schema from a released ``sglang`` package.

Downloads the package with ``pip download --no-deps`` (or reads a wheel/sdist given with
``--package``), parses its source with :mod:`ast` — nothing is imported or copied — and
writes ``tests/data/sglang_schema.json`` (the test suite derives the same schema from the wheel
it caches, see ``tests/sglang_release.py``; the JSON is its offline fallback):

- ``version``: the sglang release the schema was read from.
- ``endpoints``: every native route of ``sglang/srt/entrypoints/http_server.py`` (paths
  outside ``/v1/``), as ``{path: {"methods", "handler", "request_class", "fields",
  "required", "query"}}``. ``request_class`` is the ``io_struct`` class the handler's body
  is parsed into (``null`` when the handler takes no body); ``fields`` are its field names,
  inherited ones included; ``required`` those without a default.
- ``sampling_params``: the fields of ``SamplingParams`` in
  ``sglang/srt/sampling/sampling_params.py`` (its ``__init__`` arguments in releases where
  it is a plain class, its annotated fields where it is a dataclass/struct).
- ``sampling_params_contract`` / ``generate_contract``: where the release ships the
  generated JSON contract (``sglang/api/v1/api_types.py``), the fields of its
  ``SamplingParams`` (unknown keys rejected with 400) and ``GenerateRequest``.

Usage::

    python scripts/extract_sglang_schema.py                    # newest release pip finds
    python scripts/extract_sglang_schema.py --version 0.5.23
    python scripts/extract_sglang_schema.py --package /tmp/x/sglang-0.5.23-....whl
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
API_TYPES = "sglang/api/v1/api_types.py"
ROUTE_DECORATORS = {"get": ["GET"], "post": ["POST"], "put": ["PUT"], "delete": ["DELETE"]}
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "sglang_schema.json"


@dataclass
class Field:
    name: str
    required: bool


# ---------------------------------------------------------------------------- package files


def download(version: str | None, dest: Path) -> Path:
    """``pip download --no-deps sglang[==version]`` into ``dest``; returns the file."""
    spec = "sglang" if version is None else f"sglang=={version}"
    pip = pip_command()
    if pip is None:
        raise SystemExit(
            "no pip found: install pip, or download sglang yourself and pass --package"
        )
    cmd = [*pip, "download", "--no-deps", "--quiet", spec, "-d", str(dest)]
    subprocess.run(cmd, check=True)
    files = sorted(p for p in dest.iterdir() if p.name.startswith("sglang-"))
    if len(files) != 1:
        raise SystemExit(f"expected one sglang package in {dest}, found {[p.name for p in files]}")
    return files[0]


def pip_command() -> list[str] | None:
    """This interpreter's pip, else a pip on PATH, else uv's (uv environments have no pip);
    None when there is none. tests/sglang_release.py fetches the wheel with the same."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    for name in ("pip", "pip3"):
        path = shutil.which(name)
        if path is not None:
            return [path]
    uvx = shutil.which("uvx")
    if uvx is not None:
        return [uvx, "pip"]
    return None


def package_version(package: Path) -> str:
    """The version in a wheel/sdist file name: ``sglang-0.5.23-cp311-...whl`` -> ``0.5.23``."""
    match = re.match(r"sglang-([^-]+?)(?:\.tar\.gz|\.zip|-)", package.name)
    if match is None:
        raise SystemExit(f"cannot read a version from the file name {package.name}")
    return match.group(1)


def read_sources(package: Path, wanted: list[str]) -> dict[str, str]:
    """Source text of the ``wanted`` package paths (``sglang/...``) in a wheel or sdist.

    Sdists nest the package under ``sglang-X/`` (and sometimes ``python/``): a member is
    matched by its path suffix.
    """
    found: dict[str, str] = {}
    if package.suffix == ".whl" or package.suffix == ".zip":
        with zipfile.ZipFile(package) as archive:
            for name in archive.namelist():
                for path in wanted:
                    if name == path or name.endswith("/" + path):
                        found[path] = archive.read(name).decode("utf-8")
    else:
        with tarfile.open(package) as archive:
            for member in archive.getmembers():
                for path in wanted:
                    if member.name.endswith("/" + path):
                        data = archive.extractfile(member)
                        if data is not None:
                            found[path] = data.read().decode("utf-8")
    return found


# ---------------------------------------------------------------------------- ast readers


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _is_classvar(annotation: ast.AST) -> bool:
    return "ClassVar" in _names_in(annotation) or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "ClassVar"
    )


def _field_call_info(value: ast.AST) -> tuple[bool, bool] | None:
    """For ``x: T = field(...)``: (is an init field, has a default); None if not field()."""
    if not (isinstance(value, ast.Call) and _call_name(value.func) in {"field", "Field"}):
        return None
    keywords = {k.arg: k.value for k in value.keywords}
    init = keywords.get("init")
    is_init = not (isinstance(init, ast.Constant) and init.value is False)
    has_default = "default" in keywords or "default_factory" in keywords or bool(value.args)
    return is_init, has_default


def _call_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def class_defs(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def class_fields(name: str, classes: dict[str, ast.ClassDef]) -> list[Field]:
    """Fields of a dataclass / pydantic model / msgspec struct, base classes first.

    Bases defined in the same module contribute their fields (a redefinition in the
    subclass replaces the inherited one); ``ClassVar`` and ``field(init=False)`` are skipped.
    """
    node = classes[name]
    fields: dict[str, Field] = {}
    for base in node.bases:
        base_name = base.id if isinstance(base, ast.Name) else None
        if base_name in classes and base_name != name:
            for f in class_fields(base_name, classes):
                fields[f.name] = f
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if _is_classvar(stmt.annotation):
            continue
        required = stmt.value is None
        info = _field_call_info(stmt.value) if stmt.value is not None else None
        if info is not None:
            is_init, has_default = info
            if not is_init:
                continue
            required = not has_default
        fields[stmt.target.id] = Field(stmt.target.id, required)
    return list(fields.values())


def init_arguments(node: ast.ClassDef) -> list[Field] | None:
    """Arguments of ``__init__`` (without ``self``), or None when the class defines none."""
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            args = stmt.args
            positional = args.posonlyargs + args.args
            n_required = len(positional) - len(args.defaults)
            out = [Field(a.arg, i < n_required) for i, a in enumerate(positional)]
            out += [Field(a.arg, d is None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
            return [f for f in out if f.name != "self"]
    return None


def routes(tree: ast.Module) -> list[tuple[str, list[str], ast.AsyncFunctionDef | ast.FunctionDef]]:
    """(path, methods, handler) for each ``@app.<verb>("/path")`` / ``@app.api_route``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
                continue
            if not (isinstance(deco.func.value, ast.Name) and deco.func.value.id == "app"):
                continue
            verb = deco.func.attr
            if not deco.args or not isinstance(deco.args[0], ast.Constant):
                continue  # a path computed at run time (environment variables)
            path = deco.args[0].value
            if verb == "api_route":
                keywords = {k.arg: k.value for k in deco.keywords}
                methods_node = keywords.get("methods")
                methods = (
                    [e.value for e in methods_node.elts if isinstance(e, ast.Constant)]
                    if isinstance(methods_node, ast.List | ast.Tuple)
                    else ["GET"]
                )
            elif verb in ROUTE_DECORATORS:
                methods = ROUTE_DECORATORS[verb]
            else:
                continue
            found.append((path, methods, node))
    return found


def handler_request(
    handler: ast.FunctionDef | ast.AsyncFunctionDef, known: set[str]
) -> tuple[str | None, list[str]]:
    """The body class of a handler (an annotation naming a known class) and its Query params."""
    body_class = None
    query = []
    args = handler.args.args + handler.args.kwonlyargs
    defaults = [None] * (len(handler.args.args) - len(handler.args.defaults)) + list(
        handler.args.defaults
    )
    defaults += list(handler.args.kw_defaults)
    for arg, default in zip(args, defaults):
        if arg.annotation is not None and body_class is None:
            hits = _names_in(arg.annotation) & known
            if hits:
                body_class = sorted(hits)[0]
                continue
        if isinstance(default, ast.Call) and _call_name(default.func) == "Query":
            query.append(arg.arg)
    return body_class, query


# ---------------------------------------------------------------------------- schema


def extract(sources: dict[str, str], version: str) -> dict:
    for path in (IO_STRUCT, SAMPLING_PARAMS, HTTP_SERVER):
        if path not in sources:
            raise SystemExit(f"{path} not found in the sglang {version} package")
    io_classes = class_defs(ast.parse(sources[IO_STRUCT]))
    known = set(io_classes)

    endpoints: dict[str, dict] = {}
    for path, methods, handler in routes(ast.parse(sources[HTTP_SERVER])):
        if path.startswith("/v1/"):
            continue  # the OpenAI-compatible API: not used by the trainer
        body_class, query = handler_request(handler, known)
        entry = endpoints.setdefault(
            path,
            {
                "methods": [],
                "handler": handler.name,
                "request_class": body_class,
                "fields": [],
                "required": [],
                "query": query,
            },
        )
        entry["methods"] = sorted(set(entry["methods"]) | set(methods))
        if body_class is not None:
            fields = class_fields(body_class, io_classes)
            entry["fields"] = [f.name for f in fields]
            entry["required"] = [f.name for f in fields if f.required]

    sampling_classes = class_defs(ast.parse(sources[SAMPLING_PARAMS]))
    if "SamplingParams" not in sampling_classes:
        raise SystemExit(f"SamplingParams not found in {SAMPLING_PARAMS}")
    sampling = init_arguments(sampling_classes["SamplingParams"])
    sampling_kind = "__init__"
    if sampling is None:
        sampling = class_fields("SamplingParams", sampling_classes)
        sampling_kind = "class fields"

    schema = {
        "sglang_version": version,
        "generated_by": "scripts/extract_sglang_schema.py",
        "sources": {"request_classes": IO_STRUCT, "routes": HTTP_SERVER},
        "endpoints": dict(sorted(endpoints.items())),
        "sampling_params": {
            "source": f"{SAMPLING_PARAMS} SamplingParams ({sampling_kind})",
            "fields": [f.name for f in sampling],
        },
    }
    if API_TYPES in sources:
        contract = class_defs(ast.parse(sources[API_TYPES]))
        for key, name in (
            ("sampling_params_contract", "SamplingParams"),
            ("generate_contract", "GenerateRequest"),
        ):
            if name in contract:
                schema[key] = {
                    "source": f"{API_TYPES} {name}",
                    "fields": [f.name for f in class_fields(name, contract)],
                }
    return schema


def schema_of(package: Path) -> dict:
    """The schema of one downloaded sglang wheel/sdist (what ``main`` writes)."""
    sources = read_sources(package, [IO_STRUCT, SAMPLING_PARAMS, HTTP_SERVER, API_TYPES])
    return extract(sources, package_version(package))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=None, help="sglang release (default: newest)")
    parser.add_argument("--package", type=Path, default=None, help="a downloaded wheel/sdist")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="sglang-schema-") as tmp:
        package = args.package or download(args.version, Path(tmp))
        schema = schema_of(package)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(schema, indent=1) + "\n")
    print(
        f"sglang {schema['sglang_version']}: {len(schema['endpoints'])} endpoints -> {args.output}"
    )


if __name__ == "__main__":
    main()
