"""The flags generated from megatron-core's config dataclasses come from a checked-in table
(``miles_megatron.megatron_core_fields``, a module per release), so that parsing a command line imports neither
megatron-core nor torch: the installed release's table equals what megatron-core itself declares
(CI runs this on both locked releases), and a bad command line or ``--help`` of a Megatron job
is answered without importing torch, megatron-core or Ray."""

from __future__ import annotations

import subprocess
import sys

from miles_megatron.generated_flags import field_rows, installed_release, introspected_rows
from miles_megatron.megatron_core_fields import rows_of


def test_the_table_is_what_the_installed_megatron_core_declares():
    release = installed_release()
    table = rows_of(release)
    assert table is not None, (
        f"megatron-core {release} has no module: python -m miles_megatron.generated_flags --write"
    )
    rows = introspected_rows()
    assert len(rows) > 100  # the three config classes' flag-able fields
    assert table == rows, "refresh: python -m miles_megatron.generated_flags --write"
    assert field_rows() == rows


PROBE = """
import sys
from miles_launch.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
heavy = sorted(m for m in ("torch", "megatron", "ray", "transformers") if m in sys.modules)
print("HEAVY", code, ",".join(heavy), file=sys.stderr)
"""


def probe(*argv: str) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300
    )
    *lines, last = done.stderr.strip().splitlines()
    _, code, heavy = (last.split(" ") + [""])[:3]
    return int(code), heavy, "\n".join(lines)


def test_argument_errors_and_help_import_no_heavy_module():
    for backend in ("megatron", "fsdp"):
        code, heavy, err = probe("train", "--train-backend", backend, "--lrr", "1")
        assert code == 2 and heavy == "", (backend, heavy, err)
        assert err == "error: unrecognized flag --lrr (did you mean --lr?)"
    # a generated megatron-core flag outside what the backend honours: refused the same way
    code, heavy, err = probe("train", "--virtual-pipeline-model-parallel-size", "2")
    assert code == 2 and heavy == "" and "--virtual-pipeline-model-parallel-size" in err, err
    code, heavy, _ = probe("train", "--help")
    assert code == 0 and heavy == ""


UNPICKLE = """
import pickle, sys
args = pickle.loads(sys.stdin.buffer.read())
cfg = args.run_config
names = sorted(type(g).__name__ for g in cfg.groups if type(g).__name__.startswith("Generated"))
print(",".join(names), args.moe_token_dispatcher_type)
"""


def test_parsed_args_unpickle_in_a_process_that_never_parsed(tmp_path):
    """A job's namespace, ``run_config`` and its generated megatron-core groups included, is
    pickled to every Ray trainer actor: a fresh interpreter rebuilds it (the generated group
    classes are made on pickle's first lookup)."""
    import pickle

    from megatron_ranks import parse
    from megatron_tiny_models import make_tiny_hf

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    args = parse(["--hf-checkpoint", hf_dir, "--moe-token-dispatcher-type", "alltoall"])
    generated = sorted(
        type(g).__name__ for g in args.run_config.groups if type(g).__name__.startswith("Gen")
    )
    assert generated  # the namespace does carry generated groups
    done = subprocess.run(
        [sys.executable, "-c", UNPICKLE], input=pickle.dumps(args), capture_output=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == [",".join(generated), "alltoall"]
