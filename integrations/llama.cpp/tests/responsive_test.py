#!/usr/bin/env python3
"""A server whose hinted requests wait for KV stays responsive.

A hinted request waits for its KV on an HTTP thread of its own. llama-server's HTTP pool keeps
`--threads-http` threads (default: the larger of n_parallel + 4 and the cores less one) and adds
threads on demand (up to 1,024 more, each gone after its request), so waiting requests never
take the threads `/health`, `/metrics`, `/v1/models` and unhinted requests need. Checked with
more waiting requests than the pool's fixed threads, on the default pool:
  1. W hinted requests naming a frozen trusted source (it accepts and never answers;
     `--kv-fetch always`, so each waits for its transfer deadline) are all waiting at once
     (`llamacpp_kv_fetch_waiting` = W, more than the fixed threads);
  2. meanwhile `/health`, `/metrics`, `/v1/models` answer and an unhinted `/completion` completes,
     each while the W requests still wait (the gauge read after each answer is still W);
  3. the hinted requests then end as the cold server would answer them (the fetch timed out,
     counted), and nothing stays waiting.
Every wait is on a condition (the gauge, the requests' own completion), never on time.
Exit status 0 when every check passed.

The W requests start one at a time, each once the gauge counts the one before, and the gauge is
read on one kept-alive connection opened before them: the HTTP pool (cpp-httplib's) adds a
thread only when a request comes while no thread is idle, and a thread counts as idle until it
wakes and takes its request, so two requests that come together can find one idle thread
between them and one waits in the queue for a busy thread (here up to the fetch deadline).
That is the pool's own behaviour, not the waiting requests'; the test keeps clear of it.
"""
import http.client
import os
import re
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import check, run_test  # noqa: E402
from two_instance_test import FrozenSource, answer, complete, completion_body, envelope, metrics, text, wait_for  # noqa: E402

W = 12  # more than the fixed threads of the default pool on CI (2 cores, -np 1: 5)


class Gauge:
    """`llamacpp_kv_fetch_waiting` read on one kept-alive connection (its thread of the pool is
    held from the first read on, so a read never queues behind the waiting requests); opened
    again when the server closes it (keep-alive ends after a count or an idle time)."""

    def __init__(self, port):
        self.port, self.conn = port, None

    def __call__(self):
        for _ in range(2):
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                self.conn.request("GET", "/metrics")
                body = self.conn.getresponse().read().decode()
                m = re.search(r"^llamacpp_kv_fetch_waiting (\S+)$", body, re.M)
                return float(m.group(1)) if m else -1
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
        return -1

    def close(self):
        if self.conn is not None:
            self.conn.close()


def body(a, start):
    # bounded: at most 4 * W connections are accepted and held open, never answered
    frozen = FrozenSource(4 * W)
    ep = frozen.endpoint
    try:
        B = start("B", ["--kv-hints-trusted", "--kv-trusted-endpoint", ep, "--kv-fetch", "always"])
        C = start("C", [])
        prompts = [text(150, 3000 + i) for i in range(W)]
        # the names first, so that the W requests start together (each fetch's offer deadline,
        # a few seconds, runs from its connect to the frozen source)
        hashes = [B.json("POST", "/v1/kv/lookup", {"prompt": p})[1]["block_hashes"] for p in prompts]
        results = [None] * W

        def hinted(i):
            results[i] = B.json("POST", "/completion",
                                completion_body(prompts[i], {"kv_hints": envelope(ep, hashes[i], "w%d" % i)}))

        threads = [threading.Thread(target=hinted, args=(i,)) for i in range(W)]
        waiting = Gauge(B.port)
        started = 0
        waiting()  # the gauge's connection (and its thread) first
        for i, t in enumerate(threads):
            t.start()
            if started == i and wait_for(lambda: waiting() == i + 1):
                started += 1
        check(started == W and waiting() == W, "1. %d hinted requests wait for their KV at once" % W,
              "%d seen waiting one by one, waiting %s" % (started, waiting()))

        # 2. the rest of the server answers while they wait
        answered = []
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models")):
            st, _ = B.request(method, path)
            answered.append((path, st, waiting()))
        plain = complete(B, text(40, 3999), {"n_predict": 2})
        answered.append(("/completion", 200 if plain.get("content") is not None else 0, waiting()))
        check(all(st == 200 and w == W for _, st, w in answered),
              "2. /health, /metrics, /v1/models and an unhinted /completion answer while all %d still wait" % W,
              "%s" % answered)

        # 3. the waits end (the frozen source times out), every answer as the cold server's
        for t in threads:
            t.join()
        differ = [i for i in range(W) if results[i] is None or results[i][0] != 200
                  or answer(results[i][1]) != answer(complete(C, prompts[i], {"cache_prompt": False}))]
        m = metrics(B)
        check(not differ and m.get("llamacpp_kv_fetch_waiting") == 0
              and m.get('llamacpp_kv_fetch_total{outcome="timeout"}', 0) + m.get('llamacpp_kv_fetch_total{outcome="joined"}', 0) >= W,
              "3. the waits end as timeouts, every answer equals the cold server's, nothing waits",
              "differ %s, waiting %s, timeout %s, joined %s" % (differ, m.get("llamacpp_kv_fetch_waiting"),
                                                            m.get('llamacpp_kv_fetch_total{outcome="timeout"}'),
                                                            m.get('llamacpp_kv_fetch_total{outcome="joined"}')))
        waiting.close()
    finally:
        frozen.close()


if __name__ == "__main__":
    sys.exit(run_test("kvrelay-responsive-", body))
