"""Every flag that names a user function, walked from the installed argument groups: the same
two accepted forms (``MODULE:FUNCTION``, ``MODULE.FUNCTION``) through the real parser and the
preflight's import check, and the same one-line error for a bad form or a missing module."""

from __future__ import annotations

import re

import pytest
from miles_core.args import ArgumentError, entry_point_groups, installed_groups, parse_args
from miles_core.args.flags import FLAG_METADATA_KEY
from miles_core.user_functions import check_function_flags, function_flags

#: The user-function flags as the docs list them (written out: the walk must find exactly these).
EXPECTED = {
    "custom_advantage_function_path",
    "custom_prepare_path",
    "custom_loss_function_path",
    "custom_rm_path",
    "dynamic_sampling_filter_path",
    "custom_generate_function_path",
    "custom_megatron_init_path",
    "custom_megatron_before_log_prob_hook_path",
    "custom_megatron_before_train_step_hook_path",
}
#: What a flag needs beside it to pass the combination checks.
NEEDS = {
    "dynamic_sampling_filter_path": ["--dynamic-filter"],
}
#: The backend whose groups a flag is parsed with, as ``miles train`` would (FSDP unless named).
BACKEND = {
    "custom_megatron_init_path": "megatron",
    "custom_megatron_before_log_prob_hook_path": "megatron",
    "custom_megatron_before_train_step_hook_path": "megatron",
}


async def user_fn(*args, **kwargs):  # async: --custom-generate-function-path requires it
    return None


@pytest.fixture(scope="module")
def groups():
    return installed_groups()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text('{"prompt": "hi", "label": "1"}\n')
    return str(path)


def test_the_walk_finds_every_user_function_flag(groups):
    dests = {
        f.name
        for g in groups
        for f in g.__dataclass_fields__.values()
        if FLAG_METADATA_KEY in f.metadata
    }
    named_like_one = {
        d for d in dests if re.fullmatch(r"custom_.*_path|.*_function_path|.*_filter_path", d)
    }
    assert named_like_one == EXPECTED  # no user-function flag outside the walk
    assert set(function_flags(groups)) == EXPECTED


@pytest.mark.parametrize("dest", sorted(EXPECTED))
def test_same_forms_and_same_errors(dest, prompts):
    option = "--" + dest.replace("_", "-")
    backend = BACKEND.get(dest, "fsdp")
    groups = entry_point_groups("core", "launch", backend)

    def parse(spec):
        argv = ["--prompt-data", prompts, "--train-backend", backend, option, spec]
        argv += NEEDS.get(dest, [])
        return parse_args(argv, groups)

    for spec in (f"{__name__}:user_fn", f"{__name__}.user_fn"):
        args = parse(spec)
        check_function_flags(args, groups)  # the preflight's import of every named function
    with pytest.raises(ArgumentError) as bad_form:
        parse("nodots")
    assert str(bad_form.value) == f"{option} nodots: expected MODULE:FUNCTION or MODULE.FUNCTION"
    args = None
    try:
        args = parse("no_such_module_uf:f")  # some flags import at parse time already
    except ArgumentError as exc:
        missing = str(exc)
    else:
        with pytest.raises(ArgumentError) as at_preflight:
            check_function_flags(args, groups)
        missing = str(at_preflight.value)
    assert missing.startswith(f"{option} no_such_module_uf:f: cannot import no_such_module_uf (")
    assert "\n" not in missing
