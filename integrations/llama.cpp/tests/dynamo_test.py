#!/usr/bin/env python3
"""Dynamo 1.6.1's KV router in front of two kvrelay llama-servers: the servers publish KV events
(--kv-events), Dynamo indexes them, and the hint it builds for one server is fetched from the
other; every answer equals a cold server's.

    PYTHONPATH=$KVRELAY_DYNAMO_PYTHONPATH python3 integrations/llama.cpp/tests/dynamo_test.py \\
        --server target/llama-server/bin/llama-server-kvrelay --model MODEL.gguf [--threads 1]

Needs `dynamo` (ai-dynamo-runtime 1.6.1; .ci/ensure-dynamo.sh installs it and exports
KVRELAY_DYNAMO_PYTHONPATH). Servers on loopback, with the bit-exact settings of
two_instance_test.py: A and A2 (A2 with a 4 MiB block store) serve and publish events, B trusts
hints from both (--kv-trusted-endpoint, --kv-fetch always) and publishes too, C is the cold
reference (no KV path; cache_prompt off). Checks:
  a. A answers a prompt; Dynamo's SelectionService, fed by A's events, hints B to fetch A's
     blocks (A's KV endpoint, A's block names); B fetches them and answers as C.
  b. A2 evicts a prompt (other prompts fill its small store); the router, subscribed, stops
     naming A2 for it, and B answers it cold.
  c. A router started after A answered still learns what A holds (the replay socket).
  d. Dynamo's runtime: scripts/dynamo_worker.py (--api llama) registers A and B with a
     DistributedRuntime (file discovery in a private folder, TCP requests, ZMQ events); the
     KvRouter's generate sent to B's worker carries the hint; B fetches A's blocks and streams
     C's tokens.
Every wait is bounded and polls a condition.
"""
import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from smoke_test import Server  # noqa: E402
from two_instance_test import BT, answer, complete, metrics, text  # noqa: E402

WORKER = os.path.join(ROOT, "scripts", "dynamo_worker.py")


class Named(Server):
    """A llama-server as dynamo_selection.Router sees one: name, base, info."""

    def __init__(self, name, binary, model, args, log_dir, threads):
        self.name = name
        super().__init__(binary, model, args, os.path.join(log_dir, name + ".log"), threads=threads)
        self.info = self.json("GET", "/v1/kv/info")[1]

    def lookup(self, prompt):
        return self.json("POST", "/v1/kv/lookup", {"prompt": prompt})[1]


def fetched(srv):
    return metrics(srv).get("llamacpp_kv_fetched_blocks_total", 0)


def first_line(proc, what, timeout=90):
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited ({proc.returncode})")
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if line.strip():
                return line
    raise AssertionError(f"{what} printed nothing in {timeout} s")


