"""The KV agent: Agent, Fetch, FetchResult, Fingerprint, BlockHolder, fetch_run_length."""

from __future__ import annotations

import ctypes
import math
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from . import _bindings as B
from . import _lib as L
from ._lib import lib
from ._common import AgentLimit, FetchFailure, SIZE_MAX, U32, U64, _Errors, _FETCH_DESTROY, _HOLDER_DESTROY, _Handle, _HolderSlot, _PIN, _RETURNED, _UNPIN, _Use, _check, _closed, _enter_agent_thread, _ident, _int, _label, _out, _shut, _strs, _table, _text, _tls, _u32s, _u64s, _utf8  # noqa: F401
from .copy import KvLayout

# --- the KV agent ---------------------------------------------------------------------------

_FINGERPRINT_FIELDS = tuple(f[0] for f in L.AgentFingerprint._fields_ if f[0] != "size")


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
        for f in _FINGERPRINT_FIELDS:
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


def _result_of(r: L.FetchResultType, detail: str = "") -> FetchResult:
    return FetchResult(_label(FetchFailure, r.failure), r.blocks, r.bytes, r.seconds, r.withheld, detail)


class _FetchSlot:
    __slots__ = ("callback", "future", "errors")

    def __init__(self, callback: Optional[Callable[[FetchResult], None]], future: Future[FetchResult], errors: _Errors):
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
_submit = lib.kvrelay_agent_submit
_submit_checked = lib.kvrelay_agent_submit_checked
DIGEST_BYTES = B.KVRELAY_BLOCK_DIGEST_BYTES


def _digests(what: str, digests: Sequence[bytes], n: Optional[int] = None) -> bytes:
    """``digests`` (each ``bytes`` of 32) as one contiguous buffer; ``n`` the count required."""
    if isinstance(digests, (bytes, bytearray, str)):
        raise TypeError(f"{what} must be a sequence of {DIGEST_BYTES}-byte digests, not {type(digests).__name__}")
    out = []
    for i, d in enumerate(digests):
        if not isinstance(d, (bytes, bytearray)) or len(d) != DIGEST_BYTES:
            raise ValueError(f"{what}[{i}] must be {DIGEST_BYTES} bytes")
        out.append(bytes(d))
    if n is not None and len(out) != n:
        raise ValueError(f"{what}: {len(out)} digests for {n} names (one per name)")
    return b"".join(out)


class Naming:
    """Block names and content digests (SPEC section 8), the library's one definition:
    ``seed`` the engine's name seed, ``block_tokens`` tokens per block, ``lora_id`` the
    adapter's id (0: none), ``salt`` the request's cache salt (bytes; block 0 only).
    ``names(tokens)`` names the full blocks; ``digests(identity, tokens)`` gives their
    content digests under the engine identity (what a checked fetch asks for and what a
    source records with :meth:`Agent.record_digests`)."""

    def __init__(self, seed: int, block_tokens: int, *, lora_id: int = 0, salt: bytes = b""):
        self.seed = _int("seed", seed, 0, U64)
        self.block_tokens = _int("block_tokens", block_tokens, 1, SIZE_MAX)
        self.lora_id = _int("lora_id", lora_id, 0, U64)
        if not isinstance(salt, (bytes, bytearray)):
            raise TypeError(f"salt must be bytes, not {type(salt).__name__}")
        self.salt = bytes(salt)

    def _c(self) -> Any:
        n = B.kvrelay_naming(ctypes.sizeof(B.kvrelay_naming), self.seed, self.block_tokens, self.lora_id, None, 0)
        if self.salt:
            n.salt = ctypes.cast(ctypes.c_char_p(self.salt), ctypes.c_void_p)
            n.salt_len = len(self.salt)
        return n

    def names(self, tokens: Sequence[int]) -> list[int]:
        """The names of the full blocks of a request's ``tokens``."""
        t = _u32s("tokens", tokens)
        cap = len(t) // self.block_tokens
        out = (ctypes.c_uint64 * max(cap, 1))()
        n = ctypes.c_size_t()
        _check("kvrelay_block_names", lib.kvrelay_block_names(ctypes.byref(self._c()), 0, 0, t, len(t), out, cap, ctypes.byref(n)))
        return list(out[: n.value])

    def digests(self, identity: bytes, tokens: Sequence[int]) -> list[bytes]:
        """The content digests of the full blocks of a request's ``tokens`` under the engine
        identity ``identity`` (bytes: the model by content and every setting that changes KV)."""
        if not isinstance(identity, (bytes, bytearray)):
            raise TypeError(f"identity must be bytes, not {type(identity).__name__}")
        t = _u32s("tokens", tokens)
        cap = len(t) // self.block_tokens
        buf = ctypes.create_string_buffer(max(cap, 1) * DIGEST_BYTES)
        n = ctypes.c_size_t()
        ident = bytes(identity)
        _check(
            "kvrelay_block_digests",
            lib.kvrelay_block_digests(ctypes.byref(self._c()), ident, len(ident), None, 0, t, len(t), buf, cap, ctypes.byref(n)),
        )
        raw = buf.raw
        return [raw[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] for i in range(n.value)]

