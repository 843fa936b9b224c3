#!/usr/bin/env python3
"""The official `openai` Python client, unmodified, against kvrelay llama-servers: a chat
completion whose hint (sent with `extra_body`, as OpenAI clients send unknown members) names
another instance's KV fetches it, streamed and not, and answers exactly as a cold server.

    PYTHONPATH=<a folder with openai> python3 integrations/llama.cpp/tests/openai_client_test.py \\
        --server target/llama-server/bin/llama-server-kvrelay --model MODEL.gguf [--threads 1]

Servers as in two_instance_test.py (A serves, B trusts hints from A with --kv-fetch always, C is
cold). The hint's block names come from A's /v1/kv/lookup on the same `messages`, which it
renders through the chat template as /v1/chat/completions does. Exit status 0 when every check
passed.
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import Server, check, failures  # noqa: E402
from two_instance_test import BT, envelope, metrics, text  # noqa: E402

import openai  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-dir")
    a = ap.parse_args()
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvrelay-llama-openai-")
    os.makedirs(log_dir, exist_ok=True)
    print("logs in", log_dir, "openai", openai.__version__)
    exact = ["-fa", "off", "-ub", str(BT), "--cache-ram", "0", "--kv-block-tokens", str(BT)]
    servers = []

    def start(name, args):
        s = Server(a.server, a.model, exact + args, os.path.join(log_dir, name + ".log"), threads=a.threads)
        servers.append(s)
        return s

    try:
        A = start("A", ["--kv-listen", "127.0.0.1:0", "--kv-hints-trusted"])  # trusted: lookup answers blocks_held
        ep = A.json("GET", "/v1/kv/info")[1]["source_control_endpoint"]
        B = start("B", ["--kv-hints-trusted", "--kv-trusted-endpoint", ep, "--kv-fetch", "always"])
        C = start("C", [])
        client = {s: openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=300)
                  for s in (A, B, C)}

        def chat(srv, messages, extra=None, stream=False):
            kw = dict(model="local", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5,
                      extra_body=extra or {})
            if not stream:
                r = client[srv].chat.completions.create(**kw)
                c = r.choices[0]
                return c.message.content, [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                                           for t in c.logprobs.content]
            parts, probs = [], []
            for chunk in client[srv].chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    parts.append(c.delta.content or "")
                    if c.logprobs and c.logprobs.content:
                        probs += [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                                  for t in c.logprobs.content]
            return "".join(parts), probs

        for i, stream in enumerate((False, True)):
            what = "streamed" if stream else "not streamed"
            messages = [{"role": "system", "content": "You repeat call signs."},
                        {"role": "user", "content": text(140, 40 + i)}]
            chat(A, messages)
            look = A.json("POST", "/v1/kv/lookup", {"messages": messages})[1]
            check(look["blocks_held"] == look["blocks_total"] >= 4, "A holds the conversation's blocks (%s)" % what,
                  "%d blocks" % look["blocks_held"])
            want = chat(C, messages, {"cache_prompt": False}, stream)
            f0 = metrics(B).get("llamacpp_kv_fetched_blocks_total", 0)
            got = chat(B, messages, {"kv_hints": envelope(ep, look["block_hashes"], "openai-%d" % i)}, stream)
            n = metrics(B).get("llamacpp_kv_fetched_blocks_total", 0) - f0
            fetchable = (look["n_tokens"] - 1) // BT
            check(n == fetchable, "openai client, %s: B fetched A's blocks" % what, "%d of %d" % (n, fetchable))
            check(got == want and len(got[1]) > 0,
                  "openai client, %s: B's text and top-5 logprobs equal the cold server's" % what, repr(got[0]))
    finally:
        for s in servers:
            s.stop()
    if failures:
        print("%d check(s) failed: %s (logs in %s)" % (len(failures), ", ".join(failures), log_dir))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
