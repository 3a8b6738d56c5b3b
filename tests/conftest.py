"""Shared test configuration: GPU tests skip without CUDA."""

import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton decides at decoration
# time, so this must be set before any test imports miles_native.kernels (directly or through
# miles_fsdp's MoE adaptation).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords or "/tests/gpu/" in str(item.fspath):
            item.add_marker(skip)


# ---- the released SGLang package, run as code (tests/sglang_release.py) ----------------------
@pytest.fixture(scope="session")
def sglang_release():
    """The unpacked ``sglang`` wheel's root; skips (one line) where it cannot be fetched."""
    import sglang_release as release

    missing = release.missing_modules()
    if missing:
        pytest.skip(f"sglang {release.SGLANG_VERSION} harness: {missing} not installed (uv sync)")
    try:
        return release.fetch()
    except release.Unavailable as error:
        pytest.skip(f"sglang {release.SGLANG_VERSION} not fetched: {error}")


@pytest.fixture(scope="session")
def sglang_router_release():
    """The unpacked ``sglang-router`` wheel's root, or None where it cannot be fetched."""
    import sglang_release as release

    try:
        return release.fetch("sglang-router", release.ROUTER_VERSION)
    except release.Unavailable:
        return None


@pytest.fixture(scope="session")
def sglang_engine(sglang_release, sglang_router_release, tmp_path_factory):
    """One engine stand-in process per session whose weight handlers are SGLang's own code
    (tests/sglang_conformance/stand_in.py), as a :class:`StandInEngine`."""
    from sglang_conformance.stand_in_client import StandInEngine

    log = tmp_path_factory.mktemp("sglang") / "stand_in.log"
    engine = StandInEngine(sglang_release, sglang_router_release, log)
    yield engine
    engine.close()