# Endpoints of recent fetches as kvrelay_str views of UTF-8 copies: a runtime fetches
# from a few peers, over and over. The C side copies what it needs at submission; the caller
# holds the buffer until then (an entry may be dropped by another thread meanwhile).
_endpoints: dict[str, tuple[Any, L.Str]] = {}
_ENDPOINTS_KEPT = 64


def _endpoint(endpoint: Any) -> tuple[Any, L.Str]:
    """``endpoint`` (a str) as UTF-8 bytes and a ``kvrelay_str`` over them (TypeError else)."""
    exact = type(endpoint) is str  # a str subclass may hash or compare differently: not cached
    if exact:
        hit = _endpoints.get(endpoint)
        if hit is not None:
            return hit
    e = _utf8("endpoint", endpoint)
    buf = ctypes.create_string_buffer(e, len(e))
    entry = (buf, L.Str(ctypes.addressof(buf), len(e)))
    if exact:
        if len(_endpoints) >= _ENDPOINTS_KEPT:
            _endpoints.clear()
        _endpoints[endpoint] = entry
    return entry


_endpoint_bytes: dict[str, bytes] = {}


def _endpoint_utf8(endpoint: str) -> bytes:
    """``endpoint`` as UTF-8 bytes, kept for the next submission (as ``_endpoint`` keeps its
    C string)."""
    e: bytes = _utf8("endpoint", endpoint)
    if len(_endpoint_bytes) >= _ENDPOINTS_KEPT:
        _endpoint_bytes.clear()
    _endpoint_bytes[endpoint] = e
    return e


_WAIT_SLICE_MS = 50  # result() waits in slices this long, so that Ctrl-C (signals) get through


