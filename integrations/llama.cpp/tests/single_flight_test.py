#!/usr/bin/env python3
"""Concurrent requests for the same new prefix from one source share one fetch (single flight):
the source sends the blocks once, every answer equals a cold server's.

    python3 integrations/llama.cpp/tests/single_flight_test.py --server target/llama-server/bin/llama-server-kvrelay \
        --model MODEL.gguf [--threads 1] [--log-dir DIR]

Standard library only. A serves; B (four slots) trusts hints and fetches from A through a gated
relay, which holds A's answers back until either every request opened a connection of its own
(no single flight) or all but one joined the first fetch, so that the requests overlap however
fast the machine; C is the cold reference. The requests start one at a time, each once the one
before joined the flight (or opened its own connection): llama-server's HTTP pool (cpp-httplib's)
grows only when no thread counts as idle, so requests that come at the same moment can leave
one queued behind the waiting ones, and with it the test's poll of /metrics and the gate. So B
runs on the default pool. Checks:
  1. eight hinted requests at once for one new prompt of about 28 blocks: one of them fetches
     (A sends the prompt's blocks once, over the streams of that one fetch), the others join it
     (`joined`) or, arriving after it, find the blocks held (`nothing_to_fetch`);
  2. every answer equals the cold server's;
  3. nothing stays pinned on B (after 4);
  4. one batched /completion of three hinted prompts: the three fetches run at once (the relay
     holds the source's answers until all three connected), each answer equals the cold one;
  5. one batched /completion of 40 hinted prompts: while the fetches wait behind the gate,
     exactly 8 prompts wait for their KV (llamacpp_kv_fetch_waiting) and B's thread count grows
     by at most those 8 plus two (before: a thread per hinted prompt), and every prompt is
     answered.
Exit status 0 when every check passed.
"""
import os
import socket
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import check, run_test  # noqa: E402
from two_instance_test import BT, answer, complete, completion_body, envelope, fetch_outcomes, fetches, metrics, text, wait_for  # noqa: E402

N = 8
M = 40  # hinted prompts of one batched request (5.)
MAX_FETCH_THREADS = 8  # kvrelay_llama_state.hpp: hinted prompts of one request that fetch at once


def threads_of(srv):
    # the server process's threads now
    return len(os.listdir("/proc/%d/task" % srv.proc.pid))


# The source's first frame on a new connection: its authentication challenge (a 12-byte frame
# header, its nonce and its proof, 32 bytes each). The relay lets it through at once: the
# handshake completes (the source's handshake deadline is 2 s) and the gate holds the offer.
CHALLENGE_BYTES = 12 + 2 * 32


