// Consumer of an installed kvrelay: find_package(kvrelay) + kvrelay::kvrelay.
#include <cstdio>
#include <cstring>

#include <kvrelay.hpp>

int main() {
  if (std::strcmp(kvrelay_version(), "0.1.0") != 0 || KVRELAY_VERSION_MAJOR != 0) {
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