class Fetch:
    """A submitted fetch: ``result(timeout)`` waits (interruptible: Ctrl-C raises
    ``KeyboardInterrupt`` within about 50 ms), ``done()`` polls, ``cancel()`` stops it,
    ``close()`` (or the end of a ``with`` block) frees the handle; a running fetch goes on.
    ``future`` is a ``concurrent.futures.Future``: with a ``callback`` given to
    ``Agent.fetch`` it is resolved on the agent's fetch thread, right before the callback runs
    there (keep both short); otherwise the first access starts a thread that waits for it and
    lets go of the Fetch before resolving it. Without a callback nothing of Python runs on the
    agent's threads (the cheapest submission). A Fetch keeps its Agent alive. ``close()`` on
    another thread waits for a call in flight (a ``result()`` for at most one 50 ms slice; it
    then raises ``ValueError``, as every call on a closed Fetch does)."""

    __slots__ = ("_agent", "_future", "_handle", "_calls", "_orphan", "__weakref__")

    def __init__(self, agent: "Agent", future: Optional[Future[FetchResult]]):
        self._agent = agent
        self._future = future
        self._handle = ctypes.c_void_p()  # written by the submission
        self._calls: list[int] = []  # the calls in flight (_common: handles)
        self._orphan: Optional[int] = None

    @property
    def _ptr(self) -> Optional[int]:
        return self._handle.value

    def _take(self) -> Optional[int]:
        h = self._handle  # (every call reads its value once: emptied in place)
        p, h.value = h.value, None
        return p

    def _release(self, p: int) -> None:
        lib.kvrelay_fetch_free(p)

    @property
    def future(self) -> Future[FetchResult]:
        if self._future is None:
            fut: Future[FetchResult] = Future()
            self._future = fut
            fut.set_running_or_notify_cancel()
            # the thread gets the Fetch in a list it empties: no other reference to it stays
            threading.Thread(target=_resolve, args=([self], fut), daemon=True, name="kvrelay-fetch-future").start()
        return self._future

    def done(self) -> bool:
        r = L.FetchResult()
        calls, me = self._calls, _ident()
        try:  # (a scheduler may poll often: _Use inlined)
            calls.append(me)
            h = self._handle.value
            if not h:
                raise _closed(self)
            return bool(lib.kvrelay_fetch_poll(h, ctypes.byref(r)) == L.OK)
        finally:
            _out(self, me)

    def cancel(self) -> None:
        """Ask the fetch to stop (it completes as ``cancelled`` after the block in progress)."""
        with _Use(self) as h:
            _check("kvrelay_fetch_cancel", lib.kvrelay_fetch_cancel(h))

    def detail(self) -> str:
        """Why the completed fetch failed, in words (empty when it did not)."""
        with _Use(self) as h:
            return _text("kvrelay_fetch_detail", lib.kvrelay_fetch_detail, h)

    def result(self, timeout: Optional[float] = None) -> FetchResult:
        """Wait for the result (``TimeoutError`` after ``timeout`` seconds). Waits in short
        slices, so that signal handlers (Ctrl-C) run meanwhile, and so that a ``close()`` on
        another thread waits for one slice at most (this then raises ``ValueError``)."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
            if not timeout >= 0:
                raise ValueError(f"timeout must be >= 0, not {timeout}")
        end = None if timeout is None else time.monotonic() + timeout
        r = L.FetchResult()
        calls, me = self._calls, _ident()
        while True:
            ms = _WAIT_SLICE_MS
            if end is not None:
                ms = max(0, min(ms, int((end - time.monotonic()) * 1000)))
            # each slice takes the handle once and is registered as a call in flight: the
            # result and its detail are read with the same handle, which close() frees only
            # after the slice
            try:
                calls.append(me)
                h = self._handle.value
                if not h:
                    raise _closed(self)
                st = lib.kvrelay_fetch_wait(h, ms, ctypes.byref(r))
                if st != L.ERR_PENDING:
                    _check("kvrelay_fetch_wait", st)
                    return _result_of(r, _text("kvrelay_fetch_detail", lib.kvrelay_fetch_detail, h) if r.failure else "")
            finally:
                _out(self, me)
            if end is not None and time.monotonic() >= end:
                raise TimeoutError("the fetch is still running")

    def close(self) -> None:
        """Free the handle (the fetch itself goes on; ``cancel()`` first to stop it), once the
        calls in flight on it have returned."""
        if getattr(self, "_handle", None) is None:
            return  # __init__ did not run
        p = _shut(self)
        if p:
            lib.kvrelay_fetch_free(p)

    def __enter__(self) -> "Fetch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _resolve(box: list[Fetch], fut: Future[FetchResult]) -> None:
    """The thread behind ``Fetch.future`` (a fetch without a callback): waits for the result,
    lets go of the Fetch, then resolves ``fut``. In that order: when the Fetch (and its Agent)
    were dropped meanwhile, they are freed here before ``fut`` resolves, so whoever waits on
    ``fut`` finds the agent freed, not still being freed on this thread."""
    f = box.pop()
    res: Optional[FetchResult] = None
    err: Optional[BaseException] = None
    try:
        res = f.result()
    except BaseException as e:
        err = e
        # the traceback's frames (Fetch.result's) would hold the Fetch, and the Agent, as long
        # as the future holds the exception
        traceback.clear_frames(e.__traceback__)
    del f
    if err is not None:
        fut.set_exception(err)
    else:
        assert res is not None
        fut.set_result(res)


_LIMITS = {m.value: m.c for m in AgentLimit}  # limits by name (kvrelay_agent_limit)


def _free_agent(ptr: Optional[int], keep: Any) -> None:
    """Free an agent, here and now: ``close()``, the end of a ``with`` block, its last
    reference dropped, interpreter exit. The one exception: on a thread running one of the
    package's callbacks (a holder's ``pin``/``unpin``/``returned``, a fetch callback, a destroy
    callback; an agent dropped or closed there) it runs on a new thread instead, because
    ``kvrelay_agent_free`` waits for the agent's threads and callbacks (the agent's own: it would
    wait for itself; another agent's: two agents freeing each other from their callbacks would
    wait for each other). ``keep`` (the pool's layout and buffer) lives until the agent is freed."""
    if getattr(_tls, "in_callback", False):
        threading.Thread(target=_free_agent, args=(ptr, keep), name="kvrelay-agent-free").start()
        return
    lib.kvrelay_agent_free(ptr)


def _agent_gone(agent: "weakref.ref[Agent]", ptr: Optional[int], keep: Any) -> None:
    """An agent's finalizer: it died (no call can be in flight: a call holds the Agent), or the
    interpreter exits with it still referenced (atexit: closed as ``close()`` closes it, after
    the calls in flight on other threads)."""
    a = agent()
    if a is not None:
        a.close()
    else:
        _free_agent(ptr, keep)


class Agent(_Handle):
    """The KV agent: serves the pool ``layout`` describes to other instances (through
    ``holder``) and fetches named blocks from them into it. ``listen`` ``None`` makes a
    fetch-only agent; ``allow`` the peers served (``loopback``, addresses, ``ADDR/PREFIX``);
    ``key`` a pre-shared key (bytes) or ``key_env`` the variable holding it (neither: the
    per-user key, made on first use and readable by its user alone, unless ``per_user_key`` is
    False, which turns authentication off: TCP only, no memory grant leaves the agent); ``transport``
    ``tcp``, ``nixl`` (with ``nixl_lib_dir``), ``cuda-ipc`` (device pools of one host) or
    ``cuda-ipc,nixl`` (both, each source fetched from with the first that reaches it); ``limits`` overrides of the default limits
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
        per_user_key: bool = True,
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
        if not isinstance(per_user_key, bool):
            raise TypeError(f"per_user_key must be a bool, not {type(per_user_key).__name__}")
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
        self._finalizer: Optional[weakref.finalize[[weakref.ref[Agent], Optional[int], Any], Agent]] = None
        fp = L.AgentFingerprint(*(getattr(fingerprint, f) for f in _FINGERPRINT_FIELDS))
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
            if not per_user_key:
                _check(
                    "kvrelay_agent_config_set_per_user_key", lib.kvrelay_agent_config_set_per_user_key(cfg, False)
                )
            for i, v in lims:
                _check("kvrelay_agent_config_set_limit", lib.kvrelay_agent_config_set_limit(cfg, i, v))
            if device is not None:
                _check("kvrelay_agent_config_set_device", lib.kvrelay_agent_config_set_device(cfg, device))
            # the holder lives in the handle table until the agent's destroy callback
            # (kvrelay_agent_free, or right away if kvrelay_agent_new fails)
            slot = _table.add(_HolderSlot(holder, self._errors))
            h = L.BlockHolder(slot, _PIN, _UNPIN, _HOLDER_DESTROY, _RETURNED)
            out = ctypes.c_void_p()
            with layout._use() as lp:
                _check("kvrelay_agent_new", lib.kvrelay_agent_new(cfg, lp, ctypes.byref(h), ctypes.byref(out)))
            self._ptr = out.value
            # freed by close(), when the last reference goes, or at interpreter exit (atexit:
            # before the interpreter stops running Python, so no agent thread calls into it
            # after that)
            self._finalizer = weakref.finalize(self, _agent_gone, weakref.ref(self), out.value, layout)
        finally:
            lib.kvrelay_agent_config_free(cfg)

    def close(self) -> None:
        """Stop serving, end running fetches (their callbacks run, as ``shutdown`` or
        ``cancelled``) and free the agent, on this thread, before returning: its threads are
        joined and its port closed (dropping the last reference, or the end of a ``with``
        block, does the same). Calls in flight on other threads return first; later ones raise
        ``ValueError``. Called from one of the package's callbacks (a holder's or a fetch's,
        this agent's or another's), the free happens on a new thread instead, once the
        callback has returned (see ``_free_agent``)."""
        p = _shut(self)
        if p:
            self._release(p)

    def _release(self, p: int) -> None:
        f, self._finalizer = getattr(self, "_finalizer", None), None
        if f is not None:
            f.detach()
        _free_agent(p, self._layout)

    def __del__(self) -> None:
        pass  # the finalizer frees it (it does not hold the Agent)

    @property
    def callback_errors(self) -> int:
        """How many exceptions the holder and the fetch callbacks raised (each one logged)."""
        return self._errors.count

    @property
    def endpoint(self) -> str:
        """This agent's ``source_control_endpoint`` (``tcp://ADDR:PORT``; empty: fetch-only)."""
        with self._use() as p:
            return _text("kvrelay_agent_endpoint", lib.kvrelay_agent_endpoint, p)

    def record_checksums(self, ids: Sequence[int]) -> None:
        """Blocks ``ids`` just became reusable: sum them where they lie (O(bytes))."""
        i = _u32s("ids", ids)
        with self._use() as p:
            _check("kvrelay_agent_record_checksums", lib.kvrelay_agent_record_checksums(p, i, len(i)))

    def verify_blocks(self, ids: Sequence[int]) -> int:
        """Check blocks ``ids`` where they lie against what was recorded for them (the checksum,
        and with a key the keyed tag), in order: how many leading blocks still hold it (a block
        with nothing recorded fails). Call it before a runtime takes blocks from a pool another
        process could write into (a NIXL registration); O(bytes)."""
        i = _u32s("ids", ids)
        verified = ctypes.c_size_t(0)
        with self._use() as p:
            _check("kvrelay_agent_verify_blocks", lib.kvrelay_agent_verify_blocks(p, i, len(i), ctypes.byref(verified)))
        return int(verified.value)

    def record_digests(self, ids: Sequence[int], digests: Sequence[bytes]) -> None:
        """The content digests of blocks ``ids`` (``digests[i]`` for ``ids[i]``, from
        :meth:`Naming.digests` over the tokens whose KV the block holds), after their checksums:
        each block is served with its digest, and a checked fetch takes it only under it."""
        i = _u32s("ids", ids)
        d = _digests("digests", digests, len(i))
        with self._use() as p:
            _check("kvrelay_agent_record_digests", lib.kvrelay_agent_record_digests(p, i, d, len(i)))

    def fetch(
        self,
        endpoint: str,
        names: Sequence[int],
        dst_blocks: Sequence[int],
        *,
        digests: Optional[Sequence[bytes]] = None,
        held: int = 0,
        deadline_ms: int = 10_000,
        callback: Optional[Callable[[FetchResult], None]] = None,
    ) -> Fetch:
        """Fetch blocks ``names[held:]`` from ``endpoint`` into ``dst_blocks`` (name
        ``held + i`` into ``dst_blocks[i]``), checked by content: ``digests[i]`` is the content
        digest of block ``names[i]`` (:meth:`Naming.digests` over the request's own tokens); a
        block the source recorded another digest for (or none) is never written. Without
        ``digests`` the fetch takes blocks by name alone, which the library refuses unless the
        agent's limit ``unchecked_fetch`` is 1. Never blocks; ``callback`` (optional) runs with
        the result on the agent's fetch thread once it completes (keep it short; it must not
        close the agent)."""
        # the agent's address is taken once, and this call is registered, so that a close() on
        # another thread waits for it (_common: handles)
        calls, me = self._calls, _ident()
        try:
            calls.append(me)
            agent = self._ptr
            fast = L.fast
            plain: Optional[Fetch] = None
            dbuf = None if digests is None else _digests("digests", digests)
            if fast is not None and callback is None and dbuf is None and type(endpoint) is str and agent:
                # the compiled helper: plain lists or tuples of ints and ints in range, taken as
                # they are; anything else answers NotImplemented (nothing submitted, the handle
                # still empty) and takes the checking path below with the same Fetch
                e = _endpoint_bytes.get(endpoint)
                if e is None:
                    e = _endpoint_utf8(endpoint)
                plain = Fetch(self, None)
                st = fast.submit(agent, e, names, held, dst_blocks, deadline_ms, 0, ctypes.addressof(plain._handle))
                if st == 0:
                    return plain
                if isinstance(st, int):
                    _check("kvrelay_agent_submit", st)
            ebuf, es = _endpoint(endpoint)  # ebuf holds the bytes es points at until the call returns
            n, d = _u64s("names", names), _u32s("dst_blocks", dst_blocks)
            if type(held) is not int or not 0 <= held <= SIZE_MAX:
                held = _int("held", held, 0, SIZE_MAX)
            if type(deadline_ms) is not int or not 1 <= deadline_ms <= U32:
                deadline_ms = _int("deadline_ms", deadline_ms, 1, U32)
            if callback is not None and not callable(callback):
                raise TypeError(f"callback must be callable, not {type(callback).__name__}")
            if not len(d):
                raise ValueError("a fetch needs at least one destination block (dst_blocks)")
            if held + len(d) > len(n):
                raise ValueError(f"held + len(dst_blocks) = {held + len(d)} exceeds len(names) = {len(n)}")
            if dbuf is not None and len(dbuf) != DIGEST_BYTES * len(n):
                raise ValueError(f"digests: {len(dbuf) // DIGEST_BYTES} digests for {len(n)} names (one per name)")
            if not agent:
                raise _closed(self)
            p = L.FetchParams(es, n, len(n), held, d, len(d), deadline_ms)

            def submit(cbs: Any, out: Any) -> int:
                if dbuf is None:
                    return int(_submit(agent, p, cbs, out))
                return int(_submit_checked(agent, p, dbuf, len(n), cbs, out))

            # (ctypes passes a struct given for a POINTER parameter by reference: no byref())
            if callback is None:
                f = plain if plain is not None else Fetch(self, None)
                _check("kvrelay_agent_submit", submit(None, f._handle))
                return f
            fut: Future[FetchResult] = Future()
            f = Fetch(self, fut)
            # the callback lives in the handle table until the fetch's destroy callback, which
            # runs exactly once on every path (a refused submission included)
            cbs = L.FetchCallbacks(ctypes.sizeof(L.FetchCallbacks), _table.add(_FetchSlot(callback, fut, self._errors)), _FETCH_DONE, _FETCH_DESTROY)
            _check("kvrelay_agent_submit", submit(cbs, f._handle))
            return f
        finally:
            _out(self, me)

    def estimate(self, endpoint: str, blocks: int) -> float:
        """Seconds a fetch of ``blocks`` blocks from ``endpoint`` is expected to take."""
        e = _utf8("endpoint", endpoint)
        _int("blocks", blocks, 0, SIZE_MAX)
        out = ctypes.c_double()
        with self._use() as p:
            _check("kvrelay_agent_estimate", lib.kvrelay_agent_estimate(p, e, len(e), blocks, ctypes.byref(out)))
        return out.value

    def record_import(self, blocks: int, seconds: float) -> None:
        """Report that the runtime's own import of ``blocks`` fetched blocks (at most the pool's)
        took ``seconds`` (0 to 3600): :meth:`estimate` counts it from then on."""
        _int("blocks", blocks, 0, self._layout.num_blocks)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"seconds: expected a number, got {type(seconds).__name__}")
        if not math.isfinite(seconds) or not 0 <= seconds <= 3600:
            raise ValueError(f"seconds: expected 0 to 3600, got {seconds!r}")
        with self._use() as p:
            _check("kvrelay_agent_record_import", lib.kvrelay_agent_record_import(p, blocks, float(seconds)))

    def import_estimate(self, blocks: int) -> float:
        """Seconds the runtime's import of ``blocks`` blocks is expected to take (0 before a report)."""
        _int("blocks", blocks, 0, SIZE_MAX)
        out = ctypes.c_double()
        with self._use() as p:
            _check("kvrelay_agent_import_estimate", lib.kvrelay_agent_import_estimate(p, blocks, ctypes.byref(out)))
        return out.value

    @property
    def stats(self) -> dict[str, int]:
        s = L.AgentStats()
        with self._use() as p:
            _check("kvrelay_agent_read_stats", lib.kvrelay_agent_read_stats(p, ctypes.byref(s), ctypes.sizeof(s)))
        return {n: getattr(s, n) for n in L.AGENT_STATS}

    def prometheus(self) -> str:
        with self._use() as p:
            return _text("kvrelay_agent_prometheus", lib.kvrelay_agent_prometheus, p)


def fetch_run_length(names: Sequence[int], held: int, hashes: Sequence[int]) -> int:
    """How many blocks after ``held`` a hint's ``hashes`` cover (membership, SPEC section 8)."""
    n, h = _u64s("names", names), _u64s("hashes", hashes)
    _int("held", held, 0, SIZE_MAX)
    out = ctypes.c_size_t()
    _check("kvrelay_fetch_run_length", lib.kvrelay_fetch_run_length(n, len(n), held, h, len(h), ctypes.byref(out)))
    return out.value
