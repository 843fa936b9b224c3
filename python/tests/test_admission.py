import json

import pytest

import kvrelay


def envelope(version="0.1", endpoint="tcp://127.0.0.1:7000", hashes=(1, 2, 3), **extra):
    env = {
        "protocol_version": version,
        "message_id": "m-1",
        "actions": [
            {
                "action_id": "a1",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {"source_control_endpoint": endpoint, "block_hashes": list(hashes)},
            }
        ],
    }
    env.update(extra)
    return json.dumps(env, indent=1).encode()


def test_every_outcome_and_reason_is_counted():
    edge = kvrelay.Admission(trusted=True, max_bytes=4096)
    assert edge.admit(None).kind == "absent"
    assert edge.admit(b"null").kind == "absent"
    ok = edge.admit(envelope())
    assert ok.admitted and ok.reason == "none" and ok.snapshot is not None
    assert edge.admit(envelope(version="9.9")).reason == "unknown_version"
    assert edge.admit(envelope(hashes=range(2000))).reason == "oversized"
    bad = edge.admit(b'{"protocol_version":"0.1","message_id":"m","actions":{}}')
    assert (bad.kind, bad.reason) == ("ignored", "malformed") and bad.detail and bad.snapshot is None
    assert edge.admit(b"{not json").reason == "malformed"
    untrusted = kvrelay.Admission()  # trust off by default
    assert untrusted.admit(envelope()).reason == "untrusted"
    assert edge.counters == {"admitted": 1, "untrusted": 0, "unknown_version": 1, "oversized": 1, "malformed": 2}
    assert untrusted.counters["untrusted"] == 1
    text = edge.prometheus()
    assert "kvrelay_kv_hints_admitted_total 1" in text
    assert 'kvrelay_kv_hints_ignored_total{reason="malformed"} 2' in text


def test_trust_from_the_environment(monkeypatch):
    monkeypatch.setenv("PY_KVRELAY_TRUST", "1")
    assert kvrelay.Admission(trust_env="PY_KVRELAY_TRUST").admit(envelope()).admitted
    monkeypatch.setenv("PY_KVRELAY_TRUST", "0")
    assert kvrelay.Admission(trust_env="PY_KVRELAY_TRUST").admit(envelope()).reason == "untrusted"


def test_snapshot_views_are_canonical_immutable_and_outlive_nothing():
    edge = kvrelay.Admission(trusted=True)
    snap = edge.admit(envelope(extra_root={"z": 1})).snapshot
    canon = bytes(snap.canonical)
    assert canon == json.dumps(json.loads(envelope(extra_root={"z": 1})), separators=(",", ":")).encode()
    assert snap.to_json() == canon
    assert (snap.protocol_version, snap.message_id, len(snap)) == ("0.1", "m-1", 1)
    a = snap.action(0)
    assert (a.index, a.id, a.action_type, a.version) == (0, "a1", "kv.fetch", "1.0")
    assert json.loads(bytes(a.payload)) == {"block_hashes": [1, 2, 3], "source_control_endpoint": "tcp://127.0.0.1:7000"}
    assert a.payload.readonly
    with pytest.raises(TypeError):
        a.payload[0] = 0
    with pytest.raises(AttributeError):
        snap.message_id = "other"
    with pytest.raises(IndexError):
        snap.action(1)
    one = json.loads(snap.action_envelope(0))
    assert one["actions"][0]["action_id"] == "a1" and one["extra_root"] == {"z": 1}
    # a view keeps its snapshot alive after the handle is dropped
    view = snap.action(0).canonical
    child = snap.retain()
    del snap
    assert json.loads(bytes(view))["action_id"] == "a1"
    assert child.message_id == "m-1"
    child.close()
    with pytest.raises(ValueError):
        child.message_id


