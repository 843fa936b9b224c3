/* KV copy through the C ABI: the CPU reference engine on the three layout kinds, refusals,
 * and a clean status where there is no CUDA driver. Prints "N passed, M failed". */
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
  printf("%s: ok\n", name);
  free(back);
  free(staging);
  kvrelay_cpu_engine_free(e);
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
  }
  EXPECT(kvrelay_pinned_host(NULL) == NULL && kvrelay_pinned_len(NULL) == 0);
  kvrelay_pinned_free(NULL);
  kvrelay_cuda_engine_free(NULL);

  free(mem);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
