"""Frozen roles: (2 gloo ranks) reference and teacher outputs equal dense HF copies and differ
from the actor, hooks see every role by component, the KL term reads the reference, sleep/wake
over all roles keeps outputs; argument errors of the backend."""

from __future__ import annotations

import pytest
import torch
from dense_reference import dense_logits
from miles_core.args import ArgumentError
from miles_fsdp.roles import FrozenSource, component_names, frozen_role
from role_programs import roles_program, sleep_cycles_program
from run_args import make_args
from spawn import run_ranks
from test_lora import save_adapter
from tiny_models import arch_config, qwen3_config, save_tiny_model


@pytest.mark.slow
def test_reference_and_teacher_two_ranks(tmp_path):
    hf_dir = save_tiny_model(tmp_path / "actor", seed=0)
    ref_dir = save_tiny_model(tmp_path / "ref", seed=1)
    teacher_dir = save_tiny_model(tmp_path / "teacher", seed=2)
    ref_adapter = save_adapter(str(ref_dir), tmp_path / "ref_adapter")
    data = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "out.pt"
    run_ranks(
        2,
        roles_program,
        *map(str, (hf_dir, ref_dir, ref_adapter, teacher_dir)),
        data,
        str(tmp_path / "ckpt"),
        str(out),
        timeout=400,
    )
    res = torch.load(out, weights_only=True)
    mine = data[0::2]  # rank 0's rows
    expected = {
        "actor": dense_logits(hf_dir, mine),
        "reference": dense_logits(ref_dir, mine, ref_adapter),
        "teacher": dense_logits(teacher_dir, mine),
    }
    for role, value in expected.items():
        torch.testing.assert_close(res["logits"][role].double(), value, atol=2e-5, rtol=0)
    assert (res["logits"]["reference"] - res["logits"]["actor"]).abs().max() > 1e-2
    assert (res["logits"]["teacher"] - res["logits"]["actor"]).abs().max() > 1e-2
    assert res["frozen"] == {"reference": (False, False), "teacher": (False, False)}
    assert res["seen"] == {
        "models": ["model"],
        "reference": ["model"],
        "teacher": ["model"],
        "teacher_requires_grad": False,
    }
    assert res["metrics"]["kl_loss"] > 0  # the reference differs from the actor
    # training moved the actor only; sleep/wake (the teacher is CPU-offloaded: never sleeps)
    assert not torch.equal(res["trained"]["actor"], res["logits"]["actor"])
    for role in ("reference", "teacher"):
        torch.testing.assert_close(res["trained"][role], res["logits"][role], atol=0, rtol=0)
    for role, value in res["trained"].items():
        torch.testing.assert_close(res["after_sleep"][role], value, atol=0, rtol=0)
    assert res["skipped"] == ["teacher"]
    # never checkpointed: the iteration holds the actor only; a resume rebuilds the frozen
    # roles from --ref-load / --teacher-load (and the reference's adapter)
    import torch.distributed.checkpoint as dcp

    it = tmp_path / "ckpt" / "iter_0000001"
    assert {p.name for p in it.iterdir()} == {
        "model",
        "optimizer",
        "lr_scheduler",
        "rng.pt",
        "meta.json",
    }
    saved = dcp.FileSystemReader(str(it / "model")).read_metadata().state_dict_metadata
    assert sorted(saved) == sorted(f"model.{k}" for k in res["actor_keys"])
    torch.testing.assert_close(res["resumed"]["actor"], res["trained"]["actor"], atol=0, rtol=0)
    for role in ("reference", "teacher"):
        torch.testing.assert_close(res["resumed"][role], res["logits"][role], atol=0, rtol=0)


def test_causal_lm_has_one_component():
    assert component_names(make_args()) == ["model"]
    assert component_names(make_args(update_weight_target_module=["lm"])) == ["lm"]
    with pytest.raises(ArgumentError, match="trains a causal LM, one component, got 2 \\(a, b\\)"):
        component_names(make_args(update_weight_target_module=["a", "b"]))


