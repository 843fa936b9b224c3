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
``Fetch``) free their C object on ``close()``, at the end of a ``with`` block, or when collected;
``close()`` waits for the calls in flight on the handle (other threads'), and a call on a closed
handle raises ``ValueError``. Failures raise ``KvrelayError`` carrying the library's last-error
text; bad Python arguments raise ``TypeError`` or ``ValueError`` (``IndexError`` for an index out
of range) before any C call.
"""

from __future__ import annotations

from ._common import AgentLimit, DecisionKind, Discard, FetchFailure, HintSpelling, KvrelayError, OutcomeKind, Reason, Status, cuda_available, kv_checksum, version
from .admission import Action, Admission, Outcome, Snapshot, find_hint
from .policy import Binding, Candidate, Capabilities, Decision, FetchRequest, Orchestrator, Provider
from .copy import CpuEngine, KvLayout
from .agent import Agent, BlockHolder, Fetch, FetchResult, Fingerprint, Naming, fetch_run_length

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
    "Naming",
    "Candidate",
    "Capabilities",
    "CpuEngine",
    "Decision",
    "Fetch",
    "FetchRequest",
    "FetchResult",
    "Fingerprint",
    "HintSpelling",
    "KvLayout",
    "KvrelayError",
    "Orchestrator",
    "Outcome",
    "Provider",
    "Snapshot",
    "cuda_available",
    "fetch_run_length",
    "find_hint",
    "kv_checksum",
    "version",
]
