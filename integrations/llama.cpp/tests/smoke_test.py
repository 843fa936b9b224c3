#!/usr/bin/env python3
"""Smoke test of the kvrelay llama-server (phase 1), standard library only.

    python3 integrations/llama.cpp/tests/smoke_test.py --server target/llama-server/bin/llama-server-kvrelay \
        --model MODEL.gguf [--unpatched target/llama-server/bin/llama-server-unpatched] [--threads 1]

Starts the server on 127.0.0.1 (a free port) three times: untrusted (the default), with
--kv-hints-trusted, and with LLAMA_ARG_KV_HINTS_TRUSTED=1 and --kv-block-tokens 16, and checks hint
admission as /metrics counts it, the 400 for two hint spellings and for a misaligned hint list,
/v1/kv/info and /v1/kv/lookup; with --unpatched, that the unpatched server answers the same chat
request and has no /v1/kv routes. Each request generates at most 4 tokens. Exit status 0 when
every check passed; server logs are left in --log-dir (default: a temporary folder).
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ENVELOPE = {
    "protocol_version": "0.1",
    "message_id": "smoke-1",
    "actions": [{
        "action_id": "a1",
        "action_type": "kv.fetch",
        "action_version": "1.0",
        "payload": {"source_control_endpoint": "tcp://127.0.0.1:1", "block_hashes": [11, 22]},
    }],
}
MALFORMED = {"protocol_version": "0.1", "message_id": 7, "actions": []}  # message_id must be a string
MESSAGES = [{"role": "user", "content": "Say hello to the block naming smoke test, please."}]

failures = []


def check(cond, what, detail=""):
    print("%s %s%s" % ("PASS" if cond else "FAIL", what, (": " + detail) if detail else ""), flush=True)
    if not cond:
        failures.append(what)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary, model, args, log_path, env=None, threads=1):
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.log_path = log_path
        cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-c", "2048", "-np", "1",
               "-t", str(threads), "-tb", str(threads), "--metrics", "-n", "4"] + args
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})))
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited with %s; log: %s" % (self.proc.returncode, log_path))
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become healthy; log: " + log_path)

    def request(self, method, path, body=None):
        # a str body goes as it is (the client's own bytes), anything else as JSON
        data = None if body is None else body.encode() if isinstance(body, str) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def json(self, method, path, body=None):
        status, text = self.request(method, path, body)
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def metrics(self):
        status, text = self.request("GET", "/metrics")
        assert status == 200, text
        out = {}
        for line in text.splitlines():
            m = re.match(r'^(llamacpp_kv_hints_\w+(?:\{[^}]*\})?) (\S+)$', line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out, text

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_test(prefix, body, settings=(), extra_options=None):
    """The frame the integration's two-server tests share: parses --server, --model, --threads and
    --log-dir (and what `extra_options(parser)` adds), makes the log folder, and calls
    `body(a, start)` where `start(name, args, env=None, model=None)` starts a server with
    `settings` before `args` and records it; every server is stopped however the body ends.
    Returns the exit status: 0 when every check passed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-dir")
    if extra_options:
        extra_options(ap)
    a = ap.parse_args()
    log_dir = a.log_dir or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(log_dir, exist_ok=True)
    a.log_dir = log_dir
    print("logs in", log_dir)
    servers = []

    def start(name, args, env=None, model=None):
        s = Server(a.server, model or a.model, list(settings) + list(args), os.path.join(log_dir, name + ".log"),
                   env=env, threads=a.threads)
        servers.append(s)
        return s

    try:
        body(a, start)
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


