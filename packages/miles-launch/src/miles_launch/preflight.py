"""The preflight of ``miles train``: the whole job checked in the driver before Ray, a trainer
rank, an engine or the tokenizer of the run starts, so that a mistake costs seconds, not a
minute of model loading on every node.

:func:`preflight` returns one line per problem, each naming the flag and the way out (the
command prints them as ``error:`` lines and exits with status 2, as for a bad flag), and the
notes a run prints at startup (a ``--load`` that starts fresh). Checked, in this order:

* ``--hf-checkpoint``: given (the engines boot from it and the run's tokenizer is read from it),
  a directory with a ``config.json`` naming a ``model_type``, safetensors weights (every shard
  its index lists; not needed by a replay that resumes ``--load``), and a tokenizer that
  ``AutoTokenizer`` loads from the directory alone;
* outputs: ``--save``, ``--critic-save``, ``--tensorboard-dir``, ``--offload-train-disk-dir``,
  ``--update-weight-disk-dir``, ``--update-weight-local-checkpoint-dir`` (directories), and
  ``--metrics-jsonl``, ``--save-debug-rollout-data``, ``--save-trigger-sentinel`` (files): each
  can be created and written, tried with a temporary file in its nearest existing directory
  that is removed at once (nothing is left behind); ``--save`` has room for the model's
  weights at least;
* user functions: every flag that names one (``MODULE:FUNC``: the reward, the custom generate,
  advantage, loss, prepare and filter functions, the Megatron hooks) imports and names a
  function; the loss hook's second parameter is named ``logits`` or ``scores`` (the roles
  group's ``preflight``);
* prompts: every record of ``--prompt-data`` and of each ``--eval-prompt-data`` set holds
  ``--input-key`` and, when ``--rm-type`` reads labels, ``--label-key`` (the first bad record
  named by file and line);
* checkpoints: ``--load`` (and the critic's ``--critic-load``) holds a committed checkpoint
  written by this ``--train-backend``, or no tracker at all: then the run starts fresh and says
  so, or refuses under ``--load-required``;
* the machine: every flag group's ``preflight`` hook (the backend's decides whether it runs
  here: Megatron needs a CUDA device, FSDP does not) and a local job's bundles against this
  machine's GPUs;
* memory: the memory plan's estimate per trainer GPU (:mod:`miles_launch.memory_plan`) against
  ``--gpu-memory-gib`` or the local GPU, unless ``--ignore-memory-plan``.

Nothing here starts a process or writes a file that outlives the check.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from miles_core.args import ArgGroup, ArgumentError
from miles_core.args.checks import flag_value
from miles_core.args.parsed import ParsedArgs
from miles_core.checkpoint_layout import TRACKER_FILENAME, CheckpointError, resolve_load
from miles_core.user_functions import check_function_flags
from transformers import AutoTokenizer

from miles_launch.memory_plan import check_memory
from miles_launch.placement import plan_layout
from miles_launch.rollout.prompts import PromptDataError, check_record, read_records
from miles_launch.rollout_args import eval_sets

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass
class PreflightResult:
    """The problems found (each one line) and the notes a run prints at startup."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def preflight(args: ParsedArgs, groups: Sequence[type[ArgGroup]]) -> PreflightResult:
    """Every check of the module docstring; never raises for a problem of the job."""
    result = PreflightResult()
    checks: list[Callable[[], None]] = [
        lambda: check_hf_checkpoint(args),
        lambda: check_outputs(args),
        lambda: check_function_flags(args, groups),
        lambda: check_prompts(args),
        lambda: check_loads(args, result.notes),
        *[lambda group=group: group.preflight(args) for group in groups],
        lambda: check_local_devices(args),
        lambda: check_memory(args, local_gpus() > 0 and not args.ray_address),
    ]
    for check in checks:
        try:
            check()
        except (ArgumentError, PromptDataError) as exc:
            line = " ".join(str(exc).split())
            if line not in result.problems:  # e.g. a hook that does not import, found twice
                result.problems.append(line)
    return result


# ---------------------------------------------------------------------- --hf-checkpoint
def hf_weights_needed(args: ParsedArgs) -> bool:
    """Whether the job reads the HF directory's weights: the engines boot from them and the
    FSDP backend builds from them; only a replay (no engines) that resumes a Megatron
    ``--load`` reads the architecture alone."""
    if not args.load_debug_rollout_data or args.train_backend == "fsdp":
        return True
    try:
        return not (args.load and resolve_load(args.load, args.ckpt_step))
    except CheckpointError:
        return True  # check_loads reports it


