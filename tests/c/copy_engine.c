/* KV copy through the C ABI: the CPU reference engine on the three layout kinds, refusals,
 * a clean status where there is no CUDA driver, and, where there is one, the CUDA engine from
 * C: kvrelay_cuda_engine_new, gather and scatter with a done_event, kvrelay_pinned_alloc and
 * kvrelay_pinned_register, byte-exact, with the caller's context left as it was.
 * KVRELAY_REQUIRE_GPU=1 turns the GPU skip into a failure. Prints "N passed, M failed". */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrelay.h"

#include "expect.h"

enum { LAYERS = 3, BLOCKS = 24, KV = 128 };

static void check_gather(kvrelay_kv_layout *layout, const kvrelay_kv_segment *segs, size_t nseg, const char *name) {
  kvrelay_cpu_engine *e = NULL;
  EXPECT(kvrelay_cpu_engine_new(layout, &e) == KVRELAY_OK);
  uint32_t ids[5] = {7, 0, 23, 7, 12};
  uint64_t bb = kvrelay_kv_layout_stage_block_bytes(layout);
  EXPECT(bb == nseg * KV);
  size_t len = 5 * bb;
  uint8_t *staging = (uint8_t *)malloc(len + 16);
  memset(staging, 0xEE, len + 16);
  EXPECT(kvrelay_cpu_gather(e, ids, 5, staging, len + 16) == KVRELAY_OK);
  int same = 1;
  for (size_t i = 0; i < 5; i++)
    for (size_t s = 0; s < nseg; s++) {
      const uint8_t *src = (const uint8_t *)(uintptr_t)(segs[s].base + ids[i] * segs[s].block_stride);
      if (memcmp(staging + i * bb + s * KV, src, KV) != 0) same = 0;
    }
  EXPECT(same);
  EXPECT(staging[len] == 0xEE); /* nothing past the blocks */
  /* round trip into other blocks */
  uint32_t others[4] = {1, 2, 3, 4};
  EXPECT(kvrelay_cpu_scatter(e, staging, len, others, 4) == KVRELAY_OK);
  uint8_t *back = (uint8_t *)malloc(4 * bb);
  EXPECT(kvrelay_cpu_gather(e, others, 4, back, 4 * bb) == KVRELAY_OK);
  EXPECT(memcmp(back, staging, 4 * bb) == 0);
  /* refusals */
  uint32_t dup[2] = {5, 5}, far[1] = {BLOCKS};
  EXPECT(kvrelay_cpu_scatter(e, staging, len, dup, 2) == KVRELAY_ERR_DUPLICATE_BLOCK);
  EXPECT(kvrelay_cpu_gather(e, far, 1, staging, len) == KVRELAY_ERR_OUT_OF_RANGE);
  EXPECT(kvrelay_cpu_gather(e, ids, 5, staging, len - 1) == KVRELAY_ERR_STAGING);
  EXPECT(kvrelay_cpu_gather(e, NULL, 0, NULL, 0) == KVRELAY_OK);
  EXPECT(kvrelay_cpu_gather(e, NULL, 3, staging, len) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_cpu_gather(NULL, ids, 5, staging, len) == KVRELAY_ERR_NULL);
  /* a count whose byte size passes isize::MAX is refused, never turned into a slice */
  EXPECT(kvrelay_cpu_gather(e, ids, SIZE_MAX / 2, staging, len) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_cpu_scatter(e, staging, len, ids, SIZE_MAX / 4 + 1) == KVRELAY_ERR_INVALID_ARGUMENT);
  printf("%s: ok\n", name);
  free(back);
  free(staging);
  kvrelay_cpu_engine_free(e);
}


/* The few driver calls the test makes itself, as a runtime would, loaded with dlopen (no CUDA
 * headers needed). */
typedef int cu_result;
typedef struct cu_ctx_st *cu_context;
typedef struct cu_event_st *cu_event;
typedef unsigned long long cu_deviceptr;
typedef struct {
  cu_result (*init)(unsigned);
  cu_result (*device_get)(int *, int);
  cu_result (*primary_retain)(cu_context *, int);
  cu_result (*primary_release)(int);
  cu_result (*ctx_set)(cu_context);
  cu_result (*ctx_get)(cu_context *);
  cu_result (*mem_alloc)(cu_deviceptr *, size_t);
  cu_result (*mem_free)(cu_deviceptr);
  cu_result (*htod)(cu_deviceptr, const void *, size_t);
  cu_result (*dtoh)(void *, cu_deviceptr, size_t);
  cu_result (*event_create)(cu_event *, unsigned);
  cu_result (*event_sync)(cu_event);
  cu_result (*event_destroy)(cu_event);
  cu_result (*ctx_create)(cu_context *, unsigned, int);
  cu_result (*ctx_destroy)(cu_context);
} driver;

