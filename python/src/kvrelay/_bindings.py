"""The C ABI of libkvrelay, generated from include/kvrelay.h by python/tools/gen_bindings.py:
do not edit by hand (python/tests/test_bindings.py fails when this file is stale). Constants,
enums (labels and C values), struct layouts, callback types and the prototype of every
function of the header."""

# fmt: off
from __future__ import annotations

import enum
from ctypes import CFUNCTYPE, POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_int32, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p  # noqa: F401
from typing import Any, Optional, TypeVar

# --- constants

KVRELAY_BLOCK_DIGEST_BYTES = 32  # Bytes of one block content digest (`kvrelay_block_digests`): a SHA-256.
KVRELAY_PROVIDER_DECLINED = 1073741824  # Set in a provider's positive `fetch` answer (a negative one is never a decline) to say it declined by choice (nothing to fetch, not worth it, another request already fetching the same blocks) rather than failed: the decision's discard is then `KVRELAY_DISCARD_PROVIDER_DECLINED`, not `KVRELAY_DISCARD_FETCH_FAILED` (counted apart); `provider_code` keeps the whole answer.
KVRELAY_DISCARD_SLOTS = 16  # Slots of `kvrelay_policy_counters.discarded`: indexed by `kvrelay_discard` value (slot 0, `KVRELAY_DISCARD_NONE`, stays 0).
KVRELAY_VERSION_MAJOR = 0  # Major version of the library the header belongs to (checked against the crate version).
KVRELAY_VERSION_MINOR = 4  # Minor version.
KVRELAY_VERSION_PATCH = 3  # Patch version.
KVRELAY_DETAIL_CAPACITY = 128  # Size of `kvrelay_outcome.detail`, NUL included.

# --- enums: each C enum as a str enum whose values are the labels of its constants (the
# C name after the enum's common prefix, lower case), each member's C value in .c


_E = TypeVar("_E", bound="CEnum")


class CEnum(str, enum.Enum):
    """A C enum: the value is the label (compares equal to the str), ``.c`` the C value."""

    _value_: str
    c: int

    def __new__(cls, label: str, c: int) -> CEnum:
        obj = str.__new__(cls, label)
        obj._value_ = label
        obj.c = c
        return obj

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str(self), spec)

    @classmethod
    def from_c(cls: type[_E], c: int) -> Optional[_E]:
        """The member of C value ``c``; None for a value this header does not define."""
        for m in cls:
            if m.c == c:
                return m
        return None


class Status(CEnum):
    """``kvrelay_status``: Result of every kvrelay function that can fail. The values are fixed and never reused."""

    OK = ("ok", 0)
    ERR_NULL = ("err_null", 1)
    ERR_INVALID_ARGUMENT = ("err_invalid_argument", 2)
    ERR_BUFFER_TOO_SMALL = ("err_buffer_too_small", 3)
    ERR_OUT_OF_RANGE = ("err_out_of_range", 4)
    ERR_INVALID_CONFIG = ("err_invalid_config", 5)
    ERR_INVALID_UTF8 = ("err_invalid_utf8", 6)
    ERR_BATCH_LENGTH_MISMATCH = ("err_batch_length_mismatch", 7)
    ERR_INVALID_HANDLE = ("err_invalid_handle", 8)
    ERR_INVALID_LAYOUT = ("err_invalid_layout", 9)
    ERR_NO_CUDA_DRIVER = ("err_no_cuda_driver", 10)
    ERR_NO_CUDA_DEVICE = ("err_no_cuda_device", 11)
    ERR_CUDA = ("err_cuda", 12)
    ERR_UNSUPPORTED = ("err_unsupported", 13)
    ERR_DUPLICATE_BLOCK = ("err_duplicate_block", 14)
    ERR_STAGING = ("err_staging", 15)
    ERR_PENDING = ("err_pending", 16)
    ERR_BUSY = ("err_busy", 17)
    ERR_IO = ("err_io", 18)
    ERR_PANIC = ("err_panic", 99)


class HintSpelling(CEnum):
    """``kvrelay_hint_spelling``: Where a request body carries its KV hint (`kvrelay_find_hint`)."""

    NONE = ("none", 0)
    KV_HINTS = ("kv_hints", 1)
    KV_HINT = ("kv_hint", 2)
    ROUTER_HINT = ("router_hint", 3)
    TRANSFER_KV_HINT = ("transfer_kv_hint", 4)
    TRANSFER_ROUTER_HINT = ("transfer_router_hint", 5)


class OutcomeKind(CEnum):
    """``kvrelay_outcome_kind``: What happened to a hint: `kvrelay_outcome.kind`."""

    ABSENT = ("absent", 0)
    ADMITTED = ("admitted", 1)
    IGNORED = ("ignored", 2)


class Reason(CEnum):
    """``kvrelay_reason``: Why a hint was dropped: `kvrelay_outcome.reason` (`KVRELAY_REASON_NONE` unless ignored)."""

    NONE = ("none", 0)
    UNTRUSTED = ("untrusted", 1)
    UNKNOWN_VERSION = ("unknown_version", 2)
    OVERSIZED = ("oversized", 3)
    MALFORMED = ("malformed", 4)


class Discard(CEnum):
    """``kvrelay_discard``: Why optional named fetch was not attempted: `kvrelay_decision.discard`. The values never change meaning; `kvrelay_discard_name` gives the metric label."""

    NONE = ("none", 0)
    NOT_GENERATION_ONLY = ("not_generation_only", 1)
    LORA_ADAPTER = ("lora_adapter", 2)
    NO_HINT = ("no_hint", 3)
    NO_CANDIDATE = ("no_candidate", 4)
    MISSING_MAPPING = ("missing_mapping", 5)
    UNAUTHORIZED = ("unauthorized", 6)
    CAPABILITY_MISMATCH = ("capability_mismatch", 7)
    AMBIGUOUS_MAPPING = ("ambiguous_mapping", 8)
    REQUEST_PAIRED = ("request_paired", 9)
    ENDPOINT_MISSING = ("endpoint_missing", 10)
    ENDPOINT_INVALID = ("endpoint_invalid", 11)
    ENDPOINT_NOT_TRUSTED = ("endpoint_not_trusted", 12)
    PROVIDER_REJECTED = ("provider_rejected", 13)
    FETCH_FAILED = ("fetch_failed", 14)
    PROVIDER_DECLINED = ("provider_declined", 15)


class DecisionKind(CEnum):
    """``kvrelay_decision_kind``: `kvrelay_decision.kind`."""

    NAMED_FETCH = ("named_fetch", 1)
    KEEP_PAIRED_PATH = ("keep_paired_path", 2)


class Addressing(CEnum):
    """``kvrelay_addressing``: `kvrelay_policy_config_add_binding`'s addressing mode."""

    NAMED = ("named", 0)
    REQUEST_PAIRED = ("request_paired", 1)


class CopyMethod(CEnum):
    """``kvrelay_copy_method``: `kvrelay_cuda_engine_options.method`."""

    KERNEL = ("kernel", 0)
    BATCH = ("batch", 1)
    PER_CHUNK = ("per_chunk", 2)
    STAGED = ("staged", 3)


