"""Admission of hint envelopes and snapshots: Admission, Outcome, Snapshot, Action."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from . import _bindings as B
from . import _lib as L
from ._lib import lib
from ._common import HintSpelling, OutcomeKind, Reason, SIZE_MAX, _Handle, _bool, _buffer, _check, _closed, _ident, _index, _int, _label, _out, _sized, _text, _utf8, _view, version  # noqa: F401

# --- snapshots ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One action of a snapshot. ``payload`` and ``canonical`` are read-only views of the
    snapshot's own bytes (no copy); they keep the snapshot alive."""

    index: int
    id: str
    action_type: str
    version: str
    payload: memoryview
    canonical: memoryview

    def __repr__(self) -> str:
        # text representations never show hint contents (SPEC): sizes only
        return f"Action(index={self.index}, payload=<{len(self.payload)} bytes>, canonical=<{len(self.canonical)} bytes>)"


class _SnapshotRef:
    """One reference to a C snapshot, released when this object dies (any thread: a release is
    one atomic decrement). Held by the ``Snapshot`` handle and by every view of its bytes, so
    that a view stays valid whatever is closed."""

    __slots__ = ("ptr", "__weakref__")

    def __init__(self, ptr: int):
        self.ptr: Optional[int] = ptr

    def __del__(self, _release: Callable[[Any], None] = lib.kvrelay_snapshot_release) -> None:
        p, self.ptr = self.ptr, None
        if p:
            _release(p)


class _Ref(Protocol):
    """One reference to a C snapshot: ``_SnapshotRef``, or the compiled helper's
    ``SnapshotRef`` (the same in C: no Python finalizer, no ctypes call; only the helper's
    admit makes one)."""

    @property
    def ptr(self) -> Optional[int]: ...


class Snapshot(_Handle):
    """An admitted envelope, immutable: canonical bytes and zero-copy accessors. Share it with
    ``retain()`` (another reference to the same snapshot: a child request, a queue, a rank).
    ``close()`` gives up this handle's reference; the views it handed out (``canonical``,
    ``Action.payload``, ``Action.canonical``) hold their own and stay valid."""

    _ref: Optional[_Ref]  # None once closed (set through object.__setattr__: immutable)

    def __init__(self, ptr: int):
        object.__setattr__(self, "_ref", _SnapshotRef(ptr))

    @classmethod
    def _of(cls, ref: _Ref) -> "Snapshot":
        """A handle over the reference ``ref`` (the compiled helper's admit made it)."""
        s = cls.__new__(cls)
        object.__setattr__(s, "_ref", ref)
        return s

    def close(self) -> None:
        """Give up this handle's reference. A call in flight on another thread keeps its own
        (each call takes the reference once), so it never waits and nothing it returns dangles."""
        object.__setattr__(self, "_ref", None)

    def __del__(self) -> None:
        pass

    @property
    def _ptr(self) -> Optional[int]:
        r = self._ref
        return r.ptr if r is not None else None

    @_ptr.setter
    def _ptr(self, value: Optional[int]) -> None:
        raise AttributeError("a Snapshot is immutable")

    def _r(self) -> tuple[_Ref, int]:
        """This handle's reference and its address, taken once per call: the call's own
        reference, so a ``close()`` meanwhile (another thread) frees nothing under it."""
        r = self._ref
        p = r.ptr if r is not None else None
        if r is None or not p:
            raise _closed(self)
        return r, p

    def retain(self) -> "Snapshot":
        """Another handle to the same snapshot (one atomic increment)."""
        r, p = self._r()
        return Snapshot(lib.kvrelay_snapshot_retain(p))

    @property
    def canonical(self) -> memoryview:
        """The canonical compact JSON bytes (a read-only view, no copy)."""
        r, p = self._r()
        b = L.Bytes()
        _check("kvrelay_snapshot_canonical", lib.kvrelay_snapshot_canonical(p, ctypes.byref(b)))
        return _view(r, b.ptr, b.len)

    @property
    def protocol_version(self) -> str:
        r, p = self._r()
        s = L.Str()
        _check("kvrelay_snapshot_protocol_version", lib.kvrelay_snapshot_protocol_version(p, ctypes.byref(s)))
        return L.text(s)  # a copy, made while r holds the bytes

    @property
    def message_id(self) -> str:
        r, p = self._r()
        s = L.Str()
        _check("kvrelay_snapshot_message_id", lib.kvrelay_snapshot_message_id(p, ctypes.byref(s)))
        return L.text(s)

    @staticmethod
    def _count(p: int) -> int:
        n = ctypes.c_size_t()
        _check("kvrelay_snapshot_action_count", lib.kvrelay_snapshot_action_count(p, ctypes.byref(n)))
        return n.value

    def __len__(self) -> int:
        r, p = self._r()
        return self._count(p)

    def action(self, index: int) -> Action:
        """The action at ``index`` (producer order); ``IndexError`` when ``index`` is negative
        or past the end, ``TypeError`` when it is not an int."""
        r, p = self._r()
        i = _index("index", index, self._count(p), "actions")
        a = L.Action()
        _check("kvrelay_snapshot_action", lib.kvrelay_snapshot_action(p, i, ctypes.byref(a)))
        return Action(
            a.index,
            L.text(a.id),
            L.text(a.action_type),
            L.text(a.version),
            _view(r, a.payload.ptr, a.payload.len),
            _view(r, a.canonical.ptr, a.canonical.len),
        )

    @property
    def actions(self) -> list[Action]:
        r, p = self._r()
        return [self.action(i) for i in range(self._count(p))]

    def to_json(self) -> bytes:
        """An independent copy of the canonical document."""
        r, p = self._r()
        return _sized("kvrelay_snapshot_decode", lib.kvrelay_snapshot_decode, p)

    def to_msgpack(self) -> bytes:
        """The envelope as MessagePack, for transport (``Admission.decode_msgpack`` reads it)."""
        r, p = self._r()
        return _sized("kvrelay_snapshot_msgpack", lib.kvrelay_snapshot_msgpack, p)

    def action_envelope(self, index: int) -> bytes:
        """The canonical one-action envelope of action ``index`` (``IndexError`` as
        ``action``)."""
        r, p = self._r()
        i = _index("index", index, self._count(p), "actions")
        return _sized("kvrelay_snapshot_action_envelope", lib.kvrelay_snapshot_action_envelope, p, i)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Snapshot is immutable")

    def __repr__(self) -> str:
        # never hint contents: no message id, no action
        r = self._ref
        if r is None or not r.ptr:
            return "Snapshot(closed)"
        p = r.ptr
        b = L.Bytes()
        _check("kvrelay_snapshot_canonical", lib.kvrelay_snapshot_canonical(p, ctypes.byref(b)))
        return f"Snapshot(actions={self._count(p)}, canonical=<{b.len} bytes>)"


