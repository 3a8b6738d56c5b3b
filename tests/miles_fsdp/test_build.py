"""One build path for every role (miles_fsdp.build): a MoE reference under R3 routes the packed
row to the experts the actor replays (its log-probs equal a float64 reference written in the
tests at those experts, and not its own routing); the placement of a CPU-offloaded role."""

from __future__ import annotations

import pytest
import torch
from miles_fsdp.build import placement
from moe_reference import reference_log_probs
from routed_experts_testing import (
    differs,
    moe_config,
    moe_layers,
    own_top_k,
    perturb_routers,
    save_trainer_copy,
)
from run_args import make_args
from tiny_models import save_tiny_model

TOKENS = 12


@pytest.mark.slow
def test_moe_reference_replays_the_rollout_routing(one_rank_group, tmp_path):
    from miles_core.batch import RolloutBatch, Sample
    from miles_core.packing import pack_thd
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.train_step import policy_log_probs
    from transformers import AutoModelForCausalLM

    config = moe_config("qwen3_moe")
    actor_dir = save_tiny_model(tmp_path / "actor", config, seed=0)
    tokens = torch.randint(2, 64, (TOKENS,), generator=torch.Generator().manual_seed(5))
    reference = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32)
    own = own_top_k(reference, tokens[:-1])  # the rollout routes as the actor does
    routed = torch.stack([own[layer] for layer in sorted(own)], dim=1).int()
    perturb_routers(reference, routed)  # the reference's own top-k is not the rollout's
    assert differs(own_top_k(reference, tokens[:-1]), routed)
    ref_dir = save_trainer_copy(reference, tmp_path / "ref")

    backend = FSDPBackend()
    backend.init(
        make_args(
            hf_checkpoint=str(actor_dir),
            ref_load=str(ref_dir),
            use_rollout_routing_replay=True,
            attn_implementation="eager",
        )
    )
    sample = Sample(tokens=tokens, response_length=TOKENS - 3, reward=1.0, routed_experts=routed)
    batch = RolloutBatch([sample])
    ctx = backend._rollout_context()
    got = policy_log_probs(ctx, batch, backend.frozen["reference"])[0].double()
    actor = policy_log_probs(ctx, batch)[0].double()
    backend.close()

    as_packed = pack_thd(batch).routed_experts[:TOKENS]
    response = slice(2, TOKENS - 1)  # log-probs of tokens 3.. (the response)
    want, _ = reference_log_probs(str(ref_dir), tokens, as_packed)
    # fp32 forward of a 2-layer model against float64: a few hundred fp32 ulps of O(1) values
    torch.testing.assert_close(got, want[response].detach(), rtol=0, atol=2e-5)
    want_actor, _ = reference_log_probs(str(actor_dir), tokens, as_packed)
    torch.testing.assert_close(actor, want_actor[response].detach(), rtol=0, atol=2e-5)
    # control: routed by its own top-k, the reference gives other numbers
    own = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = own(input_ids=tokens[None], use_cache=False).logits[0]
    own_lp = torch.log_softmax(logits, -1)[:-1].gather(-1, tokens[1:, None]).squeeze(-1)
    assert (own_lp[response].double() - got).abs().max() > 1e-2
    assert moe_layers(own)


def test_placement_of_cpu_offloaded_roles():
    """--fsdp-cpu-offload / --ref-cpu-offload / --teacher-cpu-offload on a CUDA node: the
    parameter shards on the CPU, the buffers (rotary inv_freq) on the accelerator."""
    cuda = torch.device("cuda", 1)
    offloaded = placement(cuda, cpu_offload=True)
    assert (offloaded.params, offloaded.buffers) == (torch.device("cpu"), cuda)
    resident = placement(cuda, cpu_offload=False)
    assert (resident.params, resident.buffers) == (cuda, cuda)


@pytest.mark.slow
def test_offloaded_build_materialises_where_placement_says(one_rank_group, tmp_path, monkeypatch):
    """The build puts parameters and buffers where :func:`placement` decides, asked with the
    accelerator and the role's offload flag: on this CPU node the decision is mocked to put the
    buffers on the ``meta`` device, which only the decision can have chosen."""
    import miles_fsdp.build as build
    from miles_fsdp.backend import FSDPBackend

    asked = []

    def decide(device, cpu_offload):
        asked.append((device, cpu_offload))
        return build.Placement(params=torch.device("cpu"), buffers=torch.device("meta"))

    monkeypatch.setattr(build, "placement", decide)
    hf_dir = save_tiny_model(tmp_path / "m")
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir), fsdp_cpu_offload=True))
    assert asked == [(torch.device("cpu"), True)]
    buffers = dict(backend.model.named_buffers())
    assert buffers and all(b.device.type == "meta" for b in buffers.values())
    assert all(p.device.type == "cpu" for p in backend.model.parameters())
    backend.close()
