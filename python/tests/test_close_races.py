"""A close() on another thread while a call is in flight: each call takes its handle's C address
(a Snapshot: its reference) once and uses it throughout; close() waits for the calls in flight
before it frees (an Agent, a Fetch, every handle) and a call made after it raises the package's
closed error (ValueError); a Snapshot's call holds its own reference, so whatever it returns
stays valid.

Each race is made to happen, not hoped for: the C function a call makes is wrapped, and the
wrapper, inside the call, starts the thread that closes, then waits (on an event, never a sleep)
until that thread has either freed the object (the bug: freed under the call) or waits for the
call to return (the fix)."""

import json
import threading

import pytest

import kvrelay
import kvrelay._bindings as B
import kvrelay._common as C
import kvrelay._lib as L
import kvrelay.admission as AD
import kvrelay.agent as A
import kvrelay.policy as P

BLOCK = 4096
FP = kvrelay.Fingerprint(block_tokens=32, layers=1, kv_heads=1, head_dim=64, dtype_bytes=2, naming=7)
CLOSED = "tcp://127.0.0.1:1"  # nothing listens there: a fetch fails at connect, quickly
LONG = 30  # seconds: the bound of every wait below, reached only when something is broken


class Holder:
    def pin(self, names):
        return []

    def unpin(self, ids):
        pass


def envelope(mid="m"):
    return json.dumps({"protocol_version": "0.1", "message_id": mid, "actions": [
        {"action_id": "a-" + mid, "action_type": "kv.fetch", "action_version": "1.0",
         "payload": {"source_control_endpoint": "tcp://127.0.0.1:7000", "block_hashes": [1, 2]}}]}).encode()


class Lib:
    """The loaded library with some of its functions replaced."""

    def __init__(self, lib, **replaced):
        self._lib = lib
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._lib, name)


class Race:
    """close() on another thread, started inside a call. ``progress`` is set when the closing
    thread has freed the object, or waits (in _common's condition) for the call in flight."""

    def __init__(self, monkeypatch):
        self.progress = threading.Event()
        self.freed = []
        self.freed_inside = None
        self.closer = None
        race = self

        class Closing(threading.Condition):
            def wait(self, timeout=None):
                race.progress.set()
                return super().wait(timeout)

        monkeypatch.setattr(C, "_closing", Closing(getattr(C, "_lock", None)), raising=False)

    def free(self, real):
        def free(p):
            real(p)
            self.freed.append(p)
            self.progress.set()

        return free

    def inside(self, close):
        """In the wrapped C call: close on another thread; wait until it freed or waits."""
        self.closer = threading.Thread(target=close, name="closer")
        self.closer.start()
        assert self.progress.wait(LONG), "close() neither freed the object nor waited for the call"
        self.freed_inside = list(self.freed)

    def finish(self):
        self.closer.join(LONG)
        assert not self.closer.is_alive(), "close() did not return after the call had"
        assert self.freed_inside == [], "close() freed the object under a call in flight"
        assert len(self.freed) == 1, "close() freed it once the call had returned"


def agent_without_listener():
    buf = bytearray(4 * BLOCK)
    return kvrelay.Agent(FP, kvrelay.KvLayout.from_buffer(buf, 4, BLOCK), Holder(), listen=None, limits={"unchecked_fetch": 1})


@pytest.mark.parametrize("helper", [False, True], ids=["ctypes", "helper"])
def test_close_waits_for_a_fetch_submission(monkeypatch, helper):
    if helper and L.fast is None:
        pytest.skip("the compiled helper is not built")
    race = Race(monkeypatch)
    agent = agent_without_listener()
    monkeypatch.setattr(A, "lib", Lib(A.lib, kvrelay_agent_free=race.free(A.lib.kvrelay_agent_free)))
    if helper:
        real = L.fast

        class Fast:
            def __getattr__(self, name):
                return getattr(real, name)

            def submit(self, *args):
                st = real.submit(*args)
                race.inside(agent.close)
                return st

        monkeypatch.setattr(L, "fast", Fast())
    else:
        monkeypatch.setattr(L, "fast", None)
        real_submit = A._submit

        def submit(*args):
            st = real_submit(*args)
            race.inside(agent.close)
            return st

        monkeypatch.setattr(A, "_submit", submit)
    f = agent.fetch(CLOSED, [1], [0])
    race.finish()
    assert f.result(timeout=LONG).failure in ("connect", "shutdown")
    with pytest.raises(ValueError, match="Agent is closed"):
        agent.fetch(CLOSED, [1], [0])
    with pytest.raises(ValueError, match="Agent is closed"):
        agent.stats


def test_close_waits_for_a_result(monkeypatch):
    race = Race(monkeypatch)
    with agent_without_listener() as agent:
        f = agent.fetch(CLOSED, [1], [0])
        real_wait = A.lib.kvrelay_fetch_wait

        def wait(h, ms, out):
            st = real_wait(h, LONG * 1000, out)  # completes: nothing listens there
            race.inside(f.close)
            return st

        monkeypatch.setattr(A, "lib", Lib(A.lib, kvrelay_fetch_wait=wait, kvrelay_fetch_free=race.free(A.lib.kvrelay_fetch_free)))
        r = f.result(timeout=LONG)
        race.finish()
        # the detail was read with the handle the wait used, before close() freed it (it was
        # read again from the Fetch: 'this Fetch is closed')
        assert r.failure == "connect" and r.detail
        with pytest.raises(ValueError, match="Fetch is closed"):
            f.result(timeout=LONG)
        with pytest.raises(ValueError, match="Fetch is closed"):
            f.done()


