"""kvrelay for Python: admission of KV hint envelopes, immutable snapshots, candidate collection
and orchestration with a Python provider, the KV copy engine, and the KV agent (serve a pool,
fetch named blocks from another instance), all over libkvrelay's stable C ABI (ctypes: no
compiler needed at install time).

>>> import kvrelay
>>> edge = kvrelay.Admission(trusted=True)
>>> out = edge.admit(b'{"protocol_version":"0.1","message_id":"m","actions":[]}')
>>> out.admitted, out.snapshot.message_id
(True, 'm')

Handles (``Admission``, ``Snapshot``, ``Orchestrator``, ``KvLayout``, ``CpuEngine``, ``Agent``,
``Fetch``) free their C object on ``close()``, at the end of a ``with`` block, or when collected.
Failures raise ``KvrelayError`` carrying the library's last-error text; bad Python arguments
raise ``TypeError`` or ``ValueError`` before any C call.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from . import _bindings as B
from . import _lib as L
from ._lib import lib

__all__ = [
    "Action",
    "Admission",
    "Agent",
    "AgentLimit",
    "DecisionKind",
    "Discard",
    "FetchFailure",
    "OutcomeKind",
    "Reason",
    "Status",
    "Binding",
    "BlockHolder",
    "Candidate",
    "Capabilities",
    "CpuEngine",
    "Decision",
    "Fetch",
    "FetchRequest",
    "FetchResult",
    "Fingerprint",
    "KvLayout",
    "KvrelayError",
    "Orchestrator",
    "Outcome",
    "Provider",
    "Snapshot",
    "cuda_available",
    "fetch_run_length",
    "kv_checksum",
    "version",
]

# The header's enums, their values the C labels (they compare equal to the plain strings:
# ``outcome.reason == "untrusted"``); ``.c`` is the C value.
OutcomeKind = B.OutcomeKind
Reason = B.Reason
DecisionKind = B.DecisionKind
Discard = B.Discard
FetchFailure = B.FetchFailure
AgentLimit = B.AgentLimit
Status = B.Status


def _label(enum: Any, c: int) -> Any:
    """The member of C value ``c``, or ``"unknown"`` for a value newer than this header."""
    m = enum.from_c(c)
    return m if m is not None else "unknown"



class KvrelayError(RuntimeError):
    """A kvrelay call failed: ``status`` is the C status code, the message the library's own
    account of it (``kvrelay_last_error_message``)."""

    def __init__(self, call: str, status: int, message: str):
        super().__init__(f"{call}: {message}")
        self.call = call
        self.status = status


def _last_error() -> str:
    n = ctypes.c_size_t(0)
    lib.kvrelay_last_error_message(None, 0, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value + 1)
    lib.kvrelay_last_error_message(buf, len(buf), ctypes.byref(n))
    return buf.value.decode("utf-8", "replace")


def _check(call: str, status: int) -> None:
    if status != L.OK:
        msg = _last_error() or lib.kvrelay_status_message(status).decode()
        raise KvrelayError(call, status, msg)


def _sized(call: str, f: Callable[..., int], *args: Any) -> bytes:
    """The size-query convention: ask for the size, then fill a buffer of that size."""
    n = ctypes.c_size_t(0)
    st = f(*args, None, 0, ctypes.byref(n))
    if st not in (L.OK, L.ERR_BUFFER_TOO_SMALL):
        _check(call, st)
    buf = ctypes.create_string_buffer(max(n.value, 1))
    _check(call, f(*args, buf, len(buf), ctypes.byref(n)))
    return buf.raw[: n.value]


def _text(call: str, f: Callable[..., int], *args: Any) -> str:
    return _sized(call, f, *args).rstrip(b"\0").decode("utf-8")


def _utf8(name: str, s: Any) -> bytes:
    if not isinstance(s, str):
        raise TypeError(f"{name} must be a str, not {type(s).__name__}")
    return s.encode("utf-8")


def _buffer(name: str, data: Any) -> tuple[Any, int]:
    """A readable byte buffer: its address (kept alive by the returned object) and length."""
    try:
        mv = memoryview(data).cast("B")
    except TypeError:
        raise TypeError(f"{name} must be bytes-like, not {type(data).__name__}") from None
    if mv.readonly:
        # a read-only buffer: copy into a ctypes array (admission reads it once)
        return (ctypes.c_char * len(mv)).from_buffer_copy(mv), len(mv)
    return (ctypes.c_char * len(mv)).from_buffer(mv), len(mv)


U32 = 2**32 - 1
U64 = 2**64 - 1
SIZE_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_size_t)) - 1


def _int(name: str, v: Any, lo: int = 0, hi: int = U64) -> int:
    """``v`` as an int in ``lo..=hi`` (a C integer's range: never wrapped), else TypeError /
    ValueError naming the argument. Accepts what ``operator.index`` accepts, never a bool."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(v).__name__}") from None
    if not lo <= i <= hi:
        raise ValueError(f"{name} must be in {lo}..={hi}, not {i}")
    return i


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, not {type(v).__name__}")
    return v