static int load_driver(driver *d) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return 0;
#define SYM(field, name) *(void **)(&d->field) = dlsym(h, name)
  SYM(init, "cuInit");
  SYM(device_get, "cuDeviceGet");
  SYM(primary_retain, "cuDevicePrimaryCtxRetain");
  SYM(primary_release, "cuDevicePrimaryCtxRelease_v2");
  SYM(ctx_set, "cuCtxSetCurrent");
  SYM(ctx_get, "cuCtxGetCurrent");
  SYM(mem_alloc, "cuMemAlloc_v2");
  SYM(mem_free, "cuMemFree_v2");
  SYM(htod, "cuMemcpyHtoD_v2");
  SYM(dtoh, "cuMemcpyDtoH_v2");
  SYM(event_create, "cuEventCreate");
  SYM(event_sync, "cuEventSynchronize");
  SYM(event_destroy, "cuEventDestroy_v2");
  SYM(ctx_create, "cuCtxCreate_v2");
  SYM(ctx_destroy, "cuCtxDestroy_v2");
#undef SYM
  return d->init && d->device_get && d->primary_retain && d->primary_release && d->ctx_set && d->ctx_get &&
         d->mem_alloc && d->mem_free && d->htod && d->dtoh && d->event_create && d->event_sync && d->event_destroy &&
         d->ctx_create && d->ctx_destroy;
}

