"""What the modules of the package share: errors, argument checks, the handle table and the
agent-thread trampolines of the holder. Nothing here is public."""

from __future__ import annotations

import array
import ctypes
import logging
import operator
import threading
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar, cast

from . import _bindings as B
from . import _lib as L
from ._lib import lib

# The header's enums, their values the C labels (they compare equal to the plain strings:
# ``outcome.reason == "untrusted"``); ``.c`` is the C value.
OutcomeKind = B.OutcomeKind
Reason = B.Reason
DecisionKind = B.DecisionKind
Discard = B.Discard
FetchFailure = B.FetchFailure
AgentLimit = B.AgentLimit
Status = B.Status
HintSpelling = B.HintSpelling


_BY_C: dict[type[B.CEnum], dict[int, B.CEnum]] = {
    e: {m.c: m for m in e} for e in (OutcomeKind, Reason, DecisionKind, Discard, FetchFailure, AgentLimit, Status, HintSpelling)
}


def _label(enum: type[B.CEnum], c: int) -> str:
    """The member of C value ``c``, or ``"unknown"`` for a value newer than this header (a
    dict lookup: the hot calls (admit, decide, a fetch's result) label every answer)."""
    return _BY_C[enum].get(c, "unknown")



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
    """The size-query convention: ask for the size, then fill a buffer of that size (again,
    larger, when the text grew in between: counters another thread moved)."""
    n = ctypes.c_size_t(0)
    st = f(*args, None, 0, ctypes.byref(n))
    if st not in (L.OK, L.ERR_BUFFER_TOO_SMALL):
        _check(call, st)
    for _ in range(8):
        buf = ctypes.create_string_buffer(max(n.value, 1))
        st = f(*args, buf, len(buf), ctypes.byref(n))
        if st != L.ERR_BUFFER_TOO_SMALL:
            break
    _check(call, st)
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


