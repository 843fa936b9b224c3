"""Issue 31, arguments and text representations: every bad argument is a TypeError or
ValueError naming it, raised before any C call; integers are range-checked, never wrapped;
reprs never show hint contents."""

import json
import logging

import pytest

import kvrelay

BLOCK = 4096
FP = kvrelay.Fingerprint(block_tokens=32, layers=1, kv_heads=1, head_dim=64, dtype_bytes=2, naming=7)
EP = "tcp://127.0.0.1:7000"
SECRET = "s3cret-hint-content"


class Holder:
    def pin(self, names):
        return []

    def unpin(self, ids):
        pass


@pytest.fixture
def agent():
    buf = bytearray(4 * BLOCK)
    with kvrelay.Agent(FP, kvrelay.KvLayout.from_buffer(buf, 4, BLOCK), Holder(), listen=None, limits={"unchecked_fetch": 1}) as a:
        yield a


def raises(exc, name, f, *args, **kw):
    with pytest.raises(exc) as e:
        f(*args, **kw)
    assert name in str(e.value), (name, str(e.value))


def test_fetch_arguments(agent):
    raises(TypeError, "callback", agent.fetch, EP, [1], [0], callback=5)  # was accepted, its error swallowed
    raises(ValueError, "held", agent.fetch, EP, [1], [0], held=-1)
    raises(ValueError, "held", agent.fetch, EP, [1], [0], held=2**64)
    raises(TypeError, "held", agent.fetch, EP, [1], [0], held=True)
    raises(ValueError, "deadline_ms", agent.fetch, EP, [1], [0], deadline_ms=2**32)
    raises(ValueError, "deadline_ms", agent.fetch, EP, [1], [0], deadline_ms=0)
    raises(ValueError, "names[0]", agent.fetch, EP, [2**64], [0])
    raises(ValueError, "dst_blocks[1]", agent.fetch, EP, [1, 2], [0, -1])
    raises(TypeError, "dst_blocks", agent.fetch, EP, [1], "0")
    raises(TypeError, "endpoint", agent.fetch, b"tcp://127.0.0.1:1", [1], [0])
    with agent.fetch("tcp://127.0.0.1:1", [1], [0]) as f:
        raises(ValueError, "timeout", f.result, -1)
        raises(TypeError, "timeout", f.result, "10")
        f.result(timeout=30)


def test_estimate_and_run_length_refuse_negative_counts(agent):
    raises(ValueError, "blocks", agent.estimate, EP, -1)  # was 6,148,914,691 s
    assert 0 < agent.estimate(EP, 10) < 1
    # the runtime's import cost joins the estimate once reported
    base = agent.estimate(EP, 10)
    assert agent.import_estimate(10) == 0
    raises(ValueError, "seconds", agent.record_import, 2, -0.5)
    raises(ValueError, "seconds", agent.record_import, 2, float("nan"))
    raises(TypeError, "seconds", agent.record_import, 2, "1")
    raises(ValueError, "blocks", agent.record_import, -1, 1.0)
    raises(ValueError, "blocks", agent.record_import, 5, 1.0)  # the pool has 4
    raises(ValueError, "seconds", agent.record_import, 2, 3601.0)
    agent.record_import(2, 0.25)
    assert abs(agent.import_estimate(20) - 0.25) < 1e-9  # one block count: a fixed cost
    assert abs(agent.estimate(EP, 10) - base - 0.25) < 1e-9
    agent.record_import(4, 0.5)  # a second count gives the slope: 125 ms a block
    assert abs(agent.import_estimate(8) - 1.0) < 1e-9
    raises(ValueError, "held", kvrelay.fetch_run_length, [1, 2], -1, [1])
    assert kvrelay.fetch_run_length([1, 2, 3], 1, [3, 2]) == 2
    assert "fetch_run_length" in kvrelay.__all__