class GatedRelay:
    """A TCP relay to `target_port` on loopback that passes the client's bytes at once and the
    target's only once `gate` is set (but for the first CHALLENGE_BYTES of each connection);
    counts the connections it accepted."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4 * N)
        self.port = self.sock.getsockname()[1]
        self.gate = threading.Event()
        self.connections = 0
        self.socks = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        # bounded: at most 4 * N connections are relayed
        while self.connections < 4 * N:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            t = socket.create_connection(("127.0.0.1", self.target_port))
            self.socks += [c, t]
            threading.Thread(target=self.pump, args=(c, t, False), daemon=True).start()
            threading.Thread(target=self.pump, args=(t, c, True), daemon=True).start()

    def pump(self, src, dst, gated):
        free = CHALLENGE_BYTES if gated else 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if free:
                    head, data = data[:free], data[free:]
                    free -= len(head)
                    dst.sendall(head)
                    if not data:
                        continue
                if gated:
                    self.gate.wait(120)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.gate.set()
        self.sock.close()
        for s in self.socks:
            s.close()


def sent_blocks(srv):
    m = metrics(srv)
    return sum(v for k, v in m.items() if k.startswith("kvrelay_kv_agent_blocks") and 'direction="sent"' in k)


def body(a, start):
    A = start("A", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted"])
    ep_a = A.json("GET", "/v1/kv/info")[1]["source_control_endpoint"]
    relay = GatedRelay(int(ep_a.rsplit(":", 1)[1]))
    ep = "tcp://127.0.0.1:%d" % relay.port
    B = start("B", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep,
                    "-np", "4", "-c", "8192"])  # 2048 a slot: A's context per sequence
    C = start("C", [])
    try:
        P = text(480, 77)
        complete(A, P)
        look = A.json("POST", "/v1/kv/lookup", {"prompt": P})[1]
        fetchable = (look["n_tokens"] - 1) // BT
        check(look["blocks_held"] >= fetchable >= 10, "A holds the prompt's blocks", "%d blocks" % fetchable)
        want = complete(C, P, {"cache_prompt": False})

        before, sent_before = metrics(B), sent_blocks(A)
        results = {}

        def ask(i):
            try:
                results[i] = complete(B, P, {"kv_hints": envelope(ep, look["block_hashes"], "flight-%d" % i)})
            except Exception as e:  # noqa: BLE001 (reported by the checks below)
                results[i] = e

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(N)]
        # the requests overlap: A's answers are held back until all but the first joined it, or
        # (without single flight) every request opened its own connection; one at a time, each
        # once the one before is in (the first: its fetch connected)
        joined_now = lambda: fetches(B, "joined") - before.get('llamacpp_kv_fetch_total{outcome="joined"}', 0)  # noqa: E731
        for i, t in enumerate(threads):
            t.start()
            wait_for(lambda: relay.connections >= i + 1 or (i > 0 and joined_now() >= i))
        relay.gate.set()
        for t in threads:
            t.join(300)
        after = metrics(B)
        by = {k.split('outcome="')[1].rstrip('"}'): v for k, v in fetch_outcomes(before, after).items()}
        sent = sent_blocks(A) - sent_before
        check(sent == fetchable and by.get("fetched", 0) == 1
              and by.get("joined", 0) + by.get("nothing_to_fetch", 0) == N - 1,
              "1. %d requests at once for one new prefix: one fetch, the blocks sent once" % N,
              "%d connections, %d of %d blocks sent, %s" % (relay.connections, sent, fetchable, by))
        bad = [i for i in range(N) if not isinstance(results.get(i), dict) or answer(results[i]) != answer(want)]
        check(not bad, "2. every answer equals the cold server's", "differ: %s" % bad)

        # 4. one batched request of three hinted prompts: their fetches run at once (the relay holds
        # the source's answers until all three connected; one after another, the first would wait
        # for its deadline behind the closed gate and end as a timeout)
        relay.gate.clear()
        Ps = [text(160, 780 + k) for k in range(3)]
        looks = []
        for p in Ps:
            complete(A, p)
            looks.append(A.json("POST", "/v1/kv/lookup", {"prompt": p})[1])
        wants = [complete(C, p, {"cache_prompt": False}) for p in Ps]
        before, conns = metrics(B), relay.connections
        out = {}

        def batched():
            out["r"] = B.json("POST", "/completion", dict(
                completion_body(Ps), kv_hints=[envelope(ep, lk["block_hashes"], "batch-%d" % k) for k, lk in enumerate(looks)]))

        t = threading.Thread(target=batched, daemon=True)
        t.start()
        wait_for(lambda: relay.connections - conns >= 3)
        relay.gate.set()
        t.join(300)
        by = {k.split('outcome="')[1].rstrip('"}'): v for k, v in fetch_outcomes(before, metrics(B)).items()}
        st, rs = out.get("r", (None, None))
        check(st == 200 and by == {"fetched": 3}, "4. a batched request's three hinted prompts fetch at once",
              "%s, %s" % (st, by))
        got = sorted(rs, key=lambda r: r.get("index", 0)) if isinstance(rs, list) else []
        check(len(got) == 3 and all(answer(g) == answer(w) for g, w in zip(got, wants)),
              "4. each of the batch's answers equals the cold server's")
        check(wait_for(lambda: metrics(B).get("llamacpp_kv_store_pinned_blocks", -1) == 0), "3. nothing stays pinned on B")

        # 5. one batched request of M hinted prompts: at most MAX_FETCH_THREADS of them fetch at
        # once (helpers of the request's thread), not a thread each. The relay holds the source's
        # answers, so the fetches in flight stay blocked while B's threads are counted
        relay.gate.clear()
        Ms = [text(30, 1900 + k) for k in range(M)]
        hint_sets = [B.json("POST", "/v1/kv/lookup", {"prompt": p})[1]["block_hashes"] for p in Ms]
        base = threads_of(B)
        many = {}

        def batched_many():
            many["r"] = B.json("POST", "/completion", dict(
                completion_body(Ms), n_predict=2,
                kv_hints=[envelope(ep, h, "many-%d" % k) for k, h in enumerate(hint_sets)]))

        t = threading.Thread(target=batched_many, daemon=True)
        t.start()
        # as many fetches as may run at once wait behind the gate (llamacpp_kv_fetch_waiting counts
        # the prompts waiting for their KV)
        waiting = lambda: metrics(B).get("llamacpp_kv_fetch_waiting", 0)  # noqa: E731
        full = wait_for(lambda: waiting() >= MAX_FETCH_THREADS)
        peak = max(threads_of(B) for _ in range(20))
        peak_waiting = max(waiting() for _ in range(20))
        relay.gate.set()
        t.join(600)
        st, rs = many.get("r", (None, None))
        check(full and peak_waiting == MAX_FETCH_THREADS and peak - base <= MAX_FETCH_THREADS + 2,
              "5. %d hinted prompts in one request: %d fetch at once, B grew by %d threads"
              % (M, MAX_FETCH_THREADS, peak - base),
              "%s prompts waiting for their KV, %d threads before, %d at the peak" % (peak_waiting, base, peak))
        check(st == 200 and isinstance(rs, list) and len(rs) == M, "5. every prompt of the batch is answered",
              "status %s, %s answers" % (st, len(rs) if isinstance(rs, list) else rs))
        check(wait_for(lambda: metrics(B).get("llamacpp_kv_store_pinned_blocks", -1) == 0),
              "5. nothing stays pinned on B")
    finally:
        relay.close()


if __name__ == "__main__":
    # the bit-exact settings of two_instance_test.py
    exact = ["-fa", "off", "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT)]
    sys.exit(run_test("kvrelay-single-flight-", body, exact))
