#!/usr/bin/env python3
"""Two kvrelay llama-servers on loopback: B fetches A's KV by a hint, and answers as a cold server.

    python3 integrations/llama.cpp/tests/two_instance_test.py --server target/llama-server/bin/llama-server-kvrelay \
        --model MODEL.gguf [--threads 1] [--log-dir DIR] [--flash-attn off|on] [--server-args "-ngl 99"]

Standard library only. Starts its servers with the settings that keep moved KV bit-exact
(`-np 1 -fa off -ub 32`, F16 KV, one thread, 32-token blocks, no RAM prompt cache): A serves its
blocks (--kv-listen; A2 too, killed in check 6), B trusts hints and fetches from A
(--kv-trusted-endpoint A, --kv-fetch always), C is the cold reference (no KV flags; every request
with cache_prompt false, so each one prefills from token 0), D is B with a store of two blocks
and --kv-load-failure-policy fail (checks 11 and 12). Checks, each by the servers' own counters (/metrics) and answers:
  1. A's prompt's full blocks are served (/v1/kv/lookup: blocks_held);
  2. a hinted request to B fetches A's blocks, prefills only the rest, and its greedy text and
     the first tokens' top-5 probabilities equal C's;
  3. a longer prompt whose first blocks B holds fetches only the blocks B lacks;
  4. a hint naming an endpoint off B's trusted registry fetches nothing (the policy counts it);
  5. a hint naming blocks of another naming scheme fetches nothing (nothing_to_fetch);
  6. a source killed before the fetch: the fetch fails (connect), the answer is C's;
  7. a client that goes away while its fetch waits on a source that never answers: the fetch
     is cancelled and counted (client_gone), and the slot then serves the next request as C;
  8. a source that dies mid-fetch (a relay in front of A cuts its connections once two and a
     half blocks' bytes went through): B commits only the leading verified blocks, counts the
     failure by reason, prefills the rest, and answers as C;
  9. a prompt B answered already, asked again: B keeps only the slot's whole blocks of prefill
     (not the generated tokens, not the last partial block) and answers as C;
 10. a request streamed on A: its blocks are served by the stream's end, and B fetches them;
 11. fetched blocks stay pinned until the slot imports them: D (a store of two blocks, its one
     slot kept busy by a streamed request) fetches Y's blocks, then a second hinted request Z
     finds no room (Y's blocks are not evicted), and Y imports them once the slot is free;
 12. D runs with --kv-load-failure-policy fail: a fetch from the killed source answers 502
     kv_load_failed, counted by reason, and the prompt then answers as C without a hint;
and every answer equals C's. Exit status 0 when every check passed.
"""
import argparse
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import Server, check, failures  # noqa: E402

BT = 32
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def text(n_words, seed):
    # a deterministic prose-like prompt of about n_words words
    out = []
    x = seed
    for _ in range(n_words):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[x % len(WORDS)])
    return "Here is a list of call signs to remember: " + " ".join(out) + "."


def envelope(endpoint, hashes, mid):
    return {"protocol_version": "0.1", "message_id": mid, "actions": [{
        "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": endpoint, "block_hashes": hashes}}]}


class FrozenSource:
    """A source that accepts and never answers: a loopback listener whose connections are held
    open, never read from nor written to, until `close()`. Bounded: at most `limit` are accepted."""

    def __init__(self, limit):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.endpoint = "tcp://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.limit, self.held, self.stop = limit, [], threading.Event()
        self.thread = threading.Thread(target=self.accept_and_hold, daemon=True)
        self.thread.start()

    def accept_and_hold(self):
        self.sock.settimeout(0.5)
        while not self.stop.is_set() and len(self.held) < self.limit:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.thread.join()
        for c in self.held:
            c.close()
        self.sock.close()