def test_agent_and_fingerprint_arguments():
    buf = bytearray(4 * BLOCK)
    lay = kvrelay.KvLayout.from_buffer(buf, 4, BLOCK)
    raises(ValueError, "block_tokens", kvrelay.Fingerprint, -16, 1, 1, 64, 2, 7)
    raises(ValueError, "naming", kvrelay.Fingerprint, 16, 1, 1, 64, 2, 2**64)
    raises(TypeError, "layers", kvrelay.Fingerprint, 16, 1.5, 1, 64, 2, 7)
    raises(ValueError, "streams", kvrelay.Agent, FP, lay, Holder(), limits={"streams": 2**64 + 4})
    with pytest.raises(kvrelay.KvrelayError):  # the library's own ceiling, never wrapped
        kvrelay.Agent(FP, lay, Holder(), limits={"streams": 2**32 + 4})
    raises(TypeError, "allow", kvrelay.Agent, FP, lay, Holder(), allow="loopback")
    raises(ValueError, "device", kvrelay.Agent, FP, lay, Holder(), device=2**31)
    raises(TypeError, "key", kvrelay.Agent, FP, lay, Holder(), key="a str key")
    raises(ValueError, "num_blocks", kvrelay.KvLayout.from_buffer, buf, 0, BLOCK)
    raises(ValueError, "segments[0].base", kvrelay.KvLayout, 1, [(-16, 16, 16)], [])
    raises(ValueError, "num_blocks", kvrelay.KvLayout, 2**32, [(16, 16, 16)], [])


def test_admission_and_policy_arguments():
    raises(ValueError, "max_bytes", kvrelay.Admission, max_bytes=2**64)
    raises(TypeError, "max_depth", kvrelay.Admission, max_depth="9")
    raises(TypeError, "named", kvrelay.Binding, "kv", "kvrelay", named="no")
    raises(TypeError, "family", kvrelay.Binding, "kv", None)
    caps = kvrelay.Capabilities([("kvrelay", "kv.fetch", "1.0")])

    class P:
        def validate(self, req):
            return True

        def fetch(self, req):
            return True

    raises(TypeError, "endpoints", kvrelay.Orchestrator, caps, [], EP, P())  # a str, not a list of them
    o = kvrelay.Orchestrator(caps, [kvrelay.Binding("kv", "kvrelay")], [EP], P())
    raises(TypeError, "generation_only", o.decide, None, generation_only="yes")
    edge = kvrelay.Admission(trusted=True)
    s = edge.admit(b'{"protocol_version":"0.1","message_id":"m","actions":[]}').snapshot
    raises(TypeError, "index", s.action, True)
    raises(TypeError, "index", s.action_envelope, "0")


def hint():
    return json.dumps({"protocol_version": "0.1", "message_id": SECRET, "actions": [{
        "action_id": SECRET + "-id", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": EP, "block_hashes": [1], "note": SECRET}}]}).encode()


def test_text_representations_never_show_hint_contents(caplog):
    edge = kvrelay.Admission(trusted=True)
    snap = edge.admit(hint()).snapshot
    seen = []

    class P:
        def validate(self, req):
            seen.append(req)
            return True

        def fetch(self, req):
            return 2**40  # not an int32: refused and logged, never wrapped (2**40 wrapped to 0: accept)

    o = kvrelay.Orchestrator(kvrelay.Capabilities([("kvrelay", "kv.fetch", "1.0")]), [kvrelay.Binding("kv", "kvrelay")], [EP], P())
    with caplog.at_level(logging.ERROR, logger="kvrelay"):
        d = o.decide(snap)
    assert (d.kind, d.discard, d.provider_code) == ("keep_paired_path", "fetch_failed", -2)
    assert o.provider_errors == 1 and "answer" in caplog.text
    texts = [repr(snap), repr(snap.action(0)), str(snap.action(0)), repr(seen[0]), str(seen[0]), repr(edge.admit(hint())), repr(d)]
    for t in texts:
        assert SECRET not in t and "kv.fetch" not in t and "1.0" not in t, t
    assert "bytes" in repr(seen[0]) and "kv" in repr(seen[0])
