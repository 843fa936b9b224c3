// kvrelay/copy.hpp: KV layouts and block copies: KvLayout, CpuEngine, Pinned, CudaEngine.
// Part of kvrelay.hpp (C++17 RAII wrappers over kvrelay.h); include <kvrelay.hpp> for all of them.
#ifndef KVRELAY_KVRELAY_COPY_HPP
#define KVRELAY_KVRELAY_COPY_HPP

#include "core.hpp"

namespace kvrelay {

/// A validated KV pool layout (see kvrelay_kv_layout_*). Movable, not copyable.
class KvLayout {
 public:
  /// TensorRT-LLM-style `[num_blocks, layers, 2, kv_block_bytes]` pool at `pool`.
  static KvLayout all_layers_per_block(uint64_t pool, uint32_t layers, uint32_t num_blocks, uint64_t kv_block_bytes) {
    KvLayout l;
    check(kvrelay_kv_layout_all_layers_per_block(pool, layers, num_blocks, kv_block_bytes, l.h_.out()));
    return l;
  }
  /// vLLM-style: one `[2, num_blocks, kv_block_bytes]` pool per layer.
  static KvLayout per_layer_kv_first(const std::vector<uint64_t> &layer_pools, uint32_t num_blocks, uint64_t kv_block_bytes) {
    KvLayout l;
    check(kvrelay_kv_layout_per_layer_kv_first(layer_pools.data(), layer_pools.size(), num_blocks, kv_block_bytes, l.h_.out()));
    return l;
  }
  /// FlashInfer-style: one `[num_blocks, 2, kv_block_bytes]` pool per layer.
  static KvLayout per_layer_block_first(const std::vector<uint64_t> &layer_pools, uint32_t num_blocks, uint64_t kv_block_bytes) {
    KvLayout l;
    check(kvrelay_kv_layout_per_layer_block_first(layer_pools.data(), layer_pools.size(), num_blocks, kv_block_bytes, l.h_.out()));
    return l;
  }
  /// Any segment table; `pools` are the extents the segments must stay inside (may be empty).
  static KvLayout from_segments(uint32_t num_blocks, const std::vector<kvrelay_kv_segment> &segments,
                                const std::vector<kvrelay_kv_extent> &pools = {}) {
    KvLayout l;
    check(kvrelay_kv_layout_new(num_blocks, segments.data(), segments.size(), pools.data(), pools.size(), l.h_.out()));
    return l;
  }
  const kvrelay_kv_layout *get() const noexcept { return h_.get(); }
  /// Bytes of one staged block (every segment, block-major).
  uint64_t stage_block_bytes() const noexcept { return kvrelay_kv_layout_stage_block_bytes(h_.get()); }

 private:
  KvLayout() = default;
  detail::Handle<kvrelay_kv_layout, kvrelay_kv_layout_free> h_;
};

/// The CPU reference engine over a host-memory pool (the caller keeps the pool alive).
class CpuEngine {
 public:
  explicit CpuEngine(const KvLayout &layout) { check(kvrelay_cpu_engine_new(layout.get(), h_.out())); }
  /// Copy blocks `ids[0..n]` into `staging[0..len]`, block-major.
  void gather(const uint32_t *ids, std::size_t n, uint8_t *staging, std::size_t len) {
    check(kvrelay_cpu_gather(h_.get(), ids, n, staging, len));
  }
  void gather(const std::vector<uint32_t> &ids, uint8_t *staging, std::size_t len) { gather(ids.data(), ids.size(), staging, len); }
  /// Copy `staging[0..len]` back into blocks `ids[0..n]` (no repeats).
  void scatter(const uint8_t *staging, std::size_t len, const uint32_t *ids, std::size_t n) {
    check(kvrelay_cpu_scatter(h_.get(), staging, len, ids, n));
  }
  void scatter(const uint8_t *staging, std::size_t len, const std::vector<uint32_t> &ids) {
    scatter(staging, len, ids.data(), ids.size());
  }

