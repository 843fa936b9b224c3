// kvrelay.hpp: header-only C++17 RAII wrappers over kvrelay.h.
//
// Error policy: a kvrelay_status other than KVRELAY_OK throws kvrelay::Error (derived from
// std::runtime_error; status() gives the code, what() kvrelay_status_message's text). Hint
// outcomes are not errors: an ignored hint is an ordinary Outcome, so inference continues.
//
// kvrelay::Snapshot: copy = kvrelay_snapshot_retain, move = transfer, destructor = release.
// Views (std::string_view) borrow from the snapshot and are valid while some Snapshot holding
// it lives. Every other handle (Admission, Capabilities, Orchestrator, KvLayout, CpuEngine,
// Pinned, CudaEngine) is one detail::Handle: movable (construction and assignment; a moved-from
// object is empty), not copyable, freed once.
//
// Threads: Snapshot, Admission (admit, counters, prometheus), Capabilities and Orchestrator
// (decide, prometheus) may be used from any number of threads at once. CpuEngine, CudaEngine
// and Pinned belong to one thread (or stream) at a time. Provider::validate and fetch run on
// the thread that calls Orchestrator::decide, inside it, possibly on many threads at once: make
// them thread-safe; an exception they throw is caught and counts as a refusal (-1); a provider
// slot left NULL at the C level refuses as well. kvrelay::Error::what() carries the detail of
// kvrelay_last_error_message when thrown right after the failing call (same thread).
//
// The wrappers live in one header per concept under kvrelay/ (core, admission, policy, copy,
// agent, naming, events); this header includes them all.
#ifndef KVRELAY_KVRELAY_HPP
#define KVRELAY_KVRELAY_HPP

#include "kvrelay/core.hpp"
#include "kvrelay/admission.hpp"
#include "kvrelay/policy.hpp"
#include "kvrelay/copy.hpp"
#include "kvrelay/agent.hpp"
#include "kvrelay/naming.hpp"
#include "kvrelay/events.hpp"

#endif  // KVRELAY_KVRELAY_HPP
