"""EMAOptimizer: the decay schedule and averages against the formula computed by hand, the
weight swap, and (2 gloo ranks, FSDPBackend) publishing, --old-policy ema, DCP round trip with
--no-save-optim / --no-load-optim, EMA-off loading and legacy seeding."""

from __future__ import annotations

import pytest
import torch
from dense_reference import dense_model, response_log_probs
from miles_fsdp.ema import EMAOptimizer, EMASchedule
from role_programs import EMA_FLAGS, ema_program
from spawn import run_ranks
from tiny_models import save_tiny_model
from torch import nn


def hand_decay(s: int, init: float, ramp: float, top: float, flat: int) -> float:
    if s <= flat:
        return init
    return min((s - flat) * ramp, top)


def test_schedule_covers_flat_ramp_and_max():
    sched = EMASchedule(init=0.3, ramp=0.15, max=0.4, flat_steps=1)
    assert [sched.decay(s) for s in range(5)] == [0.3, 0.3, 0.15, 0.3, 0.4]
    default = EMASchedule()
    assert default.decay(0) == 0.001 and default.decay(7) == pytest.approx(0.007)
    assert default.decay(10_000) == 0.5


def test_values_per_step_match_formula_and_skip_frozen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].weight.requires_grad_(False)
    model.register_buffer("counter", torch.zeros(2))
    ema = EMAOptimizer(model.parameters(), EMASchedule(init=0.2, ramp=0.1, max=0.35, flat_steps=2))
    assert model[1].weight not in ema.state and len(ema.params()) == 3
    expected = {id(p): p.detach().double().clone() for p in ema.params()}
    frozen_before = model[1].weight.detach().clone()
    for s in range(1, 7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        d = ema.update(s)
        assert d == pytest.approx(hand_decay(s, 0.2, 0.1, 0.35, 2))
        for p in ema.params():
            expected[id(p)] = d * expected[id(p)] + (1 - d) * p.detach().double()
            torch.testing.assert_close(ema.state[p]["ema"].double(), expected[id(p)])
    assert ema.param_groups[0]["updates"] == 6
    assert not torch.equal(model[1].weight, frozen_before)  # it moved, EMA ignored it


def test_step_needs_actor_step():
    ema = EMAOptimizer(nn.Linear(2, 2).parameters(), EMASchedule())
    with pytest.raises(TypeError, match="actor_step"):
        ema.step()


def test_use_weights_swaps_and_restores_after_exception():
    model = nn.Linear(3, 3)
    ema = EMAOptimizer(model.parameters(), EMASchedule(init=0.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in ema.params():
            ema.state[p]["ema"].fill_(7.0)
    with pytest.raises(RuntimeError, match="inside"):
        with ema.use_weights(model):
            assert torch.all(model.weight == 7.0) and torch.all(model.bias == 7.0)
            raise RuntimeError("inside")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
    assert torch.all(ema.state[model.weight]["ema"] == 7.0)


@pytest.mark.slow
def test_backend_ema_two_ranks(tmp_path):
    hf_dir = str(save_tiny_model(tmp_path / "qwen3"))
    out = tmp_path / "out.pt"
    run_ranks(2, ema_program, hf_dir, str(tmp_path / "ckpt"), str(out), timeout=300)
    res = torch.load(out, weights_only=True)
    f = EMA_FLAGS
    # one update per rollout (1 optimizer step each) with the decay of the actor's step count
    expected = {n: v.double() for n, v in res["params"][0].items()}
    assert res["ema"][0].keys() == expected.keys()
    for k in range(1, 5):
        d = hand_decay(
            k,
            f["ema_decay_init"],
            f["ema_decay_ramp"],
            f["ema_decay_max"],
            f["ema_decay_flat_steps"],
        )
        assert res["decay"][k - 1] == pytest.approx(d)
        for n in expected:
            expected[n] = d * expected[n] + (1 - d) * res["params"][k][n].double()
            torch.testing.assert_close(res["ema"][k][n].double(), expected[n], atol=1e-6, rtol=0)
    assert res["decay"] == pytest.approx([0.3, 0.15, 0.3, 0.4])
    # --old-policy ema: the first rollout's EMA equals the actor (ratio 1), later ones differ
    assert abs(res["ppo_kl"][0]) < 1e-7 and all(abs(v) > 1e-9 for v in res["ppo_kl"][1:])
    # two publishes read EMA and change neither EMA nor the actor
    final_ema, final_params = res["ema"][4], res["params"][4]
    for published in res["published"]:
        for n, v in final_ema.items():
            torch.testing.assert_close(published[n], v, atol=0, rtol=0)
    for n in final_ema:
        torch.testing.assert_close(res["after_publish"]["ema"][n], final_ema[n], atol=0, rtol=0)
        torch.testing.assert_close(
            res["after_publish"]["params"][n], final_params[n], atol=0, rtol=0
        )
        torch.testing.assert_close(res["inside"][n], final_ema[n], atol=0, rtol=0)
        torch.testing.assert_close(res["after_exception"][n], final_params[n], atol=0, rtol=0)
    # DCP round trip of EMA although optimizer state was neither saved nor loaded
    it = tmp_path / "ckpt" / "iter_0000004"
    assert not (it / "optimizer").exists() and not (it / "lr_scheduler").exists()
    for n, v in final_ema.items():
        torch.testing.assert_close(res["loaded_ema"][n], v, atol=0, rtol=0)
    assert res["loaded_updates"] == 4
    assert res["no_ema_loaded"]
    # legacy: no ema/ -> EMA seeded from the loaded actor, history restarts
    for n, v in res["legacy_params"].items():
        torch.testing.assert_close(res["legacy_ema"][n], v, atol=0, rtol=0)
    torch.testing.assert_close(
        res["legacy_params"]["lm_head.weight"], final_params["lm_head.weight"]
    )
    assert res["legacy_updates"] == 0


def test_ema_state_sleeps_with_the_optimizers():
    from miles_offload.device_mover import DeviceMover

    torch.manual_seed(1)
    model = nn.Linear(4, 3)
    adam = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    ema = EMAOptimizer(model.parameters(), EMASchedule(init=0.5))
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(0)
    before = {id(p): ema.state[p]["ema"].clone() for p in ema.params()}
    mover = DeviceMover({"actor": model}, [adam, ema], device="cpu")

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    params = nbytes(model.parameters())
    adam_bytes = nbytes(v for st in adam.state.values() for v in st.values() if v.dim() > 0)
    ema_bytes = nbytes(st["ema"] for st in ema.state.values())
    for _ in range(2):
        mover.sleep()
        moved = mover.last.bytes_copied
        mover.wake_up()
        for p in ema.params():
            torch.testing.assert_close(ema.state[p]["ema"], before[id(p)], atol=0, rtol=0)
    assert moved >= params + adam_bytes + ema_bytes
    mover.close()


@pytest.mark.slow
def test_eval_weights_ema_evaluates_hand_computed_ema_and_restores(tmp_path):
    from role_programs import EVAL_FLAGS, eval_program
    from samples import make_samples

    hf_dir = save_tiny_model(tmp_path / "qwen3")
    out = tmp_path / "out.pt"
    run_ranks(2, eval_program, str(hf_dir), str(out), timeout=300)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    f = EVAL_FLAGS
    params = ranks[0]["params"]  # full tensors: the same on both ranks
    ema = {n: v.double() for n, v in params[0].items()}
    for k in range(1, 4):  # one update per rollout, decay of the actor's step count k
        d = hand_decay(
            k,
            f["ema_decay_init"],
            f["ema_decay_ramp"],
            f["ema_decay_max"],
            f["ema_decay_flat_steps"],
        )
        ema = {n: d * v + (1 - d) * params[k][n].double() for n, v in ema.items()}
    samples = make_samples(seed=7)
    ema_model, actor_model = dense_model(hf_dir, ema), dense_model(hf_dir, params[3])
    with torch.no_grad():
        expected = [response_log_probs(ema_model, s) for s in samples]
        actor = [response_log_probs(actor_model, s) for s in samples]
    total = sum(float(lp.sum()) for lp in expected)
    tokens = sum(lp.numel() for lp in expected)
    seen = []
    for res in ranks:
        seen += res["sources"]
        for lp, src in zip(res["log_probs"], res["sources"]):
            torch.testing.assert_close(lp.double(), expected[src], atol=2e-5, rtol=0)
        for lp, src in zip(res["actor_log_probs"], res["sources"]):
            torch.testing.assert_close(lp.double(), actor[src], atol=2e-5, rtol=0)
        assert res["metrics"]["tokens"] == tokens
        assert res["metrics"]["log_prob"] == pytest.approx(total / tokens, abs=2e-6)
        assert res["metrics"]["nll"] == -res["metrics"]["log_prob"]
        # training weights, EMA and train mode are back; a forward reads the actor again
        for n, v in params[3].items():
            torch.testing.assert_close(res["params_after"][n], v, atol=0, rtol=0)
            torch.testing.assert_close(res["ema_after"][n], res["ema_before"][n], atol=0, rtol=0)
        torch.testing.assert_close(res["probe_after"], res["probe_before"], atol=0, rtol=0)
        assert res["training_after"] is True
    assert sorted(seen) == list(range(len(samples)))
    # the EMA is visibly not the actor, so evaluating the wrong weights fails above
    assert max((e - a).abs().max().item() for e, a in zip(expected, actor)) > 1e-3