static void check_cuda(const uint8_t *host, size_t pool_bytes) {
  driver d;
  memset(&d, 0, sizeof d);
  EXPECT(load_driver(&d));
  int dev = 0;
  cu_context ctx = NULL, seen = NULL;
  EXPECT(d.init(0) == 0 && d.device_get(&dev, 0) == 0 && d.primary_retain(&ctx, dev) == 0);
  EXPECT(d.ctx_set(ctx) == 0); /* the runtime's thread holds its device's context */
  cu_deviceptr pool = 0;
  EXPECT(d.mem_alloc(&pool, pool_bytes) == 0);
  EXPECT(d.htod(pool, host, pool_bytes) == 0);

  kvrelay_kv_layout *layout = NULL;
  EXPECT(kvrelay_kv_layout_all_layers_per_block(pool, LAYERS, BLOCKS, KV, &layout) == KVRELAY_OK);
  kvrelay_cuda_engine *e = NULL;
  EXPECT(kvrelay_cuda_engine_new(0, layout, NULL, &e) == KVRELAY_OK);
  uint64_t bb = kvrelay_kv_layout_stage_block_bytes(layout);
  uint32_t ids[5] = {7, 0, 23, 7, 12};
  kvrelay_pinned *staging = NULL;
  EXPECT(kvrelay_pinned_alloc(0, 5 * bb, &staging) == KVRELAY_OK);
  cu_event done = NULL;
  EXPECT(d.event_create(&done, 0) == 0);
  /* gather on the legacy default stream, done_event recorded after it */
  EXPECT(kvrelay_cuda_gather(e, ids, 5, staging, NULL, (void *)done) == KVRELAY_OK);
  EXPECT(d.event_sync(done) == 0);
  const uint8_t *got = kvrelay_pinned_host(staging);
  int same = 1;
  for (size_t i = 0; i < 5; i++) /* all-layers-per-block: a block is contiguous in the pool */
    if (memcmp(got + i * bb, host + ids[i] * bb, bb) != 0) same = 0;
  EXPECT(same);
  /* the caller's own memory, registered, as staging for a scatter into other blocks */
  size_t reg_len = 4 * bb;
  uint8_t *mine = (uint8_t *)aligned_alloc(4096, (reg_len + 4095) / 4096 * 4096);
  memcpy(mine, got, reg_len);
  kvrelay_pinned *reg = NULL;
  EXPECT(kvrelay_pinned_register(0, mine, (reg_len + 4095) / 4096 * 4096, &reg) == KVRELAY_OK);
  uint32_t others[4] = {1, 2, 3, 4};
  EXPECT(kvrelay_cuda_scatter(e, reg, others, 4, NULL, (void *)done) == KVRELAY_OK);
  EXPECT(d.event_sync(done) == 0);
  uint8_t *back = (uint8_t *)malloc(pool_bytes);
  EXPECT(d.dtoh(back, pool, pool_bytes) == 0);
  EXPECT(memcmp(back + 1 * bb, mine, 4 * bb) == 0);
  /* refusals carry a detail */
  kvrelay_pinned *tiny = NULL;
  EXPECT(kvrelay_pinned_alloc(0, 16, &tiny) == KVRELAY_OK);
  EXPECT(kvrelay_cuda_gather(e, ids, 5, tiny, NULL, NULL) == KVRELAY_ERR_STAGING);
  char msg[256];
  size_t need = 0;
  EXPECT(kvrelay_last_error_message(msg, sizeof msg, &need) == KVRELAY_OK && need > 1);
  printf("a refused gather says: %s\n", msg);
  /* a failing driver call says which one and with which CUresult */
  kvrelay_pinned *huge = NULL;
  EXPECT(kvrelay_pinned_alloc(0, (size_t)1 << 52, &huge) == KVRELAY_ERR_CUDA && huge == NULL);
  EXPECT(kvrelay_last_error_message(msg, sizeof msg, &need) == KVRELAY_OK && strstr(msg, "cuMemHostAlloc") != NULL);
  printf("a failing driver call says: %s\n", msg);
  /* the thread's context is the one it had */
  EXPECT(d.ctx_get(&seen) == 0 && seen == ctx);
  /* a thread that owns a second context of its own (current) keeps it across kvrelay's calls */
  cu_context own = NULL;
  EXPECT(d.ctx_create(&own, 0, dev) == 0 && own != NULL && own != ctx);
  EXPECT(d.ctx_get(&seen) == 0 && seen == own);
  /* the done_event belongs to the device's context, not the current one: kvrelay records it in
   * its own context */
  EXPECT(kvrelay_cuda_gather(e, ids, 5, staging, NULL, (void *)done) == KVRELAY_OK);
  EXPECT(kvrelay_cuda_scatter(e, reg, others, 4, NULL, (void *)done) == KVRELAY_OK);
  kvrelay_pinned *more = NULL;
  EXPECT(kvrelay_pinned_alloc(0, 4096, &more) == KVRELAY_OK);
  kvrelay_pinned_free(more);
  EXPECT(d.ctx_get(&seen) == 0 && seen == own);
  EXPECT(d.ctx_destroy(own) == 0);
  EXPECT(d.ctx_set(ctx) == 0);
  EXPECT(d.event_sync(done) == 0);
  EXPECT(d.dtoh(back, pool, pool_bytes) == 0);
  EXPECT(memcmp(back + 1 * bb, mine, 4 * bb) == 0);
  kvrelay_pinned_free(tiny);
  kvrelay_pinned_free(reg);
  kvrelay_pinned_free(staging);
  kvrelay_cuda_engine_free(e);
  kvrelay_kv_layout_free(layout);
  d.event_destroy(done);
  d.mem_free(pool);
  EXPECT(d.ctx_get(&seen) == 0 && seen == ctx);
  d.ctx_set(NULL);
  d.primary_release(dev);
  free(back);
  free(mine);
  printf("CUDA engine from C: ok\n");
}

