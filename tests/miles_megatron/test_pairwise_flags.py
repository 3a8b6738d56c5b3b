"""Pairwise coverage of the RL flags (tests/miles_megatron/pairwise_flags.py): every two values
of every two of --advantage-estimator, --loss-type / --policy-loss, --use-kl-loss with each
--kl-loss-type and --kl-loss-coef, --entropy-coef, --use-tis with --tis-clip and
--tis-clip-low, --calculate-per-token-loss, --normalize-advantages, --eps-clip and
--eps-clip-high meet in some case, unless the argument checks refuse them together.

Default suite (no training): the cases cover every pair not refused; every case parses through
FSDP's real command line, which refuses every pair left out (exit status 2, one line); the
``extended`` test checks the same on Megatron's.

``extended``: each case trains one rollout (2 optimizer steps, the LR decaying, masked samples
carrying engine log-probs) on FSDP at one rank and on Megatron at TP = 2 (2 gloo ranks, every
case in one spawn per backend). Each step of each run equals the float64 step of
tests/miles_megatron/estimator_reference.py (HF transformers and torch's AdamW, the formulas
written from the papers and docs/rl-math.md) taken from the weights that run had before it and
with the old policy's and reference model's log-probs its loss read (teacher forcing,
tests/forced_adam.py; those log-probs are held to the float64 ones of the checkpoint at every
trained token, on every rank), within the bounds it derives from tests/tolerances.py for one
step: the loss and its parts, gradient norm and LR, each trained token's log-prob and entropy
(score_capture.py, on every rank), and every weight after the step; and every response
log-prob after the rollout. The two backends' values differ by at most their two bounds plus
the difference of the float64 steps from their two starting points. Coverage: the KL loss and
the TIS weight are reported where they are on, the TIS truncation and the PPO clip changed
some case's loss, the cases hold every --advantage-estimator and --loss-type value.
"""

from __future__ import annotations

import pytest
import torch
from pairwise_flags import (
    FACTORS,
    REFUSED,
    all_pairs,
    case_flags,
    case_name,
    case_objective,
    completion,
    pairs_of,
    pairwise_cases,
    refused,
    required_pairs,
)

pytest.importorskip("miles_fsdp")


def parser(backend: str, hf_dir: str):
    """``argv -> args``: the real command line of ``backend`` (``parse_args_or_exit``)."""
    from miles_core.args import core_groups
    from miles_core.args.parser import parse_args_or_exit
    from miles_core.backends import load

    groups = [*core_groups(), *load(backend).arg_groups()]
    base = ["--hf-checkpoint", hf_dir, "--micro-batch-size", "2", "--no-bf16"]
    return lambda argv: parse_args_or_exit([*base, *argv], groups)


def check_parses(backend: str, hf_dir: str, capsys) -> None:
    """Every case parses on ``backend``'s command line; every pair left out is refused there
    (exit status 2, one ``error:`` line)."""
    parse = parser(backend, hf_dir)
    capsys.readouterr()  # what ran before (a checkpoint's progress bar)
    for case in pairwise_cases():
        assert not refused(case)
        args = parse(case_flags(case, hf_dir))
        assert args.advantage_estimator == case["estimator"], (backend, case_name(case))
        assert args.use_kl_loss == (case["kl"] is not None)
        assert args.use_tis == case["tis"]
    required = set(required_pairs())
    for pair in (p for p in all_pairs() if p not in required):
        with pytest.raises(SystemExit) as exit_:
            parse(case_flags(completion(pair), hf_dir))
        assert exit_.value.code == 2, (backend, pair)
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, (backend, pair, err)


def test_cases_cover_every_pair_and_parse_and_the_left_out_pairs_are_refused(
    layout_hf_dirs, capsys
):
    """On FSDP's command line (the argument checks are miles-core's; the extended test checks
    Megatron's too)."""
    cases = pairwise_cases()
    assert pairwise_cases() == cases  # deterministic
    covered = set().union(*(pairs_of(c) for c in cases))
    missing = set(required_pairs()) - covered
    assert not missing, sorted(missing, key=str)[:5]
    assert len(cases) < len(required_pairs()) // 10  # a covering set, not every combination
    left_out = [p for p in all_pairs() if p not in set(required_pairs())]
    assert {frozenset(p) for p in REFUSED} <= {frozenset(p) for p in left_out}
    check_parses("fsdp", layout_hf_dirs["qwen3"], capsys)


@pytest.fixture(scope="module")
def pairwise_hf(tmp_path_factory) -> str:
    from megatron_tiny_models import make_tiny_hf

    return str(make_tiny_hf("qwen3", tmp_path_factory.mktemp("pairwise") / "hf"))


def case_configs(hf_dir: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(case_name(c), tuple(case_flags(c, hf_dir))) for c in pairwise_cases()]


