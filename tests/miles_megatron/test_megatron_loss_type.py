"""The Megatron actor's loss choices against float64 HF references, one spawned rank for all:

* ``--loss-type sft_loss``: one step's loss is the responses' negative log-likelihood,
  sequence-mean (``-(1/S) sum_i (1/n_i) sum_t log pi``), and its gradients are that loss's (the
  policy loss of the same step is ~0: GRPO's advantages sum to zero in each group and the ratio
  is 1);
* ``--custom-loss-function-path`` (tests/miles_megatron/custom_loss_hooks.py, the hook signature
  miles-core defines for both backends): a REINFORCE loss ``-(1/N) sum_i sum_t A_i log pi_it``
  (``N`` the step's loss tokens, ``log pi`` at temperature 0.8) written in the hook gives that
  formula's loss and gradients, whether it takes the logits or the fused head's scores.
"""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from loss_type_ranks import GRAD_NAMES, HOOK_ARGV, one_step
from megatron_tiny_models import make_tiny_hf
from tolerances import GRAD_REL_ERR, assert_within, grad_atol

pytestmark = [pytest.mark.slow, pytest.mark.numeric]

TEMPERATURE = 0.8  # HOOK_ARGV's --rollout-temperature
RUNS = {
    "sft": ["--loss-type", "sft_loss"],
    "hook_logits": [
        "--custom-loss-function-path", "custom_loss_hooks:reinforce_logits", *HOOK_ARGV
    ],
    "hook_scores": [
        "--custom-loss-function-path", "custom_loss_hooks:reinforce_scores", *HOOK_ARGV
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(make_tiny_hf("qwen3", tmp_path_factory.mktemp("loss_type") / "hf"))


@pytest.fixture(scope="module")
def steps(hf_dir, tmp_path_factory) -> dict:
    """Every run of :data:`RUNS`, one step each, in one spawned rank."""
    out = tmp_path_factory.mktemp("loss_type") / "steps.pt"
    spawn_ranks(one_step, 1, hf_dir, RUNS, str(out), timeout=400)
    return torch.load(f"{out}.0", weights_only=True)


def _hf(hf_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager"
    )


def _response_log_probs(model, sample, temperature: float = 1.0) -> torch.Tensor:
    logits = model(input_ids=sample.tokens[None], use_cache=False).logits[0, :-1]
    log_p = (logits / temperature).log_softmax(-1).gather(-1, sample.tokens[1:, None])[:, 0]
    return log_p[-sample.response_length :]


def _finish(model, loss):
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.sqrt(sum(g.square().sum() for g in grads.values()))
    return loss.item(), norm.item(), grads


def reference_sft(hf_dir: str):
    """(loss, grad norm, grads by HF name) of the sft step in float64."""
    from backend_reference import samples

    model = _hf(hf_dir)
    terms = [-_response_log_probs(model, s).mean() for s in samples()]
    return _finish(model, sum(terms) / len(terms))


def reference_reinforce(hf_dir: str):
    """(loss, grad norm, grads by HF name) of the hooks' REINFORCE step in float64: GRPO's
    advantages ``(R - mean_g) / (std_g + 1e-6)``, over the step's response tokens."""
    from backend_reference import GROUPS, REWARDS, samples

    model = _hf(hf_dir)
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    data = samples()
    loss = 0.0
    for i, s in enumerate(data):
        group = rewards[[j for j, g in enumerate(GROUPS) if g == GROUPS[i]]]
        advantage = (rewards[i] - group.mean()) / (group.std() + 1e-6)
        loss = loss - advantage * _response_log_probs(model, s, TEMPERATURE).sum()
    return _finish(model, loss / sum(s.response_length for s in data))


def _check_step(got: dict, loss: float, norm: float, grads: dict, names=GRAD_NAMES) -> None:
    m = got["metrics"]
    assert abs(m["loss"] - loss) <= 1e-5 * abs(loss), (m["loss"], loss)
    assert abs(m["grad_norm"] - norm) <= 2 * GRAD_REL_ERR * norm, (m["grad_norm"], norm)
    for mname, hname in names.items():
        want = grads[hname]
        mine = got["grads"][mname][: want.shape[0]]  # megatron pads the vocabulary's rows
        assert_within(mine.reshape(want.shape), want, grad_atol(want), mname)


def test_sft_loss_step_matches_float64_nll(steps, hf_dir):
    loss, norm, grads = reference_sft(hf_dir)
    _check_step(steps["sft"], loss, norm, grads)
    assert abs(steps["sft"]["metrics"]["sft_loss"] - loss) <= 1e-5 * loss
    assert loss > 1.0  # an NLL over a 96-token vocabulary, far from a policy loss's ~0


@pytest.mark.parametrize("run", ["hook_logits", "hook_scores"])
def test_custom_loss_hook_step_matches_float64_formula(steps, hf_dir, run):
    loss, norm, grads = reference_reinforce(hf_dir)
    _check_step(steps[run], loss, norm, grads)
    m = steps[run]["metrics"]
    # the hook replaced the built-in loss: its parts are the metrics, summed over the two
    # micro-batches (4 samples, --micro-batch-size 2) it was called on
    assert m["calls"] == 2.0 and abs(m["token_share"] - 1.0) <= 1e-6
    assert abs(m["reinforce"] - loss) <= 1e-5 * abs(loss) and "pg_loss" not in m
    assert abs(loss) > 1e-2  # not a loss that vanishes whatever the log-probs


@pytest.mark.extended
def test_custom_loss_hook_at_tp2_and_pp2_matches_float64_formula(hf_dir, tmp_path):
    """Two ranks, one spawn: TP = 2 with sequence parallelism (the logits hook gets the
    vocabulary gathered over TP, the scores hook the fused vocabulary-parallel head's), then
    PP = 2 (the hook runs on the last stage, which broadcasts the metrics): each gives the
    formula's loss and grad norm on every rank and its (TP-replicated) final-norm gradient."""
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    runs = {run: [*RUNS[run], *tp2] for run in ("hook_logits", "hook_scores")}
    runs["pp2"] = [*RUNS["hook_logits"], "--pipeline-model-parallel-size", "2"]
    spawn_ranks(one_step, 2, hf_dir, runs, str(tmp_path / "ranks.pt"), timeout=400)
    ranks = [torch.load(tmp_path / f"ranks.pt.{r}", weights_only=True) for r in range(2)]
    loss, norm, grads = reference_reinforce(hf_dir)
    final_norm = {"decoder.final_layernorm.weight": "model.norm.weight"}
    for rank, got in enumerate(ranks):
        for run in runs:
            last_stage = run != "pp2" or rank == 1
            _check_step(got[run], loss, norm, grads, final_norm if last_stage else {})
            assert got[run]["metrics"]["calls"] == 2.0, (rank, run)
    assert "decoder.final_layernorm.weight" not in ranks[0]["pp2"]["grads"]  # the first stage


@pytest.mark.extended
def test_custom_loss_hook_gives_fsdp_the_same_step(steps, hf_dir, tmp_path):
    """The same hook (logits) and flags on the FSDP backend: the same loss, parts and
    gradients as Megatron's, each within the fp32 bound of the float64 formula's."""
    from loss_type_ranks import fsdp_step

    out = tmp_path / "fsdp.pt"
    spawn_ranks(fsdp_step, 1, hf_dir, RUNS["hook_logits"], str(out), timeout=300, shim=False)
    fsdp = torch.load(out, weights_only=True)
    megatron = steps["hook_logits"]
    loss, norm, grads = reference_reinforce(hf_dir)
    f, m = fsdp["metrics"], megatron["metrics"]
    assert f["calls"] == m["calls"] == 2.0  # the same micro-batches
    assert abs(f["token_share"] - m["token_share"]) <= 2e-6  # each within 1e-6 of 1
    for key in ("reinforce", "loss"):  # each within 1e-5 * |loss| of the formula's
        assert abs(f[key] - m[key]) <= 2e-5 * abs(loss), key
    assert abs(fsdp["metrics"]["grad_norm"] - norm) <= 2 * GRAD_REL_ERR * norm
    for mname, hname in GRAD_NAMES.items():
        want = grads[hname]
        mine = megatron["grads"][mname][: want.shape[0]].reshape(want.shape)
        assert_within(fsdp["grads"][hname], want, grad_atol(want), hname)
        assert_within(fsdp["grads"][hname], mine, 2 * grad_atol(want), mname)
