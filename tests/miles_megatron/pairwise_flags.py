"""Test support: a pairwise covering set of the RL flags (tests/miles_megatron/test_pairwise_flags.py).

A case gives each factor of :data:`FACTORS` one value; every two values of every two factors
appear together in some case, unless the argument checks refuse them together
(:data:`REFUSED`) or one is a setting of a switch the other turns off (:data:`SETTINGS`: a
``--kl-loss-coef`` without ``--use-kl-loss`` sets nothing). ``--loss-type`` and
``--policy-loss`` are one factor (``loss``): ``--policy-loss cispo`` with ``--loss-type
sft_loss`` is refused, so their pairs add nothing. ``ppo`` (needs a critic) and the loss types
``value_loss`` and ``nft`` (refused for the actor) are left out; ``--use-kl-loss`` needs a
reference model: ``--ref-load`` is the checkpoint itself (the weights before the rollout).
"""

from __future__ import annotations

import itertools
import random

from estimator_reference import Objective

#: factor -> its values (the first is the flag's default; ``None`` where the flag is not given)
FACTORS: dict[str, tuple] = {
    "estimator": (
        "grpo", "gspo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
    ),
    "loss": ("ppo", "cispo", "sft_loss"),
    "kl": (None, "k1", "k2", "k3", "low_var_kl"),  # --use-kl-loss --kl-loss-type
    "kl_coef": (0.1, 1.0),  # --kl-loss-coef
    "entropy_coef": (0.0, 0.01),
    "tis": (False, True),  # --use-tis, on the engine's log-probs
    "tis_clip": (2.0, 1.0),  # 1.0 truncates (pi_old / pi_rollout reaches ~1.7 on these samples)
    "tis_clip_low": (0.0, 0.8),  # 0.8 truncates (it reaches down to ~0.4)
    "per_token": (False, True),  # --calculate-per-token-loss
    "normalize": (False, True),  # --normalize-advantages
    "eps_clip": (0.2, 0.02),  # 0.02 and 0.05 clip: the second step's ratios span ~[0.94, 1.06]
    "eps_clip_high": (None, 0.05),
}  # fmt: skip

#: setting -> (its switch, the switch's off value): the setting exists only with the switch on
SETTINGS = {"kl_coef": ("kl", None), "tis_clip": ("tis", False), "tis_clip_low": ("tis", False)}

#: pairs of values the argument checks refuse together (miles_core.args.groups.algorithm)
REFUSED = (
    (("estimator", "gspo"), ("per_token", True)),  # GSPO's objective is a sequence mean
    (("estimator", "dr_grpo"), ("per_token", True)),  # Dr. GRPO sums each response's tokens
    (("estimator", "gspo"), ("loss", "cispo")),  # CISPO clips token ratios, GSPO's is a sequence's
    *((("loss", "sft_loss"), ("kl", kl)) for kl in FACTORS["kl"][1:]),  # SFT has no KL term,
    (("loss", "sft_loss"), ("tis", True)),  # no importance sampling
    (("loss", "sft_loss"), ("entropy_coef", 0.01)),  # and no entropy bonus
)

Pair = tuple[tuple[str, object], tuple[str, object]]


def applies(case: dict, factor: str) -> bool:
    """Whether ``factor``'s value means anything in ``case`` (its switch, if any, is on)."""
    switch = SETTINGS.get(factor)
    return switch is None or case[switch[0]] != switch[1]


def pairs_of(case: dict) -> set[Pair]:
    names = [f for f in FACTORS if applies(case, f)]
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}


def refused(case: dict) -> bool:
    have = pairs_of(case) | {(b, a) for a, b in pairs_of(case)}
    return any(pair in have for pair in REFUSED)


def completion(pair: Pair) -> dict:
    """The case of ``pair`` with every other factor at its default, a setting's switch on at
    its first on value: refused exactly when the pair is, the refusals being pairs of
    non-default values."""
    case = {f: values[0] for f, values in FACTORS.items()}
    case.update(dict(pair))
    for factor, (switch, off) in SETTINGS.items():
        if factor in dict(pair) and case[switch] == off:
            case[switch] = next(v for v in FACTORS[switch] if v != off)
    return case


