import json

import pytest

import kvrelay

EP = "tcp://127.0.0.1:7000"


def snap(edge, actions, version="0.1"):
    raw = json.dumps({"protocol_version": version, "message_id": "m", "actions": actions}).encode()
    out = edge.admit(raw)
    assert out.admitted, out
    return out.snapshot


def fetch_action(endpoint=EP, **kw):
    payload = {"block_hashes": [7, 8]}
    if endpoint is not None:
        payload["source_control_endpoint"] = endpoint
    a = {"action_id": "f", "action_type": "kv.fetch", "action_version": "1.0", "payload": payload}
    a.update(kw)
    return a


class Recorder:
    def __init__(self, validate=True, fetch=True):
        self.answers = {"validate": validate, "fetch": fetch}
        self.seen = []

    def validate(self, req):
        self.seen.append(("validate", req))
        a = self.answers["validate"]
        if isinstance(a, BaseException):
            raise a
        return a

    def fetch(self, req):
        self.seen.append(("fetch", req))
        req.context.append(req)
        return self.answers["fetch"]


@pytest.fixture
def edge():
    return kvrelay.Admission(trusted=True)


@pytest.fixture
def caps():
    return kvrelay.Capabilities([("kvrelay", "kv.fetch", "1.0"), ("other", "kv.fetch", "2.0")])


def orch(caps, provider, bindings=None, endpoints=(EP,)):
    bindings = bindings if bindings is not None else [kvrelay.Binding("kv-tcp", "kvrelay")]
    return kvrelay.Orchestrator(caps, bindings, list(endpoints), provider)


def test_candidates(edge, caps):
    s = snap(edge, [{"action_id": "x", "action_type": "other.thing", "action_version": "1", "payload": {}}, fetch_action()])
    assert caps.candidates(s) == [kvrelay.Candidate(1, ("kvrelay",))]
    assert caps.candidates(None) == []


def test_named_fetch_hands_the_request_to_the_provider_with_its_context(edge, caps):
    p = Recorder()
    o = orch(caps, p)
    taken = []
    d = o.decide(snap(edge, [fetch_action()]), context=taken)
    assert (d.kind, d.discard, d.binding_id, d.action_index, d.provider_code) == ("named_fetch", "none", "kv-tcp", 0, 0)
    assert [w for w, _ in p.seen] == ["validate", "fetch"]
    (req,) = taken
    assert (req.binding_id, req.family, req.endpoint, req.action_type) == ("kv-tcp", "kvrelay", EP, "kv.fetch")
    assert json.loads(req.payload)["block_hashes"] == [7, 8]
    assert json.loads(req.envelope)["actions"][0]["action_id"] == "f"
    assert o.counters["named_fetch"] == 1


def test_discards_by_reason(edge, caps):
    p = Recorder()
    o = orch(caps, p)
    s = snap(edge, [fetch_action()])
    cases = [
        (o.decide(None), "no_hint"),
        (o.decide(s, generation_only=False), "not_generation_only"),
        (o.decide(s, lora_adapter=True), "lora_adapter"),
        (o.decide(snap(edge, [{"action_id": "x", "action_type": "kv.other", "action_version": "1", "payload": {}}])), "no_candidate"),
        (o.decide(snap(edge, [fetch_action(endpoint=None)])), "endpoint_missing"),
        (o.decide(snap(edge, [fetch_action(endpoint="tcp://*:1")])), "endpoint_invalid"),
        (o.decide(snap(edge, [fetch_action(endpoint="tcp://10.9.9.9:7000")])), "endpoint_not_trusted"),
    ]
    for d, want in cases:
        assert (d.kind, d.discard) == ("keep_paired_path", want)
    assert p.seen == [], "no provider call for a request that failed a check"
    unauthorized = orch(caps, p, [kvrelay.Binding("kv", "kvrelay", authorized=False)])
    assert unauthorized.decide(s).discard == "unauthorized"
    paired = orch(caps, p, [kvrelay.Binding("kv", "kvrelay", named=False)])
    assert paired.decide(s).discard == "request_paired"
    counts = o.counters["discarded"]
    assert counts["no_hint"] == 1 and counts["endpoint_not_trusted"] == 1 and counts["lora_adapter"] == 1
    assert 'reason="endpoint_not_trusted"' in o.prometheus()


def test_provider_refusals_and_exceptions_are_refusals_never_crashes(edge, caps):
    s = snap(edge, [fetch_action()])
    d = orch(caps, Recorder(validate=False)).decide(s)
    assert (d.discard, d.provider_code) == ("provider_rejected", 1)
    d = orch(caps, Recorder(validate=7)).decide(s)
    assert (d.discard, d.provider_code) == ("provider_rejected", 7)
    d = orch(caps, Recorder(fetch=False)).decide(s, context=[])
    assert (d.discard, d.provider_code) == ("fetch_failed", 1)
    o = orch(caps, Recorder(validate=RuntimeError("the provider broke")))
    d = o.decide(s)
    assert (d.kind, d.discard, d.provider_code) == ("keep_paired_path", "provider_rejected", -2)
    assert isinstance(o.last_provider_error, RuntimeError)


def test_bad_arguments(edge, caps):
    with pytest.raises(TypeError):
        kvrelay.Orchestrator(caps, [], [EP], object())
    with pytest.raises(TypeError):
        kvrelay.Capabilities([("only", "two")])
    with pytest.raises(TypeError):
        kvrelay.Orchestrator("caps", [], [EP], Recorder())
    with pytest.raises(kvrelay.KvrelayError):
        orch(caps, Recorder(), endpoints=["not an endpoint"])
    with pytest.raises(TypeError):
        orch(caps, Recorder()).decide("not a snapshot")
