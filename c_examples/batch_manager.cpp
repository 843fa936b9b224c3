// batch_manager: a small C++17 batch manager built only on kvrelay.hpp / kvrelay.h.
//
// Rank 0 admits the kv_hints of a batch of requests (good ones, malformed ones, an oversized
// one, one from an untrusted ingress, a batched request with an aligned list), broadcasts each
// admitted snapshot as MessagePack bytes to four worker-rank threads that decode it and check
// that the canonical bytes match, forks child requests that share snapshots, and frees
// everything. Every request then goes through eligibility, candidate collection and the
// orchestration policy with a mock provider that counts contacts. Prints what it did; exits
// non-zero on any mismatch or unexpected outcome.
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay.hpp"

namespace {

struct Request {
  std::string id;
  std::string kv_hints;    // raw text under "kv_hints" ("" when the request has none)
  bool trusted_ingress;    // arrived through the trusted router
  const char *expect;      // expected outcome: "admitted", "absent" or a reason name
  std::size_t prompts = 1; // > 1: a batched request
  bool lora = false;       // uses a LoRA adapter (ineligible for named fetch)
};

/// A provider that only counts: a real one would validate on its own terms and submit a
/// transfer through its transport.
class CountingProvider : public kvrelay::Provider {
 public:
  std::atomic<int> validations{0}, submissions{0};
  int validate(const kvrelay_fetch_request &r) override {
    ++validations;
    return kvrelay::view(r.action_version) == "1.0" ? 0 : 1;
  }
  int fetch(const kvrelay_fetch_request &r) override {
    ++submissions;
    return r.envelope.len > 0 ? 0 : 1;
  }
};

std::string hashes(std::size_t n) {
  std::string s;
  unsigned long long x = 0x9E3779B97F4A7C15ull;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    if (i) s += ',';
    s += std::to_string(x);
  }
  return s;
}

std::string envelope(const std::string &msg, std::size_t n_hashes) {
  return "{\"protocol_version\":\"0.1\",\"message_id\":\"" + msg +
         "\",\"actions\":[{\"action_id\":\"a1\",\"action_type\":\"kv.fetch\",\"action_version\":\"1.0\","
         "\"payload\":{\"source_control_endpoint\":\"tcp://10.0.0.7:23280\",\"block_hashes\":[" +
         hashes(n_hashes) + "]}}]}";
}

/// A broadcast message: the request id, the MessagePack bytes, and rank 0's canonical bytes to
/// compare with (a real system would compare a digest; here the test wants the bytes).
struct Broadcast {
  std::string request;
  std::vector<uint8_t> msgpack;
  std::string canonical;
};

/// One worker rank's inbox.
class Inbox {
 public:
  void push(std::optional<Broadcast> m) {
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back(std::move(m));
    }
    cv_.notify_one();
  }
  std::optional<Broadcast> pop() {
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait(g, [&] { return !q_.empty(); });
    auto m = std::move(q_.front());
    q_.pop_front();
    return m;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::optional<Broadcast>> q_;
};

std::string describe(const kvrelay::Outcome &o) {
  if (o.admitted()) return "admitted";
  if (o.absent()) return "absent";
  return o.reason_name();
}

}  // namespace

