"""Time to first token through Dynamo's router, as the client sees it.

Usage: python3 benches/dynamo/ttft.py PATH/TO/kvrelay-server --model-file F.gguf
           [--sizes 256,512,1024,2048,4096] [--reps 3] [--max-tokens 4]
Needs `dynamo` (ai-dynamo-runtime 1.6.1) on PYTHONPATH (`.ci/ensure-dynamo.sh`) and a server built
with the `llama` feature.

Two real-model servers on loopback, A and B (`--engine llama`, KV events on, hints trusted; B
trusts A's KV endpoint), both registered with one in-process Dynamo `SelectionService`. For each
prompt size and repetition, with prompts that no server has seen (token-id prompts of exactly
that many tokens, cut from a fresh text's `/v1/kv/lookup` token ids):

  cold    B prefills prompt Q (the anchor);
  routed  A answered prompt P; the router, asked with no restriction, picks A, which reuses its
          own KV;
  hinted  the router, restricted to B, returns a `kv_hint` naming A's blocks of P; B answers
          with it as `kv_hints`, fetching A's blocks over the KV agent (TCP on loopback).

TTFT is the client's: a streamed `POST /v1/completions`, from sending the request to the first
SSE data chunk that carries text. The router's overhead is the wall time of `select_and_reserve`
plus `free_reservation`, measured after the router has indexed A's blocks (that wait is polled,
bounded and not counted). The fetch's own time is the delta of B's
`kvrelay_server_kv_transfer_seconds` sum. `cached_tokens` of each answer and B's fetched tokens
prove which path ran. Medians over the repetitions; every figure also as a ratio to the cold
anchor of the same run. Prints one JSON line per measured repetition, a markdown table and a
summary JSON line.
"""

import argparse
import asyncio
import atexit
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

from dynamo_selection import Router, fetch_payload  # noqa: E402

FETCHED = "kvrelay_server_fetched_tokens_total"
XFER_SUM = "kvrelay_server_kv_transfer_seconds_sum"
XFER_COUNT = "kvrelay_server_kv_transfer_seconds_count"
XFER_BYTES = 'kvrelay_server_kv_transfer_bytes_total{direction="received"}'
WORDS = ["river", "lantern", "copper", "meadow", "harbor", "violet", "ember", "quartz", "willow", "signal",
         "orchard", "granite", "falcon", "cinder", "tundra", "marble", "saffron", "beacon", "thistle", "cobalt"]

CHILDREN = []


def kill_children():
    for p in CHILDREN:
        if p.poll() is None:
            p.kill()
    for p in CHILDREN:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def on_signal(signum, frame):
    kill_children()
    os._exit(128 + signum)


