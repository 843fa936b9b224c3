// The KV agent through the C++ wrappers (kvrelay.hpp): a source and a destination in one
// process on loopback, host pools; the fetched bytes are checked, a wrong key is refused, and
// destroying a running `kvrelay::Fetch` cancels it and waits for its completion.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay.hpp"

static int failures = 0;
#define CHECK(c)                                                      \
  do {                                                                \
    if (!(c)) {                                                       \
      ++failures;                                                     \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #c); \
    }                                                                 \
  } while (0)

namespace {
constexpr uint32_t kBlocks = 8;
constexpr uint64_t kKvBlock = 2048;  // one layer: [2, kBlocks, kKvBlock]

struct Cache : kvrelay::BlockHolder {
  std::mutex mu;
  std::map<uint64_t, uint32_t> held;
  int pins = 0;
  std::size_t pin(const uint64_t *names, std::size_t n, uint32_t *ids) override {
    std::lock_guard<std::mutex> g(mu);
    std::size_t k = 0;
    for (; k < n; ++k) {
      auto it = held.find(names[k]);
      if (it == held.end()) break;
      ids[k] = it->second;
    }
    pins += static_cast<int>(k);
    return k;
  }
  void unpin(const uint32_t *, std::size_t n) override {
    std::lock_guard<std::mutex> g(mu);
    pins -= static_cast<int>(n);
  }
};

struct Pool {
  std::vector<uint64_t> mem = std::vector<uint64_t>(2 * kBlocks * kKvBlock / 8);
  kvrelay::KvLayout layout =
      kvrelay::KvLayout::per_layer_kv_first({reinterpret_cast<uint64_t>(mem.data())}, kBlocks, kKvBlock);
  uint8_t *at(int kv, uint32_t id) { return reinterpret_cast<uint8_t *>(mem.data()) + (kv * kBlocks + id) * kKvBlock; }
};
}  // namespace

int main() {
  const kvrelay_agent_fingerprint fp {sizeof(kvrelay_agent_fingerprint), 16, 1, 4, 128, 2, 42};
  Pool src, dst;
  Cache cache, none;
  const std::vector<uint64_t> names{11, 12, 13};
  for (uint32_t i = 0; i < 3; ++i) {
    std::memset(src.at(0, i), 0x10 + i, kKvBlock);
    std::memset(src.at(1, i), 0x20 + i, kKvBlock);
    cache.held[names[i]] = i;
  }
  // each block's content digest (a runtime's come from kvrelay::Naming over its tokens)
  std::vector<kvrelay::BlockDigest> digests(3);
  for (uint8_t i = 0; i < 3; ++i) digests[i].fill(0xd0 + i);
  kvrelay::Agent source(kvrelay::AgentConfig(fp).key("the example's shared key"), src.layout, cache);
  source.record_checksums({0, 1, 2});
  source.record_digests({0, 1, 2}, digests);
  kvrelay::Agent dest(kvrelay::AgentConfig(fp).listen("").key("the example's shared key"), dst.layout, none);
  // a fetch by name alone is refused unless the limit allows it
  bool unchecked_refused = false;
  try {
    dest.fetch(source.endpoint(), names, 1, {5, 6}, 10000);
  } catch (const kvrelay::Error &e) {
    unchecked_refused = e.status() == KVRELAY_ERR_INVALID_ARGUMENT;
  }
  CHECK(unchecked_refused);
  kvrelay::Fetch f = dest.fetch(source.endpoint(), names, digests, 1, {5, 6}, 10000);
  auto r = f.wait(20000);
  CHECK(r && r->failure == KVRELAY_FETCH_OK && r->blocks == 2 && r->withheld == 0);
  for (uint32_t i = 0; i < 2; ++i) {
    CHECK(dst.at(0, 5 + i)[0] == 0x11 + i && dst.at(0, 5 + i)[kKvBlock - 1] == 0x11 + i);
    CHECK(dst.at(1, 5 + i)[7] == 0x21 + i);
  }
  CHECK(f.detail().empty());
  // what landed holds what was recorded for it (checksum and keyed tag); a byte changed in
  // place is found where a slot would take the block
  const uint32_t landed[] = {5, 6};
  CHECK(dest.verify_blocks(landed, 2) == 2);
  dst.at(1, 6)[3] ^= 0x40;
  CHECK(dest.verify_blocks(landed, 2) == 1);
  dst.at(1, 6)[3] ^= 0x40;
  CHECK(dest.verify_blocks(landed, 2) == 2);
  // the connection of a transfer that ended cleanly carries the next one (no new handshake)
  auto again = dest.fetch(source.endpoint(), names, digests, 0, {7}, 10000).wait(20000);
  CHECK(again && again->failure == KVRELAY_FETCH_OK && again->blocks == 1);
  CHECK(source.stats().accepted == 1 && source.stats().reused == 1 && dest.stats().streams_reused == 1);
  kvrelay::Agent wrong(kvrelay::AgentConfig(fp).listen("").key("not the example's shared key"), dst.layout, none);
  kvrelay::Fetch g = wrong.fetch(source.endpoint(), names, digests, 0, {0}, 10000);
  auto w = g.wait(20000);
  CHECK(w && w->failure == KVRELAY_FETCH_AUTH_FAILED && w->blocks == 0);
  CHECK(!g.detail().empty());
  bool threw = false;
  try {
    dest.fetch(source.endpoint(), names, digests, 0, {1, 1}, 1000);
  } catch (const kvrelay::Error &e) {
    threw = e.status() == KVRELAY_ERR_INVALID_ARGUMENT;
  }
  CHECK(threw);
  // the transport by name: tcp, or nixl in a build with the `nixl` feature (the CMake package
  // builds the default features: no NIXL)
  kvrelay::AgentConfig(fp).transport("tcp");
  int32_t transport_status = KVRELAY_OK;
  for (const char *t : {"carrier-pigeon", "nixl"}) {
    try {
      kvrelay::AgentConfig(fp).transport(t);
      transport_status = KVRELAY_OK;
    } catch (const kvrelay::Error &e) {
      transport_status = e.status();
    }
    CHECK(transport_status == (t[0] == 'c' ? KVRELAY_ERR_INVALID_CONFIG : KVRELAY_ERR_UNSUPPORTED));
  }
  CHECK(dest.estimate(source.endpoint(), 2) > 0);
  // the fetch side saw the refusal, but the source counts it on its own thread: wait for the
  // counter (bounded), never for a time
  for (int i = 0; i < 2000 && source.stats().refused_auth_failed == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK(source.prometheus().find("kvrelay_kv_agent_refused_total{reason=\"auth_failed\"} 1\n") != std::string::npos);
  // a source that accepts and never answers: the fetch blocks on its offer until destroyed
  int stall = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t sl = sizeof sa;
  CHECK(stall >= 0 && bind(stall, reinterpret_cast<sockaddr *>(&sa), sizeof sa) == 0 && listen(stall, 4) == 0 &&
        getsockname(stall, reinterpret_cast<sockaddr *>(&sa), &sl) == 0);
  const std::string stall_ep = "tcp://127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  kvrelay::Agent plain(kvrelay::AgentConfig(fp).listen("").limit(KVRELAY_LIMIT_UNCHECKED_FETCH, 1), dst.layout, none);
  {
    kvrelay::Fetch running = plain.fetch(stall_ep, names, 0, {3}, 60000);  // by name: the limit allows it
    CHECK(!running.poll());
  }
  // the destructor returned: the fetch completed (cancelled), its block is the runtime's again
  CHECK(plain.stats().fetch_failed_cancelled == 1);
  close(stall);
  std::printf("agent_cxx: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
