#!/usr/bin/env python3
"""What embedding kvrelay costs llama-server on a request without hints: the kvrelay build
(integrations/llama.cpp) against the unpatched build of the same pinned tree, on the same
requests, in the same run.

Both servers run at once on loopback (one slot, the same threads each), idle but for the one
request being measured: the requests alternate between them (in an order that flips every round)
so that drift of the machine falls on both alike. Each request is a cold prefill (`cache_prompt`
off) of a fixed prompt with one output token, so its time is the time to first token. The anchor
is the unpatched server's median in the same run; the noise beside the ratio is how far the
unpatched server's own two halves of the run differ (the ratio of their medians), so a cost below
it is not measurable here.

    python3 benches/llama_server/overhead.py --server target/llama-server/bin/llama-server-kvrelay \\
        --unpatched target/llama-server/bin/llama-server-unpatched --model MODEL.gguf [--serving]

`--serving` measures what serving KV costs the instance that serves it: the kvrelay build runs
with its KV path on (`--kv-listen`), and every request is a fresh prompt (its first token new)
with `cache_prompt` on, so that each one is prefilled whole and then exported: its full blocks
cut from llama.cpp's sequence state, checksummed and committed to the store, before the first
token is sent. The same prompts go to the unpatched build. The run checks, from the kvrelay
build's /metrics, that every prompt was exported.

Prints one line of JSON per prompt size and a table for benches/RESULTS.md. Every loop is
bounded (--rounds); the servers listen on 127.0.0.1 only and are stopped at the end.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary, model, threads, ctx, log_path, extra=(), cache_prompt=False):
        self.cache_prompt = cache_prompt
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.log = open(log_path, "w")
        cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-c", str(ctx), "-np", "1",
               "-t", str(threads), "-tb", str(threads), "--no-warmup"] + list(extra)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("%s exited with %s; log: %s" % (binary, self.proc.returncode, log_path))
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("%s did not become healthy; log: %s" % (binary, log_path))

    def completion(self, tokens):
        body = json.dumps({"prompt": tokens, "n_predict": 1, "cache_prompt": self.cache_prompt, "temperature": 0}).encode()
        req = urllib.request.Request(self.base + "/completion", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        took = time.perf_counter() - t0
        if out.get("tokens_evaluated", len(tokens)) < len(tokens):
            raise RuntimeError("the prompt was not prefilled whole: %s" % out.get("tokens_evaluated"))
        return took

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def exported(srv):
    with urllib.request.urlopen(srv.base + "/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("llamacpp_kv_exported_blocks_total "):
                return int(float(line.split()[1]))
    raise RuntimeError("the kvrelay build reports no exported blocks (is its KV path on?)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="the kvrelay build of llama-server")
    ap.add_argument("--unpatched", required=True, help="the unpatched build of the same tree")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="256,1024", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=20, help="requests per server and size (bounded)")
    ap.add_argument("--serving", action="store_true", help="the kvrelay build serves KV (--kv-listen); fresh prompts, cache_prompt on")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    logs = tempfile.mkdtemp(prefix="llama-overhead-")
    servers = {}
    try:
        serve = ["--kv-listen", "127.0.0.1:0", "--kv-block-tokens", "32", "--metrics"] if a.serving else []
        servers["kvrelay"] = Server(a.server, a.model, a.threads, max(sizes) + 64, os.path.join(logs, "kvrelay.log"),
                                    serve, a.serving)
        servers["unpatched"] = Server(a.unpatched, a.model, a.threads, max(sizes) + 64,
                                      os.path.join(logs, "unpatched.log"), (), a.serving)
        fresh = 0
        rows = []
        for n in sizes:
            # token ids of the model's own vocabulary, the same prompt for both (no tokenizer run)
            tokens = [(i * 7919) % 20000 + 100 for i in range(n)]
            for s in servers.values():
                s.completion(tokens)  # warm: first-touch of the weights and buffers
            times = {k: [] for k in servers}
            for r in range(a.rounds):
                if a.serving:
                    # a new first token: no server holds any block of it
                    fresh += 1
                    tokens = [100 + (900 + fresh) % 19000] + tokens[1:]
                order = ["kvrelay", "unpatched"] if r % 2 == 0 else ["unpatched", "kvrelay"]
                for k in order:
                    times[k].append(servers[k].completion(tokens))
            med = {k: statistics.median(v) for k, v in times.items()}
            half = a.rounds // 2
            u = times["unpatched"]
            noise = abs(statistics.median(u[:half]) / statistics.median(u[half:]) - 1) if half else float("nan")
            row = {
                "prompt_tokens": n,
                "rounds": a.rounds,
                "threads": a.threads,
                "kvrelay_ms": round(med["kvrelay"] * 1e3, 1),
                "unpatched_ms": round(med["unpatched"] * 1e3, 1),
                "ratio": round(med["kvrelay"] / med["unpatched"], 4),
                "noise": round(noise, 4),
            }
            if a.serving:
                row["exported_blocks_total"] = exported(servers["kvrelay"])
            rows.append(row)
            print(json.dumps(row), flush=True)
        print()
        print("| prompt tokens | kvrelay build (median) | unpatched (median, the anchor) | ratio | noise (unpatched, half against half) |")
        print("|---|---|---|---|---|")
        for r in rows:
            print("| %d | %.1f ms | %.1f ms | %.4f | %.2f%% |" % (r["prompt_tokens"], r["kvrelay_ms"], r["unpatched_ms"],
                                                            r["ratio"], 100 * r["noise"]))
    finally:
        for s in servers.values():
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