def _strs(name: str, xs: Any) -> list[bytes]:
    """A sequence of str (not a lone str, which would iterate its characters), as UTF-8."""
    if isinstance(xs, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of str, not a single {type(xs).__name__}")
    try:
        items = list(xs)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of str, not {type(xs).__name__}") from None
    return [_utf8(name, x) for x in items]


def _ints(name: str, xs: Iterable[int], ctype: Any) -> Any:
    """``xs`` as a C array of ``ctype`` (an unsigned ctypes integer), each value checked."""
    if isinstance(xs, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, not {type(xs).__name__}")
    try:
        xs = list(xs)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, not {type(xs).__name__}") from None
    hi = 2 ** (ctypes.sizeof(ctype) * 8) - 1
    return (ctype * len(xs))(*[_int(f"{name}[{i}]", x, 0, hi) for i, x in enumerate(xs)])


def _u32s(name: str, xs: Iterable[int]) -> Any:
    return _ints(name, xs, ctypes.c_uint32)


def _u64s(name: str, xs: Iterable[int]) -> Any:
    return _ints(name, xs, ctypes.c_uint64)


def _view(owner: Any, ptr: Optional[int], n: int) -> memoryview:
    """A read-only memoryview of ``n`` bytes at ``ptr`` that keeps ``owner`` (what owns the
    bytes: a ``_SnapshotRef``) alive as long as the view, or any view derived from it, lives."""
    arr = (ctypes.c_char * n).from_address(ptr or 0) if n else (ctypes.c_char * 0)()
    arr._owner = owner  # the view holds the array, the array holds the owner of the bytes
    return memoryview(arr).cast("B").toreadonly()


# --- callbacks: module-level trampolines and a handle table ----------------------------------
#
# What C calls back (holder, provider, fetch completion) is a module-level ctypes function
# whose ``user_data`` is an integer handle into ``_table`` (never a Python object's address):
# no callback closes over the object that owns it, so Agents and Orchestrators die by reference
# counting, on the thread that drops them. The C library's ``destroy`` callback removes the
# entry (it runs exactly once, when the C object is freed or its creation fails).

log = logging.getLogger("kvrelay")
_tls = threading.local()


class _Table:
    """Integer handles to Python objects, for C ``user_data``. Handles are never reused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, Any] = {}
        self._next = 0

    def add(self, obj: Any) -> int:
        with self._lock:
            self._next += 1
            self._items[self._next] = obj
            return self._next

    def get(self, handle: Optional[int]) -> Any:
        return self._items.get(handle or 0)

    def pop(self, handle: Optional[int]) -> Any:
        with self._lock:
            return self._items.pop(handle or 0, None)

    def __len__(self) -> int:
        return len(self._items)


_table = _Table()


class _Errors:
    """Exceptions raised by the Python code C called back (a holder, a provider, a fetch
    callback): each one is logged on the ``kvrelay`` logger and counted here."""

    def __init__(self) -> None:
        self.count = 0
        self.last: Optional[BaseException] = None

    def record(self, what: str, e: BaseException) -> None:
        self.count += 1  # under the GIL
        self.last = e
        try:
            log.error("kvrelay: %s raised %s", what, type(e).__name__, exc_info=e)
        except BaseException:  # never unwind into C, even when logging fails
            pass


def _enter_agent_thread() -> bool:
    prev = getattr(_tls, "in_callback", False)
    _tls.in_callback = True
    return prev


class _HolderSlot:
    __slots__ = ("holder", "errors")

    def __init__(self, holder: Any, errors: _Errors):
        self.holder, self.errors = holder, errors


def _on_pin(user_data: Optional[int], names: Any, n: int, ids_out: Any) -> int:
    prev = _enter_agent_thread()
    slot = _table.get(user_data)
    try:
        if slot is None:
            return 0
        ids = list(slot.holder.pin(names[:n]))
        if len(ids) > n:
            raise ValueError(f"pin() returned {len(ids)} ids for {n} names")
        for i, b in enumerate(ids):
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < 2**32:
                raise ValueError("pin() must return block ids (ints in 0..2**32)")
            ids_out[i] = b
        return len(ids)
    except BaseException as e:  # never unwind into C: serve nothing
        slot.errors.record("the block holder's pin()", e)
        return 0
    finally:
        _tls.in_callback = prev


def _on_unpin(user_data: Optional[int], ids: Any, n: int) -> None:
    prev = _enter_agent_thread()
    slot = _table.get(user_data)
    try:
        if slot is not None:
            slot.holder.unpin(ids[:n])
    except BaseException as e:
        slot.errors.record("the block holder's unpin()", e)
    finally:
        _tls.in_callback = prev


def _on_returned(user_data: Optional[int], ids: Any, n: int) -> None:
    prev = _enter_agent_thread()
    slot = _table.get(user_data)
    try:
        f = getattr(slot.holder, "returned", None) if slot is not None else None
        if f is not None:
            f(ids[:n])
    except BaseException as e:
        slot.errors.record("the block holder's returned()", e)
    finally:
        _tls.in_callback = prev


def _on_destroy(user_data: Optional[int]) -> None:
    # may run on an agent thread (a fetch's completion) or in the call that frees the C object;
    # dropping the entry may drop the last reference to anything, an Agent included
    prev = _enter_agent_thread()
    try:
        _table.pop(user_data)
    except BaseException:
        pass
    finally:
        _tls.in_callback = prev


_PIN = L.PIN(_on_pin)
_UNPIN = L.UNPIN(_on_unpin)
_RETURNED = L.RETURNED(_on_returned)
_HOLDER_DESTROY = L.HOLDER_DESTROY(_on_destroy)
_PROVIDER_DESTROY = L.PROVIDER_DESTROY(_on_destroy)
_FETCH_DESTROY = L.FETCH_DESTROY(_on_destroy)


def version() -> str:
    """The library's version (``kvrelay_version``)."""
    return lib.kvrelay_version().decode()


def kv_checksum(data: Any) -> int:
    """The KV block checksum the agent records and verifies (``kvrelay_kv_checksum``)."""
    buf, n = _buffer("data", data)
    out = ctypes.c_uint64()
    _check("kvrelay_kv_checksum", lib.kvrelay_kv_checksum(buf, n, ctypes.byref(out)))
    return out.value


def cuda_available(device: int = 0) -> bool:
    """Whether CUDA device ``device`` can be used (False without a driver or device)."""
    return lib.kvrelay_cuda_available(_int("device", device, 0, 2**31 - 1)) == L.OK


class _Handle:
    """Owns one C object; ``close()`` frees it once."""

    _free: Callable[[Any], None]

    def __init__(self, ptr: int):
        self._ptr = ptr

    def close(self) -> None:
        p, self._ptr = getattr(self, "_ptr", None), None
        if p:
            type(self)._free(p)

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def _p(self) -> int:
        if not self._ptr:
            raise ValueError(f"this {type(self).__name__} is closed")
        return self._ptr


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
        self.ptr = ptr

    def __del__(self, _release: Callable[[Any], None] = lib.kvrelay_snapshot_release) -> None:
        p, self.ptr = self.ptr, None
        if p:
            _release(p)


class Snapshot(_Handle):
    """An admitted envelope, immutable: canonical bytes and zero-copy accessors. Share it with
    ``retain()`` (another reference to the same snapshot: a child request, a queue, a rank).
    ``close()`` gives up this handle's reference; the views it handed out (``canonical``,
    ``Action.payload``, ``Action.canonical``) hold their own and stay valid."""

    def __init__(self, ptr: int):
        object.__setattr__(self, "_ref", _SnapshotRef(ptr))

    def close(self) -> None:
        object.__setattr__(self, "_ref", None)

    def __del__(self) -> None:
        pass

    @property
    def _ptr(self) -> Optional[int]:
        r = self._ref
        return r.ptr if r is not None else None

    def retain(self) -> "Snapshot":
        """Another handle to the same snapshot (one atomic increment)."""
        return Snapshot(lib.kvrelay_snapshot_retain(self._p))

    @property
    def canonical(self) -> memoryview:
        """The canonical compact JSON bytes (a read-only view, no copy)."""
        b = L.Bytes()
        _check("kvrelay_snapshot_canonical", lib.kvrelay_snapshot_canonical(self._p, ctypes.byref(b)))
        return _view(self._ref, b.ptr, b.len)

    @property
    def protocol_version(self) -> str:
        s = L.Str()
        _check("kvrelay_snapshot_protocol_version", lib.kvrelay_snapshot_protocol_version(self._p, ctypes.byref(s)))
        return L.text(s)

    @property
    def message_id(self) -> str:
        s = L.Str()
        _check("kvrelay_snapshot_message_id", lib.kvrelay_snapshot_message_id(self._p, ctypes.byref(s)))
        return L.text(s)

    def __len__(self) -> int:
        n = ctypes.c_size_t()
        _check("kvrelay_snapshot_action_count", lib.kvrelay_snapshot_action_count(self._p, ctypes.byref(n)))
        return n.value

    def action(self, index: int) -> Action:
        """The action at ``index`` (producer order); ``IndexError`` past the end."""
        _int("index", index, 0, SIZE_MAX)
        if not 0 <= index < len(self):
            raise IndexError(f"action {index} of {len(self)}")
        a = L.Action()
        _check("kvrelay_snapshot_action", lib.kvrelay_snapshot_action(self._p, index, ctypes.byref(a)))
        return Action(
            a.index,
            L.text(a.id),
            L.text(a.action_type),
            L.text(a.version),
            _view(self._ref, a.payload.ptr, a.payload.len),
            _view(self._ref, a.canonical.ptr, a.canonical.len),
        )

    @property
    def actions(self) -> list[Action]:
        return [self.action(i) for i in range(len(self))]

    def to_json(self) -> bytes:
        """An independent copy of the canonical document."""
        return _sized("kvrelay_snapshot_decode", lib.kvrelay_snapshot_decode, self._p)

    def to_msgpack(self) -> bytes:
        """The envelope as MessagePack, for transport (``Admission.decode_msgpack`` reads it)."""
        return _sized("kvrelay_snapshot_msgpack", lib.kvrelay_snapshot_msgpack, self._p)

    def action_envelope(self, index: int) -> bytes:
        """The canonical one-action envelope of action ``index``."""
        _int("index", index, 0, SIZE_MAX)
        if not 0 <= index < len(self):
            raise IndexError(f"action {index} of {len(self)}")
        return _sized("kvrelay_snapshot_action_envelope", lib.kvrelay_snapshot_action_envelope, self._p, index)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Snapshot is immutable")

    def __repr__(self) -> str:
        # never hint contents: no message id, no action
        if self._ref is None:
            return "Snapshot(closed)"
        return f"Snapshot(actions={len(self)}, canonical=<{len(self.canonical)} bytes>)"


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




def _outcome(o: L.Outcome, snap: ctypes.c_void_p) -> Outcome:
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
        o, snap = L.Outcome(), ctypes.c_void_p()
        if raw is None:
            buf, n = None, 0
        elif type(raw) is bytes:
            buf, n = raw, len(raw)  # passed as a pointer to its bytes, no copy
        else:
            if isinstance(raw, str):
                raise TypeError("raw must be bytes as received (encode text first)")
            buf, n = _buffer("raw", raw)
        st = lib.kvrelay_admit(self._p, buf, n, ctypes.byref(o), ctypes.byref(snap))
        if st:
            _check("kvrelay_admit", st)
        return _outcome(o, snap)

    def decode_msgpack(self, data: Any) -> Outcome:
        """Re-admit a snapshot that travelled as MessagePack: re-validated with this edge's
        limits; trust does not apply and nothing is counted (it was counted where it entered)."""
        buf, n = _buffer("data", data)
        o, snap = L.Outcome(), ctypes.c_void_p()
        _check(
            "kvrelay_admission_decode_msgpack",
            lib.kvrelay_admission_decode_msgpack(self._p, buf, n, ctypes.byref(o), ctypes.byref(snap)),
        )
        return _outcome(o, snap)

    @property
    def counters(self) -> dict[str, int]:
        c = L.Counters()
        _check("kvrelay_admission_counters", lib.kvrelay_admission_counters(self._p, ctypes.byref(c)))
        return {n: getattr(c, n) for n, _ in L.Counters._fields_}

    def prometheus(self) -> str:
        """The counters as Prometheus text."""
        return _text("kvrelay_admission_prometheus", lib.kvrelay_admission_prometheus, self._p)


# --- candidates and orchestration ---------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A supported ``kv.fetch`` action: its position and the families (names) supporting it."""

    action_index: int
    families: tuple[str, ...]


class Capabilities(_Handle):
    """What the backend families support: ``[(family, action_type, action_version), ...]``."""

    _free = staticmethod(lib.kvrelay_capabilities_free)

    def __init__(self, entries: Sequence[tuple[str, str, str]]):
        super().__init__(0)
        if isinstance(entries, (str, bytes)):
            raise TypeError("entries must be a sequence of (family, action_type, action_version) tuples")
        enc = []
        self.families: list[str] = []
        for e in entries:
            if not (isinstance(e, tuple) and len(e) == 3):
                raise TypeError("each capability is a (family, action_type, action_version) tuple")
            enc.append(tuple(_utf8(n, x) for n, x in zip(("family", "action_type", "action_version"), e)))
            if e[0] not in self.families:
                self.families.append(e[0])
        b = ctypes.c_void_p()
        _check("kvrelay_capabilities_builder_new", lib.kvrelay_capabilities_builder_new(ctypes.byref(b)))
        try:
            for f, t, v in enc:
                _check(
                    "kvrelay_capabilities_builder_add",
                    lib.kvrelay_capabilities_builder_add(b, f, len(f), t, len(t), v, len(v)),
                )
        except BaseException:
            lib.kvrelay_capabilities_builder_free(b)
            raise
        out = ctypes.c_void_p()
        _check("kvrelay_capabilities_build", lib.kvrelay_capabilities_build(b, ctypes.byref(out)))
        self._ptr = out.value

    def candidates(self, snapshot: Optional[Snapshot]) -> list[Candidate]:
        """The candidates of ``snapshot`` in producer order (none for ``None``)."""
        if snapshot is None:
            return []
        if not isinstance(snapshot, Snapshot):
            raise TypeError("snapshot must be a Snapshot")
        n = ctypes.c_size_t()
        st = lib.kvrelay_collect_candidates(snapshot._p, self._p, None, 0, ctypes.byref(n), None)
        if st not in (L.OK, L.ERR_BUFFER_TOO_SMALL):
            _check("kvrelay_collect_candidates", st)
        arr = (L.Candidate * max(n.value, 1))()
        _check("kvrelay_collect_candidates", lib.kvrelay_collect_candidates(snapshot._p, self._p, arr, len(arr), ctypes.byref(n), None))
        return [
            Candidate(c.action_index, tuple(f for i, f in enumerate(self.families) if c.families >> i & 1))
            for c in arr[: n.value]
        ]


@dataclass(frozen=True)
class Binding:
    """A backend binding of ``family``: ``named`` (fetches by content name) or request-paired,
    ``authorized`` or not, and the ``(action_type, action_version)`` pairs it supports."""

    id: str
    family: str
    named: bool = True
    authorized: bool = True
    supports: tuple[tuple[str, str], ...] = (("kv.fetch", "1.0"),)

    def __post_init__(self) -> None:
        _utf8("id", self.id)
        _utf8("family", self.family)
        _bool("named", self.named)
        _bool("authorized", self.authorized)
        if isinstance(self.supports, (str, bytes)):
            raise TypeError("supports must be a sequence of (action_type, action_version) tuples")
        for t in self.supports:
            if not (isinstance(t, tuple) and len(t) == 2):
                raise TypeError("supports must hold (action_type, action_version) tuples")
            _utf8("action_type", t[0])
            _utf8("action_version", t[1])


@dataclass(frozen=True)
class FetchRequest:
    """What a provider is asked to validate, then to fetch (copies: safe to keep). Its text
    representation shows the binding, the family and sizes, never hint contents."""

    binding_id: str
    family: str
    action_index: int
    action_type: str
    action_version: str
    payload: bytes
    endpoint: str
    envelope: bytes
    context: Any

    def __repr__(self) -> str:
        return (
            f"FetchRequest(binding_id={self.binding_id!r}, family={self.family!r}, action_index={self.action_index}, "
            f"payload=<{len(self.payload)} bytes>, envelope=<{len(self.envelope)} bytes>)"
        )


class Provider(Protocol):
    """A consumer's provider: ``validate`` then ``fetch`` return ``True``/``0`` to accept, or
    ``False``/a non-zero int to refuse. An exception counts as a refusal (code -2), never a
    crash; the orchestrator records it in ``Orchestrator.last_provider_error``."""

    def validate(self, request: FetchRequest) -> bool | int: ...

    def fetch(self, request: FetchRequest) -> bool | int: ...


@dataclass(frozen=True)
class Decision:
    """``kind`` is ``named_fetch`` or ``keep_paired_path``; ``discard`` the reason label
    (``none`` for a named fetch)."""

    kind: str
    discard: str
    binding_id: Optional[str]
    action_index: Optional[int]
    provider_code: int


class _ProviderSlot:
    __slots__ = ("provider", "errors")

    def __init__(self, provider: Any, errors: _Errors):
        self.provider, self.errors = provider, errors


_contexts = _Table()  # per-call contexts of Orchestrator.decide (kvrelay_fetch_request.call_context)


def _provider_call(which: str, user_data: Optional[int], r: Any) -> int:
    slot = _table.get(user_data)
    try:
        req = r.contents
        fr = FetchRequest(
            L.text(req.binding_id),
            L.text(req.family),
            req.action_index,
            L.text(req.action_type),
            L.text(req.action_version),
            ctypes.string_at(req.payload.ptr, req.payload.len),
            L.text(req.endpoint),
            ctypes.string_at(req.envelope.ptr, req.envelope.len),
            _contexts.get(req.call_context),
        )
        answer = getattr(slot.provider, which)(fr)
        if answer is True or answer is None:
            return 0
        if answer is False:
            return 1
        return _int(f"the provider's {which}() answer", answer, -(2**31), 2**31 - 1)
    except BaseException as e:  # never unwind into C: a refusal
        if slot is not None:
            slot.errors.record(f"the provider's {which}()", e)
        return -2


def _on_validate(user_data: Optional[int], r: Any) -> int:
    return _provider_call("validate", user_data, r)


def _on_fetch(user_data: Optional[int], r: Any) -> int:
    return _provider_call("fetch", user_data, r)


_VALIDATE = L.PROVIDER_VALIDATE(_on_validate)
_FETCH = L.PROVIDER_FETCH(_on_fetch)


class Orchestrator(_Handle):
    """Candidate collection, binding resolution, the trusted endpoint registry and the
    provider, for one request at a time (thread-safe). ``endpoints`` is the registry
    (``tcp://HOST:PORT``)."""

    _free = staticmethod(lib.kvrelay_orchestrator_free)

    def __init__(
        self,
        capabilities: Capabilities,
        bindings: Sequence[Binding],
        endpoints: Sequence[str],
        provider: Provider,
        *,
        metric_prefix: Optional[str] = None,
    ):
        super().__init__(0)
        if not isinstance(capabilities, Capabilities):
            raise TypeError("capabilities must be a Capabilities")
        for m in ("validate", "fetch"):
            if not callable(getattr(provider, m, None)):
                raise TypeError(f"the provider has no {m}() method")
        if isinstance(bindings, (str, bytes)):
            raise TypeError("bindings must be a sequence of Binding values")
        bindings = list(bindings)
        for b in bindings:
            if not isinstance(b, Binding):
                raise TypeError(f"bindings must be Binding values, not {type(b).__name__}")
        eps = _strs("endpoints", endpoints)
        p = _utf8("metric_prefix", metric_prefix) if metric_prefix is not None else None
        self._errors = _Errors()
        cfg = ctypes.c_void_p()
        _check("kvrelay_policy_config_new", lib.kvrelay_policy_config_new(ctypes.byref(cfg)))
        try:
            for b in bindings:
                i, f = _utf8("binding id", b.id), _utf8("family", b.family)
                _check(
                    "kvrelay_policy_config_add_binding",
                    lib.kvrelay_policy_config_add_binding(cfg, i, len(i), f, len(f), 0 if b.named else 1, b.authorized),
                )
                for t, v in b.supports:
                    t, v = _utf8("action_type", t), _utf8("action_version", v)
                    _check(
                        "kvrelay_policy_config_binding_support",
                        lib.kvrelay_policy_config_binding_support(cfg, i, len(i), t, len(t), v, len(v)),
                    )
            for e in eps:
                _check("kvrelay_policy_config_add_endpoint", lib.kvrelay_policy_config_add_endpoint(cfg, e, len(e)))
            if p is not None:
                _check("kvrelay_policy_config_set_metric_prefix", lib.kvrelay_policy_config_set_metric_prefix(cfg, p, len(p)))
            # the provider lives in the handle table until the orchestrator's destroy callback
            # (kvrelay_orchestrator_free, or right away if kvrelay_orchestrator_new fails)
            prov = L.Provider(_table.add(_ProviderSlot(provider, self._errors)), _VALIDATE, _FETCH, _PROVIDER_DESTROY)
            out = ctypes.c_void_p()
            _check("kvrelay_orchestrator_new", lib.kvrelay_orchestrator_new(capabilities._p, cfg, ctypes.byref(prov), ctypes.byref(out)))
            self._ptr = out.value
        finally:
            lib.kvrelay_policy_config_free(cfg)

    @property
    def last_provider_error(self) -> Optional[BaseException]:
        """The last exception the provider raised (each is logged and counted as a refusal)."""
        return self._errors.last

    @property
    def provider_errors(self) -> int:
        """How many exceptions the provider raised."""
        return self._errors.count

    def decide(
        self,
        snapshot: Optional[Snapshot],
        *,
        generation_only: bool = True,
        lora_adapter: bool = False,
        context: Any = None,
    ) -> Decision:
        """Decide for one request; when every check passes the provider's ``validate`` then
        ``fetch`` run here, on this thread, with ``context`` as ``FetchRequest.context``."""
        if snapshot is not None and not isinstance(snapshot, Snapshot):
            raise TypeError("snapshot must be a Snapshot or None")
        _bool("generation_only", generation_only)
        _bool("lora_adapter", lora_adapter)
        snap = snapshot._p if snapshot is not None else None
        key = _contexts.add(context)
        try:
            info = L.RequestInfo(generation_only, lora_adapter)
            d = L.Decision()
            _check(
                "kvrelay_orchestrate_with_context",
                lib.kvrelay_orchestrate_with_context(
                    self._p, ctypes.byref(info), snap, key, ctypes.byref(d)
                ),
            )
        finally:
            _contexts.pop(key)
        named = d.kind == B.KVRELAY_DECISION_NAMED_FETCH
        return Decision(
            _label(DecisionKind, d.kind),
            _label(Discard, d.discard),
            L.text(d.binding_id) if named else None,
            d.action_index if named else None,
            d.provider_code,
        )

    @property
    def counters(self) -> dict[str, Any]:
        c = L.PolicyCounters()
        _check("kvrelay_orchestrator_counters", lib.kvrelay_orchestrator_counters(self._p, ctypes.byref(c)))
        discarded = {m.value: c.discarded[m.c] for m in Discard if m.c and m.c < L.DISCARD_SLOTS}
        return {
            "named_fetch": c.named_fetch,
            "discarded": discarded,
            "unknown_type": c.unknown_type,
            "no_matching_version": c.no_matching_version,
        }

    def prometheus(self) -> str:
        return _text("kvrelay_orchestrator_prometheus", lib.kvrelay_orchestrator_prometheus, self._p)


# --- KV layouts and the copy engine ---------------------------------------------------------


class KvLayout(_Handle):
    """Where every block of a KV pool lives: segments (one per layer and K/V, or one for the
    whole block), block ``b`` of a segment at ``base + b * block_stride``. Build it from raw
    addresses, from a writable buffer (``bytearray``, ``mmap``: kept alive by the layout) or
    from tensor-like objects (``data_ptr()``, ``stride()``, ``element_size()``, ``shape``:
    ``torch.Tensor`` among them)."""

    _free = staticmethod(lib.kvrelay_kv_layout_free)

    def __init__(self, num_blocks: int, segments: Sequence[tuple[int, int, int]], extents: Sequence[tuple[int, int]], keep: Any = None):
        super().__init__(0)
        _int("num_blocks", num_blocks, 1, U32)
        segments, extents = list(segments), list(extents)
        if not segments:
            raise ValueError("a layout needs at least one segment")

        def table(name: str, rows: list, ctype: Any) -> Any:
            width = len(ctype._fields_)
            out = []
            for i, r in enumerate(rows):
                if not (isinstance(r, (tuple, list)) and len(r) == width):
                    raise TypeError(f"{name}[{i}] must be a tuple of {width} ints")
                out.append(ctype(*(_int(f"{name}[{i}].{f}", x) for (f, _), x in zip(ctype._fields_, r))))
            return (ctype * len(out))(*out)

        segs = table("segments", segments, L.KvSegment)
        exts = table("extents", extents, L.KvExtent)
        out = ctypes.c_void_p()
        _check("kvrelay_kv_layout_new", lib.kvrelay_kv_layout_new(num_blocks, segs, len(segments), exts, len(extents), ctypes.byref(out)))
        self._ptr = out.value
        self._keep = keep
        self.num_blocks = num_blocks
        self.block_bytes = int(lib.kvrelay_kv_layout_stage_block_bytes(self._ptr))

    @classmethod
    def contiguous(cls, base: int, num_blocks: int, block_bytes: int, keep: Any = None) -> "KvLayout":
        """``num_blocks`` blocks of ``block_bytes`` one after another from address ``base``."""
        return cls(num_blocks, [(base, block_bytes, block_bytes)], [(base, num_blocks * block_bytes)], keep)

    @classmethod
    def from_buffer(cls, buf: Any, num_blocks: int, block_bytes: int) -> "KvLayout":
        """A contiguous pool over a writable buffer of ``num_blocks * block_bytes`` bytes."""
        _int("block_bytes", block_bytes, 1)
        _int("num_blocks", num_blocks, 1, U32)
        try:
            mv = memoryview(buf).cast("B")
        except TypeError:
            raise TypeError(f"buf must be a writable buffer, not {type(buf).__name__}") from None
        if mv.readonly:
            raise ValueError("the pool's buffer must be writable")
        if len(mv) < num_blocks * block_bytes:
            raise ValueError(f"the buffer holds {len(mv)} bytes, {num_blocks} blocks need {num_blocks * block_bytes}")
        arr = (ctypes.c_char * len(mv)).from_buffer(mv)
        return cls.contiguous(ctypes.addressof(arr), num_blocks, block_bytes, keep=(arr, buf))

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any], num_blocks: Optional[int] = None) -> "KvLayout":
        """One segment per tensor (e.g. each layer's K then V), block ``b`` being ``t[b]``: the
        first dimension indexes blocks, the rest of a block must be contiguous. Each tensor's
        extent is its storage from ``t[0]`` to the end of ``t[n-1]``."""
        segs, exts = [], []
        n = num_blocks
        for t in tensors:
            for m in ("data_ptr", "stride", "element_size"):
                if not callable(getattr(t, m, None)):
                    raise TypeError(f"a tensor must have {m}() (torch.Tensor-like)")
            shape = tuple(t.shape)
            if not shape:
                raise ValueError("a tensor needs a block dimension")
            el = t.element_size()
            inner = 1
            for d in shape[1:]:
                inner *= d
            strides = t.stride() if callable(t.stride) else t.stride
            expect = 1
            for d, s in zip(reversed(shape[1:]), reversed(tuple(strides)[1:])):
                if d > 1 and s != expect:
                    raise ValueError("each block of a tensor must be contiguous (t[b] of a contiguous tensor)")
                expect *= d
            blocks = shape[0] if n is None else n
            if blocks > shape[0]:
                raise ValueError(f"num_blocks {blocks} exceeds a tensor's {shape[0]} blocks")
            n = blocks
            stride = tuple(strides)[0] * el
            per = inner * el
            segs.append((t.data_ptr(), stride, per))
            exts.append((t.data_ptr(), (blocks - 1) * stride + per))
        if n is None:
            raise ValueError("no tensors")
        return cls(n, segs, exts, keep=list(tensors))


