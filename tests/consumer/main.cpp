// Consumer of an installed kvrelay: find_package(kvrelay) + kvrelay::kvrelay.
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

// A runtime's CUDA handles, declared as cuda.h declares them (no CUDA toolkit here): they must
// pass straight through kvrelay.hpp's CUDA methods, and kvrelay.hpp must not redeclare the names.
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

#include <kvrelay.hpp>

static_assert(std::is_same<CUstream, kvrelay::CUstream>::value, "a runtime's CUstream is kvrelay's");
static_assert(std::is_same<CUevent, kvrelay::CUevent>::value, "a runtime's CUevent is kvrelay's");
// compiled, never called (it would need a GPU): the runtime's handles are accepted as they are
[[maybe_unused]] static void pass_cuda_handles(kvrelay::CudaEngine &e, const kvrelay::Pinned &p, CUstream s, CUevent ev) {
  const uint32_t id = 0;
  e.gather(&id, 1, p, s, ev);
  e.scatter(p, &id, 1, s, ev);
}

int main() {
  // the library found must be the one whose header this was compiled against
  const std::string want = std::to_string(KVRELAY_VERSION_MAJOR) + "." + std::to_string(KVRELAY_VERSION_MINOR) + "." +
                           std::to_string(KVRELAY_VERSION_PATCH);
  if (want != kvrelay_version()) {
    std::fprintf(stderr, "version mismatch: library %s\n", kvrelay_version());
    return 1;
  }
  kvrelay::AdmissionConfig cfg;
  cfg.trusted = true;
  kvrelay::Admission edge(cfg);
  kvrelay::Outcome o = edge.admit(R"({"protocol_version":"0.1","message_id":"consumer","actions":[]})");
  if (!o.admitted() || o.snapshot.message_id() != "consumer") {
    std::fprintf(stderr, "unexpected outcome %s\n", o.reason_name());
    return 1;
  }
  kvrelay::Snapshot copy = o.snapshot;  // retain
  std::printf("consumer: admitted %.*s, %zu actions, shared=%d\n", (int)copy.message_id().size(),
              copy.message_id().data(), copy.action_count(), copy.get() == o.snapshot.get());
  return 0;
}