def _as_int(name: str, v: Any) -> int:
    """``v`` as an int (what ``operator.index`` accepts, never a bool), else TypeError naming
    the argument."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(v).__name__}") from None


def _int(name: str, v: Any, lo: int = 0, hi: int = U64) -> int:
    """``v`` as an int in ``lo..=hi`` (a C integer's range: never wrapped), else TypeError /
    ValueError naming the argument. Accepts what ``operator.index`` accepts, never a bool."""
    i = _as_int(name, v)
    if not lo <= i <= hi:
        raise ValueError(f"{name} must be in {lo}..={hi}, not {i}")
    return i


def _index(name: str, index: Any, n: int, what: str) -> int:
    """``index`` as a position in ``0..n``: ``IndexError`` when negative or past the end (as a
    sequence answers; no counting from the end), ``TypeError`` when not an int
    (``operator.index``, never a bool)."""
    i = _as_int(name, index)
    if not 0 <= i < n:
        raise IndexError(f"{name} {i} out of range ({n} {what})")
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


# array.array type codes of the unsigned ctypes integers (where the sizes agree): array.array
# converts and range-checks a list in C (OverflowError, TypeError; never wrapped)
_ARRAY_CODES = {
    t: code
    for t, code in ((ctypes.c_uint32, "I"), (ctypes.c_uint64, "Q"))
    if array.array(code).itemsize == ctypes.sizeof(t)
}


def _ints(name: str, xs: Iterable[int], ctype: Any) -> Any:
    """``xs`` as a C array of ``ctype`` (an unsigned ctypes integer), each value checked: an
    int (``operator.index``, never a bool) in the type's range, else TypeError / ValueError
    naming the argument and the index."""
    if isinstance(xs, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, not {type(xs).__name__}")
    kind = type(xs)
    items: Sequence[Any]
    if kind is list or kind is tuple:  # exactly (a subclass may iterate differently each time)
        items = cast(Sequence[Any], xs)
    else:
        try:
            items = list(xs)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of ints, not {kind.__name__}") from None
    # the fast path (the hot calls: a fetch's names and blocks): array.array checks every value
    # in C; bools, which it takes for ints, and anything it refuses take the checking path below
    code = _ARRAY_CODES.get(ctype)
    if code is not None and bool not in map(type, items):
        try:
            a = array.array(code, items)
        except (TypeError, OverflowError):
            pass
        else:
            return (ctype * len(a)).from_buffer_copy(a)
    hi = 2 ** (ctypes.sizeof(ctype) * 8) - 1
    return (ctype * len(items))(*[_int(f"{name}[{i}]", x, 0, hi) for i, x in enumerate(items)])


def _u32s(name: str, xs: Iterable[int]) -> Any:
    return _ints(name, xs, ctypes.c_uint32)


def _u64s(name: str, xs: Iterable[int]) -> Any:
    return _ints(name, xs, ctypes.c_uint64)


def _view(owner: Any, ptr: Optional[int], n: int) -> memoryview:
    """A read-only memoryview of ``n`` bytes at ``ptr`` that keeps ``owner`` (what owns the
    bytes: a ``_SnapshotRef``) alive as long as the view, or any view derived from it, lives."""
    arr = (ctypes.c_char * n).from_address(ptr or 0) if n else (ctypes.c_char * 0)()
    setattr(arr, "_owner", owner)  # the view holds the array, the array holds the owner of the bytes
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
    v: bytes = lib.kvrelay_version()
    return v.decode()


def kv_checksum(data: Any) -> int:
    """The KV block checksum the agent records and verifies (``kvrelay_kv_checksum``)."""
    buf, n = _buffer("data", data)
    out = ctypes.c_uint64()
    _check("kvrelay_kv_checksum", lib.kvrelay_kv_checksum(buf, n, ctypes.byref(out)))
    return out.value


def cuda_available(device: int = 0) -> bool:
    """Whether CUDA device ``device`` can be used (False without a driver or device)."""
    st: int = lib.kvrelay_cuda_available(_int("device", device, 0, 2**31 - 1))
    return st == L.OK


_H = TypeVar("_H", bound="_Handle")

# --- handles: one address per call, close() after the calls in flight ------------------------
#
# Every call on a handle registers itself in the handle's ``_calls`` (the calling thread's
# ident: one entry per call in flight), reads the C object's address once, and passes that
# address to every C function it makes. ``close()`` first empties the handle (a call that starts
# after that finds it closed: ValueError), then waits here until no call is in flight on it, then
# frees it, on its own thread. Closed inside one of the handle's own calls on the same thread (a
# provider that closes its Orchestrator), it cannot wait: the last call out frees it.

_ident = threading.get_ident
# One for all handles: closing is rare and a call only takes it when it leaves a closed handle.
# Reentrant: a handle's __del__ (its close()) may run in the middle of another's close().
_lock = threading.RLock()
_closing = threading.Condition(_lock)


def _closed(h: Any) -> ValueError:
    return ValueError(f"this {type(h).__name__} is closed")


def _shut(h: Any) -> Optional[int]:
    """Close ``h`` to new calls and wait for the calls in flight on it: the address to free now,
    or None (closed before; or left to the last call out, see above)."""
    with _lock:
        p: Optional[int] = h._take()
        calls = h._calls if p else None
        if not calls:
            return p  # (the common case: no call in flight)
        me = _ident()
        try:
            while calls and me not in calls:
                # a call leaving wakes this; the timeout only re-checks (a call interrupted in
                # its exit, by a second Ctrl-C, may not have said so)
                _closing.wait(0.1)
        except BaseException:  # interrupted (Ctrl-C) while waiting
            if calls:
                h._orphan = p  # the last call out frees it
            else:
                h._release(p)
            raise
        if calls:  # closed inside one of its own calls, on this thread
            h._orphan = p
            return None
        return p


def _leave(h: Any) -> None:
    """A call left ``h`` after ``close()`` emptied it: wake that close(), or free ``h`` when
    close() left that to the last call out."""
    p = None
    with _lock:
        _closing.notify_all()
        if h._orphan and not h._calls:
            p, h._orphan = h._orphan, None
    if p:
        h._release(p)


def _out(h: Any, me: int) -> None:
    """The end of a call on ``h`` (``me``: its entry in ``h._calls``)."""
    try:
        h._calls.remove(me)
    except ValueError:  # interrupted before it registered
        pass
    if not h._ptr:
        _leave(h)


class _Use:
    """``with h._use() as p``: ``p`` is the address of ``h``'s C object, valid through the block
    (``close()`` waits for it); ``ValueError`` when ``h`` is closed."""

    __slots__ = ("_h", "_me")

    def __init__(self, h: Any):
        self._h, self._me = h, _ident()

    def __enter__(self) -> int:
        h = self._h
        try:
            h._calls.append(self._me)
            p: Optional[int] = h._ptr
        except BaseException:
            _out(h, self._me)
            raise
        if p:
            return p
        _out(h, self._me)
        raise _closed(h)

    def __exit__(self, *exc: Any) -> None:
        _out(self._h, self._me)


class _Handle:
    """Owns one C object; ``close()`` frees it once, after the calls in flight on it."""

    _free: Callable[[Any], None]
    _ptr: Optional[int]  # the C object's address; None (or 0) when closed or not made yet
    _calls: list[int]  # the threads of the calls in flight (one entry per call)
    _orphan: Optional[int] = None  # closed inside its own call: freed by the last call out

    def __init__(self, ptr: Optional[int]):
        self._calls = []
        self._ptr = ptr

    def _take(self) -> Optional[int]:
        p, self._ptr = getattr(self, "_ptr", None), None
        return p

    def _release(self, p: int) -> None:
        type(self)._free(p)

    def _use(self) -> _Use:
        return _Use(self)

    def close(self) -> None:
        """Free the C object, once the calls in flight on it (on other threads) have returned;
        a call made afterwards raises ``ValueError``."""
        p = _shut(self)
        if p:
            self._release(p)

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
