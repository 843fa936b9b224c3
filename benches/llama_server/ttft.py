#!/usr/bin/env python3
"""Time to first token on llama-server with kvrelay: a prompt whose KV another instance holds,
fetched by a hint, against the same server prefilling a prompt of the same length cold.

Two kvrelay builds of llama-server run at once on loopback with the bit-exact settings
(`-np 1 -fa off -ub 32 --cache-ram 0`, `--flash-attn on` for `-fa on`, 32-token blocks, the same threads): A serves its blocks
(--kv-listen), B trusts hints from A (--kv-trusted-endpoint, --kv-fetch always). Each round takes
a fresh prompt for every size (its first token differs from every earlier prompt's, so neither
server holds any of its blocks): A prefills it (not timed), A's /v1/kv/lookup names its blocks,
then B answers it with a `kv.fetch` hint naming A's blocks (fetched: the time covers the policy,
the fetch of every full block but the last token's, the import and the prefill of the rest), and
B answers another fresh prompt of the same length without a hint and with `cache_prompt` off
(cold, the anchor: a whole prefill). Right after each fetched request, B answers the floor: the
same prompt with its tail (the tokens after the last fetched block) replaced by other tokens, so
the blocks are in B's slot already and only the tail is computed: what a free fetch would give. The two alternate in an order that flips every round. Each
request generates one token, so its time is the time to first token. The noise beside the ratio
is how far the cold runs' two halves differ (the ratio of their medians).

    python3 benches/llama_server/ttft.py --server target/llama-server/bin/llama-server-kvrelay \\
        --model MODEL.gguf [--threads 2] [--sizes 256,1024,2048,4096] [--rounds 6] [--ubatch 32]
        [--server-args "-ngl 99"]

`--ubatch` other than the block size (32) leaves the bit-exact settings: blocks still move and
are reused, the answers may differ in low bits (the integration's README, "Bit-exact").
`--server-args` go to both servers (a CUDA build: `-ngl 99`). `--kv-fetch faster` lets B decide
(the agent's estimate, llama.cpp's import included once B measured one, against B's measured
prefill): a hinted request then either fetches or prefills, and the row counts the rounds that
fetched; the hinted time is what a user of the default setting gets.

Prints one line of JSON per size and a table for benches/RESULTS.md. Every loop is bounded
(--rounds); the servers listen on 127.0.0.1 only and are stopped at the end.
"""

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "integrations", "llama.cpp", "tests"))
from smoke_test import Server  # noqa: E402

BT = 32