class CpuEngine(_Handle):
    """The CPU copy engine over a host-memory layout: gather blocks into a staging buffer, or
    scatter one back (block-major, ``block_bytes`` per block)."""

    _free = staticmethod(lib.kvrelay_cpu_engine_free)

    def __init__(self, layout: KvLayout):
        super().__init__(0)
        if not isinstance(layout, KvLayout):
            raise TypeError("layout must be a KvLayout")
        out = ctypes.c_void_p()
        _check("kvrelay_cpu_engine_new", lib.kvrelay_cpu_engine_new(layout._p, ctypes.byref(out)))
        self._ptr = out.value
        self._layout = layout
        self._lock = threading.Lock()

    def gather(self, ids: Sequence[int], out: Any) -> None:
        """Copy blocks ``ids`` into ``out`` (writable, ``len(ids) * block_bytes``)."""
        arr, n = _buffer("out", out)
        if memoryview(out).readonly:
            raise ValueError("out must be writable")
        i = _u32s("ids", ids)
        with self._lock:
            _check("kvrelay_cpu_gather", lib.kvrelay_cpu_gather(self._p, i, len(i), arr, n))

    def scatter(self, data: Any, ids: Sequence[int]) -> None:
        """Copy ``data`` (``len(ids) * block_bytes``) into blocks ``ids``."""
        arr, n = _buffer("data", data)
        i = _u32s("ids", ids)
        with self._lock:
            _check("kvrelay_cpu_scatter", lib.kvrelay_cpu_scatter(self._p, arr, n, i, len(i)))


