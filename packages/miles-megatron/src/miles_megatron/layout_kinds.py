"""The parallel layouts a Megatron job may use: the kinds a test proves against HF, and a
one-line refusal of every other kind at argument time.

A layout's *kind* is the set of its dimensions larger than one, whatever their sizes: TP, PP,
CP and DP (the world divided by TP x PP x CP) on a dense model, TP, PP, DP and EP on an MoE
model (CP is refused on MoE models: ``args.check_parallel_sizes``). TP=2 x DP=2 and TP=4 x DP=8
are one kind. A kind is *proven* when a case of the layout suites trains it for several
rollouts and equals HF + AdamW (``tests/miles_megatron/test_layouts.py`` at 2, 4, 8 and 16
ranks, ``test_context_parallel.py``, ``test_backend.py``);
``tests/miles_megatron/test_layout_kinds.py`` derives the kinds of those suites' cases and
asserts they are exactly the tables below, so a table cannot name a kind no test runs. Today
every kind the size checks let through is proven; a dimension added later (CP on MoE models,
virtual pipeline stages) is refused here until a case proves it.

The check belongs to the job: it runs when the launcher's flags give the trainer's world size
(``--actor-num-nodes`` x ``--actor-num-gpus-per-node``). The backend used as a library (ranks
started by other means) builds any layout megatron-core can build.
"""

from __future__ import annotations

from miles_core.args import ArgumentError
from miles_core.args.parsed import ParsedArgs

#: the order a kind is written in
DIMENSIONS = ("tp", "pp", "cp", "dp", "ep")

#: dense kinds -> the layout-suite case that proves each (test_layouts.py,
#: test_context_parallel.py, test_backend.py; one rank: the conformance and HF-parity tests)
PROVEN_DENSE: dict[frozenset[str], str] = {
    frozenset(): "one rank",
    frozenset({"dp"}): "llama dp2",
    frozenset({"tp"}): "test_backend.py, TP 2",
    frozenset({"pp"}): "llama pp2",
    frozenset({"cp"}): "llama cp2",
    frozenset({"tp", "dp"}): "llama tp2 dp2",
    frozenset({"pp", "dp"}): "llama pp2 dp2",
    frozenset({"cp", "dp"}): "llama cp2 dp2",
    frozenset({"tp", "pp"}): "llama pp2 tp2",
    frozenset({"tp", "cp"}): "llama cp2 tp2",
    frozenset({"pp", "cp"}): "llama cp2 pp2",
    frozenset({"tp", "pp", "dp"}): "llama tp2 pp2 dp2",
    frozenset({"tp", "cp", "dp"}): "llama tp2 cp2 dp2",
    frozenset({"pp", "cp", "dp"}): "llama pp2 cp2 dp2",
    frozenset({"tp", "pp", "cp"}): "llama tp2 pp2 cp2",
    frozenset({"tp", "pp", "cp", "dp"}): "llama tp2 pp2 cp2 dp2",
}

#: MoE kinds -> the case that proves each (test_layouts.py). EP alone and PP x EP cannot be
#: built (EP takes ranks of DP or TP: ``check_parallel_sizes``); CP is refused on MoE models.
PROVEN_MOE: dict[frozenset[str], str] = {
    frozenset(): "one rank",
    frozenset({"dp"}): "moe dp2",
    frozenset({"tp"}): "moe tp2",
    frozenset({"pp"}): "moe pp2",
    frozenset({"tp", "dp"}): "moe tp2 dp4",
    frozenset({"pp", "dp"}): "moe pp2 dp4",
    frozenset({"tp", "pp"}): "moe tp2 pp2",
    frozenset({"tp", "ep"}): "moe tp2 ep2 etp1",
    frozenset({"dp", "ep"}): "moe ep2",
    frozenset({"tp", "dp", "ep"}): "moe tp2 ep2 (ETP 1 and 2)",
    frozenset({"pp", "dp", "ep"}): "moe pp2 ep2",
    frozenset({"tp", "pp", "dp"}): "moe tp2 pp2 dp2",
    frozenset({"tp", "pp", "ep"}): "moe tp2 pp2 ep2 etp1",
    frozenset({"tp", "pp", "dp", "ep"}): "moe tp2 pp2 ep2 dp2",
}


def layout_kind(tp: int, pp: int, cp: int, ep: int, world: int) -> frozenset[str]:
    """The dimensions larger than one of a layout of ``world`` ranks."""
    sizes = {"tp": tp, "pp": pp, "cp": cp, "dp": world // (tp * pp * cp), "ep": ep}
    return frozenset(d for d, size in sizes.items() if size > 1)


def kind_name(kind: frozenset[str]) -> str:
    """``TP x PP x DP``; ``no parallelism`` for the empty kind."""
    return " x ".join(d.upper() for d in DIMENSIONS if d in kind) or "no parallelism"


def check_layout_kind(args: ParsedArgs, world: int, moe: bool) -> None:
    """Refuse, in one line, a layout whose kind the layout suites do not prove.

    Runs after ``check_parallel_sizes`` (the sizes divide the world and suit the model)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp, ep = args.context_parallel_size, args.expert_model_parallel_size
    kind = layout_kind(tp, pp, cp, ep, world)
    proven = PROVEN_MOE if moe else PROVEN_DENSE
    if kind in proven:
        return
    named = {
        "--tensor-model-parallel-size": tp,
        "--pipeline-model-parallel-size": pp,
        "--context-parallel-size": cp,
        "--expert-model-parallel-size": ep,
    }
    flags = " ".join(f"{name} {size}" for name, size in named.items() if size > 1)
    model = "an MoE model" if moe else "a dense model"
    listed = ", ".join(kind_name(k) for k in proven if k)
    raise ArgumentError(
        f"{flags} on {world} GPUs (DP {world // (tp * pp * cp)}) is a {kind_name(kind)} layout "
        f"on {model}, which no test proves against HF yet; proven on {model.split(' ', 1)[1]}s: {listed}, at any "
        "sizes (docs/miles-megatron.md, Parallel layouts)"
    )