class CuttingRelay:
    """A TCP relay to `target` on loopback that cuts both sides once `limit` bytes went from the
    target to the client: the source dying mid-transfer, as the client sees it."""

    def __init__(self, target_port, limit):
        self.target_port, self.limit = target_port, limit
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.cut = threading.Event()
        self.sent = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while not self.cut.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            t = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self.pump, args=(c, t, False), daemon=True).start()
            threading.Thread(target=self.pump, args=(t, c, True), daemon=True).start()

    def pump(self, src, dst, counted):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if counted:
                    data = data[:max(0, self.limit - self.sent)]
                    self.sent += len(data)
                dst.sendall(data)
                if counted and self.sent >= self.limit:
                    self.cut.set()
                    break
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.sock.close()


def metrics(srv):
    status, text_ = srv.request("GET", "/metrics")
    assert status == 200, text_
    out = {}
    for line in text_.splitlines():
        m = re.match(r'^((?:llamacpp_kv|kvrelay_kv)\w*(?:\{[^}]*\})?) (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def fetches(srv, outcome):
    return metrics(srv).get('llamacpp_kv_fetch_total{outcome="%s"}' % outcome, 0)


def fetch_outcomes(before, after):
    # the fetch outcomes counted between two metrics() reads, by how much
    return {k: v - before.get(k, 0) for k, v in after.items()
            if k.startswith("llamacpp_kv_fetch_total") and v != before.get(k, 0)}


def hinted(srv, prompt, endpoint, hashes, mid):
    # a /completion of `prompt` with a kv.fetch hint at `endpoint` naming `hashes`: the answer,
    # the fetch outcomes it counted and the blocks it fetched
    before = metrics(srv)
    r = complete(srv, prompt, {"kv_hints": envelope(endpoint, hashes, mid)})
    after = metrics(srv)
    got = after.get("llamacpp_kv_fetched_blocks_total", 0) - before.get("llamacpp_kv_fetched_blocks_total", 0)
    return r, fetch_outcomes(before, after), got


def wait_for(cond):
    # bounded: polls `cond` (a server's counter) until it holds, 60 s at most
    for _ in range(1200):
        if cond():
            return True
        time.sleep(0.05)
    return False


def completion_body(prompt, extra=None):
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "n_probs": 5, "cache_prompt": True}
    body.update(extra or {})
    return body


def complete(srv, prompt, extra=None):
    st, r = srv.json("POST", "/completion", completion_body(prompt, extra))
    assert st == 200, (st, r)
    return r


def post_raw(srv, body):
    # a /completion request on a socket of its own, left open: the caller reads or closes it
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", srv.port), timeout=120)
    conn.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(data) + data)
    return conn


