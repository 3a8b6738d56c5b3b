"""A multi-turn calculator-tool task for ``--custom-generate-function-path calculator:generate``.

Each prompt is ``"add A B "`` (two digits). The model may call the calculator by writing
``:`` within its first turn (``TURN_TOKENS`` tokens, stop string ``:``); the environment then
appends the calculator's output ``" is S "`` (tool tokens: ``loss_mask`` 0, not trained on) and
the model answers in a second turn. The reward, returned with the sample:

* 0.5 for calling the calculator,
* 0.5 when the answer (the model's second turn, or its only turn) contains the sum ``S``.

A random model calls the tool in about one sample of ten; a policy that learns to call it
doubles as a check that the loss trains on model tokens only.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from miles_launch.rollout.custom_generate import CustomSample, GenerateContext, engine_turn

CALL = ":"
TURN_TOKENS = 4


def tool_output(prompt_text: str) -> str:
    """The calculator's answer to the prompt's ``add A B`` as the text appended after a call."""
    _, a, b = prompt_text.split()[:3]
    return f" is {int(a) + int(b)} "


def answer_reward(called: bool, answer: str, label: str) -> float:
    return 0.5 * called + 0.5 * (label in answer)


async def generate(ctx: GenerateContext, prompt, sampling_params: dict) -> CustomSample:
    """One episode: a model turn, the calculator if called, a second model turn."""
    budget = sampling_params["max_new_tokens"]
    first = dict(sampling_params, max_new_tokens=min(TURN_TOKENS, budget), stop=[CALL])
    turn = await engine_turn(ctx, list(prompt.token_ids), first)
    ids, log_probs, mask = list(turn.ids), list(turn.log_probs), [1] * len(turn.ids)
    called = turn.finish_reason == "stop" and turn.finish_matched == CALL
    answer, version = turn.text, turn.weight_version
    if called:
        tool_ids = ctx.tokenizer.encode(tool_output(prompt.text), add_special_tokens=False)
        ids += tool_ids
        log_probs += [0.0] * len(tool_ids)
        mask += [0] * len(tool_ids)
        second = dict(sampling_params, max_new_tokens=min(TURN_TOKENS, budget))
        second["sampling_seed"] = (sampling_params.get("sampling_seed", 0) + 1) % 2**31
        second.pop("stop", None)
        turn = await engine_turn(ctx, list(prompt.token_ids) + ids, second)
        ids += turn.ids
        log_probs += turn.log_probs
        mask += [1] * len(turn.ids)
        answer, version = turn.text, turn.weight_version
    return CustomSample(
        response_ids=ids,
        rollout_log_probs=log_probs,
        loss_mask=mask,
        response_text=ctx.tokenizer.decode(ids),
        finish_reason=turn.finish_reason,
        reward=answer_reward(called, answer, str(prompt.label)),
        weight_version=version,
    )


def write_prompts(path: str | Path, num_prompts: int = 64, seed: int = 0) -> Path:
    """``num_prompts`` lines ``{"prompt": "add A B ", "label": "<A+B>"}``."""
    rng = random.Random(seed)
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_prompts):
            a, b = rng.randrange(10), rng.randrange(10)
            f.write(json.dumps({"prompt": f"add {a} {b} ", "label": str(a + b)}) + "\n")
    return path