def test_msgpack_round_trip_is_re_admitted():
    edge = kvrelay.Admission(trusted=True)
    snap = edge.admit(envelope()).snapshot
    packed = snap.to_msgpack()
    back = edge.decode_msgpack(packed)
    assert back.admitted and bytes(back.snapshot.canonical) == bytes(snap.canonical)
    assert edge.decode_msgpack(packed[:-3]).reason == "malformed"
    assert edge.counters["admitted"] == 1, "a travelled snapshot is re-validated, not admitted again"


def test_bad_arguments_are_python_errors():
    edge = kvrelay.Admission(trusted=True)
    with pytest.raises(TypeError):
        edge.admit("a str is not the bytes received")
    with pytest.raises(TypeError):
        edge.admit(12)
    with pytest.raises(TypeError):
        kvrelay.Admission(trusted="yes")
    with pytest.raises(ValueError):
        kvrelay.Admission(max_bytes=-1)
    with pytest.raises(kvrelay.KvrelayError) as e:
        kvrelay.Admission(max_bytes=0)
    assert e.value.status != 0 and str(e.value)
    assert kvrelay.version() == "0.4.3"
    assert isinstance(kvrelay.kv_checksum(b"x" * 64), int)


def test_an_index_out_of_range_is_an_index_error():
    # a negative index or one past the end is an IndexError, as a sequence answers (it was a
    # ValueError for a negative one, and for one past 2**64); not an int stays a TypeError
    edge = kvrelay.Admission(trusted=True)
    snap = edge.admit(envelope()).snapshot
    assert len(snap) == 1
    for accessor in (snap.action, snap.action_envelope):
        for bad in (-1, -(2**70), 1, 2**64, 2**70):
            with pytest.raises(IndexError):
                accessor(bad)
        for bad in (True, 0.0, "0", None):
            with pytest.raises(TypeError):
                accessor(bad)
    assert snap.action(0).id == "a1" and json.loads(snap.action_envelope(0))["actions"][0]["action_id"] == "a1"
    empty = edge.admit(b'{"protocol_version":"0.1","message_id":"m","actions":[]}').snapshot
    assert len(empty) == 0 and empty.actions == []
    with pytest.raises(IndexError):
        empty.action(0)
    with pytest.raises(IndexError):
        empty.action_envelope(-1)


def test_find_hint_gives_the_clients_own_bytes_to_admit():
    trusted = kvrelay.Admission(trusted=True)
    HINT = envelope()  # indented: the bytes as sent, whitespace and all
    body = b'{"model":"m","kv_transfer_params":{"router_hint": ' + HINT + b' },"n":1}'
    spelling, value = kvrelay.find_hint(body)
    assert spelling == "transfer_router_hint" and spelling is kvrelay.HintSpelling.TRANSFER_ROUTER_HINT
    assert bytes(value) == HINT
    assert trusted.admit(value).admitted
    spelling, value = kvrelay.find_hint(b'{"kv_hint":null,"kv_hints":[' + HINT + b",null]}")
    assert spelling == "kv_hints" and bytes(value).startswith(b"[")
    assert kvrelay.find_hint(b'{"kv_hints":null}')[0] == "none"
    with pytest.raises(kvrelay.KvrelayError) as e:
        kvrelay.find_hint(b'{"kv_hint":{},"router_hint":{}}')
    assert e.value.status == kvrelay.Status.ERR_INVALID_ARGUMENT.c and "router_hint" in str(e.value)
    # a duplicate member inside the hint reaches admission as sent: malformed
    dup = HINT.replace(b'"message_id": "m-1"', b'"message_id": "m-1", "message_id": "m-2"', 1)
    assert dup != HINT
    assert trusted.admit(kvrelay.find_hint(b'{"kv_hint":' + dup + b"}")[1]).reason == "malformed"
    with pytest.raises(kvrelay.KvrelayError):
        kvrelay.find_hint(b"[1]")
    with pytest.raises(TypeError):
        kvrelay.find_hint("not bytes")