async def run(a, log_dir):
    from dynamo_selection import Router, fetch_payload

    exact = ["-fa", "off", "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT)]
    # trusted: /v1/kv/lookup answers which blocks are held only at the trusted edge
    serve = ["--kv-listen", "127.0.0.1:0", "--kv-events", "tcp://127.0.0.1:0", "--kv-hints-trusted"]
    servers = {}
    routers = []
    report = {}

    def start(name, args):
        servers[name] = Named(name, a.server, a.model, exact + args, log_dir, a.threads)
        return servers[name]

    try:
        A = start("A", serve)
        A2 = start("A2", serve + ["--kv-pool-mib", "4"])
        C = start("C", [])
        B = start("B", serve + ["--kv-fetch", "always",
                                "--kv-trusted-endpoint", A.info["source_control_endpoint"],
                                "--kv-trusted-endpoint", A2.info["source_control_endpoint"]])
        model = A.info["dynamo"]["model_name"]
        assert A.info["dynamo"]["block_size"] == BT and A.info["kv_events"]["block_size"] == BT, A.info
        assert "dynamo" not in C.info, C.info

        def cold(prompt):
            return complete(C, prompt, {"cache_prompt": False})

        router = Router()
        routers.append(router)
        ids = {"A": 1, "B": 2, "A2": 3}
        for name in ("A", "B", "A2"):
            await router.register(servers[name], ids[name])

        # a. A answers; the router hints B to fetch A's blocks
        p1 = text(150, 11)
        complete(A, p1)
        look = A.lookup(p1)
        t1, n1 = look["token_ids"], look["blocks_held"]
        assert n1 >= 4, look
        await router.wait_held(model, t1, ids["A"], lambda n: n >= n1, "the router indexes A's events")
        hint = await router.hint(model, t1, ids["B"])
        pay = fetch_payload(hint)
        assert pay is not None, f"no kv.fetch in the selection's hint: {hint}"
        assert pay["source_control_endpoint"] == A.info["source_control_endpoint"], pay
        assert pay["block_hashes"] == look["block_hashes"][:n1], (pay["block_hashes"], look["block_hashes"])
        want = cold(p1)
        f0 = fetched(B)
        got = complete(B, p1, {"kv_hint": hint})  # Dynamo's spelling
        fetchable = (len(t1) - 1) // BT
        assert fetched(B) - f0 == fetchable, f"B fetched {fetched(B) - f0} blocks, want {fetchable}"
        assert answer(got) == answer(want), (got["content"], want["content"])
        report["a"] = {"blocks_named": n1, "fetched": fetchable}

        # b. A2 evicts a prompt; the router stops naming A2
        x = text(120, 12)
        complete(A2, x)
        lx = A2.lookup(x)
        tx, nx = lx["token_ids"], lx["blocks_held"]
        assert nx >= 2, lx
        await router.wait_held(model, tx, ids["A2"], lambda n: n >= nx, "the router indexes A2's prompt")
        pay = fetch_payload(await router.hint(model, tx, ids["B"]))
        assert pay is not None and pay["source_control_endpoint"] == A2.info["source_control_endpoint"], pay
        fillers = 0
        while A2.lookup(x)["blocks_held"] > 0:
            assert fillers < 12, "A2 still holds the prompt after 12 others"
            complete(A2, text(120, 100 + fillers))
            fillers += 1
        await router.wait_held(model, tx, ids["A2"], lambda n: n == 0, "the router drops A2's evicted blocks")
        hint = await router.hint(model, tx, ids["B"])
        pay = fetch_payload(hint)
        assert pay is None or pay["source_control_endpoint"] != A2.info["source_control_endpoint"], pay
        want = cold(x)
        f0 = fetched(B)
        got = complete(B, x, {"kv_hint": hint} if hint else None)
        assert fetched(B) == f0, "B fetched an evicted prompt"
        assert answer(got) == answer(want), (got["content"], want["content"])
        report["b"] = {"blocks": nx, "fillers": fillers}

        # c. a router started after A answered learns it from A's replay socket
        p3 = text(130, 13)
        complete(A, p3)
        l3 = A.lookup(p3)
        late = Router()
        routers.append(late)
        await late.register(A, ids["A"])
        await late.register(B, ids["B"])
        await late.wait_held(model, l3["token_ids"], ids["A"], lambda n: n >= l3["blocks_held"],
                             "the late router replays A's events")
        pay = fetch_payload(await late.hint(model, l3["token_ids"], ids["B"]))
        assert pay is not None and pay["block_hashes"] == l3["block_hashes"][:l3["blocks_held"]], pay
        report["c"] = {"blocks": l3["blocks_held"]}

        # d. Dynamo's runtime, through the worker shim
        report["d"] = await through_runtime(A, B, C, model, log_dir)

        for name in ("A", "A2", "B"):
            m = metrics(servers[name])
            assert m.get("llamacpp_kv_events_published_total", 0) > 0, f"{name} published no events: {m}"
            assert m.get("llamacpp_kv_events_dropped_total", 0) == 0, f"{name} dropped events"
        return report
    finally:
        for r in routers:
            r.close()
        for s in servers.values():
            s.stop()


async def through_runtime(A, B, C, model, log_dir):
    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime

    folder = tempfile.mkdtemp(prefix="kvrelay-llama-dynamo-")
    saved = os.environ.get("DYN_FILE_KV")
    os.environ["DYN_FILE_KV"] = folder
    wenv = dict(os.environ, DYN_FILE_KV=folder)
    workers, ids, runtime = [], {}, None
    try:
        for s in (A, B):
            p = subprocess.Popen([sys.executable, WORKER, "--server", s.base, "--api", "llama"],
                                 stdout=subprocess.PIPE, stderr=open(os.path.join(log_dir, "worker-" + s.name + ".log"), "w"),
                                 env=wenv, text=True)
            workers.append(p)
            ids[s.name] = json.loads(first_line(p, f"the worker of {s.name}"))["worker_id"]
        wa, wb = ids["A"], ids["B"]
        runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
        router = KvRouter(runtime.endpoint("kvrelay.worker.generate"), BT, KvRouterConfig())

        async def held(worker, tokens):
            sc = await router.get_overlap_scores(tokens)
            rows = {w["worker_id"]: max(w["device_blocks"], w["host_pinned_blocks"]) for w in sc["workers"]}
            return rows.get(worker, 0)

        async def wait_held(worker, tokens, n, timeout):
            end = time.monotonic() + timeout
            while await held(worker, tokens) < n:
                if time.monotonic() > end:
                    return False
                await asyncio.sleep(0.1)
            return True

        # the worker relays A's events live only: A answers small probes until one arrives
        for i in range(10):
            probe = A.lookup(text(40, 200 + i))["token_ids"]
            complete(A, probe)
            if await wait_held(wa, probe, 1, 3):
                break
        else:
            raise AssertionError("no event of A reached the runtime router through its worker")
        p = text(140, 14)
        look = A.lookup(p)
        complete(A, p)
        n = A.lookup(p)["blocks_held"]
        assert await wait_held(wa, look["token_ids"], n, 30), f"the runtime router does not show A's {n} blocks"
        want = complete(C, p, {"cache_prompt": False, "return_tokens": True})
        f0 = fetched(B)
        out = []
        stream = await router.generate(look["token_ids"], model, stop_conditions={"max_tokens": 8}, worker_id=wb)
        async for r in stream:
            out.append(r)
        got_text = "".join(r.get("text") or "" for r in out)
        got_ids = [t for r in out for t in r.get("token_ids") or []]
        fetchable = (len(look["token_ids"]) - 1) // BT
        assert fetched(B) - f0 == fetchable, f"B fetched {fetched(B) - f0}, want {fetchable}: {out}"
        assert got_text == want["content"], f"{got_text!r} != cold {want['content']!r}"
        assert got_ids == want["tokens"], f"{got_ids} != cold {want['tokens']}"
        return {"blocks": n, "fetched": fetchable, "worker_ids": [wa, wb]}
    finally:
        if runtime is not None:
            runtime.shutdown()
        for p in workers:
            p.kill()
            p.wait(timeout=30)
        if saved is None:
            os.environ.pop("DYN_FILE_KV", None)
        else:
            os.environ["DYN_FILE_KV"] = saved
        shutil.rmtree(folder, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-dir")
    a = ap.parse_args()
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvrelay-llama-dynamo-")
    os.makedirs(log_dir, exist_ok=True)
    os.environ.setdefault("DYN_LOG", "error")
    print("logs in", log_dir, flush=True)
    t0 = time.monotonic()
    report = asyncio.run(asyncio.wait_for(run(a, log_dir), timeout=900))
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["ok"] = True
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
