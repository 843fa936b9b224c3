#!/usr/bin/env python3
"""A frozen trusted source costs a hinted request at most what the fetch could save, once, and
then almost nothing: under --kv-fetch faster the wait is bounded by the prefill it would save
(cancelled past it, counted late) and a source that failed is skipped for a growing period
(counted backoff).

    python3 integrations/llama.cpp/tests/bounded_fetch_test.py --server target/llama-server/bin/llama-server-kvrelay \
        --model MODEL.gguf [--threads 1] [--log-dir DIR]

Standard library only. A frozen source: a loopback listener that accepts and never answers. B
trusts hints and that endpoint, fetches with the default --kv-fetch faster; C is the cold
reference. Checks:
  0. every fetch outcome's series is in /metrics at zero before any request;
  1. B measured its prefill (two unhinted prompts), so a fetch has a bound;
  2. 20 hinted prompts in a row naming the frozen source: none waits for the transfer deadline
     or past its own bound (an attempt whose bound grew past the agent's 5 s I/O timeout may end
     as `timeout` within it), the first is cancelled as `late`, the rest are skipped (`backoff`, or
     `not_worth_it` once the agent's estimate took in the waits that brought no block),
     every one is counted once, and a retry happens only after a skip period (a few `late` at
     most);
  3. every answer equals the cold server's;
  4. nothing stays pinned on B;
  5. E, whose small store is full, gets a hint naming a source S that lacks the blocks: the fetch
     evicts nothing (its destination is only claimed until the source's offer says what comes;
     before, it evicted up to a quarter of the store, and before that every unpinned block),
     and E then answers the prompt as the cold server;
  6. stale hints never make a healthy source skipped: F (--kv-fetch faster, its prefill timed)
     gets five hints naming blocks S lacks (five `source_miss`, none skipped as `backoff`), then
     a valid one, which fetches S's blocks and answers as the cold server.
Exit status 0 when every check passed.
"""
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import check, run_test  # noqa: E402
from two_instance_test import FrozenSource, BT, answer, complete, envelope, fetch_outcomes, metrics, text, wait_for  # noqa: E402

N = 20


