// kvrelay/core.hpp: what every kvrelay C++ wrapper uses: kvrelay::Error, check, views, the
// CUDA handle types, BlockDigest and detail::Handle. Include <kvrelay.hpp> for all of them.
#ifndef KVRELAY_KVRELAY_CORE_HPP
#define KVRELAY_KVRELAY_CORE_HPP

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../kvrelay.h"

// CUDA driver handle types are the struct tags cuda.h declares (and the runtime API's
// cudaStream_t / cudaEvent_t are the same pointers), so kvrelay.hpp needs no CUDA headers and a
// runtime's CUstream / CUevent pass straight through. Only the two struct tags are declared in
// the global namespace; the typedef names stay cuda.h's (kvrelay::CUstream, kvrelay::CUevent here).
struct CUstream_st;
struct CUevent_st;

namespace kvrelay {

/// cuda.h's `CUstream` (`struct CUstream_st *`), without including it.
using CUstream = ::CUstream_st *;
/// cuda.h's `CUevent` (`struct CUevent_st *`), without including it.
using CUevent = ::CUevent_st *;

/// A kvrelay_status other than KVRELAY_OK.
class Error : public std::runtime_error {
 public:
  /// The status, and what() the thread's last-error detail when it belongs to this status
  /// (thrown right after the failing call, on the same thread), else the status's message.
  explicit Error(int32_t status) : std::runtime_error(describe(status)), status_(status) {}
  /// The kvrelay_status value.
  int32_t status() const noexcept { return status_; }

 private:
  static std::string describe(int32_t status) {
    std::string msg = kvrelay_status_message(status);
    std::size_t need = 0;
    if (status == KVRELAY_ERR_BUFFER_TOO_SMALL ||
        kvrelay_last_error_message(nullptr, 0, &need) != KVRELAY_ERR_BUFFER_TOO_SMALL || need <= 1) {
      return msg;
    }
    std::string last(need, '\0');
    if (kvrelay_last_error_message(last.data(), last.size(), &need) != KVRELAY_OK) return msg;
    last.resize(need - 1);
    // the detail starts with its status's message: use it only when it is this status's
    return last.compare(0, msg.size(), msg) == 0 ? last : msg;
  }

  int32_t status_;
};

/// Throw kvrelay::Error unless `s` is KVRELAY_OK.
inline void check(int32_t s) {
  if (s != KVRELAY_OK) throw Error(s);
}

inline std::string_view view(kvrelay_str s) noexcept { return {s.ptr, s.len}; }
inline std::string_view view(kvrelay_bytes b) noexcept { return {reinterpret_cast<const char *>(b.ptr), b.len}; }

/// One action of a snapshot, as views into it.
struct Action {
  std::size_t index;
  std::string_view id, action_type, version;
  std::string_view payload;    ///< canonical JSON of `payload`
  std::string_view canonical;  ///< canonical JSON of the whole action
};

namespace detail {
/// One owning handle for every kvrelay handle freed by one function: movable (a moved-from
/// handle is empty and frees nothing), not copyable, frees exactly once.
template <typename T, void (*Free)(T *)>
class Handle {
 public:
  Handle() noexcept = default;
  Handle(Handle &&o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  Handle &operator=(Handle &&o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  Handle(const Handle &) = delete;
  Handle &operator=(const Handle &) = delete;
  ~Handle() { reset(); }
  T *get() const noexcept { return p_; }
  /// For a `_new(..., &out)` call: frees what it held, then hands out its slot.
  T **out() noexcept {
    reset();
    return &p_;
  }
  void reset() noexcept {
    if (p_) Free(p_);
    p_ = nullptr;
  }

 private:
  T *p_ = nullptr;
};

/// Call a kvrelay "fill the caller's buffer" function: size query, then fill. Text that grows
/// between the two (Prometheus text while other threads admit) is asked for again with the
/// size the failed fill reported, a bounded number of times.
template <typename Out, typename F>
Out fill(F &&f) {
  std::size_t need = 0;
  int32_t s = f(nullptr, 0, &need);
  if (s != KVRELAY_ERR_BUFFER_TOO_SMALL && s != KVRELAY_OK) throw Error(s);
  for (int attempt = 0; attempt < 8; ++attempt) {
    Out out(need, typename Out::value_type{});
    s = f(reinterpret_cast<uint8_t *>(out.data()), out.size(), &need);
    if (s == KVRELAY_ERR_BUFFER_TOO_SMALL) continue;  // grew meanwhile; `need` is the new size
    check(s);
    out.resize(need);
    return out;
  }
  throw Error(KVRELAY_ERR_BUFFER_TOO_SMALL);
}
}  // namespace detail

/// A block's content digest (kvrelay_block_digests): SHA-256 over its tokens, chained through
/// its parent and bound to the engine identity.
using BlockDigest = std::array<uint8_t, KVRELAY_BLOCK_DIGEST_BYTES>;
static_assert(sizeof(BlockDigest) == KVRELAY_BLOCK_DIGEST_BYTES, "digests are passed to C as contiguous bytes");

}  // namespace kvrelay

#endif  // KVRELAY_KVRELAY_CORE_HPP