def request(base, method, path, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def call(base, method, path, body=None):
    status, raw = request(base, method, path, body)
    if status != 200:
        raise RuntimeError(f"{method} {path}: {status} {raw[:500]}")
    return json.loads(raw)


class Server:
    def __init__(self, binary, name, flags, env, log_path):
        self.name = name
        self.log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", *flags], stdout=subprocess.PIPE, stderr=self.log,
            env=env, text=True,
        )
        CHILDREN.append(self.proc)
        self._line = []
        self._reader = threading.Thread(target=lambda: self._line.append(self.proc.stdout.readline()), daemon=True)
        self._reader.start()

    def ready(self, timeout=180):
        self._reader.join(timeout)
        line = (self._line[0] if self._line else "").strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"{self.name}: first line {line!r} (exit {self.proc.poll()})")
        self.base = "http://" + line.removeprefix("listening on ")
        self.host, port = line.removeprefix("listening on ").rsplit(":", 1)
        self.port = int(port)
        self.info = call(self.base, "GET", "/v1/kv/info")
        self.kv_endpoint = self.info["kv_endpoint"]
        self.model = call(self.base, "GET", "/v1/models")["data"][0]["id"]
        return self

    def metrics(self):
        _, text = request(self.base, "GET", "/metrics", timeout=60)
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                try:
                    out[k] = float(v)
                except ValueError:
                    pass
        return out

    def lookup(self, prompt):
        return call(self.base, "POST", "/v1/kv/lookup", {"prompt": prompt})

    def stream(self, tokens, max_tokens, hint=None, timeout=600):
        """Streamed completion: client-side TTFT (first data chunk carrying text), usage."""
        body = {"prompt": tokens, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        if hint is not None:
            body["kv_hints"] = hint
        data = json.dumps(body).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.connect()
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=data, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{self.name} /v1/completions: {resp.status} {resp.read()[:500]!r}")
        first_chunk = first_text = None
        text, ids, usage = [], [], None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            now = time.perf_counter()
            ev = json.loads(payload)
            if "error" in ev:
                raise RuntimeError(f"{self.name}: stream error {ev}")
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices", []):
                if first_chunk is None:
                    first_chunk = now - t0
                if c.get("text"):
                    if first_text is None:
                        first_text = now - t0
                    text.append(c["text"])
                ids.extend(c.get("token_ids") or [])
        total = time.perf_counter() - t0
        conn.close()
        if first_text is None:
            raise RuntimeError(f"{self.name}: no chunk carried text ({ids})")
        return {"ttft": first_text, "first_chunk": first_chunk, "total": total, "text": "".join(text),
                "token_ids": ids, "usage": usage}

    def request_log(self):
        """The fetch labels of B's request log lines (`fetch=...`), in order."""
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return [ln for ln in f if "kvrelay_server::request" in ln or " request " in ln]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


def story(seed, words):
    out = [seed + ":"]
    n = len(seed)
    for i in range(words):
        out.append(WORDS[(i * 7 + n + i // len(WORDS)) % len(WORDS)] + ("." if i % 9 == 8 else ""))
    return " ".join(out)


def fresh_prompt(server, seed, n):
    """Token ids of exactly `n` tokens, cut from a text that starts with a unique seed."""
    words = max(32, int(n * 0.9))
    for _ in range(8):
        look = server.lookup(story(seed, words))
        ids = look["token_ids"]
        if len(ids) >= n:
            return ids[:n]
        words = int(words * 1.3 * n / max(len(ids), 1)) + 8
    raise RuntimeError(f"could not build a {n}-token prompt")


def med(xs):
    return statistics.median(xs) if xs else float("nan")


async def measure(args):
    env = dict(os.environ, KVRELAY_TRUST_KV_HINTS="1", KVRELAY_PREFILL_TOKENS_PER_S="0",
               KVRELAY_LOG="warn,kvrelay_server::request=info")
    flags = ["--engine", "llama", "--model-file", args.model_file, "--llama-ctx", str(args.llama_ctx),
             "--kv-events-endpoint", "tcp://127.0.0.1:0"]
    logs = tempfile.mkdtemp(prefix="kvrelay-ttft-")
    servers, router = {}, None
    try:
        servers["A"] = A = Server(args.binary, "A", flags, env, os.path.join(logs, "A.log")).ready()
        servers["B"] = B = Server(args.binary, "B", [*flags, "--trusted-endpoint", A.kv_endpoint], env,
                                  os.path.join(logs, "B.log")).ready()
        model = A.model
        bt = A.info["dynamo"]["block_size"]
        router = Router()
        IA, IB = 1, 2
        await router.register(A, IA)
        await router.register(B, IB)
        print(json.dumps({"model": model, "block_tokens": bt, "A": A.kv_endpoint, "B": B.kv_endpoint,
                          "sizes": args.sizes, "reps": args.reps, "max_tokens": args.max_tokens,
                          "loadavg": os.getloadavg()}), flush=True)

        # warm-up (not measured): each server prefills once, A's KV is fetched by B once
        w = fresh_prompt(A, "warmup-" + uuid.uuid4().hex[:8], 256)
        A.stream(w, args.max_tokens)
        B.stream(fresh_prompt(A, "warmupb-" + uuid.uuid4().hex[:8], 256), args.max_tokens)
        want = A.lookup(w)["blocks_held"]
        await router.wait_held(model, w, IA, lambda n: n >= want, "the router indexes A's warm-up", timeout=60)
        r, _, _ = await router.select(model, w, [IB])
        B.stream(w, args.max_tokens, r.get("kv_hint") or r.get("router_hint"))

        rows = []
        for n in args.sizes:
            per = []
            for rep in range(args.reps):
                tag = uuid.uuid4().hex[:10]
                # three fresh prompts: Q (cold on B), P (routed: A holds it), H (hinted: A holds it)
                q = fresh_prompt(A, f"cold-{n}-{rep}-{tag}", n)
                p = fresh_prompt(A, f"routed-{n}-{rep}-{tag}", n)
                h = fresh_prompt(A, f"hinted-{n}-{rep}-{tag}", n)
                assert len(q) == len(p) == len(h) == n
                for srv in (A, B):
                    for x in (q, p, h):
                        assert srv.lookup(x)["blocks_held"] == 0, f"{srv.name} already holds a fresh prompt"

                # 1. cold: B prefills Q
                cold = B.stream(q, args.max_tokens)
                assert cold["usage"]["prompt_tokens"] == n, cold["usage"]
                cold_cached = cold["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cold_cached == 0, f"cold run reused {cold_cached} tokens"

                # A answers P and H (its own cold prefills: second anchors, same size)
                a_first = A.stream(p, args.max_tokens)
                a_h = A.stream(h, args.max_tokens)
                for x in (a_first, a_h):
                    assert x["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, x["usage"]
                held = A.lookup(p)["blocks_held"]
                held_h = A.lookup(h)["blocks_held"]
                assert held >= 1 and held_h >= 1, (held, held_h)
                _, index_wait = await router.wait_held(model, p, IA, lambda n: n >= held, "the router indexes A's P", 60)
                _, wait_h = await router.wait_held(model, h, IA, lambda n: n >= held_h, "the router indexes A's H", 60)
                index_wait = max(index_wait, wait_h)

                async def routed_path():
                    # 2. routed: no restriction, the router picks the holder
                    sel, overhead, select_only = await router.select(model, p)
                    pick = sel["worker_id"]
                    assert pick == IA, f"the router picked worker {pick} for a prompt A holds"
                    got = A.stream(p, args.max_tokens)
                    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert cached >= (held - 1) * bt and cached > 0, (cached, held)
                    assert got["text"] == a_first["text"], (got["text"], a_first["text"])
                    return sel, overhead, select_only, got, cached

                async def hinted_path():
                    # 3. hinted: restricted to B, the router hints A's blocks; B fetches them
                    sel, overhead, select_only = await router.select(model, h, [IB])
                    assert sel["worker_id"] == IB, sel
                    hint = sel.get("kv_hint") or sel.get("router_hint")
                    pay = fetch_payload(hint)
                    assert pay is not None and pay["source_control_endpoint"] == A.kv_endpoint, hint
                    m0 = B.metrics()
                    got = B.stream(h, args.max_tokens, hint)
                    m1 = B.metrics()
                    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in (FETCHED, XFER_COUNT, XFER_SUM, XFER_BYTES)}
                    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert d[FETCHED] > 0 and d[XFER_COUNT] == 1, d
                    # a prompt of whole blocks: the last block is prefilled again for its logits
                    assert d[FETCHED] - bt <= cached <= d[FETCHED] and cached > 0, (cached, d)
                    assert got["text"] == a_h["text"], (got["text"], a_h["text"])
                    return sel, overhead, select_only, got, cached, pay, d

                # the two reuse paths run in alternating order across repetitions
                hinted_first = rep % 2 == 1
                if hinted_first:
                    h_sel, h_overhead, h_select_only, hinted, hinted_cached, pay, d = await hinted_path()
                    r_sel, r_overhead, r_select_only, routed, routed_cached = await routed_path()
                else:
                    r_sel, r_overhead, r_select_only, routed, routed_cached = await routed_path()
                    h_sel, h_overhead, h_select_only, hinted, hinted_cached, pay, d = await hinted_path()
                fetched, xfer_s, xfer_b = d[FETCHED], d[XFER_SUM], d[XFER_BYTES]

                row = {
                    "tokens": n, "rep": rep,
                    "cold_ttft_s": cold["ttft"], "cold_A_ttft_s": statistics.median([a_first["ttft"], a_h["ttft"]]),
                    "routed_ttft_s": routed["ttft"], "hinted_ttft_s": hinted["ttft"],
                    "router_routed_s": r_overhead, "router_hinted_s": h_overhead,
                    "select_routed_s": r_select_only, "select_hinted_s": h_select_only,
                    "fetch_s": xfer_s, "fetched_tokens": fetched, "fetched_bytes": xfer_b,
                    "hint_blocks": len(pay["block_hashes"]), "held_blocks": held, "held_blocks_hinted": held_h,
                    "routed_cached": routed_cached, "hinted_cached": hinted_cached, "cold_cached": cold_cached,
                    "index_wait_s": index_wait, "hinted_first": hinted_first,
                    "routed_hint_attached": bool(r_sel.get("kv_hint") or r_sel.get("router_hint")),
                }
                print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
                per.append(row)
            s = {"tokens": n, "reps": len(per)}
            for k in ("cold_ttft_s", "cold_A_ttft_s", "routed_ttft_s", "hinted_ttft_s", "router_routed_s",
                      "router_hinted_s", "select_hinted_s", "fetch_s", "fetched_tokens", "fetched_bytes",
                      "routed_cached", "hinted_cached", "index_wait_s"):
                s[k] = med([r[k] for r in per])
            s["routed_over_cold"] = med([r["routed_ttft_s"] / r["cold_ttft_s"] for r in per])
            s["hinted_over_cold"] = med([r["hinted_ttft_s"] / r["cold_ttft_s"] for r in per])
            s["router_over_fetch"] = med([r["router_hinted_s"] / r["fetch_s"] for r in per])
            s["cold_A_over_cold"] = med([r["cold_A_ttft_s"] / r["cold_ttft_s"] for r in per])
            s["fetch_over_cold"] = med([r["fetch_s"] / r["cold_ttft_s"] for r in per])
            s["router_over_cold"] = med([r["router_hinted_s"] / r["cold_ttft_s"] for r in per])
            rows.append(s)
        fetch_lines = [ln.strip() for ln in B.request_log() if "fetch=ok" in ln or "fetch=" in ln]
        return rows, fetch_lines
    finally:
        if router is not None:
            router.close()
        for s in servers.values():
            s.stop()
        shutil.rmtree(logs, ignore_errors=True)


def ms(x):
    return f"{x * 1e3:,.0f} ms" if x >= 0.1 else f"{x * 1e3:.1f} ms"


def table(rows):
    out = [
        "| prompt tokens | cold (B prefills) | routed to holder (A) | hinted fetch (B) | routed / cold | hinted / cold "
        "| fetch (B's transfer) | router select + free | router / fetch | cached: routed, hinted | KV fetched "
        "| A's cold / B's cold |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        out.append(
            f"| {s['tokens']:,} | {ms(s['cold_ttft_s'])} | {ms(s['routed_ttft_s'])} | {ms(s['hinted_ttft_s'])} "
            f"| {s['routed_over_cold']:.3f} | {s['hinted_over_cold']:.3f} | {ms(s['fetch_s'])} "
            f"| {s['router_hinted_s'] * 1e3:.2f} ms | {s['router_over_fetch']:.3f} "
            f"| {s['routed_cached']:,.0f}, {s['hinted_cached']:,.0f} | {s['fetched_bytes'] / 1e6:.1f} MB "
            f"| {s['cold_A_over_cold']:.2f} |"
        )
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary")
    ap.add_argument("--model-file", default=os.environ.get("KVRELAY_MODEL_FILE"))
    ap.add_argument("--sizes", default="256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--llama-ctx", type=int, default=8192)
    ap.add_argument("--timeout", type=float, default=1800, help="the whole run, seconds")
    args = ap.parse_args()
    if not args.model_file:
        ap.error("--model-file (or KVRELAY_MODEL_FILE) is required")
    args.sizes = [int(x) for x in args.sizes.split(",") if x]
    if args.reps < 1 or args.reps % 2 == 0:
        ap.error("--reps must be odd (medians of an odd count)")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    atexit.register(kill_children)
    t0 = time.monotonic()
    # the HTTP calls block the event loop, so the whole run is bounded by a watchdog thread
    def watchdog():
        print(f"ttft.py: the run took more than {args.timeout} s; stopping", file=sys.stderr, flush=True)
        kill_children()
        os._exit(124)

    dog = threading.Timer(args.timeout, watchdog)
    dog.daemon = True
    dog.start()
    rows, fetch_lines = asyncio.run(measure(args))
    dog.cancel()
    print("B's request log, hinted requests, the warm-up's first (fetch outcome, blocks, estimate):")
    for ln in fetch_lines:
        if "fetch=ok" in ln:
            print("  " + ln[ln.find("fetch="):])
    print()
    print(table(rows))
    print()
    print(json.dumps({"rows": [{k: round(v, 6) if isinstance(v, float) else v for k, v in s.items()} for s in rows],
                      "seconds": round(time.monotonic() - t0, 1), "loadavg": os.getloadavg(), "ok": True}))


if __name__ == "__main__":
    main()
