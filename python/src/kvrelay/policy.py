"""Candidate collection and orchestration: Capabilities, Binding, Orchestrator, a Python Provider."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from . import _bindings as B
from . import _lib as L
from ._lib import lib
from ._common import DecisionKind, Discard, _Errors, _Handle, _PROVIDER_DESTROY, _Table, _bool, _check, _int, _label, _strs, _table, _text, _utf8  # noqa: F401
from .admission import Snapshot

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
        ref, sp = snapshot._r()  # the snapshot's reference, held through both calls
        with self._use() as p:
            st = lib.kvrelay_collect_candidates(sp, p, None, 0, ctypes.byref(n), None)
            if st not in (L.OK, L.ERR_BUFFER_TOO_SMALL):
                _check("kvrelay_collect_candidates", st)
            arr = (L.Candidate * max(n.value, 1))()
            _check("kvrelay_collect_candidates", lib.kvrelay_collect_candidates(sp, p, arr, len(arr), ctypes.byref(n), None))
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
                for ts, vs in b.supports:
                    t, v = _utf8("action_type", ts), _utf8("action_version", vs)
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
            with capabilities._use() as cp:
                _check("kvrelay_orchestrator_new", lib.kvrelay_orchestrator_new(cp, cfg, ctypes.byref(prov), ctypes.byref(out)))
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
        ``fetch`` run here, on this thread, with ``context`` as ``FetchRequest.context``. A
        provider may close this Orchestrator: it is freed when the decision returns."""
        if snapshot is not None and not isinstance(snapshot, Snapshot):
            raise TypeError("snapshot must be a Snapshot or None")
        _bool("generation_only", generation_only)
        _bool("lora_adapter", lora_adapter)
        # the snapshot's reference is held through the call (a close() meanwhile frees nothing)
        ref, snap = snapshot._r() if snapshot is not None else (None, None)
        key = _contexts.add(context)
        try:
            info = L.RequestInfo(generation_only, lora_adapter)
            d = L.Decision()
            with self._use() as p:
                _check(
                    "kvrelay_orchestrate_with_context",
                    lib.kvrelay_orchestrate_with_context(p, ctypes.byref(info), snap, key, ctypes.byref(d)),
                )
                # d.binding_id borrows the orchestrator's bytes: copied before the call ends
                # (a close() waiting for it, or the provider's, frees them after)
                named = d.kind == B.KVRELAY_DECISION_NAMED_FETCH
                return Decision(
                    _label(DecisionKind, d.kind),
                    _label(Discard, d.discard),
                    L.text(d.binding_id) if named else None,
                    d.action_index if named else None,
                    d.provider_code,
                )
        finally:
            _contexts.pop(key)

    @property
    def counters(self) -> dict[str, Any]:
        c = L.PolicyCounters()
        with self._use() as p:
            _check("kvrelay_orchestrator_counters", lib.kvrelay_orchestrator_counters(p, ctypes.byref(c)))
        discarded = {m.value: c.discarded[m.c] for m in Discard if m.c and m.c < L.DISCARD_SLOTS}
        return {
            "named_fetch": c.named_fetch,
            "discarded": discarded,
            "unknown_type": c.unknown_type,
            "no_matching_version": c.no_matching_version,
        }

    def prometheus(self) -> str:
        with self._use() as p:
            return _text("kvrelay_orchestrator_prometheus", lib.kvrelay_orchestrator_prometheus, p)