def body(a, start):
    # bounded: at most 2 * N connections are accepted and held open, never answered
    frozen = FrozenSource(2 * N)
    ep = frozen.endpoint
    try:
        B = start("B", ["--kv-hints-trusted", "--kv-trusted-endpoint", ep])
        C = start("C", [])

        # 0. every outcome's series is there from the start, at zero
        m0 = metrics(B)
        missing = [o for o in ("fetched", "partial", "late", "backoff", "no_room", "timeout", "connect", "name_collision")
                   if m0.get('llamacpp_kv_fetch_total{outcome="%s"}' % o) != 0]
        check(not missing, "0. the fetch outcomes' series are present at zero from the start", "missing: %s" % missing)

        # 1. two unhinted prompts: B's prefill speed measured (the first prompt is not folded)
        complete(B, text(120, 901))
        complete(B, text(120, 902))
        spt = lambda: metrics(B).get("llamacpp_kv_prefill_seconds_per_token", 0)  # noqa: E731
        check(wait_for(lambda: spt() > 0), "1. B measured its prefill", "%s s a token" % spt())

        # 2. and 3. hinted prompts naming the frozen source
        before = metrics(B)
        began = time.monotonic()
        differ = []
        for i in range(N):
            p = text(140, 1000 + i)
            hashes = B.json("POST", "/v1/kv/lookup", {"prompt": p})[1]["block_hashes"]
            r = complete(B, p, {"kv_hints": envelope(ep, hashes, "frozen-%d" % i)})
            if answer(r) != answer(complete(C, p, {"cache_prompt": False})):
                differ.append(i)
        after = metrics(B)
        elapsed = time.monotonic() - began
        got = fetch_outcomes(before, after)
        by = {k.split('outcome="')[1].rstrip('"}'): v for k, v in got.items()}
        # skipped: by the backoff, or because the agent's estimate, which took in each wait that
        # brought no block, no longer beats the local prefill (not_worth_it)
        late, skipped = by.get("late", 0), by.get("backoff", 0) + by.get("not_worth_it", 0)
        # a retry only once a skip period ended: periods of 1, 2, 4, ... s (60 s at most) after each
        # failure, so in `elapsed` seconds at most this many attempts
        attempts, span, k = 1, 0.0, 0
        while True:
            span += min(2.0 ** k, 60.0)
            if span > elapsed:
                break
            attempts, k = attempts + 1, k + 1
        # an attempt whose bound grew past the agent's I/O timeout (5 s: the bound follows the
        # estimate, which takes in each wait that brought no block) ends as `timeout` when the
        # frozen source's handshake read times out first: a failed attempt like `late`, as long
        # as it waited no longer than its bound and far less than the transfer deadline (10 s)
        tried = late + by.get("timeout", 0)
        waits = [(float(w), float(at_most)) for w, at_most in re.findall(
            r"fetch (?:late|timeout): .*?, ([0-9.]+) s \(estimate [0-9.]+ s, local prefill [0-9.]+ s, waited at most ([0-9.]+) s\)",
            open(B.log_path).read())]
        overlong = [w for w in waits if w[0] > w[1] + 0.5 or w[0] >= 10.0]
        check(1 <= late and tried <= attempts and skipped == N - tried and len(waits) == tried and not overlong
              and by.get("backoff", 0) >= 1 and set(by) <= {"late", "timeout", "backoff", "not_worth_it"},
              "2. the frozen source: cancelled as late (or its handshake timed out within the bound), then skipped "
              "(backoff) but for a retry per skip period; never waited for the transfer deadline",
              "%s in %.1f s (at most %d attempts); waits past their bound: %s" % (by, elapsed, attempts, overlong))
        policy = lambda reason: after.get('llamacpp_kv_policy_discarded_total{reason="%s"}' % reason, 0) - \
            before.get('llamacpp_kv_policy_discarded_total{reason="%s"}' % reason, 0)  # noqa: E731
        check(policy("provider_declined") == skipped and policy("fetch_failed") == 0,
              "2. the policy counts each skip once, as a decline by the provider, not as a failed fetch",
              "declined %d, fetch_failed %d" % (policy("provider_declined"), policy("fetch_failed")))
        check(not differ, "3. every answer equals the cold server's", "differ: %s" % differ)
        check(after.get("llamacpp_kv_store_pinned_blocks", -1) == 0, "4. nothing stays pinned on B")

        # 5. a full store and a hint to a live source that lacks the blocks: the fetch only claims
        #    its destination (at most a quarter of the store) and evicts for it once the source's
        #    offer says what comes; S offers nothing, so nothing is evicted. E fails a request whose
        #    fetch failed (--kv-load-failure-policy fail), so nothing of it is prefilled or
        #    exported and the store's counters show the fetch's evictions alone
        S = start("S", ["--kv-listen", "127.0.0.1:0"])
        ep_s = S.json("GET", "/v1/kv/info")[1]["source_control_endpoint"]
        E = start("E", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_s, "--kv-pool-mib", "8",
                        "--kv-load-failure-policy", "fail"])
        cap = int(E.json("GET", "/v1/kv/info")[1]["store_blocks"])
        for i in range(6):
            complete(E, text(150, 2000 + i))
        m1 = metrics(E)
        q = text(400, 2100)
        hashes = E.json("POST", "/v1/kv/lookup", {"prompt": q})[1]["block_hashes"]
        st, _ = E.json("POST", "/completion", {"prompt": q, "n_predict": 4, "kv_hints": envelope(ep_s, hashes, "stale-1")})
        m2 = metrics(E)
        evicted = m2.get("llamacpp_kv_store_evicted_total", 0) - m1.get("llamacpp_kv_store_evicted_total", 0)
        check(m1.get("llamacpp_kv_store_blocks") == cap and len(hashes) > cap // 4 and st == 502
              and fetch_outcomes(m1, m2) == {'llamacpp_kv_fetch_total{outcome="source_miss"}': 1},
              "5. E's store is full, the hint names more blocks than a quarter of it, S lacks them (source_miss)",
              "%s of %d blocks, %d named, status %s, %s" % (m1.get("llamacpp_kv_store_blocks"), cap, len(hashes), st,
                                                          fetch_outcomes(m1, m2)))
        check(evicted == 0 and m2.get("llamacpp_kv_store_blocks", 0) == cap,
              "5. the stale hint evicted nothing from E's store",
              "%d evicted, %s of %d held" % (evicted, m2.get("llamacpp_kv_store_blocks"), cap))
        check(answer(complete(E, q)) == answer(complete(C, q, {"cache_prompt": False})),
              "5. E then answers the prompt as the cold server")

        # 6. stale hints (routine: a router's index lags the source's evictions) say nothing of the
        #    source's health: the valid hint after five of them fetches
        F = start("F", ["--kv-hints-trusted", "--kv-trusted-endpoint", ep_s])  # --kv-fetch faster
        for i in range(2):
            complete(F, text(150, 3000 + i))  # F times its prefill
        good = text(150, 3100)
        complete(S, good)
        hashes_good = S.json("POST", "/v1/kv/lookup", {"prompt": good})[1]["block_hashes"]
        m0 = metrics(F)
        for i in range(5):
            stale = text(150, 3200 + i)
            h = F.json("POST", "/v1/kv/lookup", {"prompt": stale})[1]["block_hashes"]
            complete(F, stale, {"kv_hints": envelope(ep_s, h, "stale-f-%d" % i)})
        m1 = metrics(F)
        check(fetch_outcomes(m0, m1) == {'llamacpp_kv_fetch_total{outcome="source_miss"}': 5},
              "6. five stale hints to a healthy source: five source_miss, none skipped (backoff)",
              str(fetch_outcomes(m0, m1)))
        r = complete(F, good, {"kv_hints": envelope(ep_s, hashes_good, "valid-f")})
        m2 = metrics(F)
        check(fetch_outcomes(m1, m2) == {'llamacpp_kv_fetch_total{outcome="fetched"}': 1}
              and answer(r) == answer(complete(C, good, {"cache_prompt": False})),
              "6. the valid hint after them fetches S's blocks and answers as the cold server",
              str(fetch_outcomes(m1, m2)))
    finally:
        frozen.close()


if __name__ == "__main__":
    # the bit-exact settings of two_instance_test.py: B's answers after reuse equal C's cold ones
    exact = ["-fa", "off", "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT)]
    sys.exit(run_test("kvrelay-bounded-fetch-", body, exact))