class Outcome:
    """What admission did with one hint: ``kind`` is ``absent``, ``admitted`` or ``ignored``;
    ``reason`` the metric label (``none``, ``untrusted``, ``unknown_version``, ``oversized``,
    ``malformed``); ``detail`` what a malformed hint got wrong (never its bytes)."""

    __slots__ = ("kind", "reason", "detail", "snapshot")

    def __init__(self, kind: str, reason: str, detail: str, snapshot: Optional[Snapshot]):
        self.kind, self.reason, self.detail, self.snapshot = kind, reason, detail, snapshot

    @property
    def admitted(self) -> bool:
        return self.kind == "admitted"

    def __repr__(self) -> str:
        return f"Outcome(kind={self.kind!r}, reason={self.reason!r}, detail={self.detail!r})"




_admit = lib.kvrelay_admit


def find_hint(body: Any) -> tuple[str, memoryview]:
    """The KV hint of a generation request, found in the body's own bytes (``kvrelay_find_hint``):
    its spelling (a :class:`HintSpelling` member, equal to its label: ``"kv_hints"``: admit with
    ``admit_batch``; ``"none"``: no hint) and its value
    exactly as the client sent it, a view into ``body``. ``null`` members are absent. Raises
    :class:`KvrelayError` (``INVALID_ARGUMENT``) when the body carries two hints (answer 400)
    or is not one JSON object."""
    buf, n = _buffer("body", body)
    spelling, at, length = ctypes.c_int32(0), ctypes.c_size_t(0), ctypes.c_size_t(0)
    _check(
        "kvrelay_find_hint",
        lib.kvrelay_find_hint(buf, n, ctypes.byref(spelling), ctypes.byref(at), ctypes.byref(length)),
    )
    view = memoryview(body).cast("B")[at.value : at.value + length.value]
    return _label(HintSpelling, spelling.value), view


def _outcome(o: L.OutcomeType, snap: ctypes.c_void_p) -> Outcome:
    r = o.reason
    return Outcome(
        _label(OutcomeKind, o.kind),
        _label(Reason, r),
        o.detail.decode("utf-8", "replace") if r == B.KVRELAY_REASON_MALFORMED else "",
        Snapshot(snap.value) if snap.value else None,
    )


