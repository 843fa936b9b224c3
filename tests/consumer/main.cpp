// Consumer of an installed kvrelay: find_package(kvrelay) + kvrelay::kvrelay.
#include <cstdio>
#include <cstring>
#include <string>

#include <kvrelay.hpp>

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