@pytest.mark.parametrize("accessor", ["canonical", "action"])
def test_a_view_made_while_its_snapshot_closes_keeps_its_bytes(monkeypatch, accessor):
    edge = kvrelay.Admission(trusted=True)
    snap = edge.admit(envelope("first")).snapshot  # the one reference to the snapshot
    want = {"canonical": bytes(snap.canonical), "action": bytes(snap.action(0).payload)}[accessor]
    name = {"canonical": "kvrelay_snapshot_canonical", "action": "kvrelay_snapshot_action"}[accessor]
    real = getattr(AD.lib, name)
    closed = []

    def call(*args):
        st = real(*args)
        t = threading.Thread(target=snap.close)  # close() lands after the C call, before the view
        t.start()
        t.join(LONG)
        closed.append(not t.is_alive())
        return st

    monkeypatch.setattr(AD, "lib", Lib(AD.lib, **{name: call}))
    view = snap.canonical if accessor == "canonical" else snap.action(0).payload
    monkeypatch.undo()
    assert closed == [True]
    # the view holds the call's reference (it was the handle's, read again after close(): None,
    # and the bytes were freed under the view)
    assert getattr(view.obj, "_owner", None) is not None, "the view does not hold its snapshot"
    others = [edge.admit(envelope("other")).snapshot for _ in range(50)]  # would reuse freed bytes
    assert bytes(view) == want
    del others
    with pytest.raises(ValueError, match="Snapshot is closed"):
        snap.canonical


def test_a_provider_closing_its_orchestrator_frees_it_after_the_decision(monkeypatch):
    # close() inside the handle's own call, on the same thread: it cannot wait for that call;
    # the call frees it on its way out (it was freed under the running decision)
    freed, deciding = [], []
    real_free = P.lib.kvrelay_orchestrator_free
    kept = []

    def free(p):
        freed.append(bool(deciding))
        if deciding:
            kept.append(p)  # not under the running call (the test would corrupt memory)
        else:
            real_free(p)

    real_decide = P.lib.kvrelay_orchestrate_with_context

    def decide(*args):
        deciding.append(1)
        try:
            return real_decide(*args)
        finally:
            deciding.pop()

    monkeypatch.setattr(P, "lib", Lib(P.lib, kvrelay_orchestrator_free=free, kvrelay_orchestrate_with_context=decide))
    monkeypatch.setattr(kvrelay.Orchestrator, "_free", staticmethod(free))

    class Closer:
        def validate(self, req):
            return True

        def fetch(self, req):
            req.context.close()
            return True

    caps = kvrelay.Capabilities([("kvrelay", "kv.fetch", "1.0")])
    o = kvrelay.Orchestrator(caps, [kvrelay.Binding("kv", "kvrelay")], ["tcp://127.0.0.1:7000"], Closer())
    snap = kvrelay.Admission(trusted=True).admit(envelope()).snapshot
    d = o.decide(snap, context=o)
    for p in kept:
        real_free(p)
    assert d.kind == "named_fetch"
    assert freed == [False], "freed once, after the decision"
    with pytest.raises(ValueError, match="Orchestrator is closed"):
        o.decide(snap)


def test_threads_calling_while_another_closes(monkeypatch):
    # bounded loops on 4 threads (stats, a fetch submission, the endpoint) while the main thread
    # closes: each call returns its answer or raises the closed error, and the library never
    # frees the agent while one of its functions runs
    agent = kvrelay.Agent(FP, kvrelay.KvLayout.from_buffer(bytearray(4 * BLOCK), 4, BLOCK), Holder(), limits={"unchecked_fetch": 1})
    lock = threading.Lock()
    inflight, overlaps, errors = [0], [], []

    def counted(f):
        def call(*args):
            with lock:
                inflight[0] += 1
            try:
                return f(*args)
            finally:
                with lock:
                    inflight[0] -= 1

        return call

    real_free = A.lib.kvrelay_agent_free

    def free(p):
        with lock:
            overlaps.append(inflight[0])
        real_free(p)

    monkeypatch.setattr(A, "lib", Lib(
        A.lib,
        kvrelay_agent_read_stats=counted(A.lib.kvrelay_agent_read_stats),
        kvrelay_agent_endpoint=counted(A.lib.kvrelay_agent_endpoint),
        kvrelay_agent_free=free,
    ))
    monkeypatch.setattr(L, "fast", None)  # every submission through the wrapped ctypes function
    monkeypatch.setattr(A, "_submit", counted(A._submit))
    started = threading.Barrier(5)
    calls = [
        lambda: agent.stats,
        lambda: agent.fetch(CLOSED, [1], [0]).close(),
        lambda: agent.endpoint,
        lambda: agent.prometheus(),
    ]

    def hammer(call):
        closed = 0
        try:
            for i in range(2000):
                if i == 1:
                    started.wait(LONG)
                try:
                    call()
                except ValueError as e:
                    assert "Agent is closed" in str(e), e
                    closed += 1
                    if closed == 3:
                        return
                except kvrelay.KvrelayError as e:  # a full fetch queue: the agent's own answer
                    assert e.status == B.KVRELAY_ERR_BUSY, e
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    started.wait(LONG)  # every thread made a call and is in its loop
    agent.close()
    for t in threads:
        t.join(LONG)
        assert not t.is_alive()
    assert errors == []
    assert overlaps == [0], "freed once, with no call of the agent in flight"