int main(void) {
  size_t per_layer = 2 * BLOCKS * KV;
  uint8_t *mem = (uint8_t *)aligned_alloc(64, LAYERS * per_layer);
  for (size_t i = 0; i < LAYERS * per_layer; i++) mem[i] = (uint8_t)(i * 2654435761u >> 13);
  uint64_t pools[LAYERS];
  for (int l = 0; l < LAYERS; l++) pools[l] = (uint64_t)(uintptr_t)(mem + l * per_layer);

  kvrelay_kv_segment segs[2 * LAYERS];
  kvrelay_kv_layout *layout = NULL;
  /* vLLM [2, blocks, kv] per layer */
  EXPECT(kvrelay_kv_layout_per_layer_kv_first(pools, LAYERS, BLOCKS, KV, &layout) == KVRELAY_OK);
  for (int l = 0; l < LAYERS; l++) {
    segs[2 * l] = (kvrelay_kv_segment){pools[l], KV, KV};
    segs[2 * l + 1] = (kvrelay_kv_segment){pools[l] + BLOCKS * KV, KV, KV};
  }
  check_gather(layout, segs, 2 * LAYERS, "per layer, K then V");
  kvrelay_kv_layout_free(layout);
  /* FlashInfer [blocks, 2, kv] per layer */
  EXPECT(kvrelay_kv_layout_per_layer_block_first(pools, LAYERS, BLOCKS, KV, &layout) == KVRELAY_OK);
  for (int l = 0; l < LAYERS; l++) {
    segs[2 * l] = (kvrelay_kv_segment){pools[l], 2 * KV, KV};
    segs[2 * l + 1] = (kvrelay_kv_segment){pools[l] + KV, 2 * KV, KV};
  }
  check_gather(layout, segs, 2 * LAYERS, "per layer, blocks first");
  kvrelay_kv_layout_free(layout);
  /* TensorRT-LLM [blocks, layers, 2, kv] in one pool (the same memory, 12 KiB blocks of 8) */
  EXPECT(kvrelay_kv_layout_all_layers_per_block(pools[0], LAYERS, BLOCKS, KV, &layout) == KVRELAY_OK);
  for (int s = 0; s < 2 * LAYERS; s++) segs[s] = (kvrelay_kv_segment){pools[0] + s * KV, 2 * LAYERS * KV, KV};
  check_gather(layout, segs, 2 * LAYERS, "all layers per block");
  kvrelay_kv_layout_free(layout);

  /* layouts that do not validate */
  kvrelay_kv_segment bad[2] = {{0, 128, 64}, {48, 128, 64}};
  layout = NULL;
  EXPECT(kvrelay_kv_layout_new(4, bad, 2, NULL, 0, &layout) == KVRELAY_ERR_INVALID_LAYOUT && layout == NULL);
  kvrelay_kv_segment misaligned[1] = {{8, 64, 64}};
  EXPECT(kvrelay_kv_layout_new(4, misaligned, 1, NULL, 0, &layout) == KVRELAY_ERR_INVALID_LAYOUT);
  kvrelay_kv_extent small = {0, 100};
  kvrelay_kv_segment ok1[1] = {{0, 64, 64}};
  EXPECT(kvrelay_kv_layout_new(4, ok1, 1, &small, 1, &layout) == KVRELAY_ERR_INVALID_LAYOUT);
  EXPECT(kvrelay_kv_layout_new(4, NULL, 1, NULL, 0, &layout) == KVRELAY_ERR_INVALID_ARGUMENT);

  /* CUDA: a clean status either way */
  kvrelay_status st = kvrelay_cuda_available(0);
  EXPECT(st == KVRELAY_OK || st == KVRELAY_ERR_NO_CUDA_DRIVER || st == KVRELAY_ERR_NO_CUDA_DEVICE);
  printf("cuda_available(0): %s\n", kvrelay_status_message(st));
  if (st != KVRELAY_OK) {
    kvrelay_pinned *p = NULL;
    EXPECT(kvrelay_pinned_alloc(0, 4096, &p) == st && p == NULL);
    EXPECT(kvrelay_cuda_available(-1) != KVRELAY_OK);
    kvrelay_cuda_copier *c = NULL;
    EXPECT(kvrelay_cuda_copier_new(0, &c) == st && c == NULL);
  }
  /* the device copier checks its handle before anything else */
  EXPECT(kvrelay_cuda_copy_2d(NULL, 0x1000, 64, 0x2000, 64, 64, 2) == KVRELAY_ERR_NULL);
  uint64_t copied = 7;
  EXPECT(kvrelay_cuda_copier_finish(NULL, &copied) == KVRELAY_ERR_NULL && copied == 7);
  EXPECT(kvrelay_cuda_copier_new(0, NULL) == KVRELAY_ERR_NULL);
  kvrelay_cuda_copier_free(NULL);
  const char *require = getenv("KVRELAY_REQUIRE_GPU");
  if (st == KVRELAY_OK) {
    check_cuda(mem, BLOCKS * 2 * LAYERS * KV);
  } else if (require && strcmp(require, "1") == 0) {
    EXPECT(!"KVRELAY_REQUIRE_GPU=1 but no CUDA driver or device");
  } else {
    printf("SKIP CUDA engine from C: %s\n", kvrelay_status_message(st));
  }
  EXPECT(kvrelay_pinned_host(NULL) == NULL && kvrelay_pinned_len(NULL) == 0);
  kvrelay_pinned_free(NULL);
  kvrelay_cuda_engine_free(NULL);

  free(mem);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