class FetchFailure(CEnum):
    """``kvrelay_fetch_failure``: Why a fetch stopped early: `kvrelay_fetch_result.failure`. Fixed values; `kvrelay_fetch_failure_name` gives the metric label."""

    OK = ("ok", 0)
    CONNECT = ("connect", 1)
    TIMEOUT = ("timeout", 2)
    REFUSED = ("refused", 3)
    FINGERPRINT_MISMATCH = ("fingerprint_mismatch", 4)
    CORRUPT = ("corrupt", 5)
    TRUNCATED = ("truncated", 6)
    SOURCE_MISS = ("source_miss", 7)
    AUTH_FAILED = ("auth_failed", 8)
    CANCELLED = ("cancelled", 9)
    SHUTDOWN = ("shutdown", 10)
    INTERNAL = ("internal", 11)
    DIGEST_MISMATCH = ("digest_mismatch", 12)


class AgentLimit(CEnum):
    """``kvrelay_agent_limit``: One of the agent's limits, for `kvrelay_agent_config_set_limit` / `_get_limit` (a limit by name, so that limits can be added without changing a struct a caller compiled in). Fixed values; `kvrelay_agent_limit_name` gives the label. Times in milliseconds (but `KVRELAY_LIMIT_POLL_US`); every value must be at least 1, except `KVRELAY_LIMIT_IDLE_TIMEOUT_MS`, `KVRELAY_LIMIT_SOCKET_BUFFER_BYTES`, `KVRELAY_LIMIT_WRITE_GRACE_MS`, `KVRELAY_LIMIT_TCP_FALLBACK`, `KVRELAY_LIMIT_POLL_US`, `KVRELAY_LIMIT_EXPORT_WHOLE_ALLOCATIONS` and `KVRELAY_LIMIT_UNCHECKED_FETCH`."""

    MAX_CONNECTIONS = ("max_connections", 1)
    MAX_PER_PEER = ("max_per_peer", 2)
    MAX_PENDING = ("max_pending", 3)
    HANDSHAKE_TIMEOUT_MS = ("handshake_timeout_ms", 4)
    IO_TIMEOUT_MS = ("io_timeout_ms", 5)
    CONNECT_TIMEOUT_MS = ("connect_timeout_ms", 6)
    MAX_NAMES = ("max_names", 7)
    FETCH_THREADS = ("fetch_threads", 8)
    MAX_QUEUED_FETCHES = ("max_queued_fetches", 9)
    STREAMS = ("streams", 10)
    MIN_STREAM_BYTES = ("min_stream_bytes", 11)
    IDLE_TIMEOUT_MS = ("idle_timeout_ms", 12)
    SOCKET_BUFFER_BYTES = ("socket_buffer_bytes", 13)
    WRITE_GRACE_MS = ("write_grace_ms", 14)
    TCP_FALLBACK = ("tcp_fallback", 15)
    POLL_US = ("poll_us", 16)
    EXPORT_WHOLE_ALLOCATIONS = ("export_whole_allocations", 17)
    UNCHECKED_FETCH = ("unchecked_fetch", 18)


class KvEventsSetting(CEnum):
    """``kvrelay_kv_events_setting``: Which setting `kvrelay_kv_events_config_set` changes. Fixed values."""

    REPLAY_ENDPOINT = ("replay_endpoint", 1)
    TOPIC = ("topic", 2)
    MEDIUM = ("medium", 3)
    ALLOW_PEER = ("allow_peer", 4)
    KEY_FILE = ("key_file", 5)


# every enumerator as an int, for the calls
KVRELAY_OK = 0
KVRELAY_ERR_NULL = 1
KVRELAY_ERR_INVALID_ARGUMENT = 2
KVRELAY_ERR_BUFFER_TOO_SMALL = 3
KVRELAY_ERR_OUT_OF_RANGE = 4
KVRELAY_ERR_INVALID_CONFIG = 5
KVRELAY_ERR_INVALID_UTF8 = 6
KVRELAY_ERR_BATCH_LENGTH_MISMATCH = 7
KVRELAY_ERR_INVALID_HANDLE = 8
KVRELAY_ERR_INVALID_LAYOUT = 9
KVRELAY_ERR_NO_CUDA_DRIVER = 10
KVRELAY_ERR_NO_CUDA_DEVICE = 11
KVRELAY_ERR_CUDA = 12
KVRELAY_ERR_UNSUPPORTED = 13
KVRELAY_ERR_DUPLICATE_BLOCK = 14
KVRELAY_ERR_STAGING = 15
KVRELAY_ERR_PENDING = 16
KVRELAY_ERR_BUSY = 17
KVRELAY_ERR_IO = 18
KVRELAY_ERR_PANIC = 99
KVRELAY_HINT_NONE = 0
KVRELAY_HINT_KV_HINTS = 1
KVRELAY_HINT_KV_HINT = 2
KVRELAY_HINT_ROUTER_HINT = 3
KVRELAY_HINT_TRANSFER_KV_HINT = 4
KVRELAY_HINT_TRANSFER_ROUTER_HINT = 5
KVRELAY_OUTCOME_ABSENT = 0
KVRELAY_OUTCOME_ADMITTED = 1
KVRELAY_OUTCOME_IGNORED = 2
KVRELAY_REASON_NONE = 0
KVRELAY_REASON_UNTRUSTED = 1
KVRELAY_REASON_UNKNOWN_VERSION = 2
KVRELAY_REASON_OVERSIZED = 3
KVRELAY_REASON_MALFORMED = 4
KVRELAY_DISCARD_NONE = 0
KVRELAY_DISCARD_NOT_GENERATION_ONLY = 1
KVRELAY_DISCARD_LORA_ADAPTER = 2
KVRELAY_DISCARD_NO_HINT = 3
KVRELAY_DISCARD_NO_CANDIDATE = 4
KVRELAY_DISCARD_MISSING_MAPPING = 5
KVRELAY_DISCARD_UNAUTHORIZED = 6
KVRELAY_DISCARD_CAPABILITY_MISMATCH = 7
KVRELAY_DISCARD_AMBIGUOUS_MAPPING = 8
KVRELAY_DISCARD_REQUEST_PAIRED = 9
KVRELAY_DISCARD_ENDPOINT_MISSING = 10
KVRELAY_DISCARD_ENDPOINT_INVALID = 11
KVRELAY_DISCARD_ENDPOINT_NOT_TRUSTED = 12
KVRELAY_DISCARD_PROVIDER_REJECTED = 13
KVRELAY_DISCARD_FETCH_FAILED = 14
KVRELAY_DISCARD_PROVIDER_DECLINED = 15
KVRELAY_DECISION_NAMED_FETCH = 1
KVRELAY_DECISION_KEEP_PAIRED_PATH = 2
KVRELAY_ADDRESSING_NAMED = 0
KVRELAY_ADDRESSING_REQUEST_PAIRED = 1
KVRELAY_COPY_KERNEL = 0
KVRELAY_COPY_BATCH = 1
KVRELAY_COPY_PER_CHUNK = 2
KVRELAY_COPY_STAGED = 3
KVRELAY_FETCH_OK = 0
KVRELAY_FETCH_CONNECT = 1
KVRELAY_FETCH_TIMEOUT = 2
KVRELAY_FETCH_REFUSED = 3
KVRELAY_FETCH_FINGERPRINT_MISMATCH = 4
KVRELAY_FETCH_CORRUPT = 5
KVRELAY_FETCH_TRUNCATED = 6
KVRELAY_FETCH_SOURCE_MISS = 7
KVRELAY_FETCH_AUTH_FAILED = 8
KVRELAY_FETCH_CANCELLED = 9
KVRELAY_FETCH_SHUTDOWN = 10
KVRELAY_FETCH_INTERNAL = 11
KVRELAY_FETCH_DIGEST_MISMATCH = 12
KVRELAY_LIMIT_MAX_CONNECTIONS = 1
KVRELAY_LIMIT_MAX_PER_PEER = 2
KVRELAY_LIMIT_MAX_PENDING = 3
KVRELAY_LIMIT_HANDSHAKE_TIMEOUT_MS = 4
KVRELAY_LIMIT_IO_TIMEOUT_MS = 5
KVRELAY_LIMIT_CONNECT_TIMEOUT_MS = 6
KVRELAY_LIMIT_MAX_NAMES = 7
KVRELAY_LIMIT_FETCH_THREADS = 8
KVRELAY_LIMIT_MAX_QUEUED_FETCHES = 9
KVRELAY_LIMIT_STREAMS = 10
KVRELAY_LIMIT_MIN_STREAM_BYTES = 11
KVRELAY_LIMIT_IDLE_TIMEOUT_MS = 12
KVRELAY_LIMIT_SOCKET_BUFFER_BYTES = 13
KVRELAY_LIMIT_WRITE_GRACE_MS = 14
KVRELAY_LIMIT_TCP_FALLBACK = 15
KVRELAY_LIMIT_POLL_US = 16
KVRELAY_LIMIT_EXPORT_WHOLE_ALLOCATIONS = 17
KVRELAY_LIMIT_UNCHECKED_FETCH = 18
KVRELAY_KV_EVENTS_REPLAY_ENDPOINT = 1
KVRELAY_KV_EVENTS_TOPIC = 2
KVRELAY_KV_EVENTS_MEDIUM = 3
KVRELAY_KV_EVENTS_ALLOW_PEER = 4
KVRELAY_KV_EVENTS_KEY_FILE = 5


