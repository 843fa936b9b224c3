#!/usr/bin/env python3
"""A block name that collides never brings another prompt's KV into a slot: on one server, and
across two.

    python3 integrations/llama.cpp/tests/collision_test.py --server target/llama-server/bin/llama-server-kvrelay \
        --model MODEL.gguf [--threads 1] [--log-dir DIR]

Needs the test build (build.sh with KVRELAY_TEST_HOOKS=1, as the test command makes it): run with
KVRELAY_LLAMA_TEST_NAME_COLLISIONS=1, its block names ignore the tokens, so two prompts of one
length share every name, as a crafted collision would; content digests still come from the
tokens. Standard library only. Servers (the bit-exact settings of two_instance_test.py, names
forced to collide): A serves its blocks and trusts hints; B trusts hints and fetches from A; C is
the cold reference. P and Q are two prompts of the same length and different tokens. Checks:
  1. the hook is on: A names P and Q alike (else the server is not the test build: failed);
  2. A holds P's blocks; /v1/kv/lookup says it holds none of Q's (the names, not the content);
  3. one server: A answers Q as C does; its slot imported nothing of P (a name collision counted
     in llamacpp_kv_store_name_collisions_total), and A keeps P's blocks, not Q's, under the names;
  4. across two: B, hinted to fetch Q's blocks from A, is sent P's under Q's names: nothing is
     written (counted name_collision, and digest_mismatch by the agent), B answers Q as C does;
  5. B hinted to fetch P's blocks from A gets them (the names collide, the contents are equal)
     and answers P as C does;
and nothing stays pinned on A or B. Exit status 0 when every check passed.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import check, run_test  # noqa: E402
from two_instance_test import BT, answer, complete, envelope, fetch_outcomes, metrics, text  # noqa: E402

HOOK = {"KVRELAY_LLAMA_TEST_NAME_COLLISIONS": "1"}


def body(a, start):
    A = start("A", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted"], HOOK)
    ep_a = A.json("GET", "/v1/kv/info")[1]["source_control_endpoint"]
    B = start("B", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_a], HOOK)
    C = start("C", [])

    def tokens(prompt):
        st, r = C.json("POST", "/tokenize", {"content": prompt, "add_special": True})
        assert st == 200, r
        return r["tokens"]

    # two prompts of one length (token ids), different from their first block on
    p, q = tokens(text(160, 11)), tokens(text(160, 12))
    n = min(len(p), len(q))
    P, Q = p[:n], q[:n]
    check(n >= 4 * BT and P[BT:2 * BT] != Q[BT:2 * BT], "P and Q: one length, other tokens", "%d tokens" % n)

    def cold(prompt):
        return complete(C, prompt, {"cache_prompt": False})

    def lookup(srv, prompt):
        st, r = srv.json("POST", "/v1/kv/lookup", {"prompt": prompt})
        assert st == 200, r
        return r

    # 1. the hook
    look_p, look_q = lookup(A, P), lookup(A, Q)
    check(look_p["block_hashes"] == look_q["block_hashes"] and len(look_p["block_hashes"]) >= 4,
          "the test build's forced collisions are on: P's and Q's blocks share every name",
          "%d names" % len(look_p["block_hashes"]))

    # 2. A holds P's blocks, none of Q's
    want_p, want_q = cold(P), cold(Q)
    complete(A, P)
    total = look_p["blocks_total"]
    check(lookup(A, P)["blocks_held"] == total, "A holds P's blocks", "%d blocks" % total)
    check(lookup(A, Q)["blocks_held"] == 0, "A holds none of Q's blocks under the same names")

    # 3. one server: Q on A imports nothing of P
    before = metrics(A)
    r = complete(A, Q)
    after = metrics(A)
    collisions = after.get("llamacpp_kv_store_name_collisions_total", 0) - \
        before.get("llamacpp_kv_store_name_collisions_total", 0)
    imported = after.get("llamacpp_kv_imported_tokens_total", 0) - before.get("llamacpp_kv_imported_tokens_total", 0)
    check(collisions >= 1 and imported == 0, "A's slot imported nothing of P for Q (a name collision, counted)",
          "%d collisions, %d tokens imported" % (collisions, imported))
    check(r["timings"]["prompt_n"] == n, "A prefilled all of Q", "prompt_n %s" % r["timings"]["prompt_n"])
    check(answer(r) == answer(want_q), "A answers Q as the cold server", repr(r["content"]))
    check(lookup(A, P)["blocks_held"] == total and lookup(A, Q)["blocks_held"] == 0,
          "A keeps P's blocks under the names; Q's were not stored over them")

    # 4. across two: B is sent P's blocks for Q's names, and writes none of them
    before = metrics(B)
    r = complete(B, Q, {"kv_hints": envelope(ep_a, look_q["block_hashes"], "collide-1")})
    after = metrics(B)
    outcomes = fetch_outcomes(before, after)
    fetched = after.get("llamacpp_kv_fetched_blocks_total", 0) - before.get("llamacpp_kv_fetched_blocks_total", 0)
    mismatch = after.get('kvrelay_kv_agent_fetches_total{outcome="failed",reason="digest_mismatch"}', 0) - \
        before.get('kvrelay_kv_agent_fetches_total{outcome="failed",reason="digest_mismatch"}', 0)
    check(outcomes == {'llamacpp_kv_fetch_total{outcome="name_collision"}': 1} and fetched == 0 and mismatch == 1,
          "B's fetch of Q's names from A took no block (name_collision; the agent's digest_mismatch)",
          "%s, %d blocks, %d mismatches" % (outcomes, fetched, mismatch))
    check(r["timings"]["prompt_n"] == n, "B prefilled all of Q", "prompt_n %s" % r["timings"]["prompt_n"])
    check(answer(r) == answer(want_q), "B answers Q as the cold server", repr(r["content"]))

    # 5. the same names for P's own tokens: fetched, and exact
    before = metrics(B)
    r = complete(B, P, {"kv_hints": envelope(ep_a, look_p["block_hashes"], "collide-2")})
    after = metrics(B)
    outcomes = fetch_outcomes(before, after)
    fetched = after.get("llamacpp_kv_fetched_blocks_total", 0) - before.get("llamacpp_kv_fetched_blocks_total", 0)
    check(outcomes == {'llamacpp_kv_fetch_total{outcome="fetched"}': 1} and fetched == (n - 1) // BT,
          "B fetched P's blocks from A (equal contents under the colliding names)",
          "%s, %d blocks" % (outcomes, fetched))
    check(answer(r) == answer(want_p), "B answers P as the cold server", repr(r["content"]))

    for name, s in (("A", A), ("B", B)):
        pinned = metrics(s).get("llamacpp_kv_store_pinned_blocks", -1)
        check(pinned == 0, "nothing pinned on %s" % name, "%d pinned" % pinned)


def main():
    exact = ["-fa", "off", "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT)]
    return run_test("kvrelay-llama-collision-", body, exact)


if __name__ == "__main__":
    sys.exit(main())
