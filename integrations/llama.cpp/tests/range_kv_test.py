#!/usr/bin/env python3
"""Only new KV leaves a slot, only missing KV enters one (libllama's position-range KV API).

    python3 integrations/llama.cpp/tests/range_kv_test.py --server target/llama-server/bin/llama-server-kvrelay \
        --model MODEL.gguf [--threads 1] [--log-dir DIR] [--flash-attn off|on] [--server-args "-ngl 99"]

Standard library only. Servers with the bit-exact settings of two_instance_test.py and 16-token
blocks: A serves its blocks, B trusts hints and fetches from A, C is the cold reference. Checks,
by the servers' own byte counters (llamacpp_kv_export_bytes_total and
llamacpp_kv_import_bytes_total count what moves between llama.cpp's KV cache and the store):
  1. /v1/kv/info names the position-range path;
  2. a 30-turn conversation on A's one slot (each prompt: the last prompt, its answer and a new
     user line): the bytes exported are exactly the final prompt's full blocks times the block
     size, and each of those blocks was exported once (a whole-sequence export would move the
     whole conversation every turn);
  3. B's slot holds 60 blocks of a prompt; the prompt one block longer, hinted at A, makes B
     fetch that one block, and the import moves exactly one block into the slot (not 61); B's
     answer (greedy text and top-5 probabilities) equals C's;
  4. F, whose KV type differs (F32), hinted at A's blocks: its names differ (the identity binds the
     KV types), so nothing is fetched or written, counted nothing_to_fetch; it answers as a cold
     server of its own settings (the range API itself refuses another layout: range_api_test).
Exit status 0 when every check passed.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import check, run_test  # noqa: E402
from two_instance_test import answer, complete, envelope, metrics, text  # noqa: E402

BT = 16


def tokenize(srv, s):
    st, r = srv.json("POST", "/tokenize", {"content": s, "add_special": False})
    assert st == 200, r
    return r["tokens"]


def delta(before, after, key):
    return after.get(key, 0) - before.get(key, 0)


def body(a, start):
    A = start("A", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted", "-c", "4096"])
    st, info = A.json("GET", "/v1/kv/info")
    bb = int(info["block_bytes"])
    ep_a = info["source_control_endpoint"]
    check(st == 200 and info.get("kv_path") == "position_range" and (info.get("store_memory") or "").split(" (")[0] in ("host", "pinned host"),
          "/v1/kv/info names the path", "%s, %s" % (info.get("kv_path"), info.get("store_memory")))

    # 2. a conversation of 30 turns on one slot
    prompt = tokenize(A, "Here is a conversation about call signs.")
    before = metrics(A)
    exported_per_turn = []
    for turn in range(30):
        prompt = prompt + tokenize(A, " User: " + text(6, 100 + turn)[len("Here is a list of call signs to remember: "):] +
                                   " Assistant:")
        m0 = metrics(A)
        r = complete(A, prompt, {"n_predict": 4, "n_probs": 0, "return_tokens": True})
        exported_per_turn.append(delta(m0, metrics(A), "llamacpp_kv_export_bytes_total"))
        n_prompt = r["tokens_evaluated"]
        check(n_prompt == len(prompt), "turn %d: the server took the prompt as sent" % turn, "%d of %d" % (n_prompt, len(prompt)))
        prompt = prompt + r["tokens"]
    after = metrics(A)
    full = n_prompt // BT  # the last prompt's full blocks (its answer is in no prompt)
    moved = delta(before, after, "llamacpp_kv_export_bytes_total")
    check(moved == full * bb, "30 turns exported exactly the final prompt's %d full blocks" % full,
          "%d bytes, %d blocks of %d bytes" % (moved, moved // bb, bb))
    check(delta(before, after, "llamacpp_kv_exported_blocks_total") == full, "no block was exported twice",
          "%d blocks" % delta(before, after, "llamacpp_kv_exported_blocks_total"))
    check(max(exported_per_turn) <= 4 * bb, "no turn exported more than its own new blocks",
          "largest turn: %d blocks" % (max(exported_per_turn) // bb))

    # 3. B holds 60 blocks of P; P1 adds one block; B fetches it, and only it enters the slot
    # (A's context per sequence: the identity binds it)
    B = start("B", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_a, "-c", "4096"])
    C = start("C", ["-c", "4096"])
    words = tokenize(A, " " + " ".join(text(900, 7).split()[8:]))
    P = words[:60 * BT + 5]
    P1 = words[:61 * BT + 5]
    check(len(P1) == 61 * BT + 5, "the prompts are long enough", "%d tokens" % len(words))
    complete(B, P)
    complete(A, P1)
    look = A.json("POST", "/v1/kv/lookup", {"prompt": P1})[1]
    held_b = B.json("POST", "/v1/kv/lookup", {"prompt": P1})[1].get("blocks_held")
    check(look.get("blocks_held") == 61 and held_b == 60, "A holds P1's 61 blocks, B P's 60",
          "A %s, B %s" % (look.get("blocks_held"), held_b))
    want = complete(C, P1, {"cache_prompt": False})
    before = metrics(B)
    r = complete(B, P1, {"kv_hints": envelope(ep_a, look["block_hashes"], "range-1")})
    after = metrics(B)
    check(delta(before, after, "llamacpp_kv_fetched_blocks_total") == 1, "B fetched the one block it lacked",
          "%d blocks" % delta(before, after, "llamacpp_kv_fetched_blocks_total"))
    imported = delta(before, after, "llamacpp_kv_import_bytes_total")
    check(imported == bb, "the import moved exactly one block into the slot",
          "%d bytes (%d blocks)" % (imported, imported // bb))
    check(r["timings"]["prompt_n"] == len(P1) - 61 * BT, "B prefilled only the tokens after the 61 blocks",
          "prompt_n %s" % r["timings"]["prompt_n"])
    check(answer(r) == answer(want), "B's greedy text and top-5 probabilities equal the cold server's", repr(r["content"]))

    # 4. a server whose KV type differs (F32) is hinted at A's F16 blocks: its identity differs, so
    #    A's names are not its prompt's and nothing is fetched or written (counted nothing_to_fetch,
    #    declined); it answers as a cold server of its own settings
    F = start("F", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_a, "-ctk", "f32", "-ctv", "f32"])
    CF = start("CF", ["-ctk", "f32", "-ctv", "f32"])
    info_f = F.json("GET", "/v1/kv/info")[1]
    check(info_f["naming_seed"] != info["naming_seed"] and int(info_f["block_bytes"]) == 2 * bb,
          "F (F32 KV) names blocks under another seed, and its blocks are twice the size")
    want = complete(CF, P1, {"cache_prompt": False})
    before = metrics(F)
    r = complete(F, P1, {"kv_hints": envelope(ep_a, look["block_hashes"], "range-2")})
    after = metrics(F)
    check(delta(before, after, 'llamacpp_kv_fetch_total{outcome="nothing_to_fetch"}') == 1
          and delta(before, after, "llamacpp_kv_fetched_blocks_total") == 0
          and delta(before, after, "llamacpp_kv_import_bytes_total") == 0,
          "F fetched and imported nothing of A's, counted nothing_to_fetch")
    check(answer(r) == answer(want), "F's answer equals its own cold server's", repr(r["content"]))


def main():
    # --flash-attn off|on and --server-args "..." (a CUDA build: -ngl 99), taken before run_test's own
    opts = {"--flash-attn": "off", "--server-args": ""}
    for k in opts:
        if k in sys.argv:
            i = sys.argv.index(k)
            opts[k] = sys.argv[i + 1]
            del sys.argv[i:i + 2]
    exact = ["-fa", opts["--flash-attn"], "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT)] + \
        opts["--server-args"].split()
    return run_test("kvrelay-llama-range-", body, exact)


if __name__ == "__main__":
    sys.exit(main())