# --- structs (in header order: what one uses is defined before it)


class kvrelay_outcome(Structure):
    """The outcome of admitting (or decoding) one hint. Plain data; nothing to free."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_outcome)` as the caller's header declares it (set by the caller before the call; the library writes only the fields that size covers).
        ("kind", c_int32),  # A `kvrelay_outcome_kind` value.
        ("reason", c_int32),  # A `kvrelay_reason` value.
        ("detail", (c_char * KVRELAY_DETAIL_CAPACITY)),  # For `KVRELAY_REASON_MALFORMED`: what failed and where, NUL-terminated (cut to fit). Never contains bytes of the hint. Empty otherwise.
    ]


class kvrelay_counters(Structure):
    """A copy of an admission edge's counters."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_counters)` as the caller's header declares it (set by the caller before the call; the library writes only the fields that size covers).
        ("admitted", c_uint64),  # `admitted_total`
        ("untrusted", c_uint64),  # `ignored_total{reason="untrusted"}`
        ("unknown_version", c_uint64),  # `ignored_total{reason="unknown_version"}`
        ("oversized", c_uint64),  # `ignored_total{reason="oversized"}`
        ("malformed", c_uint64),  # `ignored_total{reason="malformed"}`
    ]

kvrelay_block_holder_pin_fn = CFUNCTYPE(c_size_t, c_void_p, POINTER(c_uint64), c_size_t, POINTER(c_uint32))

kvrelay_block_holder_unpin_fn = CFUNCTYPE(None, c_void_p, POINTER(c_uint32), c_size_t)

kvrelay_block_holder_destroy_fn = CFUNCTYPE(None, c_void_p)

kvrelay_block_holder_returned_fn = CFUNCTYPE(None, c_void_p, POINTER(c_uint32), c_size_t)


class kvrelay_block_holder(Structure):
    """The runtime's reuse cache, as the agent's service sees it. `pin` and `unpin` run on the agent's connection threads, several at once: they must be thread-safe, must not unwind or `longjmp` out (catch C++ exceptions inside) and must not call back into this agent. - `pin(user_data, names, n, ids_out)`: of the `n` consecutive block names, find the leading run this instance holds, pin those blocks (no eviction, no write, no reuse until `unpin`), write their block ids into `ids_out[0..k]` (room for `n`) and return `k` (0: the first name is not held). The agent serves only blocks whose checksum was recorded (`kvrelay_agent_record_checksums`). - `unpin(user_data, ids, k)`: release blocks pinned by `pin` (each exactly once). - `destroy(user_data)` (may be NULL): called once when the agent is freed, after its last use of the holder, or when `kvrelay_agent_new` fails. - `returned(user_data, ids, k)` (may be NULL over TCP; needed with NIXL): destination blocks a fetch withheld (`kvrelay_fetch_result.withheld`) are free again, no transfer can write them any more. Runs on a fetch worker, or in `kvrelay_agent_free`. Without it withheld blocks stay out of the runtime's pool for good (counted in `blocks_withheld`)."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_block_holder)` as the caller's header declares it (callbacks of a newer header are refused while set, absent ones of an older header are NULL).
        ("user_data", c_void_p),  # Passed back to every callback.
        ("pin", kvrelay_block_holder_pin_fn),  # Pin the leading held run of `names`.
        ("unpin", kvrelay_block_holder_unpin_fn),  # Release pinned blocks.
        ("destroy", kvrelay_block_holder_destroy_fn),  # Release `user_data`.
        ("returned", kvrelay_block_holder_returned_fn),  # Withheld destination blocks are free again.
    ]


class kvrelay_source_speed(Structure):
    """A source's speed estimate."""

    _fields_ = [
        ("setup_s", c_double),  # Seconds before the first verified block.
        ("bytes_per_s", c_double),  # Bytes per second after it.
    ]