 private:
  detail::Handle<kvrelay_cpu_engine, kvrelay_cpu_engine_free> h_;
};

/// Pinned, device-mapped host memory: allocated here, or the caller's own memory registered.
class Pinned {
 public:
  Pinned(int device, std::size_t len) { check(kvrelay_pinned_alloc(device, len, h_.out())); }
  /// Pin and map the caller's memory `[ptr, ptr + len)` (unregistered when this is destroyed;
  /// the memory must outlive it and not be registered elsewhere).
  static Pinned register_memory(int device, void *ptr, std::size_t len) {
    Pinned p;
    check(kvrelay_pinned_register(device, ptr, len, p.h_.out()));
    return p;
  }
  uint8_t *data() noexcept { return kvrelay_pinned_host(h_.get()); }
  std::size_t size() const noexcept { return kvrelay_pinned_len(h_.get()); }
  const kvrelay_pinned *get() const noexcept { return h_.get(); }

 private:
  Pinned() = default;
  detail::Handle<kvrelay_pinned, kvrelay_pinned_free> h_;
};

/// The CUDA engine over a device pool; copies are enqueued on the caller's CUstream, after the
/// work already enqueued there, and `done` (may be null) is recorded after them. Not
/// thread-safe: one engine per thread or stream that copies concurrently. Every call leaves the
/// calling thread's current CUDA context as it was.
class CudaEngine {
 public:
  CudaEngine(int device, const KvLayout &layout, const kvrelay_cuda_engine_options *options = nullptr) {
    check(kvrelay_cuda_engine_new(device, layout.get(), options, h_.out()));
  }
  void gather(const uint32_t *ids, std::size_t n, const Pinned &staging, CUstream stream, CUevent done = nullptr) {
    check(kvrelay_cuda_gather(h_.get(), ids, n, staging.get(), static_cast<void *>(stream), static_cast<void *>(done)));
  }
  void gather(const std::vector<uint32_t> &ids, const Pinned &staging, CUstream stream, CUevent done = nullptr) {
    gather(ids.data(), ids.size(), staging, stream, done);
  }
  void scatter(const Pinned &staging, const uint32_t *ids, std::size_t n, CUstream stream, CUevent done = nullptr) {
    check(kvrelay_cuda_scatter(h_.get(), staging.get(), ids, n, static_cast<void *>(stream), static_cast<void *>(done)));
  }
  void scatter(const Pinned &staging, const std::vector<uint32_t> &ids, CUstream stream, CUevent done = nullptr) {
    scatter(staging, ids.data(), ids.size(), stream, done);
  }

 private:
  detail::Handle<kvrelay_cuda_engine, kvrelay_cuda_engine_free> h_;
};

/// Checked strided device-to-device copies on one device, on a stream of its own (for a cache
/// that is not a kvrelay layout: llama.cpp's K and V tensors). Not thread-safe.
class CudaCopier {
 public:
  explicit CudaCopier(int device) { check(kvrelay_cuda_copier_new(device, h_.out())); }
  /// Enqueue `height` rows of `width` bytes, `src_pitch` apart at `src`, to `dst` (`dst_pitch`).
  void copy_2d(uint64_t dst, std::size_t dst_pitch, uint64_t src, std::size_t src_pitch, std::size_t width,
               std::size_t height) {
    check(kvrelay_cuda_copy_2d(h_.get(), dst, dst_pitch, src, src_pitch, width, height));
  }
  /// Wait for the copies enqueued since the last finish; the bytes they moved.
  uint64_t finish() {
    uint64_t bytes = 0;
    check(kvrelay_cuda_copier_finish(h_.get(), &bytes));
    return bytes;
  }
  kvrelay_cuda_copier *get() const { return h_.get(); }

 private:
  detail::Handle<kvrelay_cuda_copier, kvrelay_cuda_copier_free> h_;
};

}  // namespace kvrelay

#endif  // KVRELAY_KVRELAY_COPY_HPP