def chat(srv, extra):
    return srv.json("POST", "/v1/chat/completions", dict({"messages": MESSAGES, "max_tokens": 4}, **extra))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--unpatched")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-dir")
    a = ap.parse_args()
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvrelay-llama-smoke-")
    os.makedirs(log_dir, exist_ok=True)
    print("logs in", log_dir)
    ignored = 'llamacpp_kv_hints_ignored_total{reason="%s"}'

    # 1. untrusted (the default)
    srv = Server(a.server, a.model, [], os.path.join(log_dir, "untrusted.log"), threads=a.threads)
    try:
        st, info = srv.json("GET", "/v1/kv/info")
        print("  /v1/kv/info:", json.dumps(info))
        check(st == 200 and info.get("block_tokens") == 32 and info.get("kv_hints_trusted") is False
              and re.fullmatch(r"[0-9a-f]{16}", info.get("naming_seed", "")) is not None
              and info.get("model") == os.path.basename(a.model),
              "GET /v1/kv/info (untrusted, 32-token blocks)")
        st, r = chat(srv, {"kv_hints": ENVELOPE})
        check(st == 200 and "choices" in r, "chat completion with kv_hints, untrusted",
              "status %d, system_fingerprint %s" % (st, r.get("system_fingerprint") if isinstance(r, dict) else None))
        m, text = srv.metrics()
        print("  /metrics (kvrelay part):\n    " + "\n    ".join(l for l in text.splitlines() if "kv_hints" in l))
        check("llamacpp:prompt_tokens_total" in text, "/metrics still carries llama-server's own metrics")
        check(m.get(ignored % "untrusted") == 1 and m.get("llamacpp_kv_hints_admitted_total") == 0,
              "untrusted hint counted as ignored{reason=untrusted}")
        st, r = chat(srv, {"kv_hints": ENVELOPE, "kv_transfer_params": {"kv_hint": ENVELOPE}})
        check(st == 400, "two hint spellings -> 400", "%d %s" % (st, json.dumps(r)[:200]))
        st, r = chat(srv, {"kv_hint": ENVELOPE, "router_hint": ENVELOPE})
        check(st == 400, "kv_hint + router_hint -> 400", "status %d" % st)
        st, r = chat(srv, {"kv_hints": None, "kv_hint": ENVELOPE})
        check(st == 200, "a null spelling counts as absent (kv_hints: null + kv_hint -> 200)", "status %d" % st)

        # block names
        st, lk = srv.json("POST", "/v1/kv/lookup", {"prompt": "hello " * 200})
        print("  /v1/kv/lookup:", json.dumps({k: lk[k] for k in lk if k != "token_ids"})[:400])
        check(st == 200 and lk["blocks_total"] == lk["n_tokens"] // 32 and len(lk["block_hashes"]) == lk["blocks_total"]
              and "blocks_held" not in lk and lk["blocks_total"] >= 2,
              "POST /v1/kv/lookup {prompt} (untrusted: no blocks_held, no membership answer)")
        ids = lk["token_ids"]
        st, lk2 = srv.json("POST", "/v1/kv/lookup", {"prompt": ids[:64]})
        check(st == 200 and lk2["block_hashes"] == lk["block_hashes"][:2], "names chain over the prefix (token-id prompt)")
        st, lk3 = srv.json("POST", "/v1/kv/lookup", {"prompt": "hello " * 200, "cache_salt": "tenant-a"})
        check(st == 200 and lk3["block_hashes"][0] != lk["block_hashes"][0], "cache_salt changes the names")
        st, lm = srv.json("POST", "/v1/kv/lookup", {"messages": MESSAGES})
        check(st == 200 and lm["blocks_total"] == lm["n_tokens"] // 32, "POST /v1/kv/lookup {messages}",
              "%d tokens, %d blocks" % (lm.get("n_tokens", -1), lm.get("blocks_total", -1)))
        # the same tokens as llama-server's own template and tokenizer routes give
        _, tpl = srv.json("POST", "/apply-template", {"messages": MESSAGES})
        _, tk = srv.json("POST", "/tokenize", {"content": tpl["prompt"], "add_special": True, "parse_special": True})
        check(tk.get("tokens") == lm.get("token_ids"), "lookup {messages} tokens == /apply-template + /tokenize")
        st, bad = srv.json("POST", "/v1/kv/lookup", {"prompt": "x", "messages": MESSAGES})
        check(st == 400, "lookup with prompt and messages -> 400", "status %d" % st)
        st, r = chat(srv, {})
        check(st == 200, "chat completion without a hint")
        untrusted_seed = info.get("naming_seed")
    finally:
        srv.stop()

    # 2. trusted by flag
    srv = Server(a.server, a.model, ["--kv-hints-trusted", "-lv", "5"], os.path.join(log_dir, "trusted.log"),
                 threads=a.threads)
    try:
        st, info = srv.json("GET", "/v1/kv/info")
        check(st == 200 and info.get("kv_hints_trusted") is True and info.get("naming_seed") == untrusted_seed,
              "GET /v1/kv/info (trusted, same seed)")
        st, r = chat(srv, {"kv_hints": ENVELOPE})
        check(st == 200, "chat completion with kv_hints, trusted")
        m, _ = srv.metrics()
        check(m.get("llamacpp_kv_hints_admitted_total") == 1, "trusted hint counted as admitted", str(m))
        st, r = chat(srv, {"kv_hints": MALFORMED})
        check(st == 200, "a malformed hint never fails the request", "status %d" % st)
        m, _ = srv.metrics()
        check(m.get(ignored % "malformed") == 1, "malformed hint counted as ignored{reason=malformed}")
        st, r = chat(srv, {"kv_hints": dict(ENVELOPE, protocol_version="9.9")})
        m, _ = srv.metrics()
        check(st == 200 and m.get(ignored % "unknown_version") == 1, "unknown version counted")
        st, r = chat(srv, {"kv_transfer_params": {"router_hint": ENVELOPE}})
        m, _ = srv.metrics()
        check(st == 200 and m.get("llamacpp_kv_hints_admitted_total") == 2, "kv_transfer_params.router_hint admitted")
        st, r = srv.json("POST", "/completion", {"prompt": ["one", "two"], "n_predict": 2, "kv_hints": [ENVELOPE, None]})
        m, _ = srv.metrics()
        check(st == 200 and m.get("llamacpp_kv_hints_admitted_total") == 3, "aligned kv_hints list on a 2-prompt /completion",
              "status %d" % st)
        st, r = srv.json("POST", "/v1/completions", {"prompt": ["one", "two"], "max_tokens": 2,
                                                     "kv_hints": [ENVELOPE, ENVELOPE, ENVELOPE]})
        check(st == 400, "misaligned kv_hints list -> 400", "status %d" % st)
        st, r = srv.json("POST", "/v1/completions", {"prompt": "three", "max_tokens": 2, "kv_hint": ENVELOPE})
        m, _ = srv.metrics()
        check(st == 200 and m.get("llamacpp_kv_hints_admitted_total") == 4, "kv_hint on /v1/completions admitted")
        # admission sees the client's own bytes (kvrelay_find_hint over the raw body), not the
        # server's parse: a duplicate member inside the hint, which a JSON parser would collapse
        # into one, is malformed; the same hint sent twice at the top level is a 400
        env = json.dumps(ENVELOPE)
        dup = env.replace('"message_id": "smoke-1"', '"message_id": "smoke-1", "message_id": "smoke-2"', 1)
        check(dup != env, "the duplicate-member body is built")
        before = m.get(ignored % "malformed", 0)
        st, r = srv.json("POST", "/v1/completions", '{"prompt": "four", "max_tokens": 2, "kv_hint": %s}' % dup)
        m, _ = srv.metrics()
        check(st == 200 and m.get(ignored % "malformed", 0) == before + 1 and m.get("llamacpp_kv_hints_admitted_total") == 4,
              "a duplicate member inside the hint is malformed (the raw bytes were admitted)", "status %d" % st)
        st, r = srv.json("POST", "/v1/completions", '{"prompt": "five", "max_tokens": 2, "kv_hints": %s, "kv_hints": %s}' % (env, env))
        check(st == 400, "kv_hints twice in one body -> 400", "status %d" % st)
    finally:
        srv.stop()
    with open(os.path.join(log_dir, "trusted.log"), errors="replace") as f:  # a random model's output is not UTF-8
        log = f.read()
    check(re.search(r"kvrelay: slot \d+, task \d+ carries an admitted KV hint with 1 action", log) is not None,
          "the admitted snapshot reaches the slot (debug log line)")
    check(re.search(r"kvrelay [0-9.]+: KV hints TRUSTED", log) is not None, "startup line says trusted")

    # 3. trusted by environment, 16-token blocks
    srv = Server(a.server, a.model, ["--kv-block-tokens", "16", "--alias", "tiny-alias"], os.path.join(log_dir, "env.log"),
                 env={"LLAMA_ARG_KV_HINTS_TRUSTED": "1"}, threads=a.threads)
    try:
        st, info = srv.json("GET", "/v1/kv/info")
        check(st == 200 and info.get("kv_hints_trusted") is True and info.get("block_tokens") == 16
              and info.get("model") == "tiny-alias", "LLAMA_ARG_KV_HINTS_TRUSTED=1, --kv-block-tokens 16, --alias")
        st, lk = srv.json("POST", "/v1/kv/lookup", {"prompt": "hello " * 200})
        check(st == 200 and lk["blocks_total"] == lk["n_tokens"] // 16, "lookup with 16-token blocks")
    finally:
        srv.stop()

    # 4. the unpatched server
    if a.unpatched:
        srv = Server(a.unpatched, a.model, [], os.path.join(log_dir, "unpatched.log"), threads=a.threads)
        try:
            st, r = chat(srv, {"kv_hints": ENVELOPE})
            check(st == 200, "unpatched server answers the same chat request")
            st, _ = srv.request("GET", "/v1/kv/info")
            check(st == 404, "unpatched server has no /v1/kv/info", "status %d" % st)
        finally:
            srv.stop()

    print("%d check(s) failed" % len(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