class kvrelay_agent_stats(Structure):
    """A copy of the agent's counters (monotonic, except the `*_now` gauges). `kvrelay_agent_stats` in C."""

    _fields_ = [
        ("accepted", c_uint64),  # Connections accepted from allowed peers.
        ("served", c_uint64),  # Connections that completed their handshake and were served.
        ("blocks_sent", c_uint64),  # Blocks sent.
        ("bytes_sent", c_uint64),  # Bytes of blocks sent.
        ("refused_peer_not_allowed", c_uint64),  # Connections refused: peer not on the allowlist.
        ("refused_busy", c_uint64),  # Refused: no serving slot, or no slot for a connection in its handshake.
        ("refused_per_peer_limit", c_uint64),  # Refused: the peer address holds its limit.
        ("refused_bad_request", c_uint64),  # Refused: a frame that does not decode or is not the one expected.
        ("refused_fingerprint_mismatch", c_uint64),  # Refused: the layouts differ.
        ("refused_auth_failed", c_uint64),  # Refused: authentication failed.
        ("refused_too_many_names", c_uint64),  # Refused: more names than `max_names`.
        ("refused_internal", c_uint64),  # Refused: the pin callback answered something impossible.
        ("handshake_timeouts", c_uint64),  # Connections closed because the handshake ran past its deadline (or the peer left).
        ("serve_aborted", c_uint64),  # Served transfers that stopped early (the peer left, a write deadline, the transfer deadline).
        ("pending_now", c_uint64),  # Connections in their handshake now (a gauge).
        ("serving_now", c_uint64),  # Connections serving now (a gauge).
        ("fetches_submitted", c_uint64),  # Fetches submitted.
        ("fetches_ok", c_uint64),  # Fetches completed without failure.
        ("fetch_failed_connect", c_uint64),  # Fetches that failed: connect.
        ("fetch_failed_timeout", c_uint64),  # ... timeout.
        ("fetch_failed_refused", c_uint64),  # ... refused.
        ("fetch_failed_fingerprint_mismatch", c_uint64),  # ... fingerprint mismatch.
        ("fetch_failed_corrupt", c_uint64),  # ... corrupt.
        ("fetch_failed_truncated", c_uint64),  # ... truncated.
        ("fetch_failed_source_miss", c_uint64),  # ... source miss.
        ("fetch_failed_auth_failed", c_uint64),  # ... authentication failed.
        ("fetch_failed_cancelled", c_uint64),  # ... cancelled.
        ("fetch_failed_shutdown", c_uint64),  # ... shut down.
        ("blocks_fetched", c_uint64),  # Blocks fetched, written and verified.
        ("bytes_fetched", c_uint64),  # Their bytes.
        ("refused_unsupported", c_uint64),  # Refused: the destination asked for a transport this service lacks (NIXL).
        ("blocks_withheld", c_uint64),  # Destination blocks a fetch withheld: writes into them (NIXL READs) were not proven over when the transfer ended, early or unwound by a panic.
        ("blocks_returned", c_uint64),  # Withheld blocks handed back to the runtime (`BlockHolder::returned`).
        ("reused", c_uint64),  # Served: transfers that came on a kept-alive connection (no new connect or handshake).
        ("streams_reused", c_uint64),  # Fetched: streams that went over a kept-alive connection.
        ("handshake_evicted", c_uint64),  # Connections closed, before their first valid message, to make room for a newer one (the handshake slots or their address's `max_per_peer` were all taken); each is answered `busy` before it closes.
        ("fetch_failed_internal", c_uint64),  # Fetches that failed: internal (a panic inside the agent).
        ("ipc_mapped_now", c_uint64),  # CUDA IPC: allocations of other processes mapped here now (a gauge).
        ("ipc_unmapped", c_uint64),  # CUDA IPC: mappings let go because their source process no longer runs, or to keep the table within its bounds (per source and in all).
        ("transport_fallbacks", c_uint64),  # Fetches made again over TCP because the agent's own transport could not reach their source (`tcp_fallback`); that source is then fetched from over TCP for a while.
        ("nixl_slow_reads", c_uint64),  # NIXL: fetches of device memory into device memory (at least 32 MiB, 1 MiB per descriptor on average) whose READs ran under 2 GB/s: UCX most likely emulated them in software (README, "The NIXL transport"). Since 0.3.1.
        ("fetch_failed_digest_mismatch", c_uint64),  # Fetches that failed: a block's content digest was not the one asked for. Since 0.3.3.
        ("ipc_offers_refused", c_uint64),  # CUDA IPC: offers in this process's name refused before any copy (memory no agent of this process on the offer's device exported, or a block its agent does not serve under the name asked); each fetch fails `corrupt`.
        ("grants_refused_unkeyed", c_uint64),  # Hellos of a transport that grants memory (CUDA IPC, NIXL) refused because this agent has no key ([`AgentConfig::per_user_key`](super::AgentConfig::per_user_key) off, no key given): no handle leaves an agent that cannot tell who asks; also counted in `refused_unsupported`. Since 0.4.1.
    ]


class kvrelay_agent_fingerprint(Structure):
    """What two instances compare before any block moves (`naming`: the runtime's naming-scheme id)."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_agent_fingerprint)` as the caller's header declares it.
        ("block_tokens", c_uint32),  # Tokens per block.
        ("layers", c_uint32),  # Layers.
        ("kv_heads", c_uint32),  # KV heads.
        ("head_dim", c_uint32),  # Head size.
        ("dtype_bytes", c_uint32),  # Bytes per element.
        ("naming", c_uint64),  # The runtime's naming-scheme id: equal ids must mean equal block names for equal KV.
    ]


class kvrelay_str(Structure):
    """A borrowed UTF-8 string view, **not** NUL-terminated. Valid while the snapshot it came from is held."""

    _fields_ = [
        ("ptr", c_void_p),  # First byte (never NULL, even when empty).
        ("len", c_size_t),  # Number of bytes.
    ]


class kvrelay_fetch_params(Structure):
    """One fetch to submit. Arrays are copied by `kvrelay_agent_fetch`."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_fetch_params)` as the caller's header declares it.
        ("endpoint", kvrelay_str),  # The source's KV endpoint, `tcp://host:port`, as the orchestration decision authorized it (`kvrelay_fetch_request.endpoint`).
        ("names", POINTER(c_uint64)),  # The request's own block names, from block 0.
        ("names_len", c_size_t),  # Number of names.
        ("held", c_size_t),  # Leading blocks the runtime holds already (not fetched).
        ("dst_blocks", POINTER(c_uint32)),  # Free destination blocks reserved for the fetch: name `held + i` goes into `dst_blocks[i]`; as many blocks are asked for as given (at most `names_len - held`).
        ("dst_len", c_size_t),  # Number of destination blocks (at least 1).
        ("deadline_ms", c_uint32),  # The whole fetch's deadline in milliseconds from submission (at least 1).
    ]


class kvrelay_fetch_result(Structure):
    """How a fetch ended."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_fetch_result)`: set by the caller of `kvrelay_fetch_poll` / `_wait` (the library writes only the fields it covers); in a completion callback, the library's own (read no field past it).
        ("failure", c_int32),  # A `kvrelay_fetch_failure` value; `KVRELAY_FETCH_OK` (0) when nothing failed (the source may still have offered fewer blocks than asked: its leading run).
        ("blocks", c_size_t),  # Leading destination blocks written and verified: commit exactly `dst_blocks[0..blocks]`, in order, whatever `failure` says.
        ("bytes", c_uint64),  # Their bytes.
        ("seconds", c_double),  # Seconds from submission to completion.
        ("withheld", c_size_t),  # Destination blocks after the verified ones that the agent still holds (NIXL only: a READ into them could not be proven stopped): `dst_blocks[blocks..blocks + withheld]` must not be reused until the holder's `returned` hands them back. 0 over TCP.
    ]

kvrelay_fetch_callbacks_done_fn = CFUNCTYPE(None, c_void_p, POINTER(kvrelay_fetch_result), kvrelay_str)

kvrelay_fetch_callbacks_destroy_fn = CFUNCTYPE(None, c_void_p)

kvrelay_fetch_callbacks_ready_fn = CFUNCTYPE(c_size_t, c_void_p, c_size_t, c_size_t)


class kvrelay_fetch_callbacks(Structure):
    """The completion of a fetch submitted with `kvrelay_agent_submit`. `size` is `sizeof(kvrelay_fetch_callbacks)` as the caller's header declares it: fields are only ever appended, the library reads `size` first and never past the caller's struct, a field an older caller's header lacks reads as zero (NULL), and a newer header's larger struct is accepted while the fields this library does not know are zero. - `done(user_data, result, detail)` (may be NULL): runs once, on one of the agent's fetch threads, when the fetch completes (also when it was cancelled or the agent is being freed), with the whole result and why it failed in words (`detail`: UTF-8, not NUL-terminated, empty when it did not fail; never hint bytes or a key). `result` and `detail` are valid during the call. It must not unwind and must not free the agent; it may free the fetch handle, poll or wait for its own fetch (which returns the result being delivered, at once) and cancel or wait for other fetches (a cancelled one still queued completes without a worker), so destroying a `kvrelay::Fetch` there never deadlocks. - `destroy(user_data)` (may be NULL): runs exactly once on every path: right after `done`, before the result is published to `kvrelay_fetch_poll` / `_wait`; or, when the submission is refused, before `kvrelay_agent_submit` returns. - `ready(user_data, from, n)` (may be NULL; since 0.4.0): lazy eviction. With it the destination blocks need only be reserved, not free, at submission: once per stream of the fetch, after the source's offer said the stream will get `n` blocks and before any of them is written, the library asks the runtime to make `dst_blocks[from..from + n]` ready to be written (to evict what they hold only now) and the stream takes as many, from the first, as it answers (at most `n`; 0: none). A source that holds none of the blocks never gets here, so a stale hint costs no eviction. Runs on a fetch thread, several streams of one fetch possibly at once and in any order; must not unwind and must not call into the agent. NULL: every destination block is free at submission."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_fetch_callbacks)`.
        ("user_data", c_void_p),  # Passed back to both callbacks.
        ("done", kvrelay_fetch_callbacks_done_fn),  # The completion.
        ("destroy", kvrelay_fetch_callbacks_destroy_fn),  # Releases `user_data`.
        ("ready", kvrelay_fetch_callbacks_ready_fn),  # Makes offered destination blocks ready (lazy eviction); may be NULL.
    ]


