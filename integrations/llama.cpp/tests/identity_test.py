#!/usr/bin/env python3
"""Servers that differ in one setting that changes KV never exchange a block; identical ones do.

    python3 integrations/llama.cpp/tests/identity_test.py --server target/llama-server/bin/llama-server-kvrelay \
        --model MODEL.gguf [--threads 1] [--log-dir DIR]

Standard library only (the fixtures: identity_fixtures.py). A serves its blocks and trusts
hints; every other server trusts hints, fetches always and may fetch from A (or, for the LoRA
scale, from L1). Each variant is A's settings with exactly one change: a control vector, the
RoPE base, the RoPE scale, an --override-kv, a LoRA scale (L1 at 1.0 against L2 at 0.5),
another GGUF of the same file name and size, the context per sequence (-c, and
-np), --no-kv-offload and a tensor placement override (-ot). Checks:
  1. A names its model by content: the SHA-256 of the file (hashlib's), cached in
     KVRELAY_CACHE_DIR, where a restart finds it;
  2. B, with A's settings, has A's seed and fetches A's blocks (the control case);
  3. each variant has another seed, and its hinted fetch from A (its own names, as a router that
     indexed it would send) is refused as a fingerprint mismatch: no block moves;
  4. --kv-model-id names the model by the operator's word: the twin GGUF under A's id has A's
     seed (which is why the flag is the operator's promise, not a check);
  5. a LongRoPE model (a tiny random phi3 whose long and short RoPE factors differ, written by
     tiny_gguf.py): cold servers at -c 2048 (long factors) and -c 512 (short) answer differently,
     so their K differs for the same tokens; a -c 2048 server fetches LA's (-c 2048) blocks and
     answers as the cold -c 2048 server; a -c 512 server has another seed, is refused
     (fingerprint mismatch) and answers as the cold -c 512 server.
Exit status 0 when every check passed.
"""
import hashlib
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from identity_fixtures import write_control_vector, write_lora, write_twin_model  # noqa: E402
from tiny_gguf import write_phi3_longrope  # noqa: E402
from smoke_test import check, run_test  # noqa: E402
from two_instance_test import BT, answer, complete, hinted, text  # noqa: E402


