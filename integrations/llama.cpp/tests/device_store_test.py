#!/usr/bin/env python3
"""llama-server's KV block store on the GPU: blocks move device to device, answers stay exact.

    python3 integrations/llama.cpp/tests/device_store_test.py --server BUILD_WITH_CUDA/llama-server \
        --model MODEL.gguf [--threads 4] [--flash-attn off|on] [--transports cuda-ipc,tcp] [--server-args "-c 4096"]

Standard library only. Needs a CUDA build of the kvrelay llama-server and a GPU: every server
runs with -ngl 99, so llama.cpp's KV cache is on CUDA device 0 and the store is a pool on that
device (--kv-store device, the default there). Without a device store (a CPU build, no GPU) it
skips, saying why, and exits 0; with KVRELAY_REQUIRE_GPU=1 that is a failure.

A is a source, C a cold reference (no KV flags, every request cache_prompt false), and for each
transport T of --transports a fetching server B_T (--kv-transport T). Checks, by the servers'
own counters and answers:
  1. A and B_T report a device store on device 0 and the transport they move blocks with;
  2. A exports the full blocks of a prompt it lacks by device copies (bytes, device copy time);
  3. B_T fetches them by a hint: its fetched bytes under transport T equal the blocks' bytes,
     and for cuda-ipc A's pool is mapped into B_T and nothing fell back to TCP;
  4. B_T prefilled only the tokens after the fetched blocks, imported by device copies, and its
     greedy text and the first tokens' top-5 probabilities equal C's;
  5. a longer prompt: B_T fetches only the blocks it lacks, and answers as C;
  6. nothing stays pinned on A or B_T.
Exit status 0 when every check passed (or the test skipped).
"""

import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import Server, check, failures  # noqa: E402
from two_instance_test import BT, answer, complete, envelope, text  # noqa: E402


