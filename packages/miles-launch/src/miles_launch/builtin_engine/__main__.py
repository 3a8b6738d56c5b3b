"""``python -m miles_launch.builtin_engine --model-path DIR --port P``: serve the built-in engine.

Loads the model, starts the scheduler thread, runs one 1-token generation (the health
check: ``/health`` answers 200 only after it succeeded), then serves HTTP with uvicorn.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from miles_core.args import ArgumentError

from miles_launch.engine_launch.api_key import API_KEY_ENV, is_loopback

# Heavy imports (torch, transformers, fastapi) happen after the argument checks, so a bad
# flag fails at once.
_DTYPES = ("auto", "bfloat16", "float16", "float32")


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m miles_launch.builtin_engine", description=__doc__)
    p.add_argument(
        "--model-path", required=True, help="HF model directory (config, safetensors, tokenizer)"
    )
    p.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require Authorization: Bearer <key> (default: ${API_KEY_ENV}, so that the key "
        "need not appear in the process list)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="longest prompt + max_new_tokens served (default: config.json's "
        "max_position_embeddings)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (one device per engine)")
    p.add_argument("--dtype", default="auto", choices=_DTYPES)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="accepted for SGLang parity; release always frees",
    )
    p.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="keep a CPU copy of released weights",
    )
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument(
        "--true-on-policy",
        action="store_true",
        help="batch-invariant forward (miles_core.batch_invariant): each token's log-prob is "
        "bitwise what the FSDP trainer computes under --true-on-policy (CPU: float32; GPU: "
        "the checkpoint's bfloat16 or float32)",
    )
    p.add_argument("--log-level", default="warning")
    ns = p.parse_args(argv)
    if ns.tp_size != 1:
        _fail(
            f"--tp-size {ns.tp_size}: the built-in engine serves on one device; use SGLang for tensor parallelism"
        )
    if ns.max_running_requests < 1:
        _fail(f"--max-running-requests must be >= 1, got {ns.max_running_requests}")
    if not (ns.device == "cpu" or ns.device == "cuda" or ns.device.startswith("cuda:")):
        _fail(f"--device {ns.device!r}: use cpu, cuda or cuda:N")
    if ns.context_length is not None and ns.context_length < 2:
        _fail(f"--context-length must be >= 2, got {ns.context_length}")
    if ns.true_on_policy:
        if ns.device == "cpu":
            if ns.dtype not in ("auto", "float32"):
                _fail(f"--true-on-policy computes in float32 on CPU, got --dtype {ns.dtype}")
            ns.dtype = "float32"
        elif ns.dtype not in ("auto", "bfloat16", "float32"):
            _fail(
                f"--true-on-policy computes in bfloat16 or float32 on a GPU, got --dtype {ns.dtype}"
            )
    ns.tokenizer_path = ns.tokenizer_path or ns.model_path
    ns.api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
    if not ns.api_key and not is_loopback(ns.host):
        _fail(
            f"--host {ns.host} is reachable from other hosts: give the engine a key with "
            f"${API_KEY_ENV} (or --api-key), or bind 127.0.0.1"
        )
    log_level = ns.log_level
    del ns.log_level
    # after the argument checks (see above): a bad flag fails before torch loads
    import torch

    if ns.device.startswith("cuda") and not torch.cuda.is_available():
        _fail(f"--device {ns.device}: CUDA is not available")
    from miles_launch.builtin_engine.server import EngineConfig  # imports torch

    config = EngineConfig(**vars(ns))
    logging.basicConfig(level=log_level.upper())
    # The engine's own events (weight-update groups joined) are logged at INFO whatever the level
    # of the libraries' messages.
    own = logging.getLogger("miles_launch.builtin_engine")
    own.setLevel(min(own.getEffectiveLevel(), logging.INFO))
    return config


def _fail(message: str) -> None:
    raise ArgumentError(message)


def health_check(scheduler, tokenizer, timeout: float = 300.0) -> None:
    """Generate one token through the scheduler; raise if it does not come back."""
    # these import torch: loaded once the arguments are checked
    from miles_launch.builtin_engine.request import Request
    from miles_launch.builtin_engine.sampling import SamplingParams

    done = threading.Event()
    prompt = tokenizer.encode("hello") or [0]
    req = Request(
        rid="health-check",
        prompt_ids=prompt,
        params=SamplingParams(max_new_tokens=1, temperature=0.0),
        on_done=lambda r: done.set(),
    )
    scheduler.submit([req])
    if not done.wait(timeout) or req.finish_reason is None or req.finish_reason["type"] == "abort":
        raise RuntimeError(f"health check generation failed: {req.finish_reason}")


def build_state(config):
    """Load tokenizer and model, start the scheduler, pass the health check."""
    # after the argument checks (see above): a bad flag fails before torch loads
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_launch.builtin_engine.scheduler import Scheduler
    from miles_launch.builtin_engine.server import EngineState
    from miles_launch.builtin_engine.weights import WeightStore

    device = torch.device(config.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # NCCL weight-update groups use the current device
    dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)
    extra = {}
    if config.true_on_policy:
        from miles_core import batch_invariant  # only under --true-on-policy; imports torch

        extra["attn_implementation"] = batch_invariant.register_hf()
    model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=dtype, **extra)
    model = model.to(device).eval()
    scheduler = Scheduler(
        model,
        tokenizer,
        device,
        max_running_requests=config.max_running_requests,
        enable_routed_experts=config.enable_return_routed_experts,
        true_on_policy=config.true_on_policy,
    )
    scheduler.start()
    weights = WeightStore(model, device, cpu_backup=config.enable_weights_cpu_backup)
    state = EngineState(
        config=config,
        tokenizer=tokenizer,
        scheduler=scheduler,
        weights=weights,
        weight_version=config.weight_version,
        vocab_size=model.get_input_embeddings().num_embeddings,
        context_length=config.context_length or model.config.max_position_embeddings,
    )
    health_check(scheduler, tokenizer)
    state.healthy = True
    return state


#: Seconds uvicorn waits for open requests after SIGTERM before it cancels them: a paused
#: engine holds its waiting /generate requests open, and would otherwise never exit.
GRACEFUL_SHUTDOWN_S = 5


def server_config(app, config):
    """The uvicorn configuration the engine serves ``app`` with."""
    import uvicorn  # after the argument checks, as torch

    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse_args(argv)
    except ArgumentError as exc:  # one line, exit status 2 (as the miles CLI)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    # after the argument checks (see above): a bad flag fails before torch loads
    import uvicorn

    from miles_launch.builtin_engine.server import build_app

    state = build_state(config)
    app = build_app(state)
    try:
        uvicorn.Server(server_config(app, config)).run()
    finally:
        state.scheduler.shutdown()


if __name__ == "__main__":
    main()
