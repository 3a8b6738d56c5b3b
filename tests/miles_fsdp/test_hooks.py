"""The custom loss hook through FSDPBackend.train() (2 gloo ranks): a distillation loss written
in the test (it runs the teacher through ``ctx``) gives the gradients and loss of a float64
dense computation of the same formula over the whole rollout."""

from __future__ import annotations

import pytest
import torch
from dense_reference import dense_model, response_log_probs
from hook_programs import HOOK_FLAGS, loss_hook_program
from samples import make_samples
from spawn import run_ranks
from tiny_models import save_tiny_model


@pytest.mark.slow
@pytest.mark.parametrize(
    "hook",
    [
        "distill_loss",  # takes logits: the dense path
        pytest.param("distill_scores_loss", marks=pytest.mark.extended),  # scores: fused head
    ],
)
def test_custom_loss_hook_through_train_matches_float64(tmp_path, hook):
    hf_dir = save_tiny_model(tmp_path / "actor", seed=0)
    teacher_dir = save_tiny_model(tmp_path / "teacher", seed=2)
    out = tmp_path / "out.pt"
    run_ranks(2, loss_hook_program, str(hf_dir), str(teacher_dir), str(out), hook, timeout=300)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]

    actor, teacher = dense_model(hf_dir), dense_model(teacher_dir)
    temperature = HOOK_FLAGS["rollout_temperature"]
    samples = make_samples()
    denominator = sum(s.response_length for s in samples)
    loss = 0.0
    for s in samples:
        with torch.no_grad():
            t_lp = response_log_probs(teacher, s, temperature)
        loss = loss + ((response_log_probs(actor, s, temperature) - t_lp) ** 2).sum()
    loss = loss / denominator
    loss.backward()

    for res in ranks:
        # the hook replaced the built-in loss: its parts are the metrics, summed over the
        # micro-batches and both ranks; the denominator is the whole step's token count
        assert set(res["seen"]["denominators"]) == {float(denominator)}
        assert len(res["seen"]["denominators"]) == res["micro_steps"] == 2
        assert res["seen"]["temperatures"] == [temperature] * 2
        assert res["seen"]["teacher_requires_grad"] == [False, False]
        assert "pg_loss" not in res["metrics"]
        assert res["metrics"]["tokens_per_s"] > 0 and res["metrics"]["lr"] > 0
        assert res["metrics"]["grad_norm"] == pytest.approx(
            torch.cat([p.grad.reshape(-1) for p in actor.parameters() if p.grad is not None])
            .norm()
            .item(),
            rel=1e-4,
        )
        assert res["metrics"]["distill"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
        assert res["metrics"]["token_share"] == pytest.approx(1.0, abs=1e-6)
        for name, p in actor.named_parameters():
            torch.testing.assert_close(
                res["grads"][name].double(), p.grad, atol=1e-6, rtol=1e-4, msg=name
            )
        # the optimizer stepped on those gradients
        assert any(not torch.equal(res["stepped"][n], v) for n, v in res["initial"].items())
    assert loss.item() > 1e-3  # actor and teacher differ: the test can see a wrong loss


def test_loss_hook_parameter_name_chooses_logits_or_scores(tmp_path):
    from miles_core.args import ArgumentError
    from miles_fsdp.hooks import HookContext, Hooks
    from run_args import make_args

    def hooks(name):
        path = f"hook_programs:{name}"
        args = make_args(hf_checkpoint=str(tmp_path), custom_loss_function_path=path)
        return Hooks.from_args(args, HookContext(args, torch.device("cpu")))

    assert hooks("distill_loss").loss.wants_logits
    assert not hooks("distill_scores_loss").loss.wants_logits
    with pytest.raises(ArgumentError, match="--custom-loss-function-path .* logits or scores"):
        hooks("misnamed_loss")
