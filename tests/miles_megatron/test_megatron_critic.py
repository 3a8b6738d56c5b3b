"""The Megatron critic (``--use-critic``) on gloo ranks with real megatron-core, against a float64
reference written here: the HF model with its LM head replaced by ``Linear(hidden, 1)`` (weights
``0.02 * randn`` of a generator seeded with ``--seed``, bias 0: the documented initialisation).

* values at TP=1 and at TP=2 with sequence parallelism equal the reference's per response token;
  the critic's first step (``v_old = v``, so the loss is ``0.5 (v - R)^2`` sequence-mean with
  ``R`` the float64 GAE returns of those values) has the reference's loss, grad norm and
  gradients of the value head and the final norm; TP=2 equals TP=1 to the same bounds;
* a critic saved after one rollout and resumed trains the next rollout to the same parameters,
  bit for bit, as the straight run;
* the critic beside the actor in one process (as on a trainer rank): one parallel state, the
  actor's one-step loss is ``-(1/S) sum_i (1/n_i) sum_t A_it`` with ``A`` the float64 GAE
  advantages of the critic's values, both save, sleep to their own files and wake;
* the critic never publishes and runs none of the actor's ``--custom-megatron-*`` hooks;
* at PP = 2 (the value head on the last stage, the values reaching the first) and at EP = 2 (a
  tiny Qwen3-MoE, DP 2 for the dense parameters) every rank's values, the loss and the gradient
  norm equal the float64 reference (CP = 2 is proven in test_context_parallel.py); and
  (``extended``, 4 ranks) at TP = 2 x PP = 2 and, on the MoE model, PP = 2 x EP = 2 (CP = 2 x
  TP = 2 and CP = 2 x PP = 2: test_context_parallel.py).
"""

from __future__ import annotations

import pytest
import torch
from critic_ranks import (
    GAMMA,
    GRAD_NAMES,
    LAMBD,
    SEED,
    actor_beside_critic,
    layout_values,
    straight_then_resumed,
    values_and_grads,
)
from critic_reference import attach_value_head
from dist_ranks import spawn_ranks
from megatron_tiny_models import make_tiny_hf
from tolerances import GRAD_REL_ERR, assert_within, grad_atol


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(make_tiny_hf("qwen3", tmp_path_factory.mktemp("qwen3") / "hf"))


def reference_critic(hf_dir: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(dtype=torch.float64, attn_implementation="eager")
    if AutoConfig.from_pretrained(hf_dir).model_type == "qwen3_moe":
        kwargs["experts_implementation"] = "eager"  # the grouped-mm kernel has no float64
    model = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    return attach_value_head(model, SEED)


def gae(reward: float, values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 GAE with the reward on the last token: delta_t = r_t + gamma V_{t+1} - V_t
    (V_n = 0), A_t = delta_t + gamma lambd A_{t+1}; (A, returns A + V)."""
    n = len(values)
    rewards = [0.0] * (n - 1) + [reward]
    adv, running = [0.0] * n, 0.0
    for t in reversed(range(n)):
        next_v = values[t + 1] if t + 1 < n else 0.0
        running = rewards[t] + GAMMA * next_v - values[t] + GAMMA * LAMBD * running
        adv[t] = running
    adv_t = torch.tensor(adv, dtype=torch.float64)
    return adv_t, adv_t + torch.tensor(values, dtype=torch.float64)


def reference_step(hf_dir: str):
    """(values, loss, grad norm, grads by HF name) of the critic's first step in float64."""
    from backend_reference import samples

    model = reference_critic(hf_dir)
    values, terms = [], []
    for s in samples():
        v = model(input_ids=s.tokens[None], use_cache=False).logits[0, :-1, 0]
        v = v[-s.response_length :]
        values.append(v.detach())
        _, returns = gae(s.reward, v.detach().tolist())
        terms.append((0.5 * (v - returns).square()).mean())
    loss = sum(terms) / len(terms)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.square().sum() for g in grads.values()))
    return values, loss.item(), norm.item(), grads


@pytest.mark.slow
@pytest.mark.numeric
def test_values_and_value_loss_gradient_match_float64_at_tp1_and_tp2(hf_dir, tmp_path):
    spawn_ranks(values_and_grads, 1, hf_dir, 1, str(tmp_path), timeout=400)
    spawn_ranks(values_and_grads, 2, hf_dir, 2, str(tmp_path), timeout=500)
    runs = {
        name: torch.load(tmp_path / f"{name}.pt", weights_only=True)
        for name in ("tp1_rank0", "tp2_rank0", "tp2_rank1")
    }
    values, loss, norm, grads = reference_step(hf_dir)
    for name, run in runs.items():
        assert run["next_id"] == 0 and run["head_type"] == "ValueHeadLinear", name
        for i, v in enumerate(values):
            assert run["values"][i].shape == v.shape
            assert_within(run["values"][i], v, torch.full_like(v, 1e-5), f"{name} values {i}")
        m = run["metrics"]
        assert abs(m["loss"] - loss) <= 1e-5 * max(loss, 1.0), (name, m["loss"], loss)
        assert abs(m["value_loss"] - loss) <= 1e-5 * max(loss, 1.0), name
        assert m["value_clipfrac"] == 0.0  # v = v_old on the first step
        assert abs(m["grad_norm"] - norm) <= 2 * GRAD_REL_ERR * norm, (name, m["grad_norm"], norm)
        for mname, hname in GRAD_NAMES.items():
            want = grads[hname].reshape(run["grads"][mname].shape)
            assert_within(run["grads"][mname], want, grad_atol(want), f"{name} {mname}")
        assert len(run["refusals"]) == 2
        assert all("never publishes" in r for r in run["refusals"])
        assert run["hook_calls"] == []  # the --custom-megatron-* hooks are the actor's
    assert max(float(v.abs().max()) for v in values) > 1e-2  # the head is not zero
    assert loss > 1e-2 and norm > 1e-2
    tp1, tp2 = runs["tp1_rank0"], runs["tp2_rank0"]
    for i in range(len(values)):  # TP=2 computes what TP=1 does (and both ranks agree)
        assert_within(tp2["values"][i], tp1["values"][i], torch.full_like(values[i], 2e-5), "tp")
        assert torch.equal(runs["tp2_rank1"]["values"][i], tp2["values"][i])


