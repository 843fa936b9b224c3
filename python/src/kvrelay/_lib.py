"""The C ABI of libkvrelay (include/kvrelay.h) through ctypes: the library, its structs and the
prototypes of every function the package calls. Nothing here is public; the classes of the
package wrap it.

The library is found, in order, at ``$KVRELAY_LIBRARY`` (a path to ``libkvrelay.so``), next to
this file (what the wheel carries), or by the loader's search path.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_bool,
    c_char,
    c_char_p,
    c_double,
    c_int32,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path

DETAIL_CAPACITY = 128
DISCARD_SLOTS = 16


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


class Str(Structure):
    _fields_ = [("ptr", c_void_p), ("len", c_size_t)]

    def text(self) -> str:
        return ctypes.string_at(self.ptr, self.len).decode("utf-8") if self.len else ""


class Bytes(Structure):
    _fields_ = [("ptr", c_void_p), ("len", c_size_t)]


class Outcome(Structure):
    _fields_ = [("kind", c_int32), ("reason", c_int32), ("detail", c_char * DETAIL_CAPACITY)]


class Counters(Structure):
    _fields_ = [(n, c_uint64) for n in ("admitted", "untrusted", "unknown_version", "oversized", "malformed")]


class AgentFingerprint(Structure):
    _fields_ = [
        ("block_tokens", c_uint32),
        ("layers", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype_bytes", c_uint32),
        ("naming", c_uint64),
    ]


PIN = CFUNCTYPE(c_size_t, c_void_p, POINTER(c_uint64), c_size_t, POINTER(c_uint32))
UNPIN = CFUNCTYPE(None, c_void_p, POINTER(c_uint32), c_size_t)
DESTROY = CFUNCTYPE(None, c_void_p)


class BlockHolder(Structure):
    _fields_ = [("user_data", c_void_p), ("pin", PIN), ("unpin", UNPIN), ("destroy", DESTROY), ("returned", UNPIN)]


class FetchParams(Structure):
    _fields_ = [
        ("endpoint", Str),
        ("names", POINTER(c_uint64)),
        ("names_len", c_size_t),
        ("held", c_size_t),
        ("dst_blocks", POINTER(c_uint32)),
        ("dst_len", c_size_t),
        ("deadline_ms", c_uint32),
    ]


class FetchResult(Structure):
    _fields_ = [
        ("failure", c_int32),
        ("blocks", c_size_t),
        ("bytes", c_uint64),
        ("seconds", c_double),
        ("withheld", c_size_t),
    ]


class SourceSpeed(Structure):
    _fields_ = [("setup_s", c_double), ("bytes_per_s", c_double)]


AGENT_STATS = (
    "accepted served blocks_sent bytes_sent refused_peer_not_allowed refused_busy refused_per_peer_limit "
    "refused_bad_request refused_fingerprint_mismatch refused_auth_failed refused_too_many_names "
    "refused_internal handshake_timeouts serve_aborted pending_now serving_now fetches_submitted fetches_ok "
    "fetch_failed_connect fetch_failed_timeout fetch_failed_refused fetch_failed_fingerprint_mismatch "
    "fetch_failed_corrupt fetch_failed_truncated fetch_failed_source_miss fetch_failed_auth_failed "
    "fetch_failed_cancelled fetch_failed_shutdown blocks_fetched bytes_fetched refused_unsupported "
    "blocks_withheld blocks_returned reused streams_reused handshake_evicted fetch_failed_internal"
).split()


class AgentStats(Structure):
    _fields_ = [(n, c_uint64) for n in AGENT_STATS]


class KvSegment(Structure):
    _fields_ = [("base", c_uint64), ("block_stride", c_uint64), ("bytes_per_block", c_uint64)]


class KvExtent(Structure):
    _fields_ = [("base", c_uint64), ("len", c_uint64)]


class Candidate(Structure):
    _fields_ = [("action_index", c_size_t), ("families", c_uint64)]


class CandidateCounts(Structure):
    _fields_ = [("unknown_type", c_uint32), ("no_matching_version", c_uint32)]


class FetchRequest(Structure):
    _fields_ = [
        ("binding_id", Str),
        ("family", Str),
        ("action_index", c_size_t),
        ("action_type", Str),
        ("action_version", Str),
        ("payload", Bytes),
        ("endpoint", Str),
        ("envelope", Bytes),
        ("call_context", c_void_p),
    ]


PROVIDER_CALL = CFUNCTYPE(c_int32, c_void_p, POINTER(FetchRequest))


class Provider(Structure):
    _fields_ = [("user_data", c_void_p), ("validate", PROVIDER_CALL), ("fetch", PROVIDER_CALL), ("destroy", DESTROY)]


class RequestInfo(Structure):
    _fields_ = [("generation_only", c_bool), ("lora_adapter", c_bool)]


class Decision(Structure):
    _fields_ = [
        ("kind", c_int32),
        ("discard", c_int32),
        ("binding_id", Str),
        ("action_index", c_size_t),
        ("provider_code", c_int32),
    ]


class PolicyCounters(Structure):
    _fields_ = [
        ("named_fetch", c_uint64),
        ("discarded", c_uint64 * DISCARD_SLOTS),
        ("unknown_type", c_uint64),
        ("no_matching_version", c_uint64),
    ]


class Action(Structure):
    _fields_ = [
        ("index", c_size_t),
        ("id", Str),
        ("action_type", Str),
        ("version", Str),
        ("payload", Bytes),
        ("canonical", Bytes),
    ]


FETCH_DONE = CFUNCTYPE(None, c_void_p, POINTER(FetchResult))
FETCH_DONE_DETAIL = CFUNCTYPE(None, c_void_p, POINTER(FetchResult), Str)


class FetchCallbacks(Structure):
    _fields_ = [("size", c_size_t), ("user_data", c_void_p), ("done", FETCH_DONE_DETAIL), ("destroy", DESTROY)]


_vp = c_void_p
_pp = POINTER(c_void_p)
_u8p = POINTER(c_uint8)
_sz = c_size_t
_szp = POINTER(c_size_t)

# name: (restype, argtypes); every `kvrelay_status` function returns c_int32
_PROTOS = {
    "kvrelay_admission_config_new": (c_int32, [_pp]),
    "kvrelay_admission_config_free": (None, [_vp]),
    "kvrelay_admission_config_set_trusted": (c_int32, [_vp, c_bool]),
    "kvrelay_admission_config_trust_from_env": (c_int32, [_vp, c_char_p, _sz]),
    "kvrelay_admission_config_set_max_bytes": (c_int32, [_vp, _sz]),
    "kvrelay_admission_config_set_max_depth": (c_int32, [_vp, _sz]),
    "kvrelay_admission_config_set_max_raw_bytes": (c_int32, [_vp, _sz]),
    "kvrelay_admission_config_set_metric_prefix": (c_int32, [_vp, c_char_p, _sz]),
    "kvrelay_admission_new": (c_int32, [_vp, _pp]),
    "kvrelay_admission_free": (None, [_vp]),
    "kvrelay_admit": (c_int32, [_vp, c_void_p, _sz, POINTER(Outcome), _pp]),
    "kvrelay_admit_batch": (c_int32, [_vp, c_void_p, _sz, _sz, POINTER(Outcome), _pp, POINTER(c_bool)]),
    "kvrelay_admission_decode_msgpack": (c_int32, [_vp, c_void_p, _sz, POINTER(Outcome), _pp]),
    "kvrelay_admission_counters": (c_int32, [_vp, POINTER(Counters)]),
    "kvrelay_admission_prometheus": (c_int32, [_vp, c_void_p, _sz, _szp]),
    "kvrelay_snapshot_retain": (c_void_p, [_vp]),
    "kvrelay_snapshot_release": (None, [_vp]),
    "kvrelay_snapshot_canonical": (c_int32, [_vp, POINTER(Bytes)]),
    "kvrelay_snapshot_protocol_version": (c_int32, [_vp, POINTER(Str)]),
    "kvrelay_snapshot_message_id": (c_int32, [_vp, POINTER(Str)]),
    "kvrelay_snapshot_action_count": (c_int32, [_vp, _szp]),
    "kvrelay_snapshot_action": (c_int32, [_vp, _sz, POINTER(Action)]),
    "kvrelay_snapshot_decode": (c_int32, [_vp, c_void_p, _sz, _szp]),
    "kvrelay_snapshot_msgpack": (c_int32, [_vp, c_void_p, _sz, _szp]),
    "kvrelay_snapshot_action_envelope": (c_int32, [_vp, _sz, c_void_p, _sz, _szp]),
    "kvrelay_capabilities_builder_new": (c_int32, [_pp]),
    "kvrelay_capabilities_builder_add": (c_int32, [_vp, c_char_p, _sz, c_char_p, _sz, c_char_p, _sz]),
    "kvrelay_capabilities_build": (c_int32, [_vp, _pp]),
    "kvrelay_capabilities_builder_free": (None, [_vp]),
    "kvrelay_capabilities_free": (None, [_vp]),
    "kvrelay_collect_candidates": (c_int32, [_vp, _vp, POINTER(Candidate), _sz, _szp, POINTER(CandidateCounts)]),
    "kvrelay_policy_config_new": (c_int32, [_pp]),
    "kvrelay_policy_config_free": (None, [_vp]),
    "kvrelay_policy_config_add_binding": (c_int32, [_vp, c_char_p, _sz, c_char_p, _sz, c_int32, c_bool]),
    "kvrelay_policy_config_binding_support": (c_int32, [_vp, c_char_p, _sz, c_char_p, _sz, c_char_p, _sz]),
    "kvrelay_policy_config_add_endpoint": (c_int32, [_vp, c_char_p, _sz]),
    "kvrelay_policy_config_set_metric_prefix": (c_int32, [_vp, c_char_p, _sz]),
    "kvrelay_orchestrator_new": (c_int32, [_vp, _vp, POINTER(Provider), _pp]),
    "kvrelay_orchestrator_free": (None, [_vp]),
    "kvrelay_orchestrate_with_context": (c_int32, [_vp, POINTER(RequestInfo), _vp, c_void_p, POINTER(Decision)]),
    "kvrelay_discard_name": (c_char_p, [c_int32]),
    "kvrelay_orchestrator_counters": (c_int32, [_vp, POINTER(PolicyCounters)]),
    "kvrelay_orchestrator_prometheus": (c_int32, [_vp, c_void_p, _sz, _szp]),
    "kvrelay_kv_layout_new": (c_int32, [c_uint32, POINTER(KvSegment), _sz, POINTER(KvExtent), _sz, _pp]),
    "kvrelay_kv_layout_stage_block_bytes": (c_uint64, [_vp]),
    "kvrelay_kv_layout_free": (None, [_vp]),
    "kvrelay_cpu_engine_new": (c_int32, [_vp, _pp]),
    "kvrelay_cpu_gather": (c_int32, [_vp, POINTER(c_uint32), _sz, c_void_p, _sz]),
    "kvrelay_cpu_scatter": (c_int32, [_vp, c_void_p, _sz, POINTER(c_uint32), _sz]),
    "kvrelay_cpu_engine_free": (None, [_vp]),
    "kvrelay_cuda_available": (c_int32, [c_int32]),
    "kvrelay_kv_checksum": (c_int32, [c_void_p, _sz, POINTER(c_uint64)]),
    "kvrelay_agent_config_new": (c_int32, [POINTER(AgentFingerprint), _pp]),
    "kvrelay_agent_config_free": (None, [_vp]),
    "kvrelay_agent_config_set_listen": (c_int32, [_vp, c_char_p, _sz]),
    "kvrelay_agent_config_set_transport": (c_int32, [_vp, c_char_p, _sz, c_char_p, _sz]),
    "kvrelay_agent_config_allow_peer": (c_int32, [_vp, c_char_p, _sz]),
    "kvrelay_agent_config_set_device": (c_int32, [_vp, c_int32]),
    "kvrelay_agent_config_set_limit": (c_int32, [_vp, c_int32, c_uint64]),
    "kvrelay_agent_config_get_limit": (c_int32, [_vp, c_int32, POINTER(c_uint64)]),
    "kvrelay_agent_limit_name": (c_char_p, [c_int32]),
    "kvrelay_agent_config_set_key": (c_int32, [_vp, c_void_p, _sz]),
    "kvrelay_agent_config_key_from_env": (c_int32, [_vp, c_char_p, _sz]),
    "kvrelay_agent_new": (c_int32, [_vp, _vp, POINTER(BlockHolder), _pp]),
    "kvrelay_agent_free": (None, [_vp]),
    "kvrelay_agent_endpoint": (c_int32, [_vp, c_void_p, _sz, _szp]),
    "kvrelay_agent_record_checksums": (c_int32, [_vp, POINTER(c_uint32), _sz]),
    "kvrelay_agent_fetch": (c_int32, [_vp, POINTER(FetchParams), FETCH_DONE, c_void_p, _pp]),
    "kvrelay_agent_submit": (c_int32, [_vp, POINTER(FetchParams), POINTER(FetchCallbacks), _pp]),
    "kvrelay_fetch_poll": (c_int32, [_vp, POINTER(FetchResult)]),
    "kvrelay_fetch_wait": (c_int32, [_vp, c_uint32, POINTER(FetchResult)]),
    "kvrelay_fetch_detail": (c_int32, [_vp, c_void_p, _sz, _szp]),
    "kvrelay_fetch_cancel": (c_int32, [_vp]),
    "kvrelay_fetch_free": (None, [_vp]),
    "kvrelay_agent_estimate": (c_int32, [_vp, c_char_p, _sz, _sz, POINTER(c_double)]),
    "kvrelay_agent_source_speed": (c_int32, [_vp, c_char_p, _sz, POINTER(SourceSpeed)]),
    "kvrelay_agent_read_stats": (c_int32, [_vp, POINTER(AgentStats), _sz]),
    "kvrelay_agent_prometheus": (c_int32, [_vp, c_void_p, _sz, _szp]),
    "kvrelay_fetch_run_length": (c_int32, [POINTER(c_uint64), _sz, _sz, POINTER(c_uint64), _sz, _szp]),
    "kvrelay_fetch_failure_name": (c_char_p, [c_int32]),
    "kvrelay_version": (c_char_p, []),
    "kvrelay_last_error_message": (c_int32, [c_void_p, _sz, _szp]),
    "kvrelay_status_message": (c_char_p, [c_int32]),
    "kvrelay_reason_name": (c_char_p, [c_int32]),
}

for _name, (_res, _args) in _PROTOS.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args

OK = 0
ERR_BUFFER_TOO_SMALL = 3
ERR_PENDING = 16

__all__ = ["lib", "c_char", "c_uint8"]
