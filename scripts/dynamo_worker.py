"""A Dynamo worker in front of one kvrelay-server (or a llama-server with kvrelay embedded,
`--api llama`): registers the server with Dynamo's distributed runtime (discovery, request
plane, event plane) and forwards the requests Dynamo's KV router sends it to the server's
/v1/completions (llama-server: its native /completion, which streams token ids), the router's
`kv_hint` as `kv_hints`.

Usage: python3 scripts/dynamo_worker.py --server http://HOST:PORT [--api openai|llama]
    [--namespace kvrelay] [--component worker] [--discovery file] [--event-plane zmq]
The server must run with --kv-events-endpoint: the worker reads its /v1/kv/info (`dynamo`:
the model name, block size, KV events endpoint and KV endpoint), relays the server's KV events
to Dynamo's event plane (KvEventPublisher in ZMQ relay mode) and advertises the server's KV
endpoint as this worker's hint source (runtime data `router_hint_source_control_endpoints`),
so a router that picks another worker for a prompt this server holds hints that worker to
fetch from this server. Prints one JSON line ({"worker_id", "model_name", "block_size", ...})
once registered, then serves until interrupted.

Environment: DYN_FILE_KV (the folder of the `file` discovery backend, shared by the workers
and the router), DYN_LOG.
"""

import argparse
import asyncio
import json
import sys
import urllib.error
import urllib.request

from dynamo.llm import (
    KvEventPublisher,
    ModelInput,
    ModelRuntimeConfig,
    ModelType,
    WorkerType,
    register_model,
)
from dynamo.runtime import DistributedRuntime


def http(base, method, path, body=None, timeout=300):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"error": text}


def kv_hint_of(request):
    """The router's hint: Dynamo 1.6 puts it at the top level of the request as `kv_hint`
    (`router_hint` also taken)."""
    return request.get("kv_hint") or request.get("router_hint")


class Forwarder:
    def __init__(self, base, api="openai"):
        self.base = base
        self.api = api

    async def generate(self, request, context=None):
        """Forward one request and stream the answer back token by token (the server sends
        each token as its engine chooses it; `return_token_ids` gives its id)."""
        stop = request.get("stop_conditions") or {}
        if self.api == "llama":
            # llama-server's /completion streams each token's id with return_tokens
            body = {
                "prompt": list(request["token_ids"]),
                "n_predict": stop.get("max_tokens") or 16,
                "stream": True,
                "return_tokens": True,
                "temperature": 0,
            }
            path = "/completion"
        else:
            body = {
                "prompt": list(request["token_ids"]),
                "max_tokens": stop.get("max_tokens") or 16,
                "stream": True,
                "stream_options": {"include_usage": True},
                "return_token_ids": True,
            }
            path = "/v1/completions"
        hint = kv_hint_of(request)
        if hint is not None:
            body["kv_hints"] = hint
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()
        reader = loop.run_in_executor(None, sse_lines, self.base, path, body, loop, queue)
        usage = None
        finish = None
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    yield {"token_ids": [], "finish_reason": "error", "text": str(item)}
                    return
                if "error" in item:
                    yield {"token_ids": [], "finish_reason": "error", "text": json.dumps(item)}
                    return
                if self.api == "llama":
                    if item.get("tokens") or item.get("content"):
                        yield {"token_ids": item.get("tokens", []), "text": item.get("content", "")}
                    if item.get("stop"):
                        finish = "length" if item.get("stop_type") == "limit" else "stop"
                        usage = {"prompt_tokens": item.get("tokens_evaluated", 0),
                                 "completion_tokens": item.get("tokens_predicted", 0),
                                 "total_tokens": item.get("tokens_evaluated", 0) + item.get("tokens_predicted", 0)}
                    continue
                if item.get("usage"):
                    usage = item["usage"]
                for choice in item.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                    if choice.get("token_ids") or choice.get("text"):
                        yield {"token_ids": choice.get("token_ids", []), "text": choice.get("text", "")}
        finally:
            await reader
        out = {"token_ids": [], "finish_reason": finish or "stop"}
        if usage:
            out["completion_usage"] = {
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "completion_tokens": usage.get("completion_tokens", 0),
                "total_tokens": usage.get("total_tokens", 0),
                "prompt_tokens_details": usage.get("prompt_tokens_details"),
            }
        yield out


def sse_lines(base, path, body, loop, queue, timeout=300):
    """POST `body` and put each server-sent event's JSON on `queue` (from this worker thread),
    then None; an error is put as the exception."""
    put = lambda x: loop.call_soon_threadsafe(queue.put_nowait, x)  # noqa: E731
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), method="POST", headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                put(json.loads(data))
    except urllib.error.HTTPError as e:
        put(RuntimeError(f"{e.code}: {e.read().decode()}"))
    except Exception as e:  # noqa: BLE001 - handed to the request's stream
        put(e)
    finally:
        put(None)


async def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", required=True, help="the kvrelay-server's base URL, http://HOST:PORT")
    ap.add_argument("--api", choices=("openai", "llama"), default="openai",
                    help="openai: /v1/completions with return_token_ids (kvrelay-server); llama: llama-server's /completion")
    ap.add_argument("--namespace", default="kvrelay")
    ap.add_argument("--component", default="worker")
    ap.add_argument("--discovery", default="file", help="Dynamo discovery backend (file, etcd, kubernetes)")
    ap.add_argument("--request-plane", default="tcp")
    ap.add_argument("--event-plane", default="zmq")
    args = ap.parse_args()

    status, info = http(args.server, "GET", "/v1/kv/info")
    if status != 200 or "dynamo" not in info:
        sys.exit(f"{args.server}/v1/kv/info has no `dynamo` registration (is --kv-events-endpoint / --kv-events set?)")
    reg = info["dynamo"]
    model, block_size = reg["model_name"], reg["block_size"]

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, args.discovery, args.request_plane, event_plane=args.event_plane)
    endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.generate")

    # the server's ZMQ events, relayed onto Dynamo's event plane under this worker's id
    publisher = KvEventPublisher(endpoint, kv_block_size=block_size, zmq_endpoint=reg["kv_events_endpoint"])

    # runtime data the router reads to build hints (values are JSON text): this worker takes
    # hints, its role (a hint pairs a source and a target of one role), and per data-parallel
    # rank the KV endpoint a hint names when this worker is the source
    config = ModelRuntimeConfig()
    config.set_engine_specific("router_hint", "true")
    config.set_engine_specific("router_hint_worker_type", json.dumps(reg["router_hint_worker_type"]))
    config.set_engine_specific(
        "router_hint_source_control_endpoints", json.dumps(reg["router_hint_source_control_endpoints"])
    )
    await register_model(
        ModelInput.Tokens,
        ModelType.Completions,
        endpoint,
        model,
        model,
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=block_size,
        runtime_config=config,
        skip_model_assets=True,
    )
    forwarder = Forwarder(args.server, args.api)
    print(
        json.dumps(
            {
                "worker_id": endpoint.connection_id(),
                "model_name": model,
                "block_size": block_size,
                "server": args.server,
                "kv_endpoint": info.get("kv_endpoint") or info.get("source_control_endpoint"),
            }
        ),
        flush=True,
    )
    try:
        await endpoint.serve_endpoint(forwarder.generate)
    finally:
        publisher.shutdown()
        runtime.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
