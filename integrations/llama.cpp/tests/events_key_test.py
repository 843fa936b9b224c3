#!/usr/bin/env python3
"""The KV events' sockets with a key (--kv-events-key-file): only a peer that logs in with the
key's subscriber token reads the events; any other peer on the allowlist gets nothing and is
counted as refused.

    PYTHONPATH=<pyzmq and msgpack> python3 integrations/llama.cpp/tests/events_key_test.py \
        --server target/llama-server/bin/llama-server-kvrelay --model MODEL.gguf [--threads 1] [--log-dir DIR]

Needs pyzmq and msgpack (the test command runs it with Dynamo's environment, which has both).
One server A publishes KV events with a key. The subscriber token is computed here the way the
README states it: HMAC-SHA-256 of "kvrelay-kv-events/v1 subscriber" under the key (its
surrounding whitespace trimmed), in lowercase hex, sent as the ZMQ PLAIN password of user
"kvrelay". Checks:
  1. /v1/kv/info says the events need a key;
  2. peers logging in with another token, with the key itself, as another user, or not at all
     (NULL) are refused: the refusals are counted (llamacpp_kv_events_refused_total);
  3. a peer with the token replays the events of a prompt A answered (its blocks' names, as
     /v1/kv/lookup gives them) and receives live batches;
  4. none of the refused peers got a batch or a replay.
Exit status 0 when every check passed.
"""
import hmac
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_test import check, run_test  # noqa: E402
from two_instance_test import complete, metrics, text, wait_for  # noqa: E402

import msgpack  # noqa: E402
import zmq  # noqa: E402

KEY = b"events-key-test-0123456789abcdef"
LABEL = b"kvrelay-kv-events/v1 subscriber"


def body(a, start):
    key_file = os.path.join(tempfile.mkdtemp(prefix="kvrelay-events-key-"), "key")
    with open(key_file, "wb") as f:
        f.write(KEY + b"\n")
    os.chmod(key_file, 0o600)  # a key file is its owner's alone (one others may read is refused)
    A = start("A", ["--kv-listen", "127.0.0.1:0", "--kv-events", "tcp://127.0.0.1:0", "--kv-hints-trusted",
                    "--kv-events-key-file", key_file])
    info = A.json("GET", "/v1/kv/info")[1]
    ev = info.get("kv_events", {})
    check(ev.get("key_required") is True, "1. /v1/kv/info: the KV events need a key", str(ev))
    token = hmac.new(KEY, LABEL, "sha256").hexdigest()
    wrong = ("1" if token[0] == "0" else "0") + token[1:]

    ctx = zmq.Context()
    peers = []

    def peer(user, password):
        sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
        for s in (sub, dealer):
            s.linger = 0
            s.rcvtimeo = 20000
            s.sndtimeo = 20000
            if user is not None:
                s.plain_username = user
                s.plain_password = password
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(ev["endpoint"])
        dealer.connect(ev["replay_endpoint"])
        peers.append((sub, dealer))
        return sub, dealer

    def refused():
        return metrics(A).get("llamacpp_kv_events_refused_total", 0)

    try:
        bad = {
            "another token": peer(b"kvrelay", wrong.encode()),
            "the key itself": peer(b"kvrelay", KEY),
            "another user": peer(b"router", token.encode()),
            "no login": peer(None, None),
        }
        # the three PLAIN logins, on both sockets, are refused by the handler (NULL ends earlier)
        check(wait_for(lambda: refused() >= 6), "2. peers without the token are refused, counted",
              "%d refusals" % refused())

        sub, dealer = peer(b"kvrelay", token.encode())
        prompt = text(140, 31)
        complete(A, prompt)
        names = A.json("POST", "/v1/kv/lookup", {"prompt": prompt})[1]["block_hashes"]
        published = lambda: metrics(A).get("llamacpp_kv_events_published_total", 0)  # noqa: E731
        wait_for(lambda: published() >= 1 + len(names))
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        stored = []
        while True:
            m = dealer.recv_multipart()
            if m[1] == b"\xff" * 8:
                break
            _ts, events, _rank = msgpack.unpackb(m[2], raw=False)
            stored += [e[1][0] for e in events if e[0] == "BlockStored"]
        check(len(names) >= 2 and stored[-len(names):] == names,
              "3. the peer with the token replays the prompt's blocks", "%d of %d names" % (len(stored), len(names)))
        live = sub.recv_multipart()
        check(len(live) == 3, "3. and receives live batches")

        got = []
        for who, (s, d) in bad.items():
            try:
                d.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
            except zmq.Again:
                pass  # no pipe to send on: libzmq tears a refused peer's down between its attempts
            for sock, what in ((s, "a batch"), (d, "a replay")):
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                    got.append("%s got %s" % (who, what))
                except zmq.Again:
                    pass
        check(not got, "4. no refused peer got a batch or a replay", "; ".join(got))
    finally:
        for s, d in peers:
            s.close()
            d.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(run_test("kvrelay-events-key-", body))