@pytest.mark.extended
def test_critic_save_and_resume_is_bitwise(hf_dir, tmp_path):
    results = spawn_ranks(straight_then_resumed, 2, hf_dir, str(tmp_path), timeout=600)
    for r in results:
        assert r["next_id"] == 1 and r["loaded_exact"] and r["moved"]
        assert r["resumed_exact"]
        first, second, again = r["metrics"]
        assert second == {**again, "tokens_per_s": second["tokens_per_s"]}
        assert first["loss"] != second["loss"]
    assert (tmp_path / "a" / "critic").is_dir() and (tmp_path / "b").exists() is False


@pytest.mark.numeric
@pytest.mark.parametrize(
    ("family", "tie", "flags"),
    [
        ("qwen3", False, ["--pipeline-model-parallel-size", "2"]),
        # tied embeddings: megatron all-reduces the tied weight's gradient between the first and
        # the last stage unless every stage knows the head is not the embedding
        ("qwen3", True, ["--pipeline-model-parallel-size", "2"]),
        ("qwen3_moe", False, ["--expert-model-parallel-size", "2"]),
    ],
    ids=["pp2", "pp2-tied", "ep2"],
)
def test_critic_at_pp2_and_ep2_matches_float64(tmp_path, family, tie, flags):
    hf = str(make_tiny_hf(family, tmp_path / "hf", tie=tie))
    runs = spawn_ranks(layout_values, 2, hf, flags, timeout=600)
    pp = flags[0] == "--pipeline-model-parallel-size"
    # the head lives on the last stage only at PP 2, on both ranks at EP 2
    check_layout(runs, hf, [None, "ValueHeadLinear"] if pp else ["ValueHeadLinear"] * 2)


@pytest.mark.extended
@pytest.mark.numeric
def test_critic_at_tp2_x_pp2_matches_float64(tmp_path):
    """The critic in a layout of two dimensions (4 ranks): TP = 2 with sequence parallelism x
    PP = 2, the value head split over the last stage's TP ranks."""
    from megatron_ranks import layout_argv

    hf = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    runs = spawn_ranks(layout_values, 4, hf, layout_argv(tp=2, pp=2), timeout=900)
    # megatron orders the ranks TP first: ranks 0 and 1 are the first stage
    check_layout(runs, hf, [None, None, "ValueHeadLinear", "ValueHeadLinear"])


@pytest.mark.extended
@pytest.mark.numeric
def test_critic_at_pp2_x_ep2_matches_float64(tmp_path):
    """The critic on an MoE model in a layout of two dimensions (4 ranks): PP = 2 x EP = 2 (DP 2
    for the dense parameters, the experts split over the DP ranks; the all-to-all dispatcher,
    which PP > 1 needs), the value head on the last stage."""
    from megatron_ranks import layout_argv

    hf = str(make_tiny_hf("qwen3_moe", tmp_path / "hf"))
    flags = [*layout_argv(pp=2, ep=2), "--moe-token-dispatcher-type", "alltoall"]
    runs = spawn_ranks(layout_values, 4, hf, flags, timeout=900)
    # ranks 0 and 1 (the two DP ranks of the first stage) hold no head
    check_layout(runs, hf, [None, None, "ValueHeadLinear", "ValueHeadLinear"])


def check_layout(runs: list[dict], hf: str, heads: list) -> None:
    """Every rank's values, the first step's value loss and gradient norm equal the float64
    reference's; ``heads``: which ranks hold the value head."""
    values, loss, norm, _ = reference_step(hf)
    assert [r["head"] for r in runs] == heads
    for rank, run in enumerate(runs):
        for i, v in enumerate(values):
            got = torch.from_numpy(run["values"][i])
            assert got.shape == v.shape
            assert_within(got, v, torch.full_like(v, 1e-5), f"rank {rank} values {i}")
        m = run["metrics"]
        assert abs(m["loss"] - loss) <= 1e-5 * max(loss, 1.0), (rank, m["loss"], loss)
        assert abs(m["grad_norm"] - norm) <= 2 * GRAD_REL_ERR * norm, (rank, m["grad_norm"], norm)
    assert loss > 1e-2 and norm > 1e-2


@pytest.mark.extended
def test_actor_beside_critic_takes_its_gae_advantages(hf_dir, tmp_path):
    from backend_reference import samples

    results = spawn_ranks(actor_beside_critic, 2, hf_dir, str(tmp_path), timeout=600)
    for r in results:
        advantages = [gae(s.reward, v)[0] for s, v in zip(samples(), r["values"], strict=True)]
        expected = -sum(float(a.mean()) for a in advantages) / len(advantages)
        assert abs(r["actor"]["loss"] - expected) <= 1e-5 * max(1.0, abs(expected)), (r, expected)
        assert r["critic"]["value_loss"] > 0
        assert len(r["sleep_files"]) == 2 and len(set(r["sleep_files"])) == 2
        assert r["asleep_after_save"]
        assert r["values_after"] != r["values"]  # the critic's step moved its values
    assert results[0]["values"] == results[1]["values"]
    assert (tmp_path / "ckpt" / "iter_0000001").is_dir()
    assert (tmp_path / "ckpt" / "critic" / "iter_0000001").is_dir()
