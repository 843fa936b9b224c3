// Block naming and KV events through the C++ wrappers (kvrelay.hpp): the same names and
// content digests as the C functions, continued block by block; a publisher's endpoints and
// counters.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay.hpp"

static int failures = 0;
#define CHECK(c)                                                                 \
  do {                                                                           \
    if (!(c)) {                                                                  \
      ++failures;                                                                \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #c); \
    }                                                                            \
  } while (0)

int main() {
  std::vector<uint32_t> toks(100);
  for (std::size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint32_t>(i * 31);
  const uint64_t seed = kvrelay::Naming::seed_of("a model identity");
  kvrelay::Naming naming(seed, 16, 0, "salt");
  const std::vector<uint64_t> whole = naming.names(toks);
  CHECK(whole.size() == 6);
  uint64_t parent = 0;
  for (std::size_t b = 0; b < whole.size(); ++b) {
    const auto one = naming.names(toks.data() + b * 16, 16, parent, b);
    CHECK(one.size() == 1 && one[0] == whole[b]);
    parent = one.empty() ? 0 : one[0];
  }
  CHECK(kvrelay::Naming(seed, 16).names(toks) != whole);  // no salt: other names
  // the salt is the object's own: a temporary string does not dangle, copies name alike
  kvrelay::Naming from_temporary(seed, 16, 0, std::string("sa") + "lt");
  const kvrelay::Naming copy = from_temporary;
  CHECK(copy.names(toks) == whole);
  // llama.cpp's signed token ids name the same blocks
  const std::vector<int32_t> signed_toks(toks.begin(), toks.end());
  CHECK(naming.names(signed_toks) == whole);
  try {
    kvrelay::Naming(seed, 0).names(toks);
    CHECK(false);
  } catch (const kvrelay::Error &e) {
    CHECK(e.status() == KVRELAY_ERR_INVALID_ARGUMENT);
  }

  // content digests: chained like the names, bound to the engine's identity
  const std::vector<kvrelay::Naming::Digest> digests = naming.digests("a model identity", toks);
  CHECK(digests.size() == 6);
  const kvrelay::Naming::Digest *dparent = nullptr;
  for (std::size_t b = 0; b < digests.size(); ++b) {
    const auto one = naming.digests("a model identity", toks.data() + b * 16, 16, dparent, b);
    CHECK(one.size() == 1 && one[0] == digests[b]);
    dparent = &digests[b];
  }
  CHECK(naming.digests("a model identity", signed_toks) == digests);
  CHECK(copy.digests("a model identity", toks) == digests);
  CHECK(naming.digests("another identity", toks) != digests);
  CHECK(kvrelay::Naming(seed, 16).digests("a model identity", toks) != digests);  // no salt
  CHECK(naming.digests("a model identity", toks.data(), 15).empty());               // no full block
  try {
    naming.digests("a model identity", toks.data() + 16, 16, nullptr, 1);  // no parent past block 0
    CHECK(false);
  } catch (const kvrelay::Error &e) {
    CHECK(e.status() == KVRELAY_ERR_NULL);
  }
  // the golden value of src/names.rs (Python's hashlib): tokens 1..=69, blocks of 32
  std::vector<uint32_t> counting(69);
  for (std::size_t i = 0; i < counting.size(); ++i) counting[i] = static_cast<uint32_t>(i + 1);
  const kvrelay::Naming::Digest golden = {0x03, 0xbc, 0x20, 0x92, 0xf8, 0x85, 0x74, 0x09, 0x69, 0x43, 0xd2,
                                          0x6f, 0x28, 0xc6, 0x93, 0x85, 0x6a, 0xb0, 0xe8, 0x7e, 0x48, 0x13,
                                          0xa8, 0x6d, 0x81, 0xe0, 0xd2, 0x57, 0xba, 0x50, 0x26, 0xab};
  const auto counted = kvrelay::Naming(kvrelay::Naming::seed_of("llama-identity"), 32).digests("llama-identity", counting);
  CHECK(counted.size() == 2 && counted[0] == golden);

  kvrelay::KvEvents ev("tcp://127.0.0.1:0", 16, "CPU");
  CHECK(ev.endpoint().rfind("tcp://127.0.0.1:", 0) == 0);
  CHECK(ev.endpoint(true) != ev.endpoint());
  ev.stored(whole[0], nullptr, toks.data(), 16);
  ev.stored(whole[1], &whole[0], toks.data() + 16, 16);
  ev.cleared();
  kvrelay_kv_events_stats s{};
  for (int i = 0; i < 20000 && s.published < 4; ++i) {
    s = ev.stats();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(s.published == 4);
  CHECK(ev.prometheus("llamacpp").find("llamacpp_kv_events_published_total 4") != std::string::npos);
  try {
    kvrelay::KvEvents bad("udp://127.0.0.1:0", 16);
    CHECK(false);
  } catch (const kvrelay::Error &e) {
    CHECK(e.status() == KVRELAY_ERR_INVALID_CONFIG);
  }
  std::printf("names_events_cxx: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
