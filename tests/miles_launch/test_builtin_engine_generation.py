"""The built-in engine over HTTP (httpx): generation against transformers references
(greedy, continuous batching, logprobs, sampling, stop conditions), errors and info."""

from __future__ import annotations

import concurrent.futures
import copy
import time

import pytest
import torch
from engine_testing import (
    PROMPTS,
    assert_generates,
    generate,
    hf_greedy,
    reference,
)

# The modules share one engine subprocess (conftest.py), started by the first of them.
pytestmark = pytest.mark.slow


def test_greedy_batch_equals_model_generate_and_is_deterministic(engine, models):
    want = reference(models, "old")
    first = generate(engine, PROMPTS)
    assert isinstance(first, list) and len(first) == len(PROMPTS)
    assert [o["output_ids"] for o in first] == want
    assert [o["output_ids"] for o in generate(engine, PROMPTS)] == want
    tok = models["tokenizer"]
    for out, ids, prompt in zip(first, want, PROMPTS):
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(tok.encode(prompt))
        assert meta["completion_tokens"] == len(ids)
        assert meta["weight_version"] == "default"
        if ids[-1] == 0:  # EOS: kept in output_ids, not in text
            assert meta["finish_reason"] == {"type": "stop", "matched": 0}
            assert out["text"] == tok.decode(ids[:-1])
        else:
            assert meta["finish_reason"] == {"type": "length", "length": 16}
            assert out["text"] == tok.decode(ids)


def test_requests_joining_and_leaving_a_running_batch(engine, models):
    """Staggered requests of different lengths (max 3 running): each equals its reference."""
    prompts = PROMPTS * 2
    lengths = [5, 23, 9, 31, 2, 17, 12, 27]
    tok, model = models["tokenizer"], models["old"][1]
    want = [hf_greedy(model, tok.encode(p), n) for p, n in zip(prompts, lengths)]

    def one(i):
        time.sleep(0.03 * i)
        body = {
            "input_ids": tok.encode(prompts[i]),
            "sampling_params": {"max_new_tokens": lengths[i], "temperature": 0},
        }
        return engine.post("/generate", body).json()["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(len(prompts))))
    assert got == want


def test_logprobs_equal_a_forward_pass(engine, models):
    tok, model = models["tokenizer"], models["old"][1]
    prompt_ids = tok.encode("the quick brown fox")
    out = engine.post(
        "/generate",
        {
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "return_logprob": True,
        },
    ).json()
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and all(x is None for _, _, x in lps)
    seq = torch.tensor([prompt_ids + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].double(), dim=-1)
    n = len(prompt_ids)
    want = [logp[n - 1 + i, tok_id].item() for i, tok_id in enumerate(out["output_ids"])]
    assert max(abs(a - b) for (a, _, _), b in zip(lps, want)) < 1e-5


def test_input_token_logprobs_rescore_the_generated_tokens(engine, models):
    """SGLang's prompt log-probs (``logprob_start_len``): a sampled response sent back as input
    gets, token for token, the log-probs the engine reported while generating it (same weights),
    and both equal a float64 forward pass; the entry at the start position is ``None``."""
    tok, model = models["tokenizer"], models["old"][1]
    prompts = [tok.encode("the quick brown fox"), tok.encode("ab")]
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    body = {"input_ids": prompts, "sampling_params": params, "return_logprob": True}
    generated = engine.post("/generate", body).json()
    reference = copy.deepcopy(model).double()
    for prompt, gen in zip(prompts, generated):
        response = gen["output_ids"]
        start = len(prompt) - 1
        scored = engine.post(
            "/generate",
            {
                "input_ids": prompt + response,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": start,
            },
        ).json()
        entries = scored["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in entries] == (prompt + response)[start:]
        assert entries[0][0] is None and all(text is None for _, _, text in entries)
        rescored = torch.tensor([lp for lp, _, _ in entries[1:]], dtype=torch.float64)
        sampled = torch.tensor(
            [lp for lp, _, _ in gen["meta_info"]["output_token_logprobs"]], dtype=torch.float64
        )
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + response])).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        want = logp[start : start + len(response)].gather(1, torch.tensor(response)[:, None])[:, 0]
        atol = 1e-5  # fp32 log-softmax of logits of magnitude ~10..50 (sharpened weights)
        torch.testing.assert_close(rescored, want, rtol=0, atol=atol)
        torch.testing.assert_close(sampled, want, rtol=0, atol=atol)
        assert not torch.allclose(rescored, rescored.new_zeros(len(response)))
    # SGLang's input log-probs are not temperature-scaled: the request's temperature is ignored
    body = {"input_ids": prompts[0] + [5, 6, 7], "return_logprob": True, "logprob_start_len": 1}
    entries = [
        engine.post("/generate", {**body, "sampling_params": {"max_new_tokens": 1, **t}}).json()[
            "meta_info"
        ]["input_token_logprobs"]
        for t in ({"temperature": 1.0}, {"temperature": 0.5})
    ]
    assert entries[0] == entries[1] and len(entries[0]) == len(prompts[0]) + 2


