#!/usr/bin/env python3
"""Memory of a fetching llama-server stays bounded (issue: "RSS grew by about 60 MiB over 100
fetches of the same shape").

What was measured (README, llama-server section, "Memory"): B fetching 100 new prompts of 300
tokens from A grew by about 12.5 MiB a fetch, without end, with llama-server's defaults. That is
llama-server's own host prompt cache (`--cache-ram`, 8192 MiB by default), which keeps each
prompt's state when a slot moves to another: with `--cache-ram 0` the same run stays flat once
kvrelay's block store (`--kv-pool-mib`, allocated at start, touched as blocks are first
written) is full. So this test runs B with `--cache-ram 0` and checks:
  1. every prompt was fetched (the store turned over);
  2. once the store is full, more fetches grow B's resident memory by at most a few MiB;
  3. in all, B grew by at most its store's size and a margin.
Exit status 0 when every check passed.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import check, run_test  # noqa: E402
from two_instance_test import complete, envelope, metrics, text  # noqa: E402

POOL_MIB = 32
WARM, TOTAL = 10, 24  # fetches that fill the store, then fetches that must not grow memory


def rss_mib(server):
    with open("/proc/%d/status" % server.proc.pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def body(a, start):
    A = start("A", ["--kv-listen", "127.0.0.1:0"])
    ep = A.json("GET", "/v1/kv/info")[1]["source_control_endpoint"]
    B = start("B", ["--kv-hints-trusted", "--kv-trusted-endpoint", ep, "--kv-pool-mib", str(POOL_MIB),
                    "--cache-ram", "0"])
    base = rss_mib(B)
    warm = None
    for i in range(TOTAL):
        q = text(200, 7000 + i)
        complete(A, q)
        hashes = A.json("POST", "/v1/kv/lookup", {"prompt": q})[1]["block_hashes"]
        B.json("POST", "/completion", {"prompt": q, "n_predict": 2, "kv_hints": envelope(ep, hashes, "rss-%d" % i)})
        if i + 1 == WARM:
            warm = rss_mib(B)
    end = rss_mib(B)
    m = metrics(B)
    fetched = m.get('llamacpp_kv_fetch_total{outcome="fetched"}', 0) + m.get('llamacpp_kv_fetch_total{outcome="partial"}', 0)
    check(fetched == TOTAL and m.get("llamacpp_kv_store_evicted_total", 0) > 0,
          "1. every prompt was fetched, and the store turned over", "%d of %d, %s evicted" % (
              fetched, TOTAL, m.get("llamacpp_kv_store_evicted_total")))
    check(end - warm <= 4, "2. once the store is full, %d more fetches grow B's memory by at most 4 MiB" % (TOTAL - WARM),
          "%.1f MiB after %d fetches, %.1f MiB after %d" % (warm, WARM, end, TOTAL))
    check(end - base <= POOL_MIB + 48, "3. in all, B grew by at most its store and a margin",
          "%.1f MiB at start, %.1f MiB at the end (store %d MiB)" % (base, end, POOL_MIB))


if __name__ == "__main__":
    sys.exit(run_test("kvrelay-rss-", body))