class kvrelay_kv_segment(Structure):
    """One (layer, K/V) slice of every block: block b at `base + b * block_stride`, `bytes_per_block` long."""

    _fields_ = [
        ("base", c_uint64),  # Address of block 0.
        ("block_stride", c_uint64),  # Distance between blocks.
        ("bytes_per_block", c_uint64),  # Bytes per block.
    ]


class kvrelay_kv_extent(Structure):
    """A memory extent the segments must stay inside."""

    _fields_ = [
        ("base", c_uint64),  # First byte.
        ("len", c_uint64),  # Length.
    ]


class kvrelay_cuda_engine_options(Structure):
    """Options of `kvrelay_cuda_engine_new` (pass NULL for the defaults: kernel, 16 CTAs of 512 threads, 1024 blocks per batch call, 256 MiB of scratch for the staged method)."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_cuda_engine_options)` as the caller's header declares it.
        ("method", c_int32),  # A `kvrelay_copy_method` value.
        ("ctas", c_uint32),  # Kernel CTA budget, 1..=1024.
        ("threads", c_uint32),  # Kernel threads per CTA, a multiple of 32 in 64..=512.
        ("max_blocks_per_call", c_size_t),  # Blocks per `cuMemcpyBatchAsync` call (descriptors reserved at setup).
        ("scratch_bytes", c_size_t),  # Device scratch of the staged method, bytes.
    ]


class kvrelay_kv_events_stats(Structure):
    """A publisher's counters (`kvrelay_kv_events_read_stats`). Fields are only ever appended, every one a `u64`."""

    _fields_ = [
        ("published", c_uint64),  # Events published.
        ("dropped", c_uint64),  # Events dropped because the publishing queue was full (65,536 events).
        ("batches", c_uint64),  # Batches published.
        ("replays", c_uint64),  # Replay requests answered.
        ("refused", c_uint64),  # Connections refused: the peer is not on the allowlist.
        ("send_errors", c_uint64),  # Batches ZMQ refused to send (they are still kept for replay).
        ("replay_batches", c_uint64),  # Batches queued for replay peers.
        ("replays_cut", c_uint64),  # Replays cut short: the peer took nothing for 5 s, asked again before the end, or its replay gave way to a newer one (16 run at once).
        ("replay_peers", c_uint64),  # Replay connections open now (a gauge): at most 16, of which at most 4 from one address. Since 0.3.4.
        ("replay_peers_refused", c_uint64),  # Replay connections refused because those limits were reached (not counted in `refused`). Since 0.3.4.
    ]


class kvrelay_naming(Structure):
    """What a chain of block names depends on besides the tokens. `size` is `sizeof(kvrelay_naming)` as the caller's header declares it (fields are only ever appended; the rules of `kvrelay_fetch_callbacks`)."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_naming)`.
        ("seed", c_uint64),  # The engine's seed: `kvrelay_name_seed` of its identity (the model file's digest, its build and every setting that changes KV bytes).
        ("block_tokens", c_size_t),  # Tokens per block (at least 1).
        ("lora_id", c_uint64),  # The LoRA adapter's id (0: none).
        ("salt", c_void_p),  # The request's cache salt (bytes; `(NULL, 0)` or empty: none), hashed into block 0 only.
        ("salt_len", c_size_t),  # Bytes of `salt`.
    ]


class kvrelay_candidate(Structure):
    """A candidate: a supported `kv.fetch` action and the families supporting it."""

    _fields_ = [
        ("action_index", c_size_t),  # Position in the snapshot's actions.
        ("families", c_uint64),  # Bit i set when family i (registration order in the capability builder) supports it.
    ]


class kvrelay_candidate_counts(Structure):
    """Counts of one candidate collection."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_candidate_counts)` as the caller's header declares it (the library writes only the fields it covers).
        ("unknown_type", c_uint32),  # Actions whose type no family lists.
        ("no_matching_version", c_uint32),  # `kv.fetch` actions whose version no family supports.
    ]


class kvrelay_bytes(Structure):
    """A borrowed byte view. Valid while the snapshot it came from is held."""

    _fields_ = [
        ("ptr", c_void_p),  # First byte (never NULL, even when empty).
        ("len", c_size_t),  # Number of bytes.
    ]


class kvrelay_fetch_request(Structure):
    """What a provider is asked to validate, then to fetch. Views valid during the call only."""

    _fields_ = [
        ("size", c_size_t),  # The library's `sizeof(kvrelay_fetch_request)`: a provider built against a newer header reads no field past it.
        ("binding_id", kvrelay_str),  # The resolved binding's id.
        ("family", kvrelay_str),  # Its family's name.
        ("action_index", c_size_t),  # Position of the action in the snapshot.
        ("action_type", kvrelay_str),  # The action's type.
        ("action_version", kvrelay_str),  # The action's version.
        ("payload", kvrelay_bytes),  # The action's canonical payload.
        ("endpoint", kvrelay_str),  # The destination, normalized, present in the trusted registry.
        ("envelope", kvrelay_bytes),  # The canonical one-action envelope to hand on.
        ("call_context", c_void_p),  # The `call_context` given to `kvrelay_orchestrate_with_context` for this request (NULL from `kvrelay_orchestrate`): where the provider leaves the fetch it accepted, for the code that asked, without globals or thread-locals.
    ]

kvrelay_provider_validate_fn = CFUNCTYPE(c_int32, c_void_p, POINTER(kvrelay_fetch_request))

kvrelay_provider_fetch_fn = CFUNCTYPE(c_int32, c_void_p, POINTER(kvrelay_fetch_request))

kvrelay_provider_destroy_fn = CFUNCTYPE(None, c_void_p)


class kvrelay_provider(Structure):
    """A consumer's provider. `validate` and `fetch` return 0 to accept, anything else to refuse (the value is the provider's own code); a NULL `validate` or `fetch` refuses (code -1), so a provider without `validate` is never asked to fetch. They run on the thread that calls `kvrelay_orchestrate`, inside that call, possibly on many threads at once, so they must be thread-safe; they must not unwind or `longjmp` out (a C++ exception must be caught inside), and must not keep the request's views after returning. `destroy` (may be NULL) is called once with `user_data` when the orchestrator is freed (or when `kvrelay_orchestrator_new` fails)."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_provider)` as the caller's header declares it.
        ("user_data", c_void_p),  # Passed back to every callback.
        ("validate", kvrelay_provider_validate_fn),  # Validate action version, payload and destination on the provider's own terms.
        ("fetch", kvrelay_provider_fetch_fn),  # Submit the named fetch.
        ("destroy", kvrelay_provider_destroy_fn),  # Release `user_data`.
    ]


class kvrelay_request_info(Structure):
    """The request facts eligibility needs."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_request_info)` as the caller's header declares it.
        ("generation_only", c_bool),  # A generation-only request.
        ("lora_adapter", c_bool),  # The request uses a LoRA adapter.
    ]