def check_case(case: dict, got: dict, ref: dict, what: str, peers: tuple = ()) -> None:
    """One case's run (estimator_ranks.estimator_rollouts) against its float64 reference,
    stepped from that run's weights: each step's loss and its parts, gradient norm and LR,
    each step's log-prob and entropy of every trained token and the old policy's and reference
    model's log-probs the loss read (on ``got``'s rank and its ``peers``':
    score_capture.check_scores, check_inputs), every weight after each step, every response
    log-prob after the rollout; the KL loss and the TIS weight reported exactly where they are
    on."""
    from backend_reference import samples
    from estimator_reference import STEPS
    from forced_adam import check_updates
    from score_capture import check_inputs, check_scores
    from tolerances import assert_within

    assert len(got["steps"]) == STEPS, what
    data = samples(masked=True, engine_log_probs=True)
    check_scores([got, *peers], ref, data, what, holes=True)
    inputs = check_inputs([got, *peers], ref["old"], data, what)
    assert inputs > 0 or case["loss"] == "sft_loss", what  # SFT reads no old policy
    for k, (step, want, tol) in enumerate(zip(got["steps"], ref["steps"], ref["tol"])):
        assert ("kl_loss" in step) == (case["kl"] is not None), (what, k, sorted(step))
        assert ("tis" in step) == case["tis"], (what, k, sorted(step))
        for key in ("loss", "grad_norm", "lr", "pg_loss", "kl_loss", "tis", "sft_loss"):
            if key in step or key in ("loss", "grad_norm", "lr"):
                w = want["loss" if key == "sft_loss" else key]
                bound = tol["loss" if key == "sft_loss" else key]
                assert abs(step[key] - w) <= bound, (what, k, key, step[key], w, bound)
    check_updates(ref["updates"], what)
    for i, (lp, t) in enumerate(zip(ref["log_probs"], ref["log_probs_tol"])):
        assert_within(torch.tensor(got["log_probs"][i]), lp, t, f"{what}: sample {i}")


def case_refs(hf_dir: str, ranks: list[dict]) -> dict:
    """Each case's float64 reference (estimator_reference.reference) stepped from one
    backend's run of it (``ranks``: every rank's estimator_rollouts result), by case name."""
    from backend_reference import samples
    from estimator_reference import reference

    data = samples(masked=True, engine_log_probs=True)
    return {
        case_name(c): reference(hf_dir, case_objective(c), data, [r[case_name(c)] for r in ranks])
        for c in pairwise_cases()
    }


@pytest.fixture(scope="module")
def fsdp_pairwise(pairwise_hf) -> dict:
    """Every case on FSDP at one rank, in one spawn."""
    from dist_ranks import spawn_ranks
    from estimator_ranks import estimator_rollouts

    configs = case_configs(pairwise_hf)
    (fsdp,) = spawn_ranks(
        estimator_rollouts, 1, "fsdp", pairwise_hf, configs, timeout=900, shim=False
    )
    return fsdp


@pytest.fixture(scope="module")
def megatron_pairwise(pairwise_hf) -> list[dict]:
    """Every case on Megatron at TP = 2 (2 gloo ranks), in one spawn: each rank's results."""
    from dist_ranks import spawn_ranks
    from estimator_ranks import estimator_rollouts

    configs = case_configs(pairwise_hf)
    return spawn_ranks(estimator_rollouts, 2, "megatron", pairwise_hf, configs, timeout=900)


@pytest.fixture(scope="module")
def fsdp_refs(pairwise_hf, fsdp_pairwise) -> dict:
    return case_refs(pairwise_hf, [fsdp_pairwise])


@pytest.fixture(scope="module")
def megatron_refs(pairwise_hf, megatron_pairwise) -> dict:
    return case_refs(pairwise_hf, megatron_pairwise)