def test_frozen_role_of_another_family_rejected(tmp_path):
    other = save_tiny_model(tmp_path / "moe", config=arch_config("qwen3_moe"))
    with pytest.raises(
        ArgumentError, match="the reference is a 'qwen3_moe' model, the actor a 'qwen3' one"
    ):
        frozen_role(FrozenSource("reference", other), qwen3_config())


def test_hooks_load_by_module_and_name():
    from miles_core.user_functions import load_function as load_hook
    from miles_fsdp.hooks import HookContext, Hooks

    assert load_hook("role_programs:record_prepare", "--custom-prepare-path").__name__ == (
        "record_prepare"
    )
    assert load_hook("role_programs.record_prepare", "--custom-prepare-path").__name__ == (
        "record_prepare"
    )
    hooks = Hooks.from_args(
        make_args(custom_loss_function_path="hook_programs:distill_loss"),
        HookContext(args=None, device=torch.device("cpu")),
    )
    assert hooks.prepare is None and hooks.loss.fn.__name__ == "distill_loss"
    assert hooks.loss.wants_logits


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nosuchmodule_xyz:f", "--custom-loss-function-path nosuchmodule_xyz:f: cannot import"),
        (
            "role_programs:nope",
            "--custom-loss-function-path role_programs:nope: role_programs has no function nope",
        ),
        ("plain", "--custom-loss-function-path plain: expected MODULE:FUNCTION"),
    ],
)
def test_hook_errors_name_the_flag(spec, message):
    from miles_core.user_functions import load_function as load_hook

    with pytest.raises(ArgumentError, match=message):
        load_hook(spec, "--custom-loss-function-path")


def assert_sleep_cycles_match(res):
    """The slept run equals the never-slept control after every cycle, bit for bit: actor
    parameters, EMA, AdamW state (so every optimizer update), losses and every role's logits."""
    assert len(res["control"]) == len(res["slept"]) == 3
    for cycle, (control, slept) in enumerate(zip(res["control"], res["slept"])):
        assert slept["memory"]["asleep"] and not slept["memory"]["asleep_after_train"], cycle
        assert slept["loss"] == control["loss"], cycle
        for part in ("params", "ema"):
            assert control[part].keys() == slept[part].keys()
            for name, value in control[part].items():
                torch.testing.assert_close(
                    slept[part][name], value, atol=0, rtol=0, msg=f"cycle {cycle} {part} {name}"
                )
        assert control["adam"].keys() == slept["adam"].keys() and control["adam"]
        for name, state in control["adam"].items():
            for key, value in state.items():
                torch.testing.assert_close(
                    slept["adam"][name][key], value, atol=0, rtol=0, msg=f"{cycle} {name} {key}"
                )
        assert sorted(control["logits"]) == ["actor", "reference", "teacher"]
        for role, value in control["logits"].items():
            torch.testing.assert_close(
                slept["logits"][role], value, atol=0, rtol=0, msg=f"cycle {cycle} {role}"
            )
    # the actor trained between cycles (the comparison is not of a model that never changes)
    first, last = res["control"][0]["params"], res["control"][-1]["params"]
    assert any(not torch.equal(first[n], last[n]) for n in first)


@pytest.mark.slow
def test_sleep_cycles_all_roles_match_never_slept_on_cpu(tmp_path):
    """The GPU test's program on 2 gloo ranks: the CPU mover's path, same comparison."""
    dirs = [str(save_tiny_model(tmp_path / name, seed=s)) for s, name in enumerate("art")]
    data = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "out.pt"
    run_ranks(2, sleep_cycles_program, *dirs, data, str(out), timeout=500)
    res = torch.load(out, weights_only=True)
    assert_sleep_cycles_match(res)
    for cycle in res["slept"]:
        assert cycle["memory"]["must_move"] > 0