class kvrelay_decision(Structure):
    """The decision for one request."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_decision)` as the caller's header declares it (the library writes only the fields it covers).
        ("kind", c_int32),  # A `kvrelay_decision_kind` value.
        ("discard", c_int32),  # For KEEP_PAIRED_PATH: the reason, a `kvrelay_discard` value; `kvrelay_discard_name` renders it. `KVRELAY_DISCARD_NONE` (0) for NAMED_FETCH.
        ("binding_id", kvrelay_str),  # For NAMED_FETCH: the binding's id (valid while the orchestrator lives).
        ("action_index", c_size_t),  # For NAMED_FETCH: the action's position in the snapshot.
        ("provider_code", c_int32),  # For `KVRELAY_DISCARD_PROVIDER_REJECTED`, `KVRELAY_DISCARD_FETCH_FAILED` and `KVRELAY_DISCARD_PROVIDER_DECLINED`: what the provider answered (its own non-zero code, -1 for a NULL callback). 0 otherwise.
    ]


class kvrelay_policy_counters(Structure):
    """A copy of an orchestrator's counters."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_policy_counters)` as the caller's header declares it (the library writes only the fields it covers).
        ("named_fetch", c_uint64),  # Optional named fetches validated and submitted.
        ("discarded", (c_uint64 * KVRELAY_DISCARD_SLOTS)),  # Requests that kept the paired path, by `kvrelay_discard` value.
        ("unknown_type", c_uint64),  # Actions whose type no backend family lists, summed over the requests that reached candidate collection (each request's actions counted once).
        ("no_matching_version", c_uint64),  # `kv.fetch` actions whose version no family supports, likewise.
    ]


class kvrelay_action(Structure):
    """One action of a snapshot, as borrowed views."""

    _fields_ = [
        ("size", c_size_t),  # `sizeof(kvrelay_action)` as the caller's header declares it (set by the caller before the call; the library writes only the fields that size covers).
        ("index", c_size_t),  # Position in the envelope's `actions` array.
        ("id", kvrelay_str),  # `action_id`, decoded.
        ("action_type", kvrelay_str),  # `action_type`, decoded.
        ("version", kvrelay_str),  # `action_version`, decoded.
        ("payload", kvrelay_bytes),  # Canonical JSON bytes of `payload` (an object).
        ("canonical", kvrelay_bytes),  # Canonical JSON bytes of the whole action object.
    ]


# --- callback types of function parameters

kvrelay_agent_fetch_done_fn = CFUNCTYPE(None, c_void_p, POINTER(kvrelay_fetch_result))

# --- functions: name -> (restype, [(parameter, argtype), ...])

