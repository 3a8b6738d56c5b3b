"""Shared test configuration: GPU tests skip without CUDA; the suite runs on every core."""

import os
from pathlib import Path

import pytest
import torch
from timeouts import scaled

# --budget-report FILE: each test's wall and CPU seconds and process starts (docs/ci.md)
pytest_plugins = ["ci_budget"]

# Without a GPU the Triton kernels run in Triton's interpreter. Triton decides at decoration
# time, so this must be set before any test imports miles_native.kernels (directly or through
# miles_fsdp's MoE adaptation).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- every core (pytest-xdist: `-n auto --dist loadgroup` in pyproject.toml) ------------------
# Each worker runs one test at a time. A test that starts other processes (spawned gloo ranks, a
# job on Ray, an engine server) may run beside another worker's test: a job on Ray keeps about
# one of two cores busy (docs/ci.md), so two at a time finish sooner than one after another.
# What must not be built twice, or run twice at once, stays on one worker through an xdist
# group: the session-scoped servers and spawns that several modules share
# (SHARED_FIXTURE_GROUPS), the network-namespace cluster, and each module whose tests share a
# module-scoped fixture (one spawn serving several tests) unless that fixture is cheap to build
# on each worker (CHEAP_FIXTURES).

#: Session fixtures that hold a process or a long spawn, shared by several modules.
SHARED_FIXTURE_GROUPS = {
    "builtin_server": "builtin_engine",
    "sglang_engine": "sglang_stand_in",
    "two_rank_run": "megatron_two_rank",
    "ppo_critic_run": "ppo_critic_job",
}
#: Module-scoped fixtures cheap enough for each worker to build its own (tiny models on disk).
CHEAP_FIXTURES = {"material", "hf_dir", "checkpoint", "one_rank_group"}


