"""Fixtures of the built-in engine tests (``test_builtin_engine_*.py``), and ``material``: the
demo's tiny model and prompts the ``miles train`` end-to-end modules run on (one per module).

One built-in engine server serves all of those modules (session scope: each server start costs
a subprocess with torch, transformers and a model load). It serves a tiny Qwen3 saved to disk
(``models["old"]``); a second set of weights (another seed, ``models["new"]``) is what the
weight-update tests load, and they restore the first afterwards. Modules that define their own
``models`` fixture (test_client_engine) override this one.
"""

from __future__ import annotations

import pytest
from demo_jobs import ppo_critic_job
from engine_testing import EngineProcess, save_tokenizer, tiny_qwen3
from miles_launch.demo import build_tiny_qwen3, write_demo_prompts

#: The shared engine's API key: its tests (the fuzz test among them) run with a key set, as a
#: job's engines do; ``engine.client`` sends it.
ENGINE_API_KEY = "shared-engine-key-0123456789"


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    tokenizer = None
    out = {}
    for name, seed in (("old", 0), ("new", 1)):
        model = tiny_qwen3(seed)
        model.save_pretrained(root / name)
        tokenizer = save_tokenizer(root / name)
        out[name] = (root / name, model)
    out["tokenizer"] = tokenizer
    out["references"] = {}
    return out


@pytest.fixture(scope="session")
def builtin_server(models):
    server = EngineProcess(
        models["old"][0],
        "--enable-weights-cpu-backup",
        "--max-running-requests",
        "3",
        api_key=ENGINE_API_KEY,
    )
    yield server
    server.close()


@pytest.fixture
def engine(builtin_server):
    """The shared server; a failed pause test must not leave it paused for the next ones."""
    yield builtin_server
    builtin_server.post("/continue_generation")


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    """(the demo's tiny Qwen3 directory, its prompts file)."""
    root = tmp_path_factory.mktemp("demo")
    return build_tiny_qwen3(root / "tiny-qwen3"), write_demo_prompts(root / "prompts.jsonl")


@pytest.fixture(scope="session")
def ppo_critic_run(tmp_path_factory):
    """One live :data:`demo_jobs.PPO_CRITIC` job (the critic in the trainer's 2 ranks, 1 built-in
    engine), shared by the tests that compare another job with it: the replay of its saved
    rollouts with no engine (test_debug_rollout_data.py), the critic on its own rank
    (test_critic_own_ranks_e2e.py) and the restart from its checkpoint of 1 (test_ppo_e2e.py). ``(material, output directory, its log)``; the output holds
    ``metrics.jsonl``, ``ckpt/`` (``iter_0000001``, ``iter_0000002``) and
    ``rollout_{0,1}.pt``."""
    root = tmp_path_factory.mktemp("ppo_critic")
    material = build_tiny_qwen3(root / "tiny-qwen3"), write_demo_prompts(root / "prompts.jsonl")
    result = ppo_critic_job(material, root / "run")
    return material, root / "run", result.stdout + result.stderr
