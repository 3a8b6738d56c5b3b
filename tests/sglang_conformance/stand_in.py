"""An engine stand-in whose weight-update handlers are SGLang's own receive code.

``python stand_in.py --sglang-root ROOT [--router-root RROOT] --port P`` serves, on 127.0.0.1,
the HTTP routes a publish round uses, with SGLang's request fields and replies. The weights it
receives are run through the released package's code (imported from the unpacked wheel at
``ROOT``, see ``tests/sglang_release.py``), composed as SGLang's model runner composes it
(``sglang/srt/model_executor/model_runner_components/weight_updater.py``, which itself does not
import on a CPU):

* ``/init_weights_update_group``: ``init_custom_process_group(backend, init_method=tcp://..,
  world_size, rank=rank_offset + tp_rank, group_name)`` (tp_rank 0: one TP worker; with a
  120 s timeout, where SGLang passes none, so that a broken test fails instead of hanging);
* ``/update_weights_from_distributed``: ``flattened_bucket``: ``FlattenedTensorBucket.empty(
  names, dtypes, shapes, device)``, ``torch.distributed.broadcast`` of its flattened tensor from
  rank 0, ``reconstruct_tensors()``; else one ``torch.empty`` + broadcast per name;
* ``/update_weights_from_tensor``: ``monkey_patch_torch_reductions()``,
  ``MultiprocessingSerializer.deserialize(serialized_named_tensors[tp_rank])`` (SGLang's
  allowlist unpickler), then ``FlattenedTensorBucket(flattened_tensor=, metadata=)
  .reconstruct_tensors()`` with the metadata converted to SGLang's ``FlattenedTensorMetadata``;
* ``/update_weights_from_disk``: every ``*.safetensors`` file of ``model_path``.

Where SGLang would call ``model.load_weights(named_tensors)``, the stand-in keeps a copy of
each tensor as received (no model, no cast). What is assumed, not run: SGLang's model loading
(name mapping, TP sharding, dtype casts) and CUDA IPC.

Test-only routes: ``GET /weights_digest`` (xxh3-128, dtype and shape of every tensor held),
``POST /reset_weights``, ``POST /parse_server_args {"argv"}`` and ``POST /parse_router_args
{"argv"}`` (SGLang's ``ServerArgs`` parser / sglang-router's ``parse_router_args``; replies
``{"unknown": [...], "error": str | null}``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_release import register  # noqa: E402

TP_RANK = 0
DEVICE = "cpu"
#: ServerArgs fields whose parsed values /parse_server_args returns (beside ``api_key``).
READ_BACK = ("rl_on_policy_target", "enable_deterministic_inference", "attention_backend")


class ParseError(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ParseError(message)


class StandIn:
    def __init__(self, router_root: str | None):
        import torch
        import torch.distributed as dist
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils.common import MultiprocessingSerializer, init_custom_process_group
        from sglang.srt.utils.network import NetworkAddress
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import (
            FlattenedTensorBucket,
            FlattenedTensorMetadata,
        )

        self.torch, self.dist = torch, dist
        self.ServerArgs = ServerArgs
        self.Serializer = MultiprocessingSerializer
        self.init_custom_process_group = init_custom_process_group
        self.NetworkAddress = NetworkAddress
        self.patch_reductions = monkey_patch_torch_reductions
        self.Bucket, self.Metadata = FlattenedTensorBucket, FlattenedTensorMetadata
        self.router_root = router_root
        self.groups: dict[str, object] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.version = "default"
        self.lock = threading.Lock()  # one weight update at a time, as SGLang's scheduler

    # ---------------------------------------------------------------- weight updates
    def load_weights(self, named_tensors) -> None:
        """Where SGLang calls ``model.load_weights``: keep a copy of each tensor."""
        for name, tensor in named_tensors:
            self.weights[name] = tensor.detach().clone()

    def init_weights_update_group(self, body: dict) -> str:
        rank = body["rank_offset"] + TP_RANK
        address = self.NetworkAddress(body["master_address"], body["master_port"])
        self.groups[body["group_name"]] = self.init_custom_process_group(
            backend=body.get("backend", "nccl"),
            init_method=address.to_tcp(),
            world_size=body["world_size"],
            rank=rank,
            group_name=body["group_name"],
            timeout=datetime.timedelta(seconds=120),
        )
        return "Succeeded to initialize custom process group."

    def destroy_weights_update_group(self, body: dict) -> str:
        pg = self.groups.pop(body["group_name"], None)
        if pg is None:
            raise ValueError("The group to be destroyed does not exist.")
        self.dist.destroy_process_group(pg)
        return "Succeeded to destroy custom process group."

    def update_weights_from_distributed(self, body: dict) -> str:
        torch = self.torch
        group = self.groups[body["group_name"]]
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if body.get("load_format") == "flattened_bucket":
            bucket = self.Bucket.empty(names, dtypes, shapes, DEVICE)
            self.dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            named = bucket.reconstruct_tensors()
        else:
            named = []
            for name, dtype, shape in zip(names, dtypes, shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype), device=DEVICE)
                self.dist.broadcast(weight, src=0, group=group)
                named.append((name, weight))
        self.load_weights(named)
        return "Succeeded to update parameter online."

    def update_weights_from_tensor(self, body: dict) -> str:
        self.patch_reductions()
        data = self.Serializer.deserialize(body["serialized_named_tensors"][TP_RANK])
        if body.get("load_format") == "flattened_bucket":
            metadata = [
                self.Metadata(
                    name=m.name,
                    shape=m.shape,
                    dtype=m.dtype,
                    start_idx=m.start_idx,
                    end_idx=m.end_idx,
                    numel=m.numel,
                )
                for m in data["metadata"]
            ]
            bucket = self.Bucket(flattened_tensor=data["flattened_tensor"], metadata=metadata)
            self.load_weights(bucket.reconstruct_tensors())
        else:
            self.load_weights(data)
        return "Success"

    def update_weights_from_disk(self, body: dict) -> str:
        from safetensors.torch import load_file

        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {body['model_path']}")
        for file in files:
            self.load_weights(load_file(str(file)).items())
        return "Succeeded to update model weights."

    # ---------------------------------------------------------------- parsers
    def parse_server_args(self, argv: list[str]) -> dict:
        parser = _RaisingParser(prog="sglang serve")
        self.ServerArgs.add_cli_args(parser)
        try:
            if "--config" in argv:  # what prepare_server_args does: the YAML's options merged
                from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

                argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
            namespace, unknown = parser.parse_known_args(argv)
        except (ParseError, ValueError) as error:
            return {"unknown": [], "error": str(error)}
        seen = {k: getattr(namespace, k, None) for k in READ_BACK}
        return {"unknown": unknown, "error": None, "api_key": namespace.api_key, **seen}

    def parse_router_args(self, argv: list[str]) -> dict:
        if self.router_root is None:
            return {"unknown": [], "error": "no sglang-router release given"}
        if self.router_root not in sys.path:
            sys.path.insert(0, self.router_root)
        # What sglang_router.launch_router.parse_router_args does (that module also imports the
        # mini load balancer's aiohttp, which its parser does not use).
        from sglang_router.router_args import RouterArgs

        parser = _RaisingParser(prog="sglang_router.launch_router")
        RouterArgs.add_cli_args(parser, use_router_prefix=False)
        try:
            namespace, unknown = parser.parse_known_args(argv)
            RouterArgs.from_cli_args(namespace, use_router_prefix=False)
        except (ParseError, ValueError) as error:
            return {"unknown": [], "error": str(error)}
        return {"unknown": unknown, "error": None}

    def digests(self) -> dict:
        import xxhash

        out = {}
        for name, tensor in self.weights.items():
            raw = tensor.contiguous().view(-1).view(self.torch.uint8).numpy()
            out[name] = [xxhash.xxh3_128_hexdigest(raw), str(tensor.dtype), list(tensor.shape)]
        return out


def make_handler(state: StandIn):
    ok = lambda message: (200, {"success": True, "message": message})  # noqa: E731

    def weight_call(fn):
        def run(body):
            with state.lock:
                message = fn(body)
            if body.get("weight_version") is not None:
                state.version = body["weight_version"]
            return ok(message)

        return run

    def set_version(body):
        state.version = body["new_version"]
        return 200, {"success": True, "message": "", "new_version": body["new_version"]}

    def reset(body):
        state.weights.clear()
        return ok("")

    post = {
        "/init_weights_update_group": lambda b: ok(state.init_weights_update_group(b)),
        "/destroy_weights_update_group": lambda b: ok(state.destroy_weights_update_group(b)),
        "/update_weights_from_distributed": weight_call(state.update_weights_from_distributed),
        "/update_weights_from_tensor": weight_call(state.update_weights_from_tensor),
        "/update_weights_from_disk": weight_call(state.update_weights_from_disk),
        "/update_weight_version": set_version,
        "/pause_generation": lambda b: (200, {"message": "paused", "status": "ok"}),
        "/continue_generation": lambda b: (200, {"message": "continued", "status": "ok"}),
        "/flush_cache": lambda b: (200, "Cache flushed."),
        "/begin_weight_update": lambda b: ok(""),
        "/end_weight_update": lambda b: ok(""),
        "/reset_weights": reset,
        "/parse_server_args": lambda b: (200, state.parse_server_args(b["argv"])),
        "/parse_router_args": lambda b: (200, state.parse_router_args(b["argv"])),
    }
    get = {
        "/health": lambda: (200, ""),
        "/get_model_info": lambda: (200, {"weight_version": state.version}),
        "/model_info": lambda: (200, {"weight_version": state.version}),
        "/weights_digest": lambda: (200, state.digests()),
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _reply(self, status: int, content) -> None:
            text = isinstance(content, str)
            data = content.encode() if text else json.dumps(content).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            route = get.get(self.path.split("?")[0])
            if route is None:
                return self._reply(404, {"detail": "Not Found"})
            self._reply(*route())

        def do_POST(self):  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            route = post.get(self.path.split("?")[0])
            if route is None:
                return self._reply(404, {"detail": "Not Found"})
            try:
                self._reply(*route(body))
            except Exception as error:  # SGLang answers a failed update with 400
                traceback.print_exc()
                self._reply(400, {"success": False, "message": f"{type(error).__name__}: {error}"})

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sglang-root", required=True)
    parser.add_argument("--router-root", default=None)
    parser.add_argument("--port", type=int, required=True)
    config = parser.parse_args()
    register(config.sglang_root)
    import torch

    torch.set_num_threads(1)
    torch.multiprocessing.set_sharing_strategy("file_system")
    state = StandIn(config.router_root)
    server = ThreadingHTTPServer(("127.0.0.1", config.port), make_handler(state))
    server.daemon_threads = True
    print(f"stand-in serving on {config.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