# --- the KV agent ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """What two agents compare before any block moves; ``naming`` is the runtime's 64-bit
    naming-scheme id (equal ids must mean equal names for equal KV)."""

    block_tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    naming: int

    def __post_init__(self) -> None:
        for f, _ in L.AgentFingerprint._fields_:
            _int(f, getattr(self, f), 0, U64 if f == "naming" else U32)


class BlockHolder(Protocol):
    """The runtime's reuse cache as the agent's service sees it. Called on agent threads:
    ``pin(names)`` returns the ids of the leading held run, pinned; ``unpin(ids)`` releases
    them; ``returned(ids)`` (optional) gets withheld destination blocks back. An exception in
    ``pin`` serves nothing (0 blocks)."""

    def pin(self, names: list[int]) -> Sequence[int]: ...

    def unpin(self, ids: list[int]) -> None: ...


@dataclass(frozen=True)
class FetchResult:
    """How a fetch ended: ``failure`` the label (``ok``, ``connect``, ``timeout``, ...),
    ``blocks`` the leading destination blocks written and verified (commit exactly those),
    ``withheld`` blocks after them still held by a NIXL READ, ``detail`` why it failed."""

    failure: str
    blocks: int
    bytes: int
    seconds: float
    withheld: int
    detail: str

    @property
    def ok(self) -> bool:
        return self.failure == "ok"


def _result_of(r: L.FetchResult, detail: str = "") -> FetchResult:
    return FetchResult(_label(FetchFailure, r.failure), r.blocks, r.bytes, r.seconds, r.withheld, detail)


class _FetchSlot:
    __slots__ = ("callback", "future", "errors")

    def __init__(self, callback: Optional[Callable[[FetchResult], None]], future: Future, errors: _Errors):
        self.callback, self.future, self.errors = callback, future, errors


def _on_fetch_done(user_data: Optional[int], r: Any, detail: Any) -> None:
    prev = _enter_agent_thread()
    slot = _table.get(user_data)
    try:
        if slot is None:
            return
        res = _result_of(r.contents, L.text(detail))
        if slot.future.set_running_or_notify_cancel():
            slot.future.set_result(res)
        if slot.callback is not None:
            slot.callback(res)
    except BaseException as e:  # never unwind into C
        if slot is not None:
            slot.errors.record("a fetch callback", e)
    finally:
        _tls.in_callback = prev


_FETCH_DONE = L.FETCH_DONE(_on_fetch_done)
_WAIT_SLICE_MS = 50  # result() waits in slices this long, so that Ctrl-C (signals) get through


class Fetch:
    """A submitted fetch: ``result(timeout)`` waits (interruptible: Ctrl-C raises
    ``KeyboardInterrupt`` within about 50 ms), ``done()`` polls, ``cancel()`` stops it,
    ``close()`` (or the end of a ``with`` block) frees the handle; a running fetch goes on.
    ``future`` is a ``concurrent.futures.Future``: with a ``callback`` given to
    ``Agent.fetch`` it is resolved on the agent's fetch thread, right before the callback runs
    there (keep both short); otherwise the first access starts a thread that waits for it.
    Without a callback nothing of Python runs on the agent's threads (the cheapest
    submission). A Fetch keeps its Agent alive."""

    __slots__ = ("_agent", "_future", "_handle", "__weakref__")

    def __init__(self, agent: "Agent", future: Optional[Future]):
        self._agent = agent
        self._future = future
        self._handle = ctypes.c_void_p()

    @property
    def future(self) -> Future:
        if self._future is None:
            fut: Future = Future()
            self._future = fut
            fut.set_running_or_notify_cancel()

            def wait() -> None:
                try:
                    fut.set_result(self.result())
                except BaseException as e:
                    fut.set_exception(e)

            threading.Thread(target=wait, daemon=True, name="kvrelay-fetch-future").start()
        return self._future

    def _poll(self) -> Optional[L.FetchResult]:
        r = L.FetchResult()
        return r if lib.kvrelay_fetch_poll(self._h, ctypes.byref(r)) == L.OK else None

    @property
    def _h(self) -> ctypes.c_void_p:
        if not self._handle.value:
            raise ValueError("this Fetch is closed")
        return self._handle

    def done(self) -> bool:
        return self._poll() is not None

    def cancel(self) -> None:
        """Ask the fetch to stop (it completes as ``cancelled`` after the block in progress)."""
        _check("kvrelay_fetch_cancel", lib.kvrelay_fetch_cancel(self._h))

    def detail(self) -> str:
        """Why the completed fetch failed, in words (empty when it did not)."""
        return _text("kvrelay_fetch_detail", lib.kvrelay_fetch_detail, self._h)

    def result(self, timeout: Optional[float] = None) -> FetchResult:
        """Wait for the result (``TimeoutError`` after ``timeout`` seconds). Waits in short
        slices, so that signal handlers (Ctrl-C) run meanwhile."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
            if not timeout >= 0:
                raise ValueError(f"timeout must be >= 0, not {timeout}")
        h = self._h
        end = None if timeout is None else time.monotonic() + timeout
        r = L.FetchResult()
        while True:
            ms = _WAIT_SLICE_MS
            if end is not None:
                ms = max(0, min(ms, int((end - time.monotonic()) * 1000)))
            st = lib.kvrelay_fetch_wait(h, ms, ctypes.byref(r))
            if st != L.ERR_PENDING:
                break
            if end is not None and time.monotonic() >= end:
                raise TimeoutError("the fetch is still running")
        _check("kvrelay_fetch_wait", st)
        return _result_of(r, self.detail() if r.failure else "")

    def close(self) -> None:
        """Free the handle (the fetch itself goes on; ``cancel()`` first to stop it)."""
        h = getattr(self, "_handle", None)
        if h is not None and h.value:
            lib.kvrelay_fetch_free(h)
            self._handle = ctypes.c_void_p()

    def __enter__(self) -> "Fetch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