PROTOTYPES: dict[str, tuple[Any, list[tuple[str, Any]]]] = {
    "kvrelay_admission_config_new": (c_int32, [("out", POINTER(c_void_p))]),
    "kvrelay_admission_config_free": (None, [("config", c_void_p)]),
    "kvrelay_admission_config_set_trusted": (c_int32, [("config", c_void_p), ("trusted", c_bool)]),
    "kvrelay_admission_config_trust_from_env": (c_int32, [("config", c_void_p), ("name", c_void_p), ("len", c_size_t)]),
    "kvrelay_admission_config_set_max_bytes": (c_int32, [("config", c_void_p), ("max_bytes", c_size_t)]),
    "kvrelay_admission_config_set_max_depth": (c_int32, [("config", c_void_p), ("max_depth", c_size_t)]),
    "kvrelay_admission_config_set_max_raw_bytes": (c_int32, [("config", c_void_p), ("max_raw_bytes", c_size_t)]),
    "kvrelay_admission_config_set_metric_prefix": (c_int32, [("config", c_void_p), ("prefix", c_void_p), ("len", c_size_t)]),
    "kvrelay_admission_new": (c_int32, [("config", c_void_p), ("out", POINTER(c_void_p))]),
    "kvrelay_admission_free": (None, [("admission", c_void_p)]),
    "kvrelay_admit": (c_int32, [("admission", c_void_p), ("json", c_void_p), ("len", c_size_t), ("outcome", POINTER(kvrelay_outcome)), ("snapshot", POINTER(c_void_p))]),
    "kvrelay_admit_batch": (c_int32, [("admission", c_void_p), ("json", c_void_p), ("len", c_size_t), ("prompts", c_size_t), ("outcomes", POINTER(kvrelay_outcome)), ("snapshots", POINTER(c_void_p)), ("shared", POINTER(c_bool))]),
    "kvrelay_admission_decode_msgpack": (c_int32, [("admission", c_void_p), ("msgpack", c_void_p), ("len", c_size_t), ("outcome", POINTER(kvrelay_outcome)), ("snapshot", POINTER(c_void_p))]),
    "kvrelay_admission_counters": (c_int32, [("admission", c_void_p), ("out", POINTER(kvrelay_counters))]),
    "kvrelay_admission_prometheus": (c_int32, [("admission", c_void_p), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_find_hint": (c_int32, [("body", c_void_p), ("len", c_size_t), ("spelling_out", POINTER(c_int32)), ("offset_out", POINTER(c_size_t)), ("len_out", POINTER(c_size_t))]),
    "kvrelay_agent_new": (c_int32, [("config", c_void_p), ("layout", c_void_p), ("holder", POINTER(kvrelay_block_holder)), ("out", POINTER(c_void_p))]),
    "kvrelay_agent_free": (None, [("agent", c_void_p)]),
    "kvrelay_agent_endpoint": (c_int32, [("agent", c_void_p), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_agent_record_checksums": (c_int32, [("agent", c_void_p), ("ids", POINTER(c_uint32)), ("n", c_size_t)]),
    "kvrelay_agent_verify_blocks": (c_int32, [("agent", c_void_p), ("ids", POINTER(c_uint32)), ("n", c_size_t), ("verified", POINTER(c_size_t))]),
    "kvrelay_agent_record_digests": (c_int32, [("agent", c_void_p), ("ids", POINTER(c_uint32)), ("digests", c_void_p), ("n", c_size_t)]),
    "kvrelay_agent_estimate": (c_int32, [("agent", c_void_p), ("endpoint", c_void_p), ("len", c_size_t), ("blocks", c_size_t), ("seconds_out", POINTER(c_double))]),
    "kvrelay_agent_record_import": (c_int32, [("agent", c_void_p), ("blocks", c_size_t), ("seconds", c_double)]),
    "kvrelay_agent_import_estimate": (c_int32, [("agent", c_void_p), ("blocks", c_size_t), ("seconds_out", POINTER(c_double))]),
    "kvrelay_agent_source_speed": (c_int32, [("agent", c_void_p), ("endpoint", c_void_p), ("len", c_size_t), ("out", POINTER(kvrelay_source_speed))]),
    "kvrelay_agent_read_stats": (c_int32, [("agent", c_void_p), ("out", POINTER(kvrelay_agent_stats)), ("size", c_size_t)]),
    "kvrelay_agent_prometheus": (c_int32, [("agent", c_void_p), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_agent_config_new": (c_int32, [("fingerprint", POINTER(kvrelay_agent_fingerprint)), ("out", POINTER(c_void_p))]),
    "kvrelay_agent_config_free": (None, [("config", c_void_p)]),
    "kvrelay_agent_config_set_listen": (c_int32, [("config", c_void_p), ("addr", c_void_p), ("len", c_size_t)]),
    "kvrelay_agent_config_set_transport": (c_int32, [("config", c_void_p), ("transport", c_void_p), ("transport_len", c_size_t), ("lib_dir", c_void_p), ("lib_dir_len", c_size_t)]),
    "kvrelay_agent_config_allow_peer": (c_int32, [("config", c_void_p), ("spec", c_void_p), ("len", c_size_t)]),
    "kvrelay_agent_config_set_device": (c_int32, [("config", c_void_p), ("device", c_int32)]),
    "kvrelay_agent_config_set_limit": (c_int32, [("config", c_void_p), ("limit", c_int32), ("value", c_uint64)]),
    "kvrelay_agent_config_get_limit": (c_int32, [("config", c_void_p), ("limit", c_int32), ("out", POINTER(c_uint64))]),
    "kvrelay_agent_limit_name": (c_char_p, [("limit", c_int32)]),
    "kvrelay_agent_config_set_key": (c_int32, [("config", c_void_p), ("key", c_void_p), ("len", c_size_t)]),
    "kvrelay_agent_config_set_per_user_key": (c_int32, [("config", c_void_p), ("on", c_bool)]),
    "kvrelay_agent_config_key_from_env": (c_int32, [("config", c_void_p), ("name", c_void_p), ("len", c_size_t)]),
    "kvrelay_agent_config_key_from_file": (c_int32, [("config", c_void_p), ("path", c_void_p), ("len", c_size_t)]),
    "kvrelay_agent_fetch": (c_int32, [("agent", c_void_p), ("params", POINTER(kvrelay_fetch_params)), ("done", kvrelay_agent_fetch_done_fn), ("user_data", c_void_p), ("out", POINTER(c_void_p))]),
    "kvrelay_agent_submit": (c_int32, [("agent", c_void_p), ("params", POINTER(kvrelay_fetch_params)), ("callbacks", POINTER(kvrelay_fetch_callbacks)), ("out", POINTER(c_void_p))]),
    "kvrelay_agent_submit_checked": (c_int32, [("agent", c_void_p), ("params", POINTER(kvrelay_fetch_params)), ("digests", c_void_p), ("digests_len", c_size_t), ("callbacks", POINTER(kvrelay_fetch_callbacks)), ("out", POINTER(c_void_p))]),
    "kvrelay_fetch_poll": (c_int32, [("fetch", c_void_p), ("out", POINTER(kvrelay_fetch_result))]),
    "kvrelay_fetch_wait": (c_int32, [("fetch", c_void_p), ("timeout_ms", c_uint32), ("out", POINTER(kvrelay_fetch_result))]),
    "kvrelay_fetch_detail": (c_int32, [("fetch", c_void_p), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_fetch_cancel": (c_int32, [("fetch", c_void_p)]),
    "kvrelay_fetch_free": (None, [("fetch", c_void_p)]),
    "kvrelay_fetch_run_length": (c_int32, [("names", POINTER(c_uint64)), ("n", c_size_t), ("held", c_size_t), ("hashes", POINTER(c_uint64)), ("m", c_size_t), ("out", POINTER(c_size_t))]),
    "kvrelay_fetch_deadline_ms": (c_uint32, [("bytes", c_uint64)]),
    "kvrelay_fetch_failure_name": (c_char_p, [("failure", c_int32)]),
    "kvrelay_last_error_message": (c_int32, [("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_kv_layout_new": (c_int32, [("num_blocks", c_uint32), ("segments", POINTER(kvrelay_kv_segment)), ("n_segments", c_size_t), ("pools", POINTER(kvrelay_kv_extent)), ("n_pools", c_size_t), ("out", POINTER(c_void_p))]),
    "kvrelay_kv_layout_per_layer_kv_first": (c_int32, [("layer_pools", POINTER(c_uint64)), ("layers", c_size_t), ("num_blocks", c_uint32), ("kv_block_bytes", c_uint64), ("out", POINTER(c_void_p))]),
    "kvrelay_kv_layout_per_layer_block_first": (c_int32, [("layer_pools", POINTER(c_uint64)), ("layers", c_size_t), ("num_blocks", c_uint32), ("kv_block_bytes", c_uint64), ("out", POINTER(c_void_p))]),
    "kvrelay_kv_layout_all_layers_per_block": (c_int32, [("pool", c_uint64), ("layers", c_uint32), ("num_blocks", c_uint32), ("kv_block_bytes", c_uint64), ("out", POINTER(c_void_p))]),
    "kvrelay_kv_layout_stage_block_bytes": (c_uint64, [("layout", c_void_p)]),
    "kvrelay_kv_layout_free": (None, [("layout", c_void_p)]),
    "kvrelay_cpu_engine_new": (c_int32, [("layout", c_void_p), ("out", POINTER(c_void_p))]),
    "kvrelay_cpu_gather": (c_int32, [("engine", c_void_p), ("ids", POINTER(c_uint32)), ("n", c_size_t), ("staging", c_void_p), ("staging_len", c_size_t)]),
    "kvrelay_cpu_scatter": (c_int32, [("engine", c_void_p), ("staging", c_void_p), ("staging_len", c_size_t), ("ids", POINTER(c_uint32)), ("n", c_size_t)]),
    "kvrelay_cpu_engine_free": (None, [("engine", c_void_p)]),
    "kvrelay_cuda_available": (c_int32, [("device", c_int32)]),
    "kvrelay_pinned_alloc": (c_int32, [("device", c_int32), ("len", c_size_t), ("out", POINTER(c_void_p))]),
    "kvrelay_pinned_register": (c_int32, [("device", c_int32), ("ptr", c_void_p), ("len", c_size_t), ("out", POINTER(c_void_p))]),
    "kvrelay_pinned_host": (c_void_p, [("pinned", c_void_p)]),
    "kvrelay_pinned_len": (c_size_t, [("pinned", c_void_p)]),
    "kvrelay_pinned_free": (None, [("pinned", c_void_p)]),
    "kvrelay_cuda_engine_new": (c_int32, [("device", c_int32), ("layout", c_void_p), ("options", POINTER(kvrelay_cuda_engine_options)), ("out", POINTER(c_void_p))]),
    "kvrelay_cuda_gather": (c_int32, [("engine", c_void_p), ("ids", POINTER(c_uint32)), ("n", c_size_t), ("staging", c_void_p), ("stream", c_void_p), ("done_event", c_void_p)]),
    "kvrelay_cuda_scatter": (c_int32, [("engine", c_void_p), ("staging", c_void_p), ("ids", POINTER(c_uint32)), ("n", c_size_t), ("stream", c_void_p), ("done_event", c_void_p)]),
    "kvrelay_cuda_engine_free": (None, [("engine", c_void_p)]),
    "kvrelay_cuda_copier_new": (c_int32, [("device", c_int32), ("out", POINTER(c_void_p))]),
    "kvrelay_cuda_copy_2d": (c_int32, [("copier", c_void_p), ("dst", c_uint64), ("dst_pitch", c_size_t), ("src", c_uint64), ("src_pitch", c_size_t), ("width", c_size_t), ("height", c_size_t)]),
    "kvrelay_cuda_copier_finish": (c_int32, [("copier", c_void_p), ("bytes_out", POINTER(c_uint64))]),
    "kvrelay_cuda_copier_free": (None, [("copier", c_void_p)]),
    "kvrelay_kv_checksum": (c_int32, [("bytes", c_void_p), ("len", c_size_t), ("out", POINTER(c_uint64))]),
    "kvrelay_kv_events_config_new": (c_int32, [("endpoint", c_void_p), ("len", c_size_t), ("block_size", c_size_t), ("out", POINTER(c_void_p))]),
    "kvrelay_kv_events_config_free": (None, [("config", c_void_p)]),
    "kvrelay_kv_events_config_set": (c_int32, [("config", c_void_p), ("setting", c_int32), ("value", c_void_p), ("len", c_size_t)]),
    "kvrelay_kv_events_start": (c_int32, [("config", c_void_p), ("out", POINTER(c_void_p))]),
    "kvrelay_kv_events_free": (None, [("events", c_void_p)]),
    "kvrelay_kv_events_stored": (c_int32, [("events", c_void_p), ("name", c_uint64), ("has_parent", c_bool), ("parent", c_uint64), ("tokens", POINTER(c_uint32)), ("n_tokens", c_size_t)]),
    "kvrelay_kv_events_removed": (c_int32, [("events", c_void_p), ("name", c_uint64)]),
    "kvrelay_kv_events_cleared": (c_int32, [("events", c_void_p)]),
    "kvrelay_kv_events_endpoint": (c_int32, [("events", c_void_p), ("replay", c_bool), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_kv_events_read_stats": (c_int32, [("events", c_void_p), ("out", POINTER(kvrelay_kv_events_stats)), ("size", c_size_t)]),
    "kvrelay_kv_events_prometheus": (c_int32, [("events", c_void_p), ("prefix", c_void_p), ("prefix_len", c_size_t), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_name_seed": (c_int32, [("identity", c_void_p), ("len", c_size_t), ("out", POINTER(c_uint64))]),
    "kvrelay_file_digest": (c_int32, [("path", c_void_p), ("len", c_size_t), ("out", c_void_p)]),
    "kvrelay_block_names": (c_int32, [("naming", POINTER(kvrelay_naming)), ("parent", c_uint64), ("first_block", c_size_t), ("tokens", POINTER(c_uint32)), ("n_tokens", c_size_t), ("names", POINTER(c_uint64)), ("cap", c_size_t), ("n_out", POINTER(c_size_t))]),
    "kvrelay_block_digests": (c_int32, [("naming", POINTER(kvrelay_naming)), ("identity", c_void_p), ("identity_len", c_size_t), ("parent", c_void_p), ("first_block", c_size_t), ("tokens", POINTER(c_uint32)), ("n_tokens", c_size_t), ("digests", c_void_p), ("cap", c_size_t), ("n_out", POINTER(c_size_t))]),
    "kvrelay_capabilities_builder_new": (c_int32, [("out", POINTER(c_void_p))]),
    "kvrelay_capabilities_builder_add": (c_int32, [("builder", c_void_p), ("family", c_void_p), ("family_len", c_size_t), ("action_type", c_void_p), ("action_type_len", c_size_t), ("action_version", c_void_p), ("action_version_len", c_size_t)]),
    "kvrelay_capabilities_build": (c_int32, [("builder", c_void_p), ("out", POINTER(c_void_p))]),
    "kvrelay_capabilities_builder_free": (None, [("builder", c_void_p)]),
    "kvrelay_capabilities_free": (None, [("caps", c_void_p)]),
    "kvrelay_collect_candidates": (c_int32, [("snapshot", c_void_p), ("caps", c_void_p), ("out", POINTER(kvrelay_candidate)), ("cap", c_size_t), ("count_out", POINTER(c_size_t)), ("counts", POINTER(kvrelay_candidate_counts))]),
    "kvrelay_policy_config_new": (c_int32, [("out", POINTER(c_void_p))]),
    "kvrelay_policy_config_free": (None, [("config", c_void_p)]),
    "kvrelay_policy_config_add_binding": (c_int32, [("config", c_void_p), ("id", c_void_p), ("id_len", c_size_t), ("family", c_void_p), ("family_len", c_size_t), ("addressing", c_int32), ("authorized", c_bool)]),
    "kvrelay_policy_config_binding_support": (c_int32, [("config", c_void_p), ("id", c_void_p), ("id_len", c_size_t), ("action_type", c_void_p), ("action_type_len", c_size_t), ("action_version", c_void_p), ("action_version_len", c_size_t)]),
    "kvrelay_policy_config_add_endpoint": (c_int32, [("config", c_void_p), ("endpoint", c_void_p), ("len", c_size_t)]),
    "kvrelay_policy_config_set_metric_prefix": (c_int32, [("config", c_void_p), ("prefix", c_void_p), ("len", c_size_t)]),
    "kvrelay_orchestrator_new": (c_int32, [("caps", c_void_p), ("config", c_void_p), ("provider", POINTER(kvrelay_provider)), ("out", POINTER(c_void_p))]),
    "kvrelay_orchestrator_free": (None, [("orchestrator", c_void_p)]),
    "kvrelay_orchestrate": (c_int32, [("orchestrator", c_void_p), ("request", POINTER(kvrelay_request_info)), ("snapshot", c_void_p), ("out", POINTER(kvrelay_decision))]),
    "kvrelay_orchestrate_with_context": (c_int32, [("orchestrator", c_void_p), ("request", POINTER(kvrelay_request_info)), ("snapshot", c_void_p), ("call_context", c_void_p), ("out", POINTER(kvrelay_decision))]),
    "kvrelay_discard_name": (c_char_p, [("discard", c_int32)]),
    "kvrelay_orchestrator_counters": (c_int32, [("orchestrator", c_void_p), ("out", POINTER(kvrelay_policy_counters))]),
    "kvrelay_orchestrator_prometheus": (c_int32, [("orchestrator", c_void_p), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_snapshot_retain": (c_void_p, [("snapshot", c_void_p)]),
    "kvrelay_snapshot_release": (None, [("snapshot", c_void_p)]),
    "kvrelay_snapshot_canonical": (c_int32, [("snapshot", c_void_p), ("out", POINTER(kvrelay_bytes))]),
    "kvrelay_snapshot_protocol_version": (c_int32, [("snapshot", c_void_p), ("out", POINTER(kvrelay_str))]),
    "kvrelay_snapshot_message_id": (c_int32, [("snapshot", c_void_p), ("out", POINTER(kvrelay_str))]),
    "kvrelay_snapshot_action_count": (c_int32, [("snapshot", c_void_p), ("out", POINTER(c_size_t))]),
    "kvrelay_snapshot_action": (c_int32, [("snapshot", c_void_p), ("index", c_size_t), ("out", POINTER(kvrelay_action))]),
    "kvrelay_snapshot_decode": (c_int32, [("snapshot", c_void_p), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_snapshot_msgpack": (c_int32, [("snapshot", c_void_p), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_snapshot_action_envelope": (c_int32, [("snapshot", c_void_p), ("index", c_size_t), ("buf", c_void_p), ("cap", c_size_t), ("len_out", POINTER(c_size_t))]),
    "kvrelay_debug_checks": (c_bool, []),
    "kvrelay_version": (c_char_p, []),
    "kvrelay_status_message": (c_char_p, [("status", c_int32)]),
    "kvrelay_reason_name": (c_char_p, [("reason", c_int32)]),
}

OPAQUE = ("kvrelay_admission", "kvrelay_admission_config", "kvrelay_agent", "kvrelay_agent_config", "kvrelay_capabilities", "kvrelay_capabilities_builder", "kvrelay_cpu_engine", "kvrelay_cuda_copier", "kvrelay_cuda_engine", "kvrelay_fetch", "kvrelay_kv_events", "kvrelay_kv_events_config", "kvrelay_kv_layout", "kvrelay_orchestrator", "kvrelay_pinned", "kvrelay_policy_config", "kvrelay_snapshot", )
