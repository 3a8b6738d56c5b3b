#!/usr/bin/env python3
"""Bump one workspace package's version; move its dependents' ranges to the new release.

    uv run scripts/bump_version.py miles-core minor      # 0.1.0 -> 0.2.0

1. ``[project].version`` in the package's pyproject.toml: major -> (M+1).0.0, minor ->
   M.(m+1).0, patch -> M.m.(p+1).
2. A ``## <new version>`` header at the top of the package's CHANGELOG.md (fill in the notes).
3. On a minor or major bump, every requirement on the package in the other packages'
   ``dependencies`` and ``optional-dependencies`` is moved to the new release: its lower bound
   becomes the new ``MAJOR.MINOR`` and its upper bound the next incompatible release
   (``<0.(m+1)`` below 1.0, ``<(M+1)`` from 1.0 on). ``miles-core>=0.1,<0.2`` becomes
   ``miles-core>=0.2,<0.3`` after a minor bump of miles-core to 0.2.0. The dependents are
   developed against the package as it is now (below 1.0 a minor release changes the API), so a
   range that still admitted the old release would let a user install a combination nobody
   tested. A patch bump leaves the ranges alone (a patch stays inside them).

``scripts/bump_version.py --align`` moves every sibling range to its sibling's current release
without bumping anything (after merging branches that bumped different packages).

The pyproject files are edited in place as text (comments and layout kept). Run ``uv lock``
afterwards. Errors (unknown package, malformed version) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PARTS = ("major", "minor", "patch")
VERSION_LINE = re.compile(r'^(version\s*=\s*")([^"]+)(")', re.MULTILINE)


class BumpError(Exception):
    """Bad input to the script; the message is printed as one line."""


@dataclass
class Package:
    name: str  # canonical distribution name
    version: str
    pyproject: Path

    @property
    def changelog(self) -> Path:
        return self.pyproject.parent / "CHANGELOG.md"


def workspace_packages(root: Path) -> dict[str, Package]:
    """Every package of the workspace (``packages/*`` and ``native``), by canonical name."""
    found = {}
    for pyproject in sorted(
        [*root.glob("packages/*/pyproject.toml"), root / "native" / "pyproject.toml"]
    ):
        if not pyproject.is_file():
            continue
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if "name" in project and "version" in project:
            name = canonicalize_name(project["name"])
            found[name] = Package(name=name, version=project["version"], pyproject=pyproject)
    return found


def bumped(version: str, part: str) -> str:
    parsed = Version(version)
    if parsed.pre or parsed.post or parsed.dev or parsed.local or len(parsed.release) > 3:
        raise BumpError(f"version {version} is not plain MAJOR.MINOR.PATCH")
    major, minor, patch = (list(parsed.release) + [0, 0])[:3]
    if part == "major":
        return f"{major + 1}.0.0"
    if part == "minor":
        return f"{major}.{minor + 1}.0"
    return f"{major}.{minor}.{patch + 1}"


def next_incompatible(version: str) -> str:
    """The first release outside ``version``'s compatible range: 0.m -> 0.(m+1), M -> M+1."""
    major, minor = Version(version).release[:2]
    return f"0.{minor + 1}" if major == 0 else f"{major + 1}"


def retargeted(requirement: str, new_version: str) -> str | None:
    """``requirement`` moved to ``>=MAJOR.MINOR,<next incompatible`` of ``new_version``.

    None when it already reads so. Pins (``==``, ``~=``, ``===``) are refused: edit them by hand.
    """
    req = Requirement(requirement)
    pinned = [spec for spec in req.specifier if spec.operator not in (">=", ">", "!=", "<", "<=")]
    if pinned:
        raise BumpError(f"requirement '{requirement}' pins with {pinned[0]}; edit it by hand")
    major, minor = Version(new_version).release[:2]
    specs = [f">={major}.{minor}", f"<{next_incompatible(new_version)}"]
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    marker = f" ; {req.marker}" if req.marker else ""
    new = f"{req.name}{extras}{','.join(specs)}{marker}"
    if Requirement(new).specifier == req.specifier:
        return None
    return new