int main() {
  int failures = 0;
  auto fail = [&](const std::string &what) {
    std::fprintf(stderr, "MISMATCH: %s\n", what.c_str());
    ++failures;
  };
  try {
    kvrelay::AdmissionConfig cfg;
    cfg.trusted = true;
    cfg.metric_prefix = "batch_manager_kv_hints";
    const kvrelay::Admission trusted_edge(cfg);
    const kvrelay::Admission untrusted_edge;  // trust off: the default

    std::vector<Request> batch = {
        {"req-0", envelope("m-0", 2), true, "admitted"},
        {"req-1", envelope("m-1", 256), true, "admitted", 1, true},
        {"req-2", "", true, "absent"},
        {"req-3", "{\"protocol_version\":\"0.1\",\"message_id\":\"m-3\",\"actions\":[{\"action_id\":1}]}", true, "malformed"},
        {"req-4", "{\"protocol_version\":\"0.1\",", true, "malformed"},
        {"req-5", envelope("m-5", 4000), true, "oversized"},
        {"req-6", envelope("m-6", 2), false, "untrusted"},
        {"req-7", "{\"protocol_version\":\"0.2\",\"whatever\":{}}", true, "unknown_version"},
        {"req-8", "[" + envelope("m-8a", 3) + ",null," + envelope("m-8c", 1) + "]", true, "admitted", 3},
    };

    // Worker ranks 1..4.
    constexpr int kWorkers = 4;
    std::vector<Inbox> inboxes(kWorkers);
    std::mutex out_mu;
    std::vector<int> checked(kWorkers, 0), bad(kWorkers, 0);
    std::vector<std::thread> workers;
    for (int r = 0; r < kWorkers; ++r) {
      workers.emplace_back([&, r] {
        const kvrelay::Admission rank_edge;  // decoding needs no trust; limits are the defaults
        while (auto m = inboxes[r].pop()) {
          kvrelay::Outcome o = rank_edge.decode_msgpack(m->msgpack);
          bool ok = o.admitted() && o.snapshot.canonical() == m->canonical;
          checked[r]++;
          if (!ok) {
            bad[r]++;
            std::lock_guard<std::mutex> g(out_mu);
            std::fprintf(stderr, "rank %d: %s did not decode to rank 0's bytes\n", r + 1, m->request.c_str());
          }
        }
      });
    }

    // The policy: one family supporting kv.fetch 1.0, one authorized named binding, and the
    // server's trusted endpoint registry.
    const kvrelay::Capabilities caps({{"nixl", "kv.fetch", "1.0"}});
    kvrelay::PolicyConfig policy;
    policy.bindings.push_back({"nixl-0", "nixl", false, true, {{"kv.fetch", "1.0"}}});
    policy.endpoints.push_back("tcp://10.0.0.7:23280");
    auto provider = std::make_shared<CountingProvider>();
    const kvrelay::Orchestrator orchestrator(caps, policy, provider);
    int named_fetches = 0;

    std::vector<std::pair<std::string, kvrelay::Snapshot>> live;  // request -> its snapshot
    std::size_t broadcasts = 0;
    for (const Request &req : batch) {
      const kvrelay::Admission &edge = req.trusted_ingress ? trusted_edge : untrusted_edge;
      std::vector<kvrelay::Outcome> outcomes;
      if (req.prompts > 1) {
        bool shared = false;
        outcomes = edge.admit_batch(req.kv_hints, req.prompts, &shared);
        std::printf("rank 0: %s (batch of %zu, %s)\n", req.id.c_str(), req.prompts, shared ? "shared envelope" : "aligned list");
      } else {
        outcomes.push_back(edge.admit(req.kv_hints));
      }
      for (std::size_t p = 0; p < outcomes.size(); ++p) {
        kvrelay::Outcome &o = outcomes[p];
        std::string name = req.id + (req.prompts > 1 ? "/p" + std::to_string(p) : "");
        std::printf("rank 0: %-9s -> %s%s%s\n", name.c_str(), describe(o).c_str(), o.detail.empty() ? "" : ": ", o.detail.c_str());
        bool expect_absent_entry = req.prompts > 1 && p == 1;  // the null entry of the list
        std::string want = expect_absent_entry ? "absent" : req.expect;
        if (describe(o) != want) fail(name + ": expected " + want + ", got " + describe(o));
        // Eligibility, candidates, then one named-fetch attempt at most.
        kvrelay_request_info info {sizeof(kvrelay_request_info), true, req.lora};
        kvrelay::Decision d = orchestrator.decide(info, o.snapshot);
        std::size_t n_candidates = o.admitted() ? caps.candidates(o.snapshot).size() : 0;
        std::printf("          candidates=%zu decision=%s%s\n", n_candidates, d.named_fetch() ? "named_fetch via " : "keep_paired_path: ",
                    d.named_fetch() ? d.binding_id.c_str() : d.discard_name());
        std::string want_decision = !o.admitted() ? "no_hint" : req.lora ? "lora_adapter" : "named_fetch";
        std::string got_decision = d.named_fetch() ? "named_fetch" : d.discard_name();
        if (got_decision != want_decision) fail(name + ": decision " + got_decision + ", expected " + want_decision);
        named_fetches += d.named_fetch();
        if (!o.admitted()) continue;
        Broadcast b{name, o.snapshot.to_msgpack(), std::string(o.snapshot.canonical())};
        for (auto &in : inboxes) in.push(b);
        ++broadcasts;
        live.emplace_back(name, std::move(o.snapshot));
      }
    }

    // Fork child requests (e.g. parallel sampling): each child shares its parent's snapshot.
    std::size_t children = 0;
    std::vector<kvrelay::Snapshot> kids;
    for (auto &[name, snap] : live) {
      for (int c = 0; c < 3; ++c) {
        kids.push_back(snap);  // copy = retain
        ++children;
        if (kids.back().get() != snap.get() || kids.back().canonical() != snap.canonical()) fail(name + ": child does not share");
        if (kids.back().action(0).action_type != "kv.fetch") fail(name + ": child action");
      }
      std::string one = snap.action_envelope(0);
      if (one != snap.canonical()) fail(name + ": one-action envelope of a one-action hint differs");
    }
    std::printf("rank 0: forked %zu child requests sharing %zu snapshots\n", children, live.size());
    std::printf("policy: %d named fetches; provider contacted %d times to validate, %d to submit\n", named_fetches,
                provider->validations.load(), provider->submissions.load());
    if (provider->validations != named_fetches || provider->submissions != named_fetches || named_fetches != 3)
      fail("provider contacts");
    std::printf("\n%s", orchestrator.prometheus().c_str());

    for (auto &in : inboxes) in.push(std::nullopt);
    for (auto &w : workers) w.join();
    for (int r = 0; r < kWorkers; ++r) {
      std::printf("rank %d: decoded and checked %d of %zu broadcasts\n", r + 1, checked[r], broadcasts);
      if (checked[r] != static_cast<int>(broadcasts) || bad[r]) fail("rank " + std::to_string(r + 1));
    }

    kvrelay_counters c = trusted_edge.counters();
    std::printf("counters: admitted=%llu malformed=%llu oversized=%llu unknown_version=%llu\n",
                (unsigned long long)c.admitted, (unsigned long long)c.malformed, (unsigned long long)c.oversized,
                (unsigned long long)c.unknown_version);
    if (c.admitted != 4 || c.malformed != 2 || c.oversized != 1 || c.unknown_version != 1) fail("trusted counters");
    if (untrusted_edge.counters().untrusted != 1) fail("untrusted counter");
    std::printf("\n%s", trusted_edge.prometheus().c_str());
    // Handles move (construction and assignment: the old one is freed, the moved-from one is
    // empty) and free once; a refused call's exception carries the library's detail.
    {
      std::vector<uint8_t> pool(4 * 2 * 2 * 64);
      kvrelay::KvLayout layout = kvrelay::KvLayout::all_layers_per_block(reinterpret_cast<uint64_t>(pool.data()), 2, 4, 64);
      kvrelay::CpuEngine engine(layout);
      kvrelay::CpuEngine other(layout);
      other = std::move(engine);
      std::vector<uint8_t> staging(layout.stage_block_bytes());
      const uint32_t id = 3;
      other.gather(&id, 1, staging.data(), staging.size());
      try {
        other.gather(&id, 1, staging.data(), 1);
        fail("a too-small staging buffer was accepted");
      } catch (const kvrelay::Error &e) {
        if (std::string(e.what()).find("needs") == std::string::npos) fail(std::string("an error without its detail: ") + e.what());
        std::printf("a refused copy says: %s\n", e.what());
      }
    }
    kids.clear();
    live.clear();  // every snapshot released here, by RAII
  } catch (const kvrelay::Error &e) {
    std::fprintf(stderr, "kvrelay error %d: %s\n", e.status(), e.what());
    return 1;
  }
  if (failures) {
    std::fprintf(stderr, "batch_manager: %d mismatches\n", failures);
    return 1;
  }
  std::printf("batch_manager: ok\n");
  return 0;
}