def all_metrics(srv):
    status, body = srv.request("GET", "/metrics")
    assert status == 200, body
    out = {}
    for line in body.splitlines():
        m = re.match(r'^([a-z_]\w*(?:\{[^}]*\})?) (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def delta(before, after, key):
    return after.get(key, 0) - before.get(key, 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--log-dir")
    ap.add_argument("--flash-attn", choices=("off", "on"), default="off")
    ap.add_argument("--transports", default="cuda-ipc,tcp")
    ap.add_argument("--server-args", default="", help="more flags for every server")
    a = ap.parse_args()
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvrelay-llama-device-")
    os.makedirs(log_dir, exist_ok=True)
    print("logs in", log_dir)
    exact = ["-fa", a.flash_attn, "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT),
             "-ngl", "99"] + a.server_args.split()
    servers = []

    def start(name, args):
        s = Server(a.server, a.model, exact + args, os.path.join(log_dir, name + ".log"), threads=a.threads)
        servers.append(s)
        return s

    try:
        A = start("A", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted"])
        st, info_a = A.json("GET", "/v1/kv/info")
        if not str(info_a.get("store_memory", "")).startswith("device"):
            why = "no device store (store_memory %r): a CPU build, or no GPU" % info_a.get("store_memory")
            if os.environ.get("KVRELAY_REQUIRE_GPU"):
                check(False, "KVRELAY_REQUIRE_GPU is set: a device store", why)
            else:
                print("SKIP", why)
                return 0
        else:
            check(info_a.get("store_device") == 0, "A's store is on CUDA device 0", "%s, %s" % (
                info_a.get("store_memory"), info_a.get("kv_transport")))
        ep_a = info_a.get("source_control_endpoint", "")
        C = start("C", [])
        bb = int(info_a["block_bytes"])

        for i, transport in enumerate(t for t in a.transports.split(",") if t):
            tag = "[%s, -fa %s]" % (transport, a.flash_attn)
            B = start("B-" + transport, ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_a,
                                         "--kv-transport", transport])
            info_b = B.json("GET", "/v1/kv/info")[1]
            check(str(info_b.get("store_memory", "")).startswith("device") and info_b.get("kv_transport") == transport,
                  "%s B has a device store and moves blocks by %s" % (tag, transport),
                  "%s, %s" % (info_b.get("store_memory"), info_b.get("kv_transport")))

            # A prefills P; its full blocks leave the KV cache by device copies
            P = text(150 + 40 * i, 100 + i)
            held0 = A.json("POST", "/v1/kv/lookup", {"prompt": P})[1]["blocks_held"]  # a prefix shared with earlier prompts
            a0 = all_metrics(A)
            complete(A, P)
            a1 = all_metrics(A)
            st, look = A.json("POST", "/v1/kv/lookup", {"prompt": P})
            n_tokens, total = look["n_tokens"], look["blocks_total"]
            check(st == 200 and total >= 4 and look["blocks_held"] == total,
                  "%s A holds every full block of P" % tag, "%d tokens, %d of %d" % (n_tokens, look["blocks_held"], total))
            check(delta(a0, a1, "llamacpp_kv_export_bytes_total") == (total - held0) * bb > 0
                  and delta(a0, a1, "llamacpp_kv_device_copy_nanoseconds_total") > 0,
                  "%s A exported the blocks of P it lacked by device copies" % tag,
                  "%d bytes, %d blocks held before" % (delta(a0, a1, "llamacpp_kv_export_bytes_total"), held0))

            # B fetches them and answers as C
            want = complete(C, P, {"cache_prompt": False})
            b0 = all_metrics(B)
            r = complete(B, P, {"kv_hints": envelope(ep_a, look["block_hashes"], "dev-%d" % i)})
            b1 = all_metrics(B)
            fetched = delta(b0, b1, "llamacpp_kv_fetched_blocks_total")
            key = 'llamacpp_kv_fetch_bytes_total{transport="%s"}' % transport
            # every full block but one that would leave no token to evaluate
            check(fetched == (n_tokens - 1) // BT and delta(b0, b1, key) == fetched * bb,
                  "%s B fetched A's blocks, counted under its transport" % tag,
                  "%d blocks, %d bytes" % (fetched, delta(b0, b1, key)))
            if transport == "cuda-ipc":
                check(delta(b0, b1, "kvrelay_kv_agent_transport_fallbacks_total") == 0
                      and b1.get("kvrelay_kv_agent_ipc_mapped", 0) > 0,
                      "%s the blocks moved device to device: A's pool mapped through CUDA IPC, no TCP fallback" % tag,
                      "fallbacks %d, mapped %d" % (delta(b0, b1, "kvrelay_kv_agent_transport_fallbacks_total"),
                                                   b1.get("kvrelay_kv_agent_ipc_mapped", 0)))
            check(r["timings"]["prompt_n"] == n_tokens - fetched * BT,
                  "%s B prefilled only the tokens after the fetched blocks" % tag, "prompt_n %d" % r["timings"]["prompt_n"])
            check(delta(b0, b1, "llamacpp_kv_import_bytes_total") == fetched * bb
                  and delta(b0, b1, "llamacpp_kv_device_copy_nanoseconds_total") > 0,
                  "%s B imported them by device copies" % tag)
            check(answer(r) == answer(want), "%s B's greedy text and top-5 probabilities equal the cold server's" % tag,
                  repr(r["content"]))

            # a longer prompt: only the blocks B lacks
            P2 = P + " " + text(80, 200 + i)
            complete(A, P2)
            look2 = A.json("POST", "/v1/kv/lookup", {"prompt": P2})[1]
            want2 = complete(C, P2, {"cache_prompt": False})
            b0 = all_metrics(B)
            r2 = complete(B, P2, {"kv_hints": envelope(ep_a, look2["block_hashes"], "dev2-%d" % i)})
            b1 = all_metrics(B)
            got = delta(b0, b1, "llamacpp_kv_fetched_blocks_total")
            check(got == (look2["n_tokens"] - 1) // BT - fetched, "%s B fetched only the blocks of P2 it lacked" % tag,
                  "fetched %d of %d, held %d" % (got, look2["blocks_total"], fetched))
            check(answer(r2) == answer(want2), "%s P2: B's answer equals the cold server's" % tag, repr(r2["content"]))
            check(all_metrics(B).get("llamacpp_kv_store_pinned_blocks") == 0, "%s B holds no block pinned" % tag)
        check(all_metrics(A).get("llamacpp_kv_store_pinned_blocks") == 0, "A holds no block pinned")
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
