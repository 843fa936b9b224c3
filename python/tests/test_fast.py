"""Issue 31, the per-request calls at C speed: the compiled helper (`kvrelay._fast`) makes
`Admission.admit` and `Agent.fetch` (without a callback) from C. Whatever it is given, every
answer, error and count equals the ctypes path's (each test runs both); what it does not take
as is goes the ctypes path. Installed by `pip install ./python`, the helper must be there
(`KVRELAY_REQUIRE_FAST=1`, as the test command sets); from the sources it is absent and the
comparisons skip."""

import array
import os

import pytest

import kvrelay
import kvrelay._lib as L

from test_admission import envelope
from test_arguments import BLOCK, FP, Holder

pytestmark = pytest.mark.skipif(
    L.fast is None and os.environ.get("KVRELAY_REQUIRE_FAST") != "1",
    reason="the compiled helper is not built (a package run from its sources)",
)


def test_the_helper_is_there_when_the_package_was_installed():
    assert L.fast is not None, "KVRELAY_REQUIRE_FAST=1, but kvrelay._fast did not build or load"


def both(monkeypatch, f):
    """f() with the helper, then through ctypes alone."""
    fast = f()
    with monkeypatch.context() as m:
        m.setattr(L, "fast", None)
        slow = f()
    return fast, slow


def outcome(o):
    snap = None if o.snapshot is None else bytes(o.snapshot.canonical)
    return (o.kind, o.reason, o.detail, snap)


def test_admit_answers_and_counts_as_ctypes_does(monkeypatch):
    raws = [
        envelope(),
        envelope(version="9.9"),
        envelope(hashes=range(2000)),
        b'{"protocol_version":"0.1","message_id":"m","actions":{}}',
        b"{not json",
        b"\xff\xfe",
        b"null",
        b"",
        None,
        bytearray(envelope()),  # not plain bytes: the ctypes path
        memoryview(envelope()),
    ]

    def run():
        edge = kvrelay.Admission(trusted=True, max_bytes=4096)
        got = [outcome(edge.admit(r)) for r in raws]
        return got, edge.counters

    fast, slow = both(monkeypatch, run)
    assert fast == slow
    assert fast[0][0][0] == "admitted" and fast[0][0][3]
    # refusals: the same exception either way
    edge = kvrelay.Admission(trusted=True)
    for bad in ["text", 5]:
        errs = both(monkeypatch, lambda: pytest.raises(TypeError, edge.admit, bad).value.args)
        assert errs[0] == errs[1]
    edge.close()
    errs = both(monkeypatch, lambda: pytest.raises(ValueError, edge.admit, envelope()).value.args)
    assert errs[0] == errs[1]


def test_fetch_submissions_and_refusals_are_the_ctypes_paths(monkeypatch):
    buf = bytearray(4 * BLOCK)
    ep = "tcp://127.0.0.1:1"  # nothing listens: each fetch fails with connect, on an agent thread
    with kvrelay.Agent(FP, kvrelay.KvLayout.from_buffer(buf, 4, BLOCK), Holder(), listen=None, limits={"unchecked_fetch": 1}) as a:
        good = [
            ([1, 2, 3], [0, 1], {}),
            ((1, 2, 3), (3,), {"held": 2}),
            ([1, 2], [2, 3], {"deadline_ms": 2**32 - 1}),
            (array.array("Q", [5, 6]), array.array("I", [1]), {}),  # not a list: the ctypes path
            (list(range(1000)), [0, 1, 2, 3], {"held": 996}),  # more ids than the helper keeps on its stack
        ]

        def submit():
            out = []
            for names, dst, kw in good:
                with a.fetch(ep, names, dst, **kw) as f:
                    r = f.result(timeout=30)
                    out.append((r.failure, r.blocks))
            return out

        fast, slow = both(monkeypatch, submit)
        assert fast == slow == [("connect", 0)] * len(good)
        bad = [
            (ValueError, (ep, [1], [0]), {"held": -1}),
            (ValueError, (ep, [1], [0]), {"held": 2**64}),
            (TypeError, (ep, [1], [0]), {"held": True}),
            (ValueError, (ep, [1], [0]), {"deadline_ms": 0}),
            (ValueError, (ep, [1], [0]), {"deadline_ms": 2**32}),
            (ValueError, (ep, [2**64], [0]), {}),
            (ValueError, (ep, [-1], [0]), {}),
            (TypeError, (ep, [True], [0]), {}),
            (TypeError, (ep, [1.0], [0]), {}),
            (ValueError, (ep, [1, 2], [0, 2**32]), {}),
            (ValueError, (ep, [1], []), {}),
            (ValueError, (ep, [1], [0, 1]), {}),
            (ValueError, (ep, [1, 2], [0]), {"held": 2}),
            (TypeError, (b"tcp://127.0.0.1:1", [1], [0]), {}),
            (TypeError, (ep, [1], "0"), {}),
        ]
        for exc, args, kw in bad:
            got = both(monkeypatch, lambda: pytest.raises(exc, a.fetch, *args, **kw).value.args)
            assert got[0] == got[1], (args, kw)
        # the library's own refusals (a block past the pool, a block twice) come back alike
        for dst in ([4], [1, 1]):
            got = both(monkeypatch, lambda: pytest.raises(kvrelay.KvrelayError, a.fetch, ep, [1, 2], dst).value.args)
            assert got[0] == got[1], dst
        assert a.stats["fetches_submitted"] == 2 * len(good)


def test_the_helpers_snapshot_reference_cannot_be_made_from_python():
    # a SnapshotRef made from an address would release a reference nobody gave it: only the
    # helper's admit makes one (before, SnapshotRef(address) was accepted)
    ref = kvrelay.Admission(trusted=True).admit(envelope()).snapshot._ref
    t = type(ref)
    assert t is L.fast.SnapshotRef
    with pytest.raises(TypeError):
        t()
    extra = L.lib.kvrelay_snapshot_retain(ref.ptr)  # a reference of its own, for the attempt
    assert extra == ref.ptr
    adopted = None
    try:
        with pytest.raises(TypeError):
            adopted = t(extra)
        with pytest.raises(TypeError):
            adopted = t.__new__(t)
    finally:
        if adopted is None:
            L.lib.kvrelay_snapshot_release(extra)
        # else the adopted object releases it when it dies