def answer(r):
    # what must equal the cold server's: the text, and each token with its top-5 probabilities
    return r["content"], json.dumps(r.get("completion_probabilities"), sort_keys=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-dir")
    ap.add_argument("--flash-attn", choices=("off", "on"), default="off",
                    help="-fa of every server (both keep the answers exact on llama.cpp's CPU and CUDA backends)")
    ap.add_argument("--server-args", default="", help="more flags for every server (a CUDA build: -ngl 99)")
    a = ap.parse_args()
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvrelay-llama-two-")
    os.makedirs(log_dir, exist_ok=True)
    print("logs in", log_dir)
    exact = ["-fa", a.flash_attn, "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT)] + a.server_args.split()
    servers = []

    def start(name, args):
        s = Server(a.server, a.model, exact + args, os.path.join(log_dir, name + ".log"), threads=a.threads)
        servers.append(s)
        return s

    try:
        # the sources run at the trusted edge: /v1/kv/lookup answers blocks_held only there
        A = start("A", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted"])
        st, info_a = A.json("GET", "/v1/kv/info")
        ep_a = info_a.get("source_control_endpoint", "")
        check(st == 200 and ep_a.startswith("tcp://127.0.0.1:"), "A serves KV", ep_a)
        A2 = start("A2", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted"])
        ep_a2 = A2.json("GET", "/v1/kv/info")[1].get("source_control_endpoint", "")
        # a source that accepts and never answers (for the client that goes away)
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        ep_silent = "tcp://127.0.0.1:%d" % silent.getsockname()[1]
        accepted = threading.Event()
        held_conns = []

        def accept_silently():
            try:
                c, _ = silent.accept()
                held_conns.append(c)
                accepted.set()
            except OSError:
                pass

        threading.Thread(target=accept_silently, daemon=True).start()
        # A behind a relay that cuts after about two and a half blocks of its answer
        relay = CuttingRelay(int(ep_a.rsplit(":", 1)[1]), 5 * int(info_a["block_bytes"]) // 2)
        ep_relay = "tcp://127.0.0.1:%d" % relay.port
        B = start("B", ["--kv-hints-trusted", "--kv-listen", "127.0.0.1:0", "--kv-fetch", "always",
                        "--kv-trusted-endpoint", ep_a, "--kv-trusted-endpoint", ep_a2,
                        "--kv-trusted-endpoint", ep_silent, "--kv-trusted-endpoint", ep_relay])
        C = start("C", [])
        check(B.json("GET", "/v1/kv/info")[1].get("naming_seed") == info_a.get("naming_seed"),
              "A and B name blocks alike (same model and settings)")

        def cold(prompt):
            return complete(C, prompt, {"cache_prompt": False})

        # 1. A prefills P; its full blocks are in its store
        P = text(150, 1)
        complete(A, P)
        st, look = A.json("POST", "/v1/kv/lookup", {"prompt": P})
        n_tokens, total = look["n_tokens"], look["blocks_total"]
        check(st == 200 and total >= 4 and look["blocks_held"] == total,
              "A holds every full block of P", "%d tokens, %d of %d blocks held" % (n_tokens, look["blocks_held"], total))

        # 2. B fetches them by a hint and answers as C
        want = cold(P)
        before = metrics(B)
        r = complete(B, P, {"kv_hints": envelope(ep_a, look["block_hashes"], "two-1")})
        after = metrics(B)
        fetchable = (n_tokens - 1) // BT
        got = after.get("llamacpp_kv_fetched_blocks_total", 0) - before.get("llamacpp_kv_fetched_blocks_total", 0)
        check(fetches(B, "fetched") == 1 and got == fetchable, "B fetched A's blocks of P",
              "%d blocks (%d fetchable)" % (got, fetchable))
        check(r["timings"]["prompt_n"] == n_tokens - fetchable * BT,
              "B prefilled only the tokens after the fetched blocks", "prompt_n %s" % r["timings"]["prompt_n"])
        check(answer(r) == answer(want), "B's greedy text and top-5 probabilities equal the cold server's",
              repr(r["content"]))
        imp = after.get("llamacpp_kv_import_fixed_seconds", 0) + after.get("llamacpp_kv_import_seconds_per_block", 0)
        check(before.get("llamacpp_kv_import_fixed_seconds", 1) == 0 and 0 < imp < 60,
              "B reported its import of the fetched blocks to the agent (the fetch estimate counts it)",
              "%.6f s for one block" % imp)

        # 3. a longer prompt: B holds P's blocks, fetches only the rest
        P2 = P[:-1] + " and then " + text(120, 2)
        complete(A, P2)
        look2 = A.json("POST", "/v1/kv/lookup", {"prompt": P2})[1]
        held_b = B.json("POST", "/v1/kv/lookup", {"prompt": P2})[1]["blocks_held"]
        want = cold(P2)
        before = metrics(B)
        r = complete(B, P2, {"kv_hints": envelope(ep_a, look2["block_hashes"], "two-2")})
        after = metrics(B)
        got = after.get("llamacpp_kv_fetched_blocks_total", 0) - before.get("llamacpp_kv_fetched_blocks_total", 0)
        fetchable2 = (look2["n_tokens"] - 1) // BT
        check(held_b > 0 and got == fetchable2 - held_b, "B fetched only the blocks of P2 it lacked",
              "held %d, fetched %d, fetchable %d" % (held_b, got, fetchable2))
        check(answer(r) == answer(want), "P2: B's answer equals the cold server's", repr(r["content"]))

        # 4. an endpoint off B's registry: no fetch, the policy counts it
        P3 = text(140, 3)
        complete(A, P3)
        look3 = A.json("POST", "/v1/kv/lookup", {"prompt": P3})[1]
        want = cold(P3)
        before = metrics(B)
        r = complete(B, P3, {"kv_hints": envelope("tcp://127.0.0.1:9", look3["block_hashes"], "two-3")})
        after = metrics(B)
        discards = {k: v for k, v in after.items() if k.startswith("llamacpp_kv_policy") and "discard" in k
                    and v != before.get(k, 0)}
        check(after.get("llamacpp_kv_fetched_blocks_total") == before.get("llamacpp_kv_fetched_blocks_total")
              and len(discards) == 1, "an untrusted endpoint fetches nothing and is counted", json.dumps(discards))
        check(answer(r) == answer(want), "P3 (untrusted endpoint): B's answer equals the cold server's")

        # 5. blocks named under another scheme: nothing to fetch
        P4 = text(130, 4)
        complete(A, P4)
        look4 = A.json("POST", "/v1/kv/lookup", {"prompt": P4})[1]
        want = cold(P4)
        n0 = fetches(B, "nothing_to_fetch")
        r = complete(B, P4, {"kv_hints": envelope(ep_a, [h ^ 0x5A5A for h in look4["block_hashes"]], "two-4")})
        check(fetches(B, "nothing_to_fetch") == n0 + 1, "another model's block names fetch nothing (nothing_to_fetch)")
        check(answer(r) == answer(want), "P4 (foreign names): B's answer equals the cold server's")

        # 6. the source is gone before the fetch: connect fails, the answer is cold
        P5 = text(160, 5)
        complete(A2, P5)
        look5 = A2.json("POST", "/v1/kv/lookup", {"prompt": P5})[1]
        check(look5["blocks_held"] == look5["blocks_total"] > 0, "A2 holds P5's blocks")
        A2.proc.send_signal(signal.SIGKILL)
        A2.proc.wait()
        want = cold(P5)
        before = metrics(B)
        r = complete(B, P5, {"kv_hints": envelope(ep_a2, look5["block_hashes"], "two-5")})
        after = metrics(B)
        failed = fetch_outcomes(before, after)
        check(list(failed) == ['llamacpp_kv_fetch_total{outcome="connect"}'],
              "a killed source: the fetch fails, counted by reason", json.dumps(failed))
        check(answer(r) == answer(want), "P5 (source killed): B's answer equals the cold server's")

        # 7. the client goes away while its fetch waits on a silent source
        P6 = text(170, 6)
        complete(A, P6)
        look6 = A.json("POST", "/v1/kv/lookup", {"prompt": P6})[1]
        client = post_raw(B, {"prompt": P6, "n_predict": 8, "temperature": 0,
                              "kv_hints": envelope(ep_silent, look6["block_hashes"], "two-6")})
        check(accepted.wait(60), "B's fetch reached the silent source")
        client.close()
        # the fetch is cancelled on the next 20 ms slice
        wait_for(lambda: fetches(B, "client_gone") > 0)
        check(fetches(B, "client_gone") == 1, "a client gone mid-fetch cancels the fetch (client_gone)")
        want = cold(P6)
        r = complete(B, P6)
        check(answer(r) == answer(want), "P6 after the gone client: B's answer equals the cold server's")
        for c in held_conns:
            c.close()
        silent.close()

        # 8. the source dies mid-fetch
        P7 = text(180, 7)
        complete(A, P7)
        look7 = A.json("POST", "/v1/kv/lookup", {"prompt": P7})[1]
        held7 = B.json("POST", "/v1/kv/lookup", {"prompt": P7})[1]["blocks_held"]  # a prefix shared with earlier prompts
        want = cold(P7)
        before = metrics(B)
        r = complete(B, P7, {"kv_hints": envelope(ep_relay, look7["block_hashes"], "two-7")})
        after = metrics(B)
        relay.close()
        got = after.get("llamacpp_kv_fetched_blocks_total", 0) - before.get("llamacpp_kv_fetched_blocks_total", 0)
        outcomes = fetch_outcomes(before, after)
        fetchable7 = (look7["n_tokens"] - 1) // BT
        # (0 verified blocks when the fetch ran on several streams, each cut before its first block)
        check(relay.cut.is_set() and got < fetchable7 and len(outcomes) == 1
              and 'outcome="fetched"' not in list(outcomes)[0] and 'outcome="partial"' not in list(outcomes)[0],
              "a source dying mid-fetch: only verified blocks are kept, the failure is counted by reason",
              "%d of %d blocks, %s" % (got, fetchable7, json.dumps(outcomes)))
        check(r["timings"]["prompt_n"] == look7["n_tokens"] - (held7 + got) * BT, "B prefilled the blocks it did not get",
              "prompt_n %s, %d blocks held before" % (r["timings"]["prompt_n"], held7))
        check(answer(r) == answer(want), "P7 (source died mid-fetch): B's answer equals the cold server's")

        # 9. the same prompt again: every full block of it lies in the slot's exact prefix, so no
        # block would be exported and llama-server keeps its own reuse (all but the last token, as
        # the unpatched server does); nothing is recomputed from a block edge
        before = metrics(B)
        r = complete(B, P7)
        after = metrics(B)
        kept = look7["n_tokens"] - r["timings"]["prompt_n"]
        check(kept == look7["n_tokens"] - 1
              and after.get("llamacpp_kv_recomputed_tokens_total", 0) == before.get("llamacpp_kv_recomputed_tokens_total", 0),
              "P7 again: B keeps llama-server's own reuse (nothing recomputed)", "kept %d of %d tokens" % (kept, look7["n_tokens"]))
        check(answer(r) == answer(want), "P7 again: B's answer equals the cold server's")

        # 10. a streamed request: A exports its prompt's blocks after the first token went out,
        # before the stream ends; B fetches them and answers as the cold server
        P8 = text(140, 8)
        st, body = A.request("POST", "/completion", {"prompt": P8, "n_predict": 4, "temperature": 0, "stream": True,
                                                     "cache_prompt": True})
        chunks = [json.loads(l[6:]) for l in body.splitlines() if l.startswith("data: {")]
        look8 = A.json("POST", "/v1/kv/lookup", {"prompt": P8})[1]
        check(st == 200 and len(chunks) >= 2 and look8["blocks_total"] >= 4 and look8["blocks_held"] == look8["blocks_total"],
              "a streamed request: A served its prompt's blocks by the stream's end",
              "%d chunks, %d of %d blocks held" % (len(chunks), look8["blocks_held"], look8["blocks_total"]))
        want = cold(P8)
        before = metrics(B)
        r = complete(B, P8, {"kv_hints": envelope(ep_a, look8["block_hashes"], "two-8")})
        after = metrics(B)
        got = after.get("llamacpp_kv_fetched_blocks_total", 0) - before.get("llamacpp_kv_fetched_blocks_total", 0)
        check(got > 0 and answer(r) == answer(want), "P8 (streamed on A): B fetched its blocks and answers as the cold server",
              "%d blocks" % got)
        check(metrics(B).get("llamacpp_kv_store_pinned_blocks") == 0, "B holds no block pinned after its requests")

        # 11. fetched blocks stay pinned until the slot imports them: D's store holds two blocks;
        # while D's one slot is busy, Y fetches two blocks and waits for the slot, then Z's fetch
        # finds no room (Y's blocks are not evicted under it); once the slot is free, Y imports
        # both, and Y and Z answer as the cold server
        D = start("D", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_a,
                        "--kv-trusted-endpoint", ep_a2, "--kv-load-failure-policy", "fail",
                        "--kv-pool-mib", "2", "--threads-http", "8"])
        st, info_d = D.json("GET", "/v1/kv/info")
        cap = info_d.get("store_blocks", 0)
        P9, P10 = text(150, 9), text(150, 10)
        for p_ in (P9, P10):
            complete(A, p_)
        look9 = A.json("POST", "/v1/kv/lookup", {"prompt": P9})[1]
        look10 = A.json("POST", "/v1/kv/lookup", {"prompt": P10})[1]
        check(st == 200 and cap == 2 and (look9["n_tokens"] - 1) // BT > cap, "D's store holds two blocks, fewer than P9's",
              "%s blocks" % cap)
        want9, want10 = cold(P9), cold(P10)
        # X keeps D's slot busy: a streamed request with no end of its own (closed below)
        xconn = post_raw(D, {"prompt": "Count from one:", "n_predict": 1900, "ignore_eos": True, "stream": True,
                             "temperature": 0})
        seen = b""
        while b"data: " not in seen:
            chunk = xconn.recv(4096)
            if not chunk:
                break
            seen += chunk
        check(b"data: " in seen, "X streams on D (its slot is busy)")
        results = {}

        def ask(name, prompt, look, mid):
            try:
                results[name] = complete(D, prompt, {"kv_hints": envelope(ep_a, look["block_hashes"], mid)})
            except Exception as e:  # noqa: BLE001 (reported by the checks below)
                results[name] = e

        ty = threading.Thread(target=ask, args=("Y", P9, look9, "two-9"), daemon=True)
        ty.start()
        # as many of P9's blocks as D's store holds: fewer than the hint's run, so `partial`
        check(wait_for(lambda: fetches(D, "partial") == 1) and fetches(D, "fetched") == 0,
              "Y fetched while D's slot is busy (what D's store holds: partial)")
        tz = threading.Thread(target=ask, args=("Z", P10, look10, "two-10"), daemon=True)
        tz.start()
        check(wait_for(lambda: fetches(D, "no_room") == 1), "Z's fetch finds no room: Y's waiting blocks are not evicted")
        m = metrics(D)
        check(m.get("llamacpp_kv_store_pinned_blocks") == cap and "Y" not in results,
              "Y's fetched blocks stay pinned while Y waits for the slot",
              "%s pinned" % m.get("llamacpp_kv_store_pinned_blocks"))
        xconn.close()  # X ends: Y, then Z take the slot
        ty.join(300)
        tz.join(300)
        ry, rz = results.get("Y"), results.get("Z")
        check(isinstance(ry, dict) and ry["timings"]["prompt_n"] == look9["n_tokens"] - cap * BT,
              "Y imported its fetched blocks after waiting", "prompt_n %s" % (ry["timings"]["prompt_n"] if isinstance(ry, dict) else ry))
        check(isinstance(ry, dict) and answer(ry) == answer(want9), "Y's answer equals the cold server's")
        check(isinstance(rz, dict) and answer(rz) == answer(want10), "Z (no room to fetch) answers as the cold server")

        # 12. --kv-load-failure-policy fail (D): a fetch from the killed source fails the request
        # (502 kv_load_failed), counted by reason; the prompt without a hint then answers as C
        before = metrics(D)
        st, err = D.json("POST", "/completion",
                         completion_body(P5, {"kv_hints": envelope(ep_a2, look5["block_hashes"], "two-12")}))
        after = metrics(D)
        failed = fetch_outcomes(before, after)
        check(st == 502 and isinstance(err, dict) and err.get("error", {}).get("type") == "kv_load_failed"
              and list(failed) == ['llamacpp_kv_fetch_total{outcome="connect"}'],
              "--kv-load-failure-policy fail: a failed fetch answers 502 kv_load_failed, counted by reason",
              "%s %s" % (st, json.dumps(failed)))
        r = complete(D, P5)
        check(answer(r) == answer(cold(P5)), "P5 without a hint on D afterwards: the answer equals the cold server's")
        check(metrics(D).get("llamacpp_kv_store_pinned_blocks") == 0, "D holds no block pinned after its requests")
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop()
            else:
                s.log.close()
    if failures:
        print("%d check(s) failed: %s (logs in %s)" % (len(failures), ", ".join(failures), log_dir))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
