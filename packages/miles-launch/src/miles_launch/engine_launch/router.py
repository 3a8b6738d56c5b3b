"""The SGLang router in front of the engines, or an external one the engines register with.

Own router: ``python -m sglang_router.launch_router --host H --port P --worker-urls URL...``
followed by every ``--router-<x>`` as ``--<x>``. External router (``--sglang-router-ip`` and
``--sglang-router-port``): no router is started; each engine is registered once healthy, with
``POST /workers {"url": ...}`` (sglang-router >= 0.3) or, when that route is missing,
``POST /add_worker?url=...`` (older routers), and removed again at shutdown with
``DELETE /workers/<url>`` or, when that route is missing, ``POST /remove_worker?url=...``. With
the job's API key, the router gets ``--api-key`` and every registration carries it.
"""

from __future__ import annotations

import sys
from urllib.parse import quote

import httpx
from miles_core.args import ArgumentError, passthrough_to_argv
from miles_core.args.parsed import ParsedArgs

RESERVED = ("host", "port", "worker-urls")


def router_command(
    args: ParsedArgs, *, host: str, port: int, worker_urls: list[str], python: str = sys.executable
) -> list[str]:
    """``python -m sglang_router.launch_router ...`` for this job's engines."""
    for key in args.router_passthrough:
        if key in RESERVED:
            raise ArgumentError(f"--router-{key} is set by miles")
    cmd = [
        python,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
    ]
    key = args.sglang_api_key
    if key and "api-key" not in args.router_passthrough:
        cmd += ["--api-key", key]  # what the router sends its workers
    return cmd + passthrough_to_argv(args.router_passthrough)


def external_router_url(args: ParsedArgs) -> str | None:
    """``http://IP:PORT`` of ``--sglang-router-ip/--sglang-router-port``, or None."""
    if args.sglang_router_ip is None:
        return None
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}"


def register_worker(
    router_url: str, worker_url: str, api_key: str | None = None, timeout: float = 30.0
) -> None:
    """Add ``worker_url`` to the router at ``router_url`` (new API first, then the old one).
    With ``api_key``, the call carries ``Authorization: Bearer`` and the new API's body the
    worker's key (what the router sends that worker)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"url": worker_url, **({"api_key": api_key} if api_key else {})}
    with httpx.Client(base_url=router_url, timeout=timeout, headers=headers) as http:
        response = http.post("/workers", json=body)
        if response.status_code in (404, 405):
            response = http.post("/add_worker", params={"url": worker_url})
        if response.status_code >= 400:
            raise RuntimeError(
                f"router {router_url} refused worker {worker_url}: "
                f"HTTP {response.status_code} {response.text[:200]}"
            )


def deregister_worker(
    router_url: str, worker_url: str, api_key: str | None = None, timeout: float = 30.0
) -> None:
    """Remove ``worker_url`` from the router at ``router_url`` (new API first, then the old
    one), so that the router sends nothing more to an engine this job stopped."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=router_url, timeout=timeout, headers=headers) as http:
        response = http.delete(f"/workers/{quote(worker_url, safe='')}")
        if response.status_code in (404, 405):
            response = http.post("/remove_worker", params={"url": worker_url})
        if response.status_code >= 400:
            raise RuntimeError(
                f"router {router_url} did not remove worker {worker_url}: "
                f"HTTP {response.status_code} {response.text[:200]}"
            )