def check_hf_checkpoint(args: ParsedArgs) -> None:
    """``--hf-checkpoint``: present, with a config, weights and a loadable tokenizer."""
    hf = args.hf_checkpoint
    if hf is None:
        raise ArgumentError(
            "--hf-checkpoint is required: the HF model directory (config.json, safetensors "
            "weights, tokenizer) the engines boot from and the prompts are tokenized with"
        )
    path = Path(hf)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ArgumentError(
            f"--hf-checkpoint {hf}: no config.json, so no HF model; point it at a model "
            "directory (e.g. what huggingface-cli download or save_pretrained wrote)"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArgumentError(
            f"--hf-checkpoint {hf}: config.json is not valid JSON ({exc})"
        ) from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ArgumentError(f"--hf-checkpoint {hf}: config.json names no model_type")
    if hf_weights_needed(args):
        check_hf_weights(path)
    check_tokenizer(path)


def check_hf_weights(path: Path) -> None:
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ArgumentError(
                f"--hf-checkpoint {path}: {SAFETENSORS_INDEX} is not a safetensors index ({exc})"
            ) from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ArgumentError(
                f"--hf-checkpoint {path}: {len(missing)} of the {len(shards)} shards "
                f"{SAFETENSORS_INDEX} lists are missing, e.g. {missing[0]} (an unfinished "
                "download?)"
            )
        return
    if (path / SAFETENSORS_SINGLE).is_file():
        return
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = f" ({others[0]} is not read: save the model with safe_serialization)" if others else ""
    raise ArgumentError(
        f"--hf-checkpoint {path}: no weights ({SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}){hint}"
    )


#: Files one of which a HF tokenizer is read from.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer.tiktoken",
)


def check_tokenizer(path: Path) -> None:
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ArgumentError(
            f"--hf-checkpoint {path}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy "
            "the tokenizer files of the model next to its config.json"
        )

    try:
        AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types; the first line says which
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ArgumentError(
            f"--hf-checkpoint {path}: the tokenizer does not load ({type(exc).__name__}: {first})"
        ) from None