def dependent_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    reqs = list(project.get("dependencies", []))
    for group in project.get("optional-dependencies", {}).values():
        reqs.extend(group)
    return reqs


def add_changelog_header(changelog: Path, name: str, version: str) -> None:
    header = f"## {version}\n\n"
    if not changelog.exists():
        changelog.write_text(f"# Changelog — {name}\n\n{header}")
        return
    text = changelog.read_text()
    if re.search(rf"^## {re.escape(version)}\s*$", text, re.MULTILINE):
        return
    first_section = re.search(r"^## ", text, re.MULTILINE)
    at = first_section.start() if first_section else len(text)
    if not first_section and not text.endswith("\n\n"):
        text = text.rstrip("\n") + "\n\n"
        at = len(text)
    changelog.write_text(text[:at] + header + text[at:])


def bump(root: Path, package: str, part: str) -> list[str]:
    """Do the bump; returns one line per change made."""
    if part not in PARTS:
        raise BumpError(f"PART must be one of {', '.join(PARTS)}, got '{part}'")
    packages = workspace_packages(root)
    target = packages.get(canonicalize_name(package))
    if target is None:
        raise BumpError(f"unknown package '{package}' (known: {', '.join(sorted(packages))})")
    new_version = bumped(target.version, part)
    changes = [f"{target.name}: {target.version} -> {new_version}"]

    text = target.pyproject.read_text()
    project_at = text.index("[project]")
    match = VERSION_LINE.search(text, project_at)
    if match is None or match.group(2) != target.version:
        raise BumpError(
            f"{target.pyproject}: no 'version = \"{target.version}\"' line in [project]"
        )
    text = text[: match.start(2)] + new_version + text[match.end(2) :]
    target.pyproject.write_text(text)
    add_changelog_header(target.changelog, target.name, new_version)
    changes.append(f"{target.changelog}: added '## {new_version}'")

    for other in packages.values():
        if other.name == target.name or part == "patch":
            continue
        text = other.pyproject.read_text()
        edited = text
        for requirement in dependent_requirements(other.pyproject):
            if canonicalize_name(Requirement(requirement).name) != target.name:
                continue
            new = retargeted(requirement, new_version)
            if new is None:
                continue
            edited = edited.replace(f'"{requirement}"', f'"{new}"')
            changes.append(f"{other.pyproject}: {requirement} -> {new}")
        if edited != text:
            other.pyproject.write_text(edited)
    return changes


def align(root: Path) -> list[str]:
    """Move every requirement on a sibling to ``>=its MAJOR.MINOR,<next incompatible``."""
    packages = workspace_packages(root)
    changes = []
    for other in packages.values():
        text = other.pyproject.read_text()
        edited = text
        for requirement in dependent_requirements(other.pyproject):
            name = canonicalize_name(Requirement(requirement).name)
            if name not in packages:
                continue
            new = retargeted(requirement, packages[name].version)
            if new is not None:
                edited = edited.replace(f'"{requirement}"', f'"{new}"')
                changes.append(f"{other.pyproject}: {requirement} -> {new}")
        if edited != text:
            other.pyproject.write_text(edited)
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", help="distribution name, e.g. miles-core")
    parser.add_argument("part", nargs="?", choices=PARTS)
    parser.add_argument(
        "--align", action="store_true", help="only move sibling ranges to the current releases"
    )
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    if not args.align and (args.package is None or args.part is None):
        parser.error("PACKAGE and PART are required (or --align)")
    try:
        changes = align(args.root) if args.align else bump(args.root, args.package, args.part)
    except BumpError as exc:
        print(f"bump_version: error: {exc}", file=sys.stderr)
        return 2
    for line in changes:
        print(line)
    print("now run: uv lock")
    return 0


if __name__ == "__main__":
    sys.exit(main())
