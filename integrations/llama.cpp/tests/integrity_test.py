#!/usr/bin/env python3
"""What a kvrelay llama-server tells and takes, and what it keeps pinned, at its edges.

    python3 integrations/llama.cpp/tests/integrity_test.py --server target/llama-server/bin/llama-server-kvrelay \
        --model MODEL.gguf [--threads 1] [--log-dir DIR]

Standard library only. Servers (the bit-exact settings of two_instance_test.py): A serves its
blocks with a pre-shared key (--kv-key-file) and trusts hints; U serves without trusting hints
and without a key file (the per-user key); B trusts hints, holds A's key and fetches from A; N
is B without the key file (its per-user key is not A's key); D fetches from U with no key
setting at all; O is D as another user's process would be (another per-user key:
KVRELAY_KEY_FILE names another file); C is the cold reference. Checks:
  1. /v1/kv/lookup on U (hints untrusted) answers nothing about membership: the same fields
     for a prompt U holds and for one it never saw, no blocks_held; A (trusted) answers it;
  2. the KV port's key: B (with the key) fetches A's blocks and answers as C; N (without it) is
     refused, counted by reason, fetches nothing and answers as C; /v1/kv/info says a key is
     required;
  2b. the per-user key: D (no setting, the same user) fetches U's blocks and answers as C; O
     (another user's key) is refused (auth_failed), fetches nothing and answers as C; a key
     file others may read is refused at start (the KV path stays off);
  3. a hinted prompt longer than B's context is not fetched for (counted prompt_too_long: the
     slot refuses it), and nothing stays pinned after its error; an empty hinted prompt leaves
     nothing pinned either;
and no block stays pinned on B or N after their requests. Exit status 0 when every check passed.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import check, run_test  # noqa: E402
from two_instance_test import BT, answer, complete, envelope, fetch_outcomes, hinted, metrics, text  # noqa: E402


def body(a, start):
    key_file = os.path.join(a.log_dir, "kv.key")
    with open(key_file, "w") as f:
        f.write("integrity-test-pre-shared-key-0123456789\n")
    os.chmod(key_file, 0o600)
    A = start("A", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted", "--kv-key-file", key_file])
    st, info_a = A.json("GET", "/v1/kv/info")
    ep_a = info_a["source_control_endpoint"]
    check(st == 200 and info_a.get("kv_key_required") is True, "A's /v1/kv/info says its KV port needs a key")
    U = start("U", ["--kv-listen", "127.0.0.1:0"])
    B = start("B", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_a,
                    "--kv-key-file", key_file])
    N = start("N", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_a])
    C = start("C", [])

    def cold(prompt):
        return complete(C, prompt, {"cache_prompt": False})

    # 1. no membership oracle where hints are not trusted
    P = text(150, 51)
    complete(U, P)
    st1, seen = U.json("POST", "/v1/kv/lookup", {"prompt": P})
    st2, unseen = U.json("POST", "/v1/kv/lookup", {"prompt": text(150, 52)})
    check(st1 == st2 == 200 and "blocks_held" not in seen and sorted(seen) == sorted(unseen),
          "untrusted /v1/kv/lookup: a prompt held and one never seen answer the same fields, no blocks_held",
          ", ".join(sorted(seen)))
    complete(A, P)
    look = A.json("POST", "/v1/kv/lookup", {"prompt": P})[1]
    check(look.get("blocks_held") == look["blocks_total"] > 0, "trusted /v1/kv/lookup answers blocks_held",
          "%s of %d" % (look.get("blocks_held"), look["blocks_total"]))

    # 2. the key: B has it, N has not
    want = cold(P)
    hint = {"kv_hints": envelope(ep_a, look["block_hashes"], "integrity-2")}
    before = metrics(B)
    r = complete(B, P, hint)
    after = metrics(B)
    got = after.get("llamacpp_kv_fetched_blocks_total", 0) - before.get("llamacpp_kv_fetched_blocks_total", 0)
    check(got == (look["n_tokens"] - 1) // BT and answer(r) == answer(want),
          "with the key: B fetched A's blocks and answers as the cold server", "%d blocks" % got)
    before = metrics(N)
    r = complete(N, P, dict(hint, kv_hints=envelope(ep_a, look["block_hashes"], "integrity-3")))
    after = metrics(N)
    outcomes = fetch_outcomes(before, after)
    check(after.get("llamacpp_kv_fetched_blocks_total", 0) == before.get("llamacpp_kv_fetched_blocks_total", 0)
          and len(outcomes) == 1 and "fetched" not in list(outcomes)[0] and "partial" not in list(outcomes)[0],
          "without the key: N's fetch is refused, counted by reason", str(outcomes))
    check(answer(r) == answer(want), "without the key: N answers as the cold server")

    # 2b. the per-user key: no setting between servers of one user; another user's key gets nothing
    st, info_u = U.json("GET", "/v1/kv/info")
    check(info_u.get("kv_key") == "per-user" and info_u.get("kv_key_required") is True and info_a.get("kv_key") == "file",
          "/v1/kv/info names the key: U the per-user key, A its key file", "%s, %s" % (info_u.get("kv_key"), info_a.get("kv_key")))
    ep_u = info_u["source_control_endpoint"]
    look_u = U.json("POST", "/v1/kv/lookup", {"prompt": P})[1]
    other = os.path.join(a.log_dir, "other-user", "agent.key")
    D = start("D", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_u])
    O = start("O", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_u],
              {"KVRELAY_KEY_FILE": other})
    check(os.path.exists(other) and (os.stat(other).st_mode & 0o777) == 0o600,
          "O made its per-user key on first use, mode 600", other)
    for name, srv, want_fetched in (("D", D, True), ("O", O, False)):
        r, outcomes, got = hinted(srv, P, ep_u, look_u["block_hashes"], "integrity-pu-" + name)
        if want_fetched:
            ok = got == (look_u["n_tokens"] - 1) // BT
            what = "D (no key setting, U's user) fetched U's blocks over the per-user key"
        else:
            ok = got == 0 and list(outcomes) == ['llamacpp_kv_fetch_total{outcome="auth_failed"}']
            what = "O (another user's key) is refused (auth_failed) and fetches nothing"
        check(ok and answer(r) == answer(want), what + ", and answers as the cold server", "%s, %d blocks" % (outcomes, got))
    O.stop()
    D.stop()
    loose = os.path.join(a.log_dir, "loose.key")
    with open(loose, "w") as f:
        f.write("a-key-file-everyone-may-read-0123456789\n")
    os.chmod(loose, 0o644)
    X = start("X", ["--kv-listen", "127.0.0.1:0", "--kv-key-file", loose])
    info_x = X.json("GET", "/v1/kv/info")[1]
    check(info_x.get("kv_path") == "off" and not info_x.get("source_control_endpoint"),
          "a key file others may read is refused: the KV path stays off", "%s" % info_x.get("kv_path"))
    X.stop()

    # 3. a prompt longer than the context is not fetched for; nothing stays pinned after its
    # error, nor after an empty hinted prompt
    P2 = text(150, 53)
    complete(A, P2)
    look2 = A.json("POST", "/v1/kv/lookup", {"prompt": P2})[1]
    long_prompt = P2 + " " + text(2300, 54)
    before = metrics(B)
    st, err = B.json("POST", "/completion", {"prompt": long_prompt, "n_predict": 4,
                                             "kv_hints": envelope(ep_a, look2["block_hashes"], "integrity-4")})
    after = metrics(B)
    check(st == 400 and fetch_outcomes(before, after) == {'llamacpp_kv_fetch_total{outcome="prompt_too_long"}': 1.0}
          and after.get("llamacpp_kv_fetched_blocks_total") == before.get("llamacpp_kv_fetched_blocks_total"),
          "a hinted prompt longer than the context: refused, nothing fetched (prompt_too_long)",
          "%s %s" % (st, fetch_outcomes(before, after)))
    check(after.get("llamacpp_kv_store_pinned_blocks") == 0, "nothing pinned after the over-long prompt's error")
    st, _ = B.json("POST", "/completion", {"prompt": "", "n_predict": 4,
                                           "kv_hints": envelope(ep_a, look2["block_hashes"], "integrity-5")})
    check(metrics(B).get("llamacpp_kv_store_pinned_blocks") == 0, "nothing pinned after an empty hinted prompt",
          "status %s" % st)
    r = complete(B, P2, {"kv_hints": envelope(ep_a, look2["block_hashes"], "integrity-6")})
    check(answer(r) == answer(cold(P2)), "P2 with its hint afterwards: B answers as the cold server")
    for name, srv in (("B", B), ("N", N)):
        check(metrics(srv).get("llamacpp_kv_store_pinned_blocks") == 0, "%s holds no block pinned" % name)


def main():
    exact = ["-fa", "off", "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT)]
    return run_test("kvrelay-llama-integrity-", body, exact)


if __name__ == "__main__":
    sys.exit(main())