@pytest.mark.extended
@pytest.mark.numeric
def test_pairwise_cases_equal_float64_on_fsdp(pairwise_hf, fsdp_refs, fsdp_pairwise, capsys):
    from backend_reference import samples
    from estimator_reference import STEPS

    hf_dir = pairwise_hf
    check_parses("megatron", hf_dir, capsys)
    data = samples(masked=True, engine_log_probs=True)
    cases = pairwise_cases()
    assert list(fsdp_pairwise) == [case_name(c) for c in cases]
    losses = {}
    for case in cases:
        name = case_name(case)
        ref = fsdp_refs[name]
        check_case(case, fsdp_pairwise[name], ref, name)
        if case["loss"] != "sft_loss":  # SFT's loss has no advantage, clip, KL or TIS term
            same = {**case, "kl": "k3" if case["kl"] == "low_var_kl" else case["kl"]}  # one formula
            losses[case_name(same)] = ref["steps"][1]["loss"]
    assert len({round(x, 9) for x in losses.values()}) == len(losses)  # every case its own loss
    # the truncations bind: pi_old / pi_rollout crosses 0.8 and 1.0 on trained tokens, and the
    # second step's ratios pi / pi_old leave [1 - 0.02, 1 + 0.05]
    old = fsdp_refs[case_name(cases[0])]
    trained = [s.loss_mask.bool() for s in data]
    tis = torch.cat(
        [(o - s.rollout_log_probs.double())[m] for o, s, m in zip(old["old"], data, trained)]
    ).exp()
    assert tis.min() < 0.8 and tis.max() > 1.0, (tis.min(), tis.max())
    second = range(len(data) // STEPS, len(data))  # the samples of the second step
    ratio = torch.cat([(old["after_one"][i] - old["old"][i])[trained[i]] for i in second]).exp()
    assert ratio.min() < 1 - 0.02 and ratio.max() > 1 + 0.05, (ratio.min(), ratio.max())


@pytest.mark.extended
@pytest.mark.numeric
def test_pairwise_cases_equal_float64_on_megatron_tp2(megatron_refs, megatron_pairwise):
    """Every case (each parses on Megatron's command line: the FSDP test's check_parses) on
    Megatron at TP = 2 with sequence parallelism equals the float64 reference stepped from its
    own weights; the TP peers report the same metrics and publish the same weights. The cases
    cover every --advantage-estimator and --loss-type / --policy-loss value."""
    cases = pairwise_cases()
    names = [case_name(c) for c in cases]
    for factor in ("estimator", "loss"):
        assert {c[factor] for c in cases} == set(FACTORS[factor]), factor
    first, second = megatron_pairwise
    assert list(first) == list(second) == names
    for case, name in zip(cases, names):
        check_case(case, first[name], megatron_refs[name], f"megatron tp2: {name}", (second[name],))
        assert first[name]["steps"] == second[name]["steps"], name
        for key, value in first[name]["weights"].items():
            assert (value == second[name]["weights"][key]).all(), (name, key)


@pytest.mark.extended
@pytest.mark.numeric
def test_pairwise_cases_agree_between_megatron_and_fsdp(
    megatron_refs, fsdp_refs, fsdp_pairwise, megatron_pairwise
):
    """Case by case, each step's metrics and the log-probs after the rollout of Megatron
    (TP = 2) and FSDP (one rank) are equal within the sum of their bounds plus the difference
    of the two float64 references (each backend is within its bound of the float64 step from
    its own weights and inputs: the triangle inequality; the references' difference is where
    the two runs stood, which the first step's shared start makes a rounding's worth), the
    metrics' names too; the old policy's log-probs they read are within twice ``SCORE_ATOL``
    of each other (each within it of the float64 ones at the checkpoint)."""
    from score_capture import INPUTS
    from tolerances import SCORE_ATOL, assert_within

    megatron = megatron_pairwise[0]
    assert list(megatron) == list(fsdp_pairwise)
    for name, m in megatron.items():
        f, ref_m, ref_f = fsdp_pairwise[name], megatron_refs[name], fsdp_refs[name]
        assert len(m["steps"]) == len(f["steps"]) == len(ref_m["tol"]) >= 2, name
        steps = zip(
            m["steps"], f["steps"], ref_m["steps"], ref_f["steps"], ref_m["tol"], ref_f["tol"]
        )
        for k, (a, b, want_m, want_f, tol_m, tol_f) in enumerate(steps):
            assert a.keys() == b.keys(), (name, k, sorted(a), sorted(b))
            keys = [key for key in a if (key if key != "sft_loss" else "loss") in tol_m]
            assert {"loss", "grad_norm", "lr"} <= set(keys), (name, k, keys)
            for key in keys:  # the metrics the reference bounds
                r = "loss" if key == "sft_loss" else key
                bound = tol_m[r] + tol_f[r] + abs(want_m[r] - want_f[r])
                assert abs(a[key] - b[key]) <= bound, (name, k, key, a[key], b[key], bound)
            for sample, got in m["scores"][k].items():
                for key in INPUTS:
                    if key in got:
                        x, y = torch.tensor(got[key]), torch.tensor(f["scores"][k][sample][key])
                        trained = ref_m["scores"][k][sample]["log_probs_tol"].isfinite()
                        tol = torch.full_like(x[trained], 2 * SCORE_ATOL, dtype=torch.float64)
                        assert_within(x[trained], y[trained], tol, f"{name}: {key} of {sample}")
        after = zip(m["log_probs"], f["log_probs"], ref_m["log_probs"], ref_f["log_probs"])
        for i, (x, y, want_m, want_f) in enumerate(after):
            tol = ref_m["log_probs_tol"][i] + ref_f["log_probs_tol"][i] + (want_m - want_f).abs()
            assert_within(torch.tensor(x), torch.tensor(y), tol, f"{name}: sample {i}")
