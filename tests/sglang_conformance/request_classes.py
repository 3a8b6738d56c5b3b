"""SGLang's HTTP request classes, as its server validates them, from the released wheel.

``sglang/srt/managers/io_struct.py`` does not import on a CPU (it pulls the scheduler, vision
processors, CUDA kernels). Its request classes themselves need only msgspec and
``sglang/srt/utils/msgspec_utils.py`` (the pydantic-core schema its HTTP server validates them
with). :func:`request_classes` compiles the wheel's own source of the named classes (and
``BaseReq``) unchanged, with that module loaded from the wheel, and the two IPC-only types the
fields mention (``FinishReasonDict``, ``WeightVersionSpans``) as ``Any``.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
import typing
from pathlib import Path


def _load(root: Path, relative: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, root / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def request_classes(root: Path | str, names: list[str]) -> dict[str, type]:
    """``{name: class}`` for SGLang request classes ``names`` of the unpacked wheel at ``root``."""
    import msgspec

    root = Path(root)
    utils = _load(root, "sglang/srt/utils/msgspec_utils.py", "sglang_release_msgspec_utils")
    source = (root / "sglang/srt/managers/io_struct.py").read_text()
    tree = ast.parse(source)
    wanted = {"BaseReq", *names}
    nodes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in wanted]
    missing = wanted - {n.name for n in nodes}
    if missing:
        raise LookupError(f"io_struct.py of this release has no {sorted(missing)}")
    module = types.ModuleType("sglang_release_io_struct_subset")
    sys.modules[module.__name__] = module  # msgspec resolves the annotations through it
    namespace = module.__dict__
    for name in ("Any", "Annotated", "Dict", "List", "Literal", "Optional", "Tuple", "Union"):
        namespace[name] = getattr(typing, name)
    namespace.update(
        msgspec=msgspec,
        msgspec_struct_pydantic_core_schema=utils.msgspec_struct_pydantic_core_schema,
        Base64Bytes=utils.Base64Bytes,
        FinishReasonDict=typing.Any,
        WeightVersionSpans=typing.Any,
    )
    code = "from __future__ import annotations\n\n" + "\n\n".join(
        ast.get_source_segment(source, node) for node in nodes
    )
    exec(compile(code, str(root / "sglang/srt/managers/io_struct.py"), "exec"), namespace)
    return {name: namespace[name] for name in names}