def post(srv, path, body):
    req = urllib.request.Request(srv.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


def post_stream(srv, path, body):
    """Time to the first streamed token (the first `data:` chunk); the stream is read
    to its end before returning (timings taken from its last chunk)."""
    host, port = srv.base[len("http://"):].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=900)
    t0 = time.perf_counter()
    c.request("POST", path, body=json.dumps(dict(body, stream=True)), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError("HTTP %d: %s" % (r.status, r.read()[:200]))
    first, last = None, {}
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if first is None:
            first = time.perf_counter() - t0  # the first token's chunk (its text may still be empty)
        last = chunk
    c.close()
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first, last


def metrics_text(srv):
    with urllib.request.urlopen(srv.base + "/metrics", timeout=60) as r:
        return r.read().decode()


def hint(endpoint, hashes):
    return {"protocol_version": "0.1", "message_id": "ttft", "actions": [{
        "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": endpoint, "block_hashes": hashes}}]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="the kvrelay build of llama-server")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="256,1024,2048,4096", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=6, help="fetched and cold requests per size (bounded)")
    ap.add_argument("--ubatch", type=int, default=BT, help="-ub of both servers (32: the bit-exact setting)")
    ap.add_argument("--flash-attn", choices=["off", "on"], default="off", help="-fa of both servers")
    ap.add_argument("--server-args", default="", help="more flags for both servers, space-separated")
    ap.add_argument("--kv-fetch", choices=["always", "faster"], default="always", help="B's fetch decision")
    ap.add_argument("--stream", action="store_true",
                    help="streamed requests of 2 tokens, timed to the first token's chunk (the export of a fetched "
                         "prompt's new blocks then comes after it)")
    ap.add_argument("--log-dir", help="where the servers' logs go (default: a new temporary folder)")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    logs = a.log_dir or tempfile.mkdtemp(prefix="llama-ttft-")
    os.makedirs(logs, exist_ok=True)
    exact = ["-c", str(max(sizes) + 64), "-fa", a.flash_attn, "-ub", str(a.ubatch), "--cache-ram", "0", "--no-warmup",
             "--kv-block-tokens", str(BT)] + a.server_args.split()
    servers = []
    try:
        A = Server(a.server, a.model, exact + ["--kv-listen", "127.0.0.1:0"], os.path.join(logs, "A.log"),
                   threads=a.threads)
        servers.append(A)
        ep = A.json("GET", "/v1/kv/info")[1]["source_control_endpoint"]
        B = Server(a.server, a.model, exact + ["--kv-hints-trusted", "--kv-listen", "127.0.0.1:0",
                                               "--kv-trusted-endpoint", ep, "--kv-fetch", a.kv_fetch],
                   os.path.join(logs, "B.log"), threads=a.threads)
        servers.append(B)
        fresh = iter(range(1, 1 << 30))
        n_vocab = B.json("GET", "/v1/models")[1]["data"][0]["meta"]["n_vocab"]
        span = min(20000, n_vocab - 100)

        def prompt(n):
            # token ids of the model's vocabulary (past its first 100, where special tokens lie);
            # the first one makes every prompt new
            k = next(fresh)
            return [100 + (900 + k) % span] + [(i * 7919 + k * 104729) % span + 100 for i in range(n - 1)]

        rows = []
        for n in sizes:
            post(B, "/completion", {"prompt": prompt(n), "n_predict": 1, "cache_prompt": False})  # warm
            times = {"fetched": [], "cold": [], "floor": []}
            fetched_rounds = 0
            for r in range(a.rounds):
                p = prompt(n)
                post(A, "/completion", {"prompt": p, "n_predict": 1})
                names = A.json("POST", "/v1/kv/lookup", {"prompt": p})[1]["block_hashes"]
                send = post_stream if a.stream else post
                n_predict = 2 if a.stream else 1
                for k in (["fetched", "cold"] if r % 2 == 0 else ["cold", "fetched"]):
                    if k == "fetched":
                        took, out = send(B, "/completion", {"prompt": p, "n_predict": n_predict, "temperature": 0,
                                                            "kv_hints": hint(ep, names)})
                        fetched_rounds += out["timings"]["prompt_n"] <= BT
                        if a.kv_fetch == "always" and out["timings"]["prompt_n"] > BT:
                            raise RuntimeError("the fetched request prefilled %d tokens" % out["timings"]["prompt_n"])
                        # the floor: the same blocks, now in B's slot, and a tail of the same length
                        # but other tokens: only the tail is computed (what a free fetch would give)
                        tail = n - (n - 1) // BT * BT
                        pf = p[:n - tail] + [(t + 1) % span + 100 for t in p[n - tail:]]
                        took_f, out_f = send(B, "/completion", {"prompt": pf, "n_predict": n_predict, "temperature": 0})
                        if out_f["timings"]["prompt_n"] != tail:
                            raise RuntimeError("the floor request prefilled %d tokens, not %d" % (out_f["timings"]["prompt_n"], tail))
                        times["floor"].append(took_f)
                    else:
                        took, out = send(B, "/completion", {"prompt": prompt(n), "n_predict": n_predict, "temperature": 0,
                                                            "cache_prompt": False})
                        if out["timings"]["prompt_n"] < n:
                            raise RuntimeError("the cold request reused KV")
                    times[k].append(took)
            med = {k: statistics.median(v) for k, v in times.items()}
            half = a.rounds // 2
            c = times["cold"]
            noise = abs(statistics.median(c[:half]) / statistics.median(c[half:]) - 1) if half else float("nan")
            row = {"prompt_tokens": n, "rounds": a.rounds, "threads": a.threads, "ubatch": a.ubatch, "stream": a.stream,
                   "flash_attn": a.flash_attn, "kv_fetch": a.kv_fetch, "fetched_rounds": fetched_rounds,
                   "fetched_ms": round(med["fetched"] * 1e3, 1), "cold_ms": round(med["cold"] * 1e3, 1),
                   "floor_ms": round(med["floor"] * 1e3, 1), "ratio": round(med["fetched"] / med["cold"], 4),
                   "ratio_floor": round(med["fetched"] / med["floor"], 4), "noise": round(noise, 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        print()
        print("| prompt tokens | -fa | hinted (median; rounds that fetched) | floor (the tail only) | cold prefill (median, the anchor) | hinted/cold | hinted/floor | noise (cold, half against half) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print("| %d | %s | %.1f ms (%d of %d) | %.1f ms | %.1f ms | %.4f | %.3f | %.2f%% |" % (
                r["prompt_tokens"], r["flash_attn"], r["fetched_ms"], r["fetched_rounds"], r["rounds"], r["floor_ms"],
                r["cold_ms"], r["ratio"], r["ratio_floor"], 100 * r["noise"]))
        m = metrics_text(B)
        print("\nB's decision terms at the end: " + ", ".join(
            l for l in m.splitlines() if l.startswith(("llamacpp_kv_prefill_", "llamacpp_kv_import_", "llamacpp_kv_fetch_total"))))
        print("\nlogs in", logs)
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