def body(a, start, fixtures, cache):
    env = {"KVRELAY_CACHE_DIR": cache}

    def start_env(name, args, model=None):
        return start(name, args, env, model)

    def info(srv):
        st, r = srv.json("GET", "/v1/kv/info")
        assert st == 200, r
        return r

    cvec = os.path.join(fixtures, "steer.gguf")
    write_control_vector(a.model, cvec)
    lora = os.path.join(fixtures, "adapter.gguf")
    write_lora(a.model, lora)
    twin = write_twin_model(a.model, os.path.join(fixtures, "twin"))
    check(os.path.basename(twin) == os.path.basename(a.model) and os.path.getsize(twin) == os.path.getsize(a.model),
          "the twin GGUF has the model's file name and size", twin)

    A = start_env("A", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted"])
    info_a = info(A)
    ep_a, seed_a = info_a["source_control_endpoint"], info_a["naming_seed"]
    P = text(120, 21)
    complete(A, P)

    # 1. the model by content, cached
    with open(a.model, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    entries = []
    for root, _, files in os.walk(cache):
        for n in files:
            with open(os.path.join(root, n)) as f:
                entries.append(f.read().split("\n", 1)[0])
    check(want in entries, "A's model is named by the SHA-256 of its file, kept in the cache directory",
          "%d cached digest(s)" % len(entries))

    def fetch_from(srv, ep, mid):
        # a hint with the fetching server's own names (what a router that indexed it sends)
        st, look = srv.json("POST", "/v1/kv/lookup", {"prompt": P})
        assert st == 200, look
        _, outcomes, got = hinted(srv, P, ep, look["block_hashes"], mid)
        return outcomes, got

    # 2. the control case
    fetching = ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_a]
    B = start_env("B", fetching)
    check(info(B)["naming_seed"] == seed_a, "B (A's settings) has A's seed")
    outcomes, got = fetch_from(B, ep_a, "id-b")
    check(outcomes == {'llamacpp_kv_fetch_total{outcome="fetched"}': 1} and got > 0,
          "B fetched A's blocks", "%s, %d blocks" % (outcomes, got))
    B.stop()

    # 3. one setting changed at a time
    refused = {'llamacpp_kv_fetch_total{outcome="fingerprint_mismatch"}': 1}
    variants = [
        ("a control vector", ["--control-vector-scaled", cvec + ":0.8"], None),
        ("the RoPE base", ["--rope-freq-base", "20000"], None),
        ("the RoPE scale", ["--rope-freq-scale", "0.5"], None),
        ("an --override-kv", ["--override-kv", "llama.attention.layer_norm_rms_epsilon=float:0.0001"], None),
        ("another GGUF of the same name and size", [], twin),
        # the context per sequence (LongRoPE models pick their RoPE factors by it), from -c
        # and from -np
        ("the context per sequence (-c)", ["-c", "4096"], None),
        ("the context per sequence (-np)", ["-np", "2"], None),
        ("--no-kv-offload", ["--no-kv-offload"], None),
        ("a tensor placement override (-ot)", ["-ot", "ffn_.*=CPU"], None),
    ]
    for i, (what, args, model) in enumerate(variants):
        V = start_env("V%d" % i, fetching + args, model)
        seed_v = info(V)["naming_seed"]
        outcomes, got = fetch_from(V, ep_a, "id-v%d" % i)
        check(seed_v != seed_a and outcomes == refused and got == 0,
              "%s: another seed, and A's blocks are refused (fingerprint mismatch)" % what,
              "seed %s, %s, %d blocks" % (seed_v, outcomes, got))
        V.stop()
    L1 = start_env("L1", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted", "--lora-scaled", lora + ":1.0"])
    info_l1 = info(L1)
    L2 = start_env("L2", ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint",
                      info_l1["source_control_endpoint"], "--lora-scaled", lora + ":0.5"])
    seed_l2 = info(L2)["naming_seed"]
    outcomes, got = fetch_from(L2, info_l1["source_control_endpoint"], "id-l2")
    check(seed_l2 not in (seed_a, info_l1["naming_seed"]) and info_l1["naming_seed"] != seed_a
          and outcomes == refused and got == 0,
          "a LoRA scale: another seed, and the other scale's server is refused (fingerprint mismatch)",
          "%s, %d blocks" % (outcomes, got))
    L2.stop()
    L1.stop()

    # 4. the operator's word
    W1 = start_env("W1", ["--kv-model-id", "vouched-model-1"])
    W2 = start_env("W2", ["--kv-model-id", "vouched-model-1"], twin)
    check(info(W1)["naming_seed"] == info(W2)["naming_seed"] != seed_a,
          "--kv-model-id: the operator's id names the model, whatever the file holds")
    W2.stop()
    W1.stop()

    # 5. LongRoPE: the context per sequence picks the RoPE factors, so it changes K
    phi3 = os.path.join(fixtures, "longrope.gguf")
    write_phi3_longrope(phi3, n_ctx_train=4096, n_ctx_orig=512)
    Q = text(12, 31)  # short: this vocabulary makes each byte a token
    LA = start_env("LA", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted"], phi3)  # -c 2048: long factors
    info_la = info(LA)
    ep_la = info_la["source_control_endpoint"]
    complete(LA, Q)
    cold_long = start_env("LC-2048", [], phi3)
    cold_short = start_env("LC-512", ["-c", "512"], phi3)
    want_long = complete(cold_long, Q, {"cache_prompt": False})
    want_short = complete(cold_short, Q, {"cache_prompt": False})
    check(answer(want_long) != answer(want_short),
          "LongRoPE: cold servers at -c 2048 and -c 512 answer differently (long and short factors, other K)")
    fetching_la = ["--kv-hints-trusted", "--kv-fetch", "always", "--kv-trusted-endpoint", ep_la]
    for name, args, want, same in (("LB", [], want_long, True), ("LS", ["-c", "512"], want_short, False)):
        srv = start_env(name, fetching_la + args, phi3)
        seed = info(srv)["naming_seed"]
        st, look = srv.json("POST", "/v1/kv/lookup", {"prompt": Q})
        assert st == 200, look
        r, outcomes, got = hinted(srv, Q, ep_la, look["block_hashes"], "id-" + name)
        if same:
            ok = seed == info_la["naming_seed"] and got == (look["n_tokens"] - 1) // BT > 0
            what = "LongRoPE, equal -c: LA's seed, LA's blocks fetched"
        else:
            ok = seed != info_la["naming_seed"] and outcomes == refused and got == 0
            what = "LongRoPE, -c 512 against LA's -c 2048: another seed, refused (fingerprint mismatch)"
        check(ok and answer(r) == answer(want), what + ", and the answer is the cold server's of its -c",
              "seed %s, %s, %d blocks" % (seed, outcomes, got))
        srv.stop()


def main():
    exact = ["-fa", "off", "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT)]
    fixtures = tempfile.mkdtemp(prefix="kvrelay-identity-fixtures-")
    try:
        return run_test("kvrelay-llama-identity-",
                        lambda a, start: body(a, start, fixtures, os.path.join(a.log_dir, "cache")), exact)
    finally:
        shutil.rmtree(fixtures, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