# ---------------------------------------------------------------------- outputs
def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(option: str, value: str, kind: str) -> Path:
    """``value`` (a directory, or a file when ``kind == "file"``) can be created and written;
    returns the existing directory the check wrote in."""
    path = Path(value)
    target = path if kind == "dir" else path.parent
    if kind == "file" and path.is_dir():
        raise ArgumentError(f"{option} {value}: is a directory; give a file path")
    existing = nearest_existing(target)
    if not existing.is_dir():
        raise ArgumentError(
            f"{option} {value}: {existing} is a file, so no directory can be made under it; "
            "choose another path"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".miles-preflight-", dir=existing)
    except OSError as exc:
        raise ArgumentError(
            f"{option} {value}: cannot write in {existing} ({exc.strerror}); choose a writable path"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return existing


#: Output directories and files checked (``(dest, kind)``), in the order reported.
OUTPUTS = (
    ("save", "dir"),
    ("critic_save", "dir"),
    ("tensorboard_dir", "dir"),
    ("offload_train_disk_dir", "dir"),
    ("update_weight_disk_dir", "dir"),
    ("update_weight_local_checkpoint_dir", "dir"),
    ("metrics_jsonl", "file"),
    ("save_debug_rollout_data", "file"),
    ("save_trigger_sentinel", "file"),
)


def check_outputs(args: ParsedArgs) -> None:
    for dest, kind in OUTPUTS:
        value = flag_value(args, dest)
        if value:
            existing = check_writable("--" + dest.replace("_", "-"), str(value), kind)
            if dest == "save":
                check_free_space(args, existing)


def hf_weight_bytes(hf: str | None) -> int:
    """Bytes of the HF directory's safetensors files (0 when unknown)."""
    if not hf or not Path(hf).is_dir():
        return 0
    return sum(p.stat().st_size for p in Path(hf).glob("*.safetensors"))


def check_free_space(args: ParsedArgs, existing: Path) -> None:
    """``--save`` has room for one checkpoint's model weights at least (a lower bound: the
    optimizer state, when saved, comes on top)."""
    need = hf_weight_bytes(args.hf_checkpoint)
    free = shutil.disk_usage(existing).free
    if need and free < need:
        raise ArgumentError(
            f"--save {args.save}: {free / 1e9:.2f} GB free in {existing}, and one checkpoint "
            f"holds at least the model's {need / 1e9:.2f} GB of weights; free space or choose "
            "another disk"
        )


# ---------------------------------------------------------------------- prompts
def label_reader(args: ParsedArgs) -> str | None:
    """The flag of the reward that reads each prompt's label (None: no built-in reward)."""
    return f"--rm-type {args.rm_type}" if args.rm_type else None


def check_prompts(args: ParsedArgs) -> None:
    """Every record of the prompt sets has the keys the job reads (module docstring)."""
    files = [("--prompt-data", args.prompt_data)] if args.prompt_data else []
    files += [(f"--eval-prompt-data {name}", path) for name, path in eval_sets(args).items()]
    if args.load_debug_rollout_data:
        files = []  # a replay draws no prompts
    reader = label_reader(args)
    for option, path in files:
        count = 0
        try:
            for where, record in read_records(Path(path)):
                check_record(
                    where, record, args.input_key, args.metadata_key, args.label_key, reader
                )
                count += 1
        except PromptDataError as exc:
            raise PromptDataError(f"{option} {exc}") from None
        except UnicodeDecodeError:
            raise PromptDataError(f"{option} {path}: not UTF-8 text") from None
        if not count:
            raise PromptDataError(f"{option} {path}: no prompts")


# ---------------------------------------------------------------------- checkpoints
def check_loads(args: ParsedArgs, notes: list[str]) -> None:
    """``--load`` and ``--critic-load``: a committed checkpoint of this backend, or nothing."""
    targets = [("--load", args.load)]
    if args.use_critic:
        targets.append(("--critic-load", args.critic_load))
    for option, path in targets:
        if not path:
            continue
        if not Path(path).exists() and os.path.abspath(path) in created_outputs(args):
            notes.append(f"resume: {option} {path}: nothing saved there yet: starting fresh")
            continue
        if not Path(path).exists():
            raise ArgumentError(
                f"{option} {path}: no such directory; leave {option} out to start fresh, or "
                "point it at the --save directory of an earlier run"
            )
        try:
            resolved = resolve_load(path, args.ckpt_step)
        except CheckpointError as exc:
            message = str(exc)
            prefix = "" if message.startswith(option) else f"{option} {path}: "
            raise ArgumentError(prefix + message) from None
        if resolved is None:
            if args.load_required:
                raise ArgumentError(
                    f"{option} {path}: no checkpoint ({TRACKER_FILENAME} missing) and "
                    "--load-required; point it at the --save directory of an earlier run"
                )
            notes.append(
                f"resume: {option} {path}: no checkpoint there (no {TRACKER_FILENAME}): "
                "starting fresh"
            )
            continue
        written_by = resolved.meta.backend
        if written_by != args.train_backend:
            raise ArgumentError(
                f"{option} {path}: iteration {resolved.iteration} was written by "
                f"--train-backend {written_by}, which --train-backend {args.train_backend} "
                f"cannot read; resume with --train-backend {written_by}"
            )
        notes.append(
            f"resume: {option} {path}: iteration {resolved.iteration} (next rollout "
            f"{resolved.meta.next_rollout_id + 1} of {args.num_rollout})"
        )


def created_outputs(args: ParsedArgs) -> list[str]:
    """The directories the driver creates once the preflight passed (:func:`make_outputs`):
    ``--save``, the critic's ``--critic-save`` and ``--tensorboard-dir``, and the directory of
    ``--metrics-jsonl``; a ``--load`` naming one of them (resume-or-start) starts fresh."""
    dirs = [args.save, args.critic_save, args.tensorboard_dir]
    if args.metrics_jsonl:
        dirs.append(os.path.dirname(os.path.abspath(args.metrics_jsonl)))
    return [os.path.abspath(d) for d in dirs if d]


def make_outputs(args: ParsedArgs) -> None:
    """Create :func:`created_outputs` (after a preflight that passed, so they can be)."""
    for path in created_outputs(args):
        Path(path).mkdir(parents=True, exist_ok=True)


# ---------------------------------------------------------------------- placement
def local_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_devices(args: ParsedArgs) -> None:
    """A local Ray (no ``--ray-address``) gets this machine's GPUs: the job's bundles, one GPU
    each, must fit them (without GPUs every bundle is a CPU slot, and those always fit)."""
    if args.ray_address:
        return
    gpus = local_gpus()
    if not gpus:
        return

    layout = plan_layout(args, use_gpu=True)
    if layout.num_bundles > gpus:
        raise ArgumentError(
            f"the job needs {layout.num_bundles} GPUs ({layout.num_trainer_ranks} trainer ranks"
            + (f" + {layout.num_critic_ranks} critic" if layout.num_critic_ranks else "")
            + (
                ""
                if layout.colocate
                else f" + {layout.num_engines * layout.gpus_per_engine} for engines"
            )
            + f") and this machine has {gpus}: lower --actor-num-gpus-per-node"
            + ("" if layout.colocate else " / --rollout-num-gpus, or --colocate")
            + ", or join a cluster with --ray-address"
        )