_LIMITS = {m.value: m.c for m in AgentLimit}  # limits by name (kvrelay_agent_limit)


def _free_agent(ptr: int, keep: Any) -> None:
    """Free an agent (its finalizer: ``close()``, its last reference dropped, or interpreter
    exit). ``kvrelay_agent_free`` waits for the agent's threads, so it never runs on one of
    them: there (an agent dropped inside a callback) it runs on a new thread instead. ``keep``
    (the pool's layout and buffer) lives until the agent is freed."""
    if getattr(_tls, "in_callback", False):
        threading.Thread(target=_free_agent, args=(ptr, keep), name="kvrelay-agent-free").start()
        return
    lib.kvrelay_agent_free(ptr)


class Agent(_Handle):
    """The KV agent: serves the pool ``layout`` describes to other instances (through
    ``holder``) and fetches named blocks from them into it. ``listen`` ``None`` makes a
    fetch-only agent; ``allow`` the peers served (``loopback``, addresses, ``ADDR/PREFIX``);
    ``key`` a pre-shared key (bytes) or ``key_env`` the variable holding it; ``transport``
    ``tcp`` or ``nixl`` (with ``nixl_lib_dir``); ``limits`` overrides of the default limits
    (``{"streams": 1, ...}``); ``device`` the CUDA device of a GPU pool."""

    def __init__(
        self,
        fingerprint: Fingerprint,
        layout: KvLayout,
        holder: BlockHolder,
        *,
        listen: Optional[str] = "127.0.0.1:0",
        allow: Sequence[str] = ("loopback",),
        key: Optional[bytes] = None,
        key_env: Optional[str] = None,
        transport: str = "tcp",
        nixl_lib_dir: Optional[str] = None,
        limits: Optional[dict[str, int]] = None,
        device: Optional[int] = None,
    ):
        super().__init__(0)
        if not isinstance(fingerprint, Fingerprint):
            raise TypeError("fingerprint must be a Fingerprint")
        if not isinstance(layout, KvLayout):
            raise TypeError("layout must be a KvLayout")
        for m in ("pin", "unpin"):
            if not callable(getattr(holder, m, None)):
                raise TypeError(f"the holder has no {m}() method")
        # every argument is checked before the first C call
        lst = _utf8("listen", listen) if listen is not None else b""
        peers = _strs("allow", allow)
        t = _utf8("transport", transport)
        d = _utf8("nixl_lib_dir", nixl_lib_dir) if nixl_lib_dir is not None else b""
        if key is not None and not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"key must be bytes, not {type(key).__name__}")
        kenv = _utf8("key_env", key_env) if key_env is not None else None
        lims = []
        if limits is not None:
            if not isinstance(limits, dict):
                raise TypeError(f"limits must be a dict of limit name to int, not {type(limits).__name__}")
            for k, v in limits.items():
                if k not in _LIMITS:
                    raise ValueError(f"unknown limit {k!r} (one of {sorted(_LIMITS)})")
                lims.append((_LIMITS[k], _int(f"limits[{k!r}]", v)))
        if device is not None:
            _int("device", device, -1, 2**31 - 1)
        self._layout = layout
        self._errors = _Errors()
        self._finalizer: Optional[weakref.finalize] = None
        fp = L.AgentFingerprint(*(getattr(fingerprint, f) for f, _ in L.AgentFingerprint._fields_))
        cfg = ctypes.c_void_p()
        _check("kvrelay_agent_config_new", lib.kvrelay_agent_config_new(ctypes.byref(fp), ctypes.byref(cfg)))
        try:
            _check("kvrelay_agent_config_set_listen", lib.kvrelay_agent_config_set_listen(cfg, lst, len(lst)))
            for a in peers:
                _check("kvrelay_agent_config_allow_peer", lib.kvrelay_agent_config_allow_peer(cfg, a, len(a)))
            _check("kvrelay_agent_config_set_transport", lib.kvrelay_agent_config_set_transport(cfg, t, len(t), d, len(d)))
            if key is not None:
                kb = bytes(key)
                _check("kvrelay_agent_config_set_key", lib.kvrelay_agent_config_set_key(cfg, kb, len(kb)))
            if kenv is not None:
                _check("kvrelay_agent_config_key_from_env", lib.kvrelay_agent_config_key_from_env(cfg, kenv, len(kenv)))
            for i, v in lims:
                _check("kvrelay_agent_config_set_limit", lib.kvrelay_agent_config_set_limit(cfg, i, v))
            if device is not None:
                _check("kvrelay_agent_config_set_device", lib.kvrelay_agent_config_set_device(cfg, device))
            # the holder lives in the handle table until the agent's destroy callback
            # (kvrelay_agent_free, or right away if kvrelay_agent_new fails)
            slot = _table.add(_HolderSlot(holder, self._errors))
            h = L.BlockHolder(slot, _PIN, _UNPIN, _HOLDER_DESTROY, _RETURNED)
            out = ctypes.c_void_p()
            _check("kvrelay_agent_new", lib.kvrelay_agent_new(cfg, layout._p, ctypes.byref(h), ctypes.byref(out)))
            self._ptr = out.value
            # freed by close(), when the last reference goes, or at interpreter exit (atexit:
            # before the interpreter stops running Python, so no agent thread calls into it
            # after that)
            self._finalizer = weakref.finalize(self, _free_agent, out.value, layout)
        finally:
            lib.kvrelay_agent_config_free(cfg)

    def close(self) -> None:
        """Stop serving, end running fetches (their callbacks run, as ``shutdown`` or
        ``cancelled``) and free the agent. Called from one of the agent's own callbacks, the
        free happens on a new thread once the callback has returned."""
        self._ptr = None
        f, self._finalizer = getattr(self, "_finalizer", None), None
        if f is not None:
            f()

    def __del__(self) -> None:
        pass  # the finalizer frees it (it does not hold the Agent)

    @property
    def callback_errors(self) -> int:
        """How many exceptions the holder and the fetch callbacks raised (each one logged)."""
        return self._errors.count

    @property
    def endpoint(self) -> str:
        """This agent's ``source_control_endpoint`` (``tcp://ADDR:PORT``; empty: fetch-only)."""
        return _text("kvrelay_agent_endpoint", lib.kvrelay_agent_endpoint, self._p)

    def record_checksums(self, ids: Sequence[int]) -> None:
        """Blocks ``ids`` just became reusable: sum them where they lie (O(bytes))."""
        i = _u32s("ids", ids)
        _check("kvrelay_agent_record_checksums", lib.kvrelay_agent_record_checksums(self._p, i, len(i)))

    def fetch(
        self,
        endpoint: str,
        names: Sequence[int],
        dst_blocks: Sequence[int],
        *,
        held: int = 0,
        deadline_ms: int = 10_000,
        callback: Optional[Callable[[FetchResult], None]] = None,
    ) -> Fetch:
        """Fetch blocks ``names[held:]`` from ``endpoint`` into ``dst_blocks`` (name
        ``held + i`` into ``dst_blocks[i]``). Never blocks; ``callback`` (optional) runs with
        the result on the agent's fetch thread once it completes (keep it short; it must not
        close the agent)."""
        e = _utf8("endpoint", endpoint)
        n, d = _u64s("names", names), _u32s("dst_blocks", dst_blocks)
        _int("held", held, 0, SIZE_MAX)
        _int("deadline_ms", deadline_ms, 1, U32)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable, not {type(callback).__name__}")
        if not len(d):
            raise ValueError("a fetch needs at least one destination block (dst_blocks)")
        if held + len(d) > len(n):
            raise ValueError(f"held + len(dst_blocks) = {held + len(d)} exceeds len(names) = {len(n)}")
        ebuf = ctypes.create_string_buffer(e, len(e))
        p = L.FetchParams(L.Str(ctypes.addressof(ebuf), len(e)), n, len(n), held, d, len(d), deadline_ms)
        if callback is None:
            f = Fetch(self, None)
            _check("kvrelay_agent_submit", lib.kvrelay_agent_submit(self._p, ctypes.byref(p), None, ctypes.byref(f._handle)))
            return f
        fut: Future = Future()
        f = Fetch(self, fut)
        # the callback lives in the handle table until the fetch's destroy callback, which
        # runs exactly once on every path (a refused submission included)
        cbs = L.FetchCallbacks(ctypes.sizeof(L.FetchCallbacks), _table.add(_FetchSlot(callback, fut, self._errors)), _FETCH_DONE, _FETCH_DESTROY)
        _check("kvrelay_agent_submit", lib.kvrelay_agent_submit(self._p, ctypes.byref(p), ctypes.byref(cbs), ctypes.byref(f._handle)))
        return f

    def estimate(self, endpoint: str, blocks: int) -> float:
        """Seconds a fetch of ``blocks`` blocks from ``endpoint`` is expected to take."""
        e = _utf8("endpoint", endpoint)
        _int("blocks", blocks, 0, SIZE_MAX)
        out = ctypes.c_double()
        _check("kvrelay_agent_estimate", lib.kvrelay_agent_estimate(self._p, e, len(e), blocks, ctypes.byref(out)))
        return out.value

    @property
    def stats(self) -> dict[str, int]:
        s = L.AgentStats()
        _check("kvrelay_agent_read_stats", lib.kvrelay_agent_read_stats(self._p, ctypes.byref(s), ctypes.sizeof(s)))
        return {n: getattr(s, n) for n in L.AGENT_STATS}

    def prometheus(self) -> str:
        return _text("kvrelay_agent_prometheus", lib.kvrelay_agent_prometheus, self._p)


def fetch_run_length(names: Sequence[int], held: int, hashes: Sequence[int]) -> int:
    """How many blocks after ``held`` a hint's ``hashes`` cover (membership, SPEC section 8)."""
    n, h = _u64s("names", names), _u64s("hashes", hashes)
    _int("held", held, 0, SIZE_MAX)
    out = ctypes.c_size_t()
    _check("kvrelay_fetch_run_length", lib.kvrelay_fetch_run_length(n, len(n), held, h, len(h), ctypes.byref(out)))
    return out.value
