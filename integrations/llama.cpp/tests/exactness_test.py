#!/usr/bin/env python3
"""A slot exports only KV a cold prefill would give, whatever llama-server did to its cells.

    python3 integrations/llama.cpp/tests/exactness_test.py --server target/llama-server/bin/llama-server-kvrelay \
        --model MODEL.gguf [--threads 1] [--log-dir DIR] [--flash-attn off|on] [--server-args "-ngl 99"]

Standard library only. llama-server replaces or moves a slot's cells outside a prefill of its
own: its prompt cache (--cache-ram, on by default) loads a saved prompt with its answer into the
slot, a slot is restored from a file (--slot-save-path), --cache-reuse shifts chunks of the
cached prompt to new positions (RoPE-shifted K). KV computed one generated token at a time, or
shifted, differs in low bits from a cold prefill of the same tokens, so a block holding it must
never be served. Each path here runs on a source server of its own, then the source answers a
follow-up prompt that extends what the path left in the slot (prompts are token ids, so that
the generated tokens stay in the follow-up exactly as they are in the cells); B fetches every
full block of the follow-up from the source by a hint, and its greedy text and top-5
probabilities must equal those of C, a cold server. Before llama-server's paths told kvrelay
(kvrelay_llama::on_cells_changed), each of these exported generated or shifted KV and B answered
differently. Where no block would be exported, llama-server's own reuse is kept as it is
(a repeated prompt evaluates only its last token), and a later prompt that adds whole blocks is
prefilled from a block edge, its blocks exact. Exit status 0 when every check passed.
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import Server, check, failures  # noqa: E402
from two_instance_test import BT, answer, complete, envelope, metrics, text  # noqa: E402


def ids_of(srv, prompt):
    # the token ids the completion routes give `prompt` (BOS included)
    st, look = srv.json("POST", "/v1/kv/lookup", {"prompt": prompt})
    assert st == 200, look
    return look["token_ids"]


def generated(r):
    return [t["id"] for t in r["completion_probabilities"]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-dir")
    ap.add_argument("--flash-attn", choices=("off", "on"), default="off")
    ap.add_argument("--server-args", default="", help="more flags for every server (a CUDA build: -ngl 99)")
    a = ap.parse_args()
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvrelay-llama-exact-")
    os.makedirs(log_dir, exist_ok=True)
    print("logs in", log_dir)
    exact = ["-fa", a.flash_attn, "-ub", str(BT), "--kv-block-tokens", str(BT)] + a.server_args.split()
    servers = []

    def start(name, args):
        s = Server(a.server, a.model, exact + args, os.path.join(log_dir, name + ".log"), threads=a.threads)
        servers.append(s)
        return s

    def endpoint(srv):
        return srv.json("GET", "/v1/kv/info")[1]["source_control_endpoint"]

    try:
        # the sources: the prompt cache as llama-server ships it; --cache-reuse; slots saved to files
        # (trusted: /v1/kv/lookup answers blocks_held only at the trusted edge)
        S1 = start("S1-prompt-cache", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted"])
        S2 = start("S2-cache-reuse", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted", "--cache-ram", "0",
                                      "--cache-reuse", "8"])
        slot_dir = os.path.join(log_dir, "slots")
        os.makedirs(slot_dir, exist_ok=True)
        S3 = start("S3-slot-restore", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted", "--cache-ram", "0",
                                       "--slot-save-path", slot_dir])
        S4 = start("S4-own-reuse", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted", "--cache-ram", "0"])
        eps = {s: endpoint(s) for s in (S1, S2, S3, S4)}
        B_args = ["--kv-hints-trusted", "--kv-fetch", "always", "--cache-ram", "0"]
        for ep in eps.values():
            B_args += ["--kv-trusted-endpoint", ep]
        B = start("B", B_args)
        C = start("C", ["--cache-ram", "0"])

        def follow_up(src, name, prompt_ids, mid):
            # src answered `prompt_ids` from the cells a path left; B fetches every full block of
            # it from src and must answer as the cold server
            st, look = src.json("POST", "/v1/kv/lookup", {"prompt": prompt_ids})
            n, total = look["n_tokens"], look["blocks_total"]
            check(st == 200 and look["blocks_held"] == total > 0, "%s: the source serves every full block of the follow-up" % name,
                  "%d tokens, %d of %d blocks" % (n, look["blocks_held"], total))
            want = complete(C, prompt_ids, {"cache_prompt": False})
            before = metrics(B)
            r = complete(B, prompt_ids, {"kv_hints": envelope(eps[src], look["block_hashes"], mid)})
            after = metrics(B)
            got = after.get("llamacpp_kv_fetched_blocks_total", 0) - before.get("llamacpp_kv_fetched_blocks_total", 0)
            check(got == (n - 1) // BT, "%s: B fetched the follow-up's blocks" % name, "%d of %d" % (got, (n - 1) // BT))
            check(answer(r) == answer(want), "%s: B's answer equals the cold server's" % name, repr(r["content"]))

        def changed(srv):
            return metrics(srv).get("llamacpp_kv_slot_cells_changed_total", 0)

        # 1. the prompt cache: P answered (40 generated tokens), a long prompt in between moves P
        # and its answer to the cache, then P + answer + more: the slot loads P's cells from the
        # cache, generated tokens included
        p_ids = ids_of(S1, text(150, 21))
        r = complete(S1, p_ids, {"n_predict": 40})
        gen = generated(r)
        complete(S1, text(320, 22))
        c0 = changed(S1)
        q_ids = p_ids + gen + ids_of(S1, text(60, 23))[1:]
        complete(S1, q_ids)
        check(changed(S1) > c0, "prompt cache: llama-server told kvrelay the slot's cells were replaced")
        follow_up(S1, "prompt cache", q_ids, "exact-1")

        # 2. --cache-reuse: head + middle + body, then head + body: llama-server shifts the body's
        # cells back by the middle's length instead of computing them
        head, middle = ids_of(S2, text(9, 32)), ids_of(S2, text(13, 33))[1:]
        body = ids_of(S2, text(160, 31))[1:]
        complete(S2, head + middle + body)
        c0 = changed(S2)
        r = complete(S2, head + body)
        # (with cache-ram 0 only the chunk shift calls the hook here; kvrelay then drops the
        # shifted cells and the prompt is prefilled: llama-server alone computes 5 tokens of it)
        check(changed(S2) > c0, "cache reuse: llama-server shifted the body's cells and told kvrelay",
              "prompt_n %d" % r["timings"]["prompt_n"])
        follow_up(S2, "cache reuse", head + body, "exact-2")

        # 3. a slot restored from a file: P answered and saved, a long prompt in between, P's
        # slot restored, then P + answer + more
        p_ids = ids_of(S3, text(150, 41))
        r = complete(S3, p_ids, {"n_predict": 40})
        gen = generated(r)
        st, _ = S3.json("POST", "/slots/0?action=save", {"filename": "p.bin"})
        check(st == 200, "slot restore: slot 0 saved")
        complete(S3, text(320, 42))
        c0 = changed(S3)
        st, _ = S3.json("POST", "/slots/0?action=restore", {"filename": "p.bin"})
        check(st == 200 and changed(S3) > c0, "slot restore: llama-server told kvrelay the slot's cells came from a file")
        q_ids = p_ids + gen + ids_of(S3, text(60, 43))[1:]
        complete(S3, q_ids)
        follow_up(S3, "slot restore", q_ids, "exact-3")

        # 4. llama-server's own reuse is kept where no exported block depends on a cut at a block
        # edge: a short prompt asked again, and a prompt of whole blocks plus a few tokens asked
        # again, evaluate only their last token (as unpatched); then a prompt that adds whole
        # blocks is prefilled from the block edge, and its exported blocks are exact
        short = ids_of(S4, "Hello, how are you?")[:10]
        complete(S4, short)
        r = complete(S4, short)
        check(r["timings"].get("cache_n", 0) == len(short) - 1 and r["timings"]["prompt_n"] == 1,
              "own reuse: a repeated %d-token prompt evaluates its last token alone (cache_n as unpatched)" % len(short),
              str(r["timings"]))
        x_ids = ids_of(S4, text(80, 9))
        x_ids = x_ids[:(len(x_ids) // BT) * BT + 5]
        complete(S4, x_ids)
        r = complete(S4, x_ids)
        check(r["timings"].get("cache_n", 0) == len(x_ids) - 1 and r["timings"]["prompt_n"] == 1,
              "own reuse: a repeated prompt of %d tokens (whole blocks and 5) evaluates its last token alone" % len(x_ids),
              str(r["timings"]))
        y_ids = x_ids + ids_of(C, " and then " + text(60, 10))[1:]
        r = complete(S4, y_ids)
        check(r["timings"]["prompt_n"] == len(y_ids) - (len(x_ids) // BT) * BT,
              "own reuse: the longer prompt is prefilled from the last block edge of the exact prefix",
              "prompt_n %d" % r["timings"]["prompt_n"])
        follow_up(S4, "own reuse, then whole blocks added", y_ids, "exact-4")

        check(metrics(B).get("llamacpp_kv_store_pinned_blocks") == 0, "B holds no block pinned after its requests")
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