def test_sampling_semantics(engine, models):
    greedy = generate(engine, "hello", 10)["output_ids"]
    # top_k = 1 at a high temperature is greedy
    assert (
        generate(engine, "hello", 10, sampling_params={"temperature": 5.0, "top_k": 1})[
            "output_ids"
        ]
        == greedy
    )
    # a tiny top_p keeps only the most likely token
    assert (
        generate(engine, "hello", 10, sampling_params={"temperature": 5.0, "top_p": 1e-6})[
            "output_ids"
        ]
        == greedy
    )
    # min_p = 1 keeps only the maximum
    assert (
        generate(engine, "hello", 10, sampling_params={"temperature": 5.0, "min_p": 1.0})[
            "output_ids"
        ]
        == greedy
    )
    seeded = {"temperature": 1.5, "sampling_seed": 7, "ignore_eos": True}
    a = generate(engine, "hello", 20, sampling_params=seeded)["output_ids"]
    assert generate(engine, "hello", 20, sampling_params=seeded)["output_ids"] == a
    many = generate(
        engine, "hello", 20, sampling_params={"temperature": 1.5, "n": 3, "ignore_eos": True}
    )
    assert (
        isinstance(many, list) and len(many) == 3 and all(len(o["output_ids"]) == 20 for o in many)
    )
    assert len({tuple(o["output_ids"]) for o in many}) > 1


def test_stop_strings_and_stop_token_ids(engine, models):
    tok = models["tokenizer"]
    full = generate(engine, "hello world", 30, sampling_params={"ignore_eos": True})
    text = full["text"]
    stop = text[5:7]
    cut = text.find(stop)
    out = generate(engine, "hello world", 30, sampling_params={"ignore_eos": True, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:cut]
    assert out["output_ids"] == full["output_ids"][: len(out["output_ids"])]
    kept = generate(
        engine,
        "hello world",
        30,
        sampling_params={"ignore_eos": True, "stop": stop, "no_stop_trim": True},
    )
    assert kept["text"].endswith(stop) and kept["text"].startswith(text[:cut])
    stop_id = full["output_ids"][3]
    out = generate(
        engine, "hello world", 30, sampling_params={"ignore_eos": True, "stop_token_ids": [stop_id]}
    )
    first = full["output_ids"].index(stop_id)
    assert out["output_ids"] == full["output_ids"][: first + 1]  # includes the stop token
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["text"] == tok.decode(full["output_ids"][:first])


def test_bad_requests_are_400_with_error_message(engine):
    r = engine.client.post("/generate", content=b"")
    assert r.status_code == 400 and "missing request body" in r.json()["error"]["message"]
    r = engine.client.post("/pause_generation", content=b"")
    assert r.status_code == 400
    r = engine.post(
        "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "bogus": 1}}
    )
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    r = engine.post("/generate", {"text": "a", "input_ids": [1]})
    assert (
        r.status_code == 400 and "exactly one of text or input_ids" in r.json()["error"]["message"]
    )
    r = engine.post("/generate", {"text": "a", "sampling_params": {"top_p": 0}})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]


def test_info_and_health(engine, models):
    assert engine.client.get("/health").status_code == 200
    info = engine.client.get("/get_model_info").json()
    assert info["model_path"] == str(models["old"][0]) and info["is_generation"] is True
    server = engine.client.get("/get_server_info").json()
    assert server["tp_size"] == 1 and server["host"] == "127.0.0.1" and "version" in server
    r = engine.post("/update_weight_version", {"new_version": "v7"})
    assert r.status_code == 200
    assert engine.client.get("/model_info").json()["weight_version"] == "v7"
    assert generate(engine, "a", 2)["meta_info"]["weight_version"] == "v7"
    engine.post("/update_weight_version", {"new_version": "default"})


def test_admission_checks_answer_400_and_the_engine_keeps_serving(engine, models):
    """Out-of-vocabulary ids (a device assert on CUDA), over-long requests and sampling values
    outside SGLang's domains are refused naming the field; nothing reaches the model."""
    for body, word in (
        ({"input_ids": [1, 2, 10**6]}, r"input_ids[2] = 1000000 is outside the vocabulary"),
        ({"input_ids": [[1], [-3]]}, "input_ids[1][0] = -3"),
        ({"input_ids": [1] * 600}, "longer than the model's context length (512 tokens)"),
        (
            {"text": "ab", "sampling_params": {"max_new_tokens": 10**9}},
            "max_new_tokens 1000000000",
        ),
        ({"text": "ab", "sampling_params": {"temperature": "hot"}}, "temperature must be"),
        ({"text": "ab", "sampling_params": [{"n": 1}, {"n": 1}]}, "2 entries for 1 prompts"),
        ({"text": "ab", "rid": {"a": 1}}, "rid must be a string"),
        ({"text": "ab", "routed_experts_start_len": "x"}, "routed_experts_start_len"),
        ({"text": "ab", "logprob_start_len": 2}, "logprob_start_len 2 is not below"),
        ({"text": "ab", "logprob_start_len": -2}, "logprob_start_len must be -1 or"),
    ):
        r = engine.post("/generate", body, timeout=10)
        assert r.status_code == 400, (body, r.text)
        assert word in r.json()["error"]["message"], r.text
    r = engine.client.post(
        "/generate",
        content=b'{"text": "ab", "sampling_params": {"temperature": NaN}}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
    assert_generates(engine, models, "old")