def _xdist_group(item) -> str | None:
    names = set(getattr(item, "fixturenames", ()))
    for fixture, group in SHARED_FIXTURE_GROUPS.items():
        if fixture in names:
            return group
    if "/tests/multihost/" in str(item.fspath):
        return "netns"
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in info.name2fixturedefs.items() if info else ():
        if name not in CHEAP_FIXTURES and defs and defs[-1].scope in ("module", "package"):
            return item.nodeid.split("::")[0]
    return None


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 4 (each holds torch and the test models), none
    on a GPU node; ``MILES_TEST_WORKERS`` overrides, 0 runs everything in this process."""
    if "MILES_TEST_WORKERS" in os.environ:
        return int(os.environ["MILES_TEST_WORKERS"])
    if torch.cuda.is_available():
        return 0  # tests/gpu: one test at a time owns the devices
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # cores are shared out between workers, not within one: torch here and in every
        # process a test starts (a subprocess compared bit for bit with this one computes with
        # as many threads)
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["MKL_NUM_THREADS"] = "1"


#: The numeric tests whose tolerance depends on the CPU's vector kernels, with the reason; they
#: are marked ``kernels`` and CI runs them again on ATen's portable kernels (.ci/run). The
#: other ``numeric`` tests (float64 formulas, elementwise fp32 against float64) do not depend
#: on how a kernel orders its sums.
FP32_SUMS = (
    "fp32 sums (matmuls, attention, reductions) whose rounding depends on the kernel's vector width"
)
KERNEL_DEPENDENT = {
    "miles_core/test_batch_invariant.py": (
        f"batch-invariant ops vs float64, and torch's own GEMV/GEMM and SDPA shown to differ: "
        f"{FP32_SUMS}"
    ),
    "miles_core/test_log_prob_head.py": f"fused log-prob head vs float64: {FP32_SUMS}",
    "miles_core/test_batch_invariant_head.py": (
        f"the mode's fused head vs its dense path and torch's BLAS head: {FP32_SUMS}"
    ),
    "miles_core/test_loss_equivalence.py": f"fp32 packed pipeline vs float64 model: {FP32_SUMS}",
    "miles_core/test_packing.py": f"packed vs unpacked fp32 attention: {FP32_SUMS}",
    "miles_fsdp/test_adaptations.py": f"adapted vs HF fp32 forward: {FP32_SUMS}",
    "miles_fsdp/test_critic.py": f"fp32 critic training vs float64 reference: {FP32_SUMS}",
    "miles_fsdp/test_fsdp_log_prob_head.py": f"fp32 head vs float64 reference: {FP32_SUMS}",
    "miles_fsdp/test_glm_routing_replay.py": f"fp32 MoE forward vs HF: {FP32_SUMS}",
    "miles_fsdp/test_lora.py": f"fp32 LoRA training vs PEFT: {FP32_SUMS}",
    "miles_fsdp/test_loss_scale.py": f"fp32 gradients at two scales: {FP32_SUMS}",
    "miles_fsdp/test_moe.py": f"fp32 MoE forward/backward vs HF: {FP32_SUMS}",
    "miles_fsdp/test_routing_replay_engine.py": f"engine vs trainer fp32 log-probs: {FP32_SUMS}",
    "miles_fsdp/test_step_slices.py": f"fp32 steps vs float64 reference: {FP32_SUMS}",
    "miles_fsdp/test_train.py": f"fp32 FSDP training vs float64 HF: {FP32_SUMS}",
    "miles_megatron/test_context_parallel.py": f"fp32 CP attention vs HF: {FP32_SUMS}",
    "miles_megatron/test_estimator_parity.py": f"fp32 rollouts vs float64 reference: {FP32_SUMS}",
    "miles_megatron/test_pairwise_flags.py": f"fp32 rollouts vs float64 reference: {FP32_SUMS}",
    "miles_megatron/test_megatron_critic.py": f"fp32 critic vs float64 reference: {FP32_SUMS}",
    "miles_megatron/test_megatron_log_prob_head.py": f"fp32 head vs float64: {FP32_SUMS}",
    "miles_megatron/test_megatron_logits.py": f"fp32 logits vs HF: {FP32_SUMS}",
    "miles_megatron/test_megatron_loss_type.py": f"fp32 losses vs float64 HF: {FP32_SUMS}",
    "miles_megatron/test_megatron_step_slices.py": f"fp32 steps vs float64 reference: {FP32_SUMS}",
    "miles_megatron/test_megatron_varlen.py": f"fp32 varlen attention vs HF: {FP32_SUMS}",
    "miles_megatron/test_packed_forward.py": f"packed fp32 forward vs HF: {FP32_SUMS}",
    "miles_megatron/test_routing_replay.py": f"replayed fp32 MoE log-probs vs float64 HF: {FP32_SUMS}",
    "miles_megatron/test_run_mcore_fsdp.py": f"fp32 training vs reference: {FP32_SUMS}",
    "miles_megatron/test_sdpa_attention.py": f"fp32 sdpa vs HF attention: {FP32_SUMS}",
    "miles_native/test_fused_moe_hf.py": f"fused MoE kernel vs HF fp32: {FP32_SUMS}",
    "miles_native/test_batch_invariant_kernels.py": (
        f"interpreted Triton tiles (numpy dots) vs float64, backward in torch fp32: {FP32_SUMS}"
    ),
    "miles_offload/test_streamed_adam.py": f"streamed vs torch fp32 Adam: {FP32_SUMS}",
}
#: ``numeric`` modules that do not depend on the kernels, with the reason.
KERNEL_INDEPENDENT = {
    "miles_core/test_advantages.py": "elementwise fp32 and float64 formulas, no kernel sums",
    "miles_core/test_losses.py": "elementwise loss formulas against float64, no kernel sums",
    "miles_core/test_mismatch.py": "elementwise fp32 terms and short masked means, no kernel sums",
    "miles_core/test_off_policy_masking.py": "elementwise PPO terms and short per-sample means",
    "miles_core/test_rollout_correction.py": "elementwise weights and short per-sample sums",
    "miles_fsdp/test_compiled_layers.py": "inductor's kernels against ATen's: the bound is the "
    "sum of both paths' rounding bounds, whatever order either sums in",
    "miles_megatron/test_compiled_layers_megatron.py": "inductor's kernels against ATen's, as "
    "miles_fsdp/test_compiled_layers.py",
}


def pytest_itemcollected(item):
    # as each test is collected: before xdist's pytest_collection_modifyitems reads the marks
    group = _xdist_group(item)
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    tests_root = Path(__file__).parent
    for item in items:
        path = Path(str(item.fspath))
        module = path.relative_to(tests_root).as_posix() if path.is_relative_to(tests_root) else ""
        if item.get_closest_marker("numeric") is not None and "/gpu/" not in str(path):
            if module in KERNEL_DEPENDENT:
                item.add_marker(pytest.mark.kernels(KERNEL_DEPENDENT[module]))
            elif module not in KERNEL_INDEPENDENT:
                raise pytest.UsageError(
                    f"{module}: a numeric test module must be listed in tests/conftest.py's "
                    "KERNEL_DEPENDENT or KERNEL_INDEPENDENT, with the reason"
                )
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords or "/tests/gpu/" in str(item.fspath):
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    # after pytest-timeout read its setting (in its pytest_configure): a hang's safety net is
    # stretched by how many tests share the machine (tests/timeouts.py)
    config = session.config
    if getattr(config, "_env_timeout", None):
        config._env_timeout = scaled(config._env_timeout)


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
