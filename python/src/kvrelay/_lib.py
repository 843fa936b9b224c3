"""Loads libkvrelay and gives every function of include/kvrelay.h its prototype, from
``_bindings`` (generated from the header by python/tools/gen_bindings.py: nothing here is
typed by hand). Nothing here is public.

The library is found, in order, at ``$KVRELAY_LIBRARY`` (a path to ``libkvrelay.so``), next to
this file (what the wheel carries), or by the loader's search path. A library that lacks a
function of the header fails the import (an older library than the package's header).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, TypeVar, cast

from . import _bindings as B


def _load() -> ctypes.CDLL:
    env = os.environ.get("KVRELAY_LIBRARY")
    candidates = [env] if env else []
    candidates.append(str(Path(__file__).with_name("libkvrelay.so")))
    candidates.append("libkvrelay.so")
    errors = []
    for c in candidates:
        try:
            return ctypes.CDLL(c)
        except OSError as e:
            errors.append(f"{c}: {e}")
    raise ImportError("kvrelay: libkvrelay.so not found (" + "; ".join(errors) + ")")


lib = _load()

for _name, (_res, _params) in B.PROTOTYPES.items():
    try:
        _f = getattr(lib, _name)
    except AttributeError:
        raise ImportError(f"kvrelay: {lib._name} has no {_name} (a library older than the package's header)") from None
    _f.restype = _res
    _f.argtypes = [t for _, t in _params]



_S = TypeVar("_S", bound=ctypes.Structure)


def _sized(cls: type[_S]) -> type[_S]:
    """The header's struct ``cls`` whose first field is ``size``, constructed with it set to
    ``sizeof`` (the 0.4 epoch's rule: the caller declares its struct's size, for outputs
    too); positional arguments are the fields after it."""

    def __init__(self: ctypes.Structure, *args: object, **kw: object) -> None:
        cls.__init__(self, ctypes.sizeof(cls), *args, **kw)

    # a subclass with the same fields (ctypes takes them from the base) and that constructor
    return cast("type[_S]", type(cls.__name__, (cls,), {"__init__": __init__}))


# the package's short names for the header's types (aliases, not copies; a struct with a size
# is constructed with it set)
Str = B.kvrelay_str
Bytes = B.kvrelay_bytes
# the header's classes themselves, for annotations (the sized names above are made at import)
OutcomeType = B.kvrelay_outcome
FetchResultType = B.kvrelay_fetch_result
Outcome = _sized(B.kvrelay_outcome)
Counters = _sized(B.kvrelay_counters)
AgentFingerprint = _sized(B.kvrelay_agent_fingerprint)
BlockHolder = _sized(B.kvrelay_block_holder)
FetchParams = _sized(B.kvrelay_fetch_params)
FetchResult = _sized(B.kvrelay_fetch_result)
FetchCallbacks = B.kvrelay_fetch_callbacks
SourceSpeed = B.kvrelay_source_speed
AgentStats = B.kvrelay_agent_stats
KvSegment = B.kvrelay_kv_segment
KvExtent = B.kvrelay_kv_extent
Candidate = B.kvrelay_candidate
CandidateCounts = _sized(B.kvrelay_candidate_counts)
FetchRequest = B.kvrelay_fetch_request
Provider = _sized(B.kvrelay_provider)
RequestInfo = _sized(B.kvrelay_request_info)
Decision = _sized(B.kvrelay_decision)
PolicyCounters = _sized(B.kvrelay_policy_counters)
Action = _sized(B.kvrelay_action)
PIN = B.kvrelay_block_holder_pin_fn
UNPIN = B.kvrelay_block_holder_unpin_fn
RETURNED = B.kvrelay_block_holder_returned_fn
HOLDER_DESTROY = B.kvrelay_block_holder_destroy_fn
PROVIDER_VALIDATE = B.kvrelay_provider_validate_fn
PROVIDER_FETCH = B.kvrelay_provider_fetch_fn
PROVIDER_DESTROY = B.kvrelay_provider_destroy_fn
FETCH_DONE = B.kvrelay_fetch_callbacks_done_fn
FETCH_DESTROY = B.kvrelay_fetch_callbacks_destroy_fn
AGENT_STATS = [f[0] for f in AgentStats._fields_]
DISCARD_SLOTS = B.KVRELAY_DISCARD_SLOTS
OK = B.KVRELAY_OK
ERR_BUFFER_TOO_SMALL = B.KVRELAY_ERR_BUFFER_TOO_SMALL
ERR_PENDING = B.KVRELAY_ERR_PENDING


def _address(f: Any) -> int:
    a = ctypes.cast(f, ctypes.c_void_p).value
    assert a, "a loaded function has an address"
    return a


# The compiled helper for the per-request calls (`_fast.c`; built by `pip install` where a C
# compiler is present), bound to this library's functions: None without it, or with
# KVRELAY_PYTHON_CTYPES_ONLY=1 (every call through ctypes; what the helper is measured and
# tested against).
fast: Optional[ModuleType]
try:
    from . import _fast as fast
except ImportError:
    fast = None
if fast is not None and os.environ.get("KVRELAY_PYTHON_CTYPES_ONLY") == "1":
    fast = None
if fast is not None:
    fast.bind(_address(lib.kvrelay_admit), _address(lib.kvrelay_agent_submit), _address(lib.kvrelay_snapshot_release))


def text(s: Str) -> str:
    """A ``kvrelay_str`` view as a Python str (a copy)."""
    return ctypes.string_at(s.ptr, s.len).decode("utf-8") if s.len else ""
