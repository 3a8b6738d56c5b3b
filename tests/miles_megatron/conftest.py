"""miles_megatron tests: the test-support modules (shim, spawned ranks, tiny models) import by
name; the 2-rank spawn test_layouts.py, test_pipeline.py, test_recompute.py and
test_custom_spec.py share."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def layout_hf_dirs(tmp_path_factory) -> dict[str, str]:
    from megatron_tiny_models import make_tiny_hf

    root = tmp_path_factory.mktemp("layout_hf")
    return {f: str(make_tiny_hf(f, root / f)) for f in ("qwen3_moe", "llama", "qwen3")}


@pytest.fixture(scope="session")
def two_rank_run(layout_hf_dirs, tmp_path_factory) -> list[dict]:
    """Every rank's ``layout_ranks.layouts_then_pipeline`` (the default 2-rank layouts, then
    the PP=2 run of test_pipeline.py, the recompute cases of test_recompute.py and the custom
    spec of test_custom_spec.py on qwen3)."""
    from dist_ranks import spawn_ranks
    from layout_ranks import LAYOUT_ROLLOUTS, layouts_then_pipeline, two_rank_cases

    save = str(tmp_path_factory.mktemp("pipeline") / "ckpt")
    cases = two_rank_cases(layout_hf_dirs)
    return spawn_ranks(
        layouts_then_pipeline,
        2,
        cases,
        LAYOUT_ROLLOUTS,
        layout_hf_dirs["qwen3"],
        save,
        timeout=900,
    )
