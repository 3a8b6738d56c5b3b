"""scripts/bump_version.py on a workspace shaped like ours (pyproject.toml and CHANGELOG.md files)."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bump_version.py"

#: A workspace shaped like ours (same members, same kinds of requirements) at fixed versions, so
#: the expectations below do not move when the real packages are bumped.
LAYOUT = {
    "packages/miles-core": ("miles-core", [], {}),
    "packages/miles-offload": (
        "miles-offload",
        ["miles-core>=0.1,<0.2", "miles-native>=0.1,<0.2"],
        {},
    ),
    "packages/miles-sync": ("miles-sync", ["miles-core>=0.1,<0.2"], {}),
    "packages/miles-fsdp": (
        "miles-fsdp",
        ["miles-core>=0.1,<0.2", "miles-sync>=0.1,<0.2", "miles-offload>=0.1,<0.2", "torch>=2.5"],
        {},
    ),
    "packages/miles-megatron": (
        "miles-megatron",
        ["miles-core>=0.1,<0.2", "miles-sync>=0.1,<0.2", "miles-offload>=0.1,<0.2"],
        {},
    ),
    "packages/miles-launch": (
        "miles-launch",
        ["miles-core>=0.1,<0.2", "miles-sync>=0.1,<0.2"],
        {"fsdp": ["miles-fsdp>=0.1,<0.2"], "megatron": ["miles-megatron>=0.1,<0.2"]},
    ),
    "native": ("miles_native", [], {}),
}
MEMBERS = [Path(m) for m in LAYOUT]


def _pyproject(name: str, deps: list[str], extras: dict[str, list[str]]) -> str:
    lines = ["[project]", f'name = "{name}"', 'version = "0.1.0"  # kept', "dependencies = ["]
    lines += [f'  "{d}",' for d in deps] + ["]"]
    if extras:
        lines.append("\n[project.optional-dependencies]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in extras.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def workspace(tmp_path) -> Path:
    for member, (name, deps, extras) in LAYOUT.items():
        (tmp_path / member).mkdir(parents=True)
        (tmp_path / member / "pyproject.toml").write_text(_pyproject(name, deps, extras))
        title = name.replace("_", "-")
        (tmp_path / member / "CHANGELOG.md").write_text(f"# Changelog — {title}\n\n## 0.1.0\n")
    return tmp_path


def _bump(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _project(root: Path, member: str) -> dict:
    return tomllib.loads((root / member / "pyproject.toml").read_text())["project"]


def _deps_on(root: Path, name: str) -> dict[str, list[str]]:
    """Every requirement on ``name`` in the workspace, by member."""
    found = {}
    for member in MEMBERS:
        project = _project(root, str(member))
        reqs = list(project.get("dependencies", []))
        for group in project.get("optional-dependencies", {}).values():
            reqs.extend(group)
        hits = [r for r in reqs if r.split(">")[0].split("<")[0].split("=")[0] == name]
        if hits:
            found[str(member)] = hits
    return found


def test_patch_bump_leaves_dependents_alone(workspace):
    before = _deps_on(workspace, "miles-core")
    out = _bump(workspace, "miles-core", "patch")
    assert out.returncode == 0, out.stderr
    assert _project(workspace, "packages/miles-core")["version"] == "0.1.1"
    assert _deps_on(workspace, "miles-core") == before
    changelog = (workspace / "packages/miles-core/CHANGELOG.md").read_text()
    assert changelog.index("## 0.1.1") < changelog.index("## 0.1.0")
    assert changelog.startswith("# Changelog — miles-core\n\n## 0.1.1\n\n## 0.1.0\n")


def test_minor_bump_moves_every_dependent_to_the_new_release(workspace):
    out = _bump(workspace, "miles-core", "minor")
    assert out.returncode == 0, out.stderr
    assert _project(workspace, "packages/miles-core")["version"] == "0.2.0"
    deps = _deps_on(workspace, "miles-core")
    assert set(deps) == {
        "packages/miles-fsdp",
        "packages/miles-launch",
        "packages/miles-megatron",
        "packages/miles-offload",
        "packages/miles-sync",
    }
    for member, reqs in deps.items():
        assert reqs == ["miles-core>=0.2,<0.3"], member
    # Other requirements and the rest of the files are untouched.
    fsdp = (workspace / "packages/miles-fsdp/pyproject.toml").read_text()
    original = _pyproject(*LAYOUT["packages/miles-fsdp"])
    assert fsdp == original.replace('"miles-core>=0.1,<0.2"', '"miles-core>=0.2,<0.3"')
    assert "miles-core: 0.1.0 -> 0.2.0" in out.stdout


def test_major_bump_reaches_optional_dependencies(workspace):
    untouched = _project(workspace, "packages/miles-launch")["optional-dependencies"]["megatron"]
    out = _bump(workspace, "miles-fsdp", "major")
    assert out.returncode == 0, out.stderr
    assert _project(workspace, "packages/miles-fsdp")["version"] == "1.0.0"
    extras = _project(workspace, "packages/miles-launch")["optional-dependencies"]
    assert extras["fsdp"] == ["miles-fsdp>=1.0,<2"]
    assert extras["megatron"] == untouched  # another package's range is left alone
    # From 1.0 on the upper bound is per major; a minor bump raises the lower bound only.
    assert _bump(workspace, "miles-fsdp", "minor").returncode == 0
    assert _project(workspace, "packages/miles-fsdp")["version"] == "1.1.0"
    extras = _project(workspace, "packages/miles-launch")["optional-dependencies"]
    assert extras["fsdp"] == ["miles-fsdp>=1.1,<2"]


def test_native_package_bumps_too(workspace):
    assert _bump(workspace, "miles_native", "minor").returncode == 0
    assert _project(workspace, "native")["version"] == "0.2.0"
    assert _deps_on(workspace, "miles-native") == {
        "packages/miles-offload": ["miles-native>=0.2,<0.3"]
    }


def test_bad_input_is_one_line_and_status_2(workspace):
    out = _bump(workspace, "miles-nope", "minor")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "bump_version: error: unknown package 'miles-nope' (known: miles-core, miles-fsdp, "
        "miles-launch, miles-megatron, miles-native, miles-offload, miles-sync)"
    ]
    out = _bump(workspace, "miles-core", "huge")
    assert out.returncode == 2 and "invalid choice: 'huge'" in out.stderr
    assert _project(workspace, "packages/miles-core")["version"] == "0.1.0"


def test_the_workspace_ranges_start_at_each_siblings_current_release():
    """Every requirement on a sibling reads ``>=its MAJOR.MINOR,<its next incompatible``.

    That is what bump_version leaves behind; a range edited by hand, or one a bump missed, would
    let a user install a combination of releases that was never tested together.
    """
    sys.path.insert(0, str(SCRIPT.parent))
    import bump_version
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    packages = bump_version.workspace_packages(REPO)
    stale = []
    for package in packages.values():
        for requirement in bump_version.dependent_requirements(package.pyproject):
            name = canonicalize_name(Requirement(requirement).name)
            if name in packages:
                assert Requirement(requirement).specifier.contains(packages[name].version)
                if bump_version.retargeted(requirement, packages[name].version) is not None:
                    stale.append(
                        f"{package.name}: {requirement} ({name} is {packages[name].version})"
                    )
    assert stale == []


def test_align_moves_ranges_to_the_current_releases_without_bumping(workspace):
    core = workspace / "packages/miles-core/pyproject.toml"
    core.write_text(core.read_text().replace('version = "0.1.0"', 'version = "0.2.0"'))
    out = _bump(workspace, "--align")
    assert out.returncode == 0, out.stderr
    assert _project(workspace, "packages/miles-core")["version"] == "0.2.0"
    for member, reqs in _deps_on(workspace, "miles-core").items():
        assert reqs == ["miles-core>=0.2,<0.3"], member
    assert _deps_on(workspace, "miles-sync")["packages/miles-fsdp"] == ["miles-sync>=0.1,<0.2"]
    assert _bump(workspace).returncode == 2  # neither a package nor --align