def all_pairs() -> list[Pair]:
    """Every pair of values of two factors (in :data:`FACTORS` order), settings with their
    switch off left out."""
    out = []
    for a, b in itertools.combinations(FACTORS, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            if (a, x) == SETTINGS.get(b) or (b, y) == SETTINGS.get(a):
                continue
            out.append(((a, x), (b, y)))
    return out


def required_pairs() -> list[Pair]:
    """The pairs some accepted case holds: :func:`all_pairs` less the refused ones."""
    return [p for p in all_pairs() if not refused(completion(p))]


def pairwise_cases(seed: int = 0, candidates: int = 40) -> list[dict]:
    """A covering set, deterministically: each case takes the first pair still uncovered and,
    of :func:`completion` and ``candidates`` random cases holding that pair, the accepted one
    covering the most uncovered pairs."""
    rng = random.Random(seed)
    uncovered = set(required_pairs())
    order = required_pairs()
    cases = []
    while uncovered:
        pair = next(p for p in order if p in uncovered)
        best = completion(pair)
        for _ in range(candidates):
            case = {f: rng.choice(values) for f, values in FACTORS.items()}
            case.update(dict(pair))
            for factor, (switch, off) in SETTINGS.items():
                if factor in dict(pair) and case[switch] == off:
                    case[switch] = rng.choice([v for v in FACTORS[switch] if v != off])
            if not refused(case) and len(pairs_of(case) & uncovered) > len(
                pairs_of(best) & uncovered
            ):
                best = case
        cases.append(best)
        uncovered -= pairs_of(best)
    return cases


def case_name(case: dict) -> str:
    return " ".join(f"{f}={case[f]}" for f in FACTORS if applies(case, f))


def case_flags(case: dict, hf_dir: str) -> list[str]:
    """The command-line flags of ``case`` (``hf_dir``: the reference model of the KL loss)."""
    argv = ["--advantage-estimator", case["estimator"]]
    if case["loss"] == "cispo":
        argv += ["--policy-loss", "cispo"]
    elif case["loss"] == "sft_loss":
        argv += ["--loss-type", "sft_loss"]
    if case["kl"] is not None:
        argv += ["--use-kl-loss", "--kl-loss-type", case["kl"]]
        argv += ["--kl-loss-coef", str(case["kl_coef"]), "--ref-load", hf_dir]
    argv += ["--entropy-coef", str(case["entropy_coef"])]
    if case["tis"]:
        argv += ["--use-tis", "--tis-clip", str(case["tis_clip"])]
        argv += ["--tis-clip-low", str(case["tis_clip_low"])]
    if case["per_token"]:
        argv.append("--calculate-per-token-loss")
    if case["normalize"]:
        argv.append("--normalize-advantages")
    argv += ["--eps-clip", str(case["eps_clip"])]
    if case["eps_clip_high"] is not None:
        argv += ["--eps-clip-high", str(case["eps_clip_high"])]
    return argv


def case_objective(case: dict) -> Objective:
    """The float64 reference's configuration of ``case`` (estimator_reference.Objective)."""
    estimator = case["estimator"]
    policy = {"ppo": "gspo" if estimator == "gspo" else "ppo", "cispo": "cispo"}
    return Objective(
        advantage="grpo" if estimator == "gspo" else estimator,
        policy=policy.get(case["loss"], "sft"),
        token_mean=case["per_token"],
        token_sum=estimator == "dr_grpo",
        normalize=case["normalize"],
        entropy_coef=case["entropy_coef"],
        kl=case["kl"],
        kl_coef=case["kl_coef"] if case["kl"] is not None else 0.0,
        tis=(case["tis_clip_low"], case["tis_clip"]) if case["tis"] else None,
        eps_clip=case["eps_clip"],
        eps_clip_high=case["eps_clip_high"],
    )