class Admission(_Handle):
    """The trusted edge (SPEC section 2). Trust is off unless ``trusted=True`` or the
    environment variable ``trust_env`` says so (read once, here). Thread-safe."""

    _free = staticmethod(lib.kvrelay_admission_free)

    def __init__(
        self,
        *,
        trusted: Optional[bool] = None,
        trust_env: Optional[str] = None,
        max_bytes: Optional[int] = None,
        max_depth: Optional[int] = None,
        max_raw_bytes: Optional[int] = None,
        metric_prefix: Optional[str] = None,
    ):
        super().__init__(0)
        # every argument is checked before the first C call
        env = _utf8("trust_env", trust_env) if trust_env is not None else None
        if trusted is not None:
            _bool("trusted", trusted)
        sizes = [
            (name, _int(name, v, 0, SIZE_MAX), f)
            for name, v, f in (
                ("max_bytes", max_bytes, lib.kvrelay_admission_config_set_max_bytes),
                ("max_depth", max_depth, lib.kvrelay_admission_config_set_max_depth),
                ("max_raw_bytes", max_raw_bytes, lib.kvrelay_admission_config_set_max_raw_bytes),
            )
            if v is not None
        ]
        prefix = _utf8("metric_prefix", metric_prefix) if metric_prefix is not None else None
        cfg = ctypes.c_void_p()
        _check("kvrelay_admission_config_new", lib.kvrelay_admission_config_new(ctypes.byref(cfg)))
        try:
            if env is not None:
                _check("kvrelay_admission_config_trust_from_env", lib.kvrelay_admission_config_trust_from_env(cfg, env, len(env)))
            if trusted is not None:
                _check("kvrelay_admission_config_set_trusted", lib.kvrelay_admission_config_set_trusted(cfg, trusted))
            for name, v, f in sizes:
                _check(f"kvrelay_admission_config_set_{name}", f(cfg, v))
            if prefix is not None:
                _check("kvrelay_admission_config_set_metric_prefix", lib.kvrelay_admission_config_set_metric_prefix(cfg, prefix, len(prefix)))
            out = ctypes.c_void_p()
            _check("kvrelay_admission_new", lib.kvrelay_admission_new(cfg, ctypes.byref(out)))
            self._ptr = out.value
        finally:
            lib.kvrelay_admission_config_free(cfg)

    def admit(self, raw: Optional[Any]) -> Outcome:
        """Admit one raw hint (bytes as received; ``None`` or empty: absent). Never raises for
        a bad hint: it is ``ignored`` with its reason and inference goes on."""
        # the edge's address is taken once, and this call is registered, so that a close() on
        # another thread waits for it (_common: handles)
        calls, me = self._calls, _ident()
        try:
            calls.append(me)
            p = self._ptr
            fast = L.fast
            if fast is not None and p:
                r = fast.admit(p, raw)
                if isinstance(r, tuple):
                    kind, reason, detail, ref = r
                    return Outcome(_label(OutcomeKind, kind), _label(Reason, reason), detail, Snapshot._of(ref) if ref is not None else None)
                if isinstance(r, int):
                    _check("kvrelay_admit", r)
                # NotImplemented (raw not plain bytes or None): the checking path
            o, snap = L.Outcome(), ctypes.c_void_p()
            if raw is None:
                buf, n = None, 0
            elif type(raw) is bytes:
                buf, n = raw, len(raw)  # passed as a pointer to its bytes, no copy
            else:
                if isinstance(raw, str):
                    raise TypeError("raw must be bytes as received (encode text first)")
                buf, n = _buffer("raw", raw)
            if not p:
                raise _closed(self)
            # (ctypes passes a struct given for a POINTER parameter by reference: no byref())
            st = _admit(p, buf, n, o, snap)
            if st:
                _check("kvrelay_admit", st)
            return _outcome(o, snap)
        finally:
            _out(self, me)

    def decode_msgpack(self, data: Any) -> Outcome:
        """Re-admit a snapshot that travelled as MessagePack: re-validated with this edge's
        limits; trust does not apply and nothing is counted (it was counted where it entered)."""
        buf, n = _buffer("data", data)
        o, snap = L.Outcome(), ctypes.c_void_p()
        with self._use() as p:
            _check(
                "kvrelay_admission_decode_msgpack",
                lib.kvrelay_admission_decode_msgpack(p, buf, n, ctypes.byref(o), ctypes.byref(snap)),
            )
        return _outcome(o, snap)

    @property
    def counters(self) -> dict[str, int]:
        c = L.Counters()
        with self._use() as p:
            _check("kvrelay_admission_counters", lib.kvrelay_admission_counters(p, ctypes.byref(c)))
        return {f[0]: getattr(c, f[0]) for f in L.Counters._fields_ if f[0] != "size"}

    def prometheus(self) -> str:
        """The counters as Prometheus text."""
        with self._use() as p:
            return _text("kvrelay_admission_prometheus", lib.kvrelay_admission_prometheus, p)
