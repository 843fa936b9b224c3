/* Two processes on loopback: the source serves its KV pool through a kvrelay agent; the
 * destination admits a kv.fetch hint, orchestrates (the provider hands the fetch back through
 * the per-call context), fetches the named run through its own agent into its own pool and
 * checks every byte. Then every failure reason a runtime sees, authentication accepted and
 * refused, and garbage and idle connections on the source's port. Host memory by default;
 * with KVRELAY_EXAMPLE_DEVICE=N both pools are memory of CUDA device N (the driver is loaded with
 * dlopen, as a runtime has it already; no CUDA headers needed). */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvrelay.h"

static int failures;
#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      failures++;                                                        \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                    \
  } while (0)

enum { BLOCKS = 16, LAYERS = 2, KVB = 4096, NAMES = 6 };
static const uint64_t names[NAMES] = {0x1001, 0x1002, 0x1003, 0x1004, 0x1005, 0x1006};
static const char KEY[] = "kvrelay example pre-shared key";

/* A block's content digest. A runtime computes it with kvrelay_block_digests over the tokens
 * whose KV the block holds (the same call on both sides, so equal tokens give equal digests);
 * this example has no tokens, so each name's digest is made up from the name. A fetch asks by
 * content (kvrelay_agent_submit_checked): a block whose recorded digest is another is never
 * written. */
static void digest_of(uint64_t name, uint8_t out[KVRELAY_BLOCK_DIGEST_BYTES]) {
  for (int i = 0; i < KVRELAY_BLOCK_DIGEST_BYTES; i++) out[i] = (uint8_t)(name >> (8 * (i % 8))) ^ (uint8_t)i;
}

/* ---- the few CUDA driver calls a GPU pool needs here ---- */
typedef int cu_result;
typedef struct cu_ctx_st *cu_context;
static struct {
  cu_result (*init)(unsigned);
  cu_result (*device_get)(int *, int);
  cu_result (*primary_retain)(cu_context *, int);
  cu_result (*ctx_set)(cu_context);
  cu_result (*mem_alloc)(unsigned long long *, size_t);
  cu_result (*mem_free)(unsigned long long);
  cu_result (*htod)(unsigned long long, const void *, size_t);
  cu_result (*dtoh)(void *, unsigned long long, size_t);
} cu;
static int device = -1; /* -1: host pools */

static int cuda_open(int ordinal) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return -1;
#define SYM(field, name) *(void **)(&cu.field) = dlsym(h, name)
  SYM(init, "cuInit");
  SYM(device_get, "cuDeviceGet");
  SYM(primary_retain, "cuDevicePrimaryCtxRetain");
  SYM(ctx_set, "cuCtxSetCurrent");
  SYM(mem_alloc, "cuMemAlloc_v2");
  SYM(mem_free, "cuMemFree_v2");
  SYM(htod, "cuMemcpyHtoD_v2");
  SYM(dtoh, "cuMemcpyDtoH_v2");
#undef SYM
  if (!cu.init || !cu.device_get || !cu.primary_retain || !cu.ctx_set || !cu.mem_alloc || !cu.mem_free || !cu.htod ||
      !cu.dtoh)
    return -1;
  int dev = 0;
  cu_context ctx = NULL;
  if (cu.init(0) != 0 || cu.device_get(&dev, ordinal) != 0 || cu.primary_retain(&ctx, dev) != 0 || cu.ctx_set(ctx) != 0)
    return -1;
  return 0;
}

/* ---- a vLLM-style pool: per layer [2, BLOCKS, KVB], host or device memory ---- */
typedef struct {
  uint64_t layer[LAYERS]; /* host or device addresses */
  kvrelay_kv_layout *layout;
} pool;

static int pool_new(pool *p) {
  for (int l = 0; l < LAYERS; l++) {
    if (device >= 0) {
      unsigned long long d = 0;
      if (cu.mem_alloc(&d, 2 * BLOCKS * KVB) != 0) return -1;
      p->layer[l] = d;
    } else {
      void *m = NULL;
      if (posix_memalign(&m, 64, 2 * BLOCKS * KVB) != 0) return -1;
      memset(m, 0, 2 * BLOCKS * KVB);
      p->layer[l] = (uint64_t)(uintptr_t)m;
    }
  }
  return kvrelay_kv_layout_per_layer_kv_first(p->layer, LAYERS, BLOCKS, KVB, &p->layout) == KVRELAY_OK ? 0 : -1;
}

static void pool_free(pool *p) {
  kvrelay_kv_layout_free(p->layout);
  for (int l = 0; l < LAYERS; l++) {
    if (device >= 0)
      cu.mem_free(p->layer[l]);
    else
      free((void *)(uintptr_t)p->layer[l]);
  }
}

/* byte i of the block-major staged block named `name` */
static uint8_t content(uint64_t name, size_t i) {
  uint64_t x = name * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return (uint8_t)x;
}

/* segment s = 2 * layer + (0: K, 1: V); staged offset s * KVB */
static uint64_t seg(pool *p, int s, uint32_t id) { return p->layer[s / 2] + (uint64_t)(s % 2) * BLOCKS * KVB + (uint64_t)id * KVB; }

static void fill_block(pool *p, uint32_t id, uint64_t name) {
  static uint8_t buf[KVB];
  for (int s = 0; s < 2 * LAYERS; s++) {
    for (size_t i = 0; i < KVB; i++) buf[i] = content(name, (size_t)s * KVB + i);
    if (device >= 0)
      CHECK(cu.htod(seg(p, s, id), buf, KVB) == 0);
    else
      memcpy((void *)(uintptr_t)seg(p, s, id), buf, KVB);
  }
}

static int block_is(pool *p, uint32_t id, uint64_t name) {
  static uint8_t buf[KVB];
  for (int s = 0; s < 2 * LAYERS; s++) {
    if (device >= 0) {
      if (cu.dtoh(buf, seg(p, s, id), KVB) != 0) return 0;
    } else {
      memcpy(buf, (void *)(uintptr_t)seg(p, s, id), KVB);
    }
    for (size_t i = 0; i < KVB; i++)
      if (buf[i] != content(name, (size_t)s * KVB + i)) return 0;
  }
  return 1;
}

/* ---- the runtime's reuse cache, as the agent's service sees it ---- */
typedef struct {
  pthread_mutex_t mu;
  uint64_t name[BLOCKS];
  int used[BLOCKS];
  int pins[BLOCKS];
  int destroyed;
} cache;

static size_t cache_pin(void *ud, const uint64_t *want, size_t n, uint32_t *ids_out) {
  cache *c = ud;
  size_t k = 0;
  pthread_mutex_lock(&c->mu);
  for (; k < n; k++) {
    int found = -1;
    for (int id = 0; id < BLOCKS; id++)
      if (c->used[id] && c->name[id] == want[k]) found = id;
    if (found < 0) break;
    c->pins[found]++;
    ids_out[k] = (uint32_t)found;
  }
  pthread_mutex_unlock(&c->mu);
  return k;
}

static void cache_unpin(void *ud, const uint32_t *ids, size_t n) {
  cache *c = ud;
  pthread_mutex_lock(&c->mu);
  for (size_t i = 0; i < n; i++) c->pins[ids[i]]--;
  pthread_mutex_unlock(&c->mu);
}

static void cache_destroy(void *ud) { ((cache *)ud)->destroyed = 1; }

static int cache_pinned(cache *c) {
  int n = 0;
  pthread_mutex_lock(&c->mu);
  for (int id = 0; id < BLOCKS; id++) n += c->pins[id];
  pthread_mutex_unlock(&c->mu);
  return n;
}

static kvrelay_agent_fingerprint fingerprint(uint64_t naming) {
  kvrelay_agent_fingerprint f = {sizeof(kvrelay_agent_fingerprint), 32, LAYERS, 2, 64, 2, naming};
  return f;
}

static kvrelay_agent *agent_new(pool *p, cache *c, const char *listen, const char *key, uint64_t naming) {
  kvrelay_agent_fingerprint f = fingerprint(naming);
  kvrelay_agent_config *cfg = NULL;
  kvrelay_agent *a = NULL;
  if (kvrelay_agent_config_new(&f, &cfg) != KVRELAY_OK) return NULL;
  /* limits by name: a library with more limits than this program knows still takes these */
  CHECK(kvrelay_agent_config_set_limit(cfg, KVRELAY_LIMIT_HANDSHAKE_TIMEOUT_MS, 300) == KVRELAY_OK); /* idle go quickly */
  CHECK(kvrelay_agent_config_set_limit(cfg, KVRELAY_LIMIT_STREAMS, 1ull << 40) == KVRELAY_ERR_INVALID_CONFIG);
  CHECK(kvrelay_agent_config_set_listen(cfg, listen, strlen(listen)) == KVRELAY_OK);
  if (key) CHECK(kvrelay_agent_config_set_key(cfg, (const uint8_t *)key, strlen(key)) == KVRELAY_OK);
  CHECK(kvrelay_agent_config_set_device(cfg, device) == KVRELAY_OK);
  /* returned: only a NIXL agent withholds blocks; this one moves them over TCP */
  kvrelay_block_holder h = {sizeof(kvrelay_block_holder), c, cache_pin, cache_unpin, cache_destroy, NULL};
  kvrelay_status st = kvrelay_agent_new(cfg, p->layout, &h, &a);
  if (st != KVRELAY_OK) {
    char msg[256];
    size_t len = 0;
    kvrelay_last_error_message(msg, sizeof msg, &len);
    fprintf(stderr, "kvrelay_agent_new: %s\n", msg);
  }
  kvrelay_agent_config_free(cfg);
  return a;
}

static void endpoint_of(kvrelay_agent *a, char *buf, size_t cap) {
  size_t len = 0;
  CHECK(kvrelay_agent_endpoint(a, buf, cap - 1, &len) == KVRELAY_OK);
  buf[len < cap ? len : cap - 1] = 0;
}

/* ---- the source process ---- */
static int run_source(int out_fd, pid_t child) {
  pool p;
  cache c = {PTHREAD_MUTEX_INITIALIZER, {0}, {0}, {0}, 0};
  cache ck = {PTHREAD_MUTEX_INITIALIZER, {0}, {0}, {0}, 0};
  if (device >= 0 && cuda_open(device) != 0) return 1;
  if (pool_new(&p) != 0) return 1;
  for (uint32_t i = 0; i < NAMES; i++) {
    fill_block(&p, 2 + i, names[i]);
    c.name[2 + i] = ck.name[2 + i] = names[i];
    c.used[2 + i] = ck.used[2 + i] = 1;
  }
  kvrelay_agent *a = agent_new(&p, &c, "127.0.0.1:0", NULL, 7);
  kvrelay_agent *k = agent_new(&p, &ck, "127.0.0.1:0", KEY, 7);
  CHECK(a && k);
  if (!a || !k) return 1;
  /* the blocks became reusable: record their checksums (they travel with the blocks) */
  uint32_t ids[NAMES];
  for (uint32_t i = 0; i < NAMES; i++) ids[i] = 2 + i;
  CHECK(kvrelay_agent_record_checksums(a, ids, NAMES) == KVRELAY_OK);
  CHECK(kvrelay_agent_record_checksums(k, ids, NAMES) == KVRELAY_OK);
  /* and their content digests (each block is served with its digest) */
  uint8_t digests[NAMES][KVRELAY_BLOCK_DIGEST_BYTES];
  for (uint32_t i = 0; i < NAMES; i++) digest_of(names[i], digests[i]);
  CHECK(kvrelay_agent_record_digests(a, ids, &digests[0][0], NAMES) == KVRELAY_OK);
  CHECK(kvrelay_agent_record_digests(k, ids, &digests[0][0], NAMES) == KVRELAY_OK);
  char ea[128], ek[128], line[300];
  endpoint_of(a, ea, sizeof ea);
  endpoint_of(k, ek, sizeof ek);
  int n = snprintf(line, sizeof line, "%s %s\n", ea, ek);
  CHECK(write(out_fd, line, (size_t)n) == n);
  close(out_fd);
  int status = 0;
  CHECK(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  /* what the destination did to this side, counted */
  kvrelay_agent_stats s;
  for (int i = 0; i < 200; i++) { /* bounded: the last unpin follows the last write */
    if (cache_pinned(&c) == 0 && cache_pinned(&ck) == 0) break;
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  CHECK(cache_pinned(&c) == 0 && cache_pinned(&ck) == 0);
  CHECK(kvrelay_agent_read_stats(a, &s, sizeof s) == KVRELAY_OK);
  printf("source: %llu blocks sent, refused: %llu bad request, %llu fingerprint; %llu idle closed\n",
         (unsigned long long)s.blocks_sent, (unsigned long long)s.refused_bad_request,
         (unsigned long long)s.refused_fingerprint_mismatch, (unsigned long long)s.handshake_timeouts);
  CHECK(s.blocks_sent == 5);
  CHECK(s.refused_bad_request == 1);
  CHECK(s.refused_fingerprint_mismatch == 1);
  CHECK(s.handshake_timeouts >= 1);
  CHECK(kvrelay_agent_read_stats(k, &s, sizeof s) == KVRELAY_OK);
  printf("keyed source: %llu blocks sent, %llu refused for authentication\n", (unsigned long long)s.blocks_sent,
         (unsigned long long)s.refused_auth_failed);
  CHECK(s.blocks_sent == 2);
  CHECK(s.refused_auth_failed == 2);
  kvrelay_agent_free(a);
  kvrelay_agent_free(k);
  CHECK(c.destroyed && ck.destroyed);
  pool_free(&p);
  return failures != 0;
}

/* ---- the destination process ---- */
typedef struct {
  char endpoint[128];
  int accepted;
} plan;

static int32_t provider_validate(void *ud, const kvrelay_fetch_request *r) {
  (void)ud;
  return (r->action_version.len == 3 && memcmp(r->action_version.ptr, "1.0", 3) == 0) ? 0 : 3;
}

static int32_t provider_fetch(void *ud, const kvrelay_fetch_request *r) {
  (void)ud;
  plan *pl = r->call_context; /* this request's own slot: no globals, no thread-locals */
  if (!pl || r->endpoint.len >= sizeof pl->endpoint) return 5;
  memcpy(pl->endpoint, r->endpoint.ptr, r->endpoint.len);
  pl->endpoint[r->endpoint.len] = 0;
  pl->accepted = 1;
  return 0;
}

static atomic_int callbacks;
static void on_done(void *ud, const kvrelay_fetch_result *r, kvrelay_str detail) {
  (void)r;
  (void)detail;
  atomic_fetch_add((atomic_int *)ud, 1);
}

static int32_t fetch_failure(kvrelay_agent *b, const char *ep, const uint64_t *nm, size_t n, size_t held,
                             const uint32_t *dst, size_t ndst, size_t *blocks) {
  kvrelay_fetch_params fp = {sizeof(kvrelay_fetch_params), {ep, strlen(ep)}, nm, n, held, dst, ndst, 10000};
  uint8_t digests[NAMES + 1][KVRELAY_BLOCK_DIGEST_BYTES];
  if (n > NAMES + 1) return -3;
  for (size_t i = 0; i < n; i++) digest_of(nm[i], digests[i]); /* the request's own blocks' digests */
  kvrelay_fetch_callbacks cb;
  memset(&cb, 0, sizeof cb);
  cb.size = sizeof cb;
  cb.user_data = &callbacks;
  cb.done = on_done;
  kvrelay_fetch *f = NULL;
  kvrelay_fetch_result r;
  r.size = sizeof r;
  if (kvrelay_agent_submit_checked(b, &fp, &digests[0][0], n, &cb, &f) != KVRELAY_OK) return -1;
  kvrelay_status st = kvrelay_fetch_wait(f, 20000, &r);
  kvrelay_fetch_free(f);
  if (st != KVRELAY_OK) return -2;
  if (blocks) *blocks = r.blocks;
  return r.failure;
}

static int connect_to(const char *ep) {
  char host[64];
  int port = 0;
  if (sscanf(ep, "tcp://%63[^:]:%d", host, &port) != 2) return -1;
  int s = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, host, &a.sin_addr);
  if (connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
    close(s);
    return -1;
  }
  struct timeval tv = {5, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return s;
}

static int run_destination(int in_fd) {
  char line[300] = {0}, ea[128], ek[128];
  size_t got = 0;
  while (got < sizeof line - 1) {
    ssize_t r = read(in_fd, line + got, sizeof line - 1 - got);
    if (r <= 0) break;
    got += (size_t)r;
  }
  if (sscanf(line, "%127s %127s", ea, ek) != 2) return 1;

  /* admit the router's hint */
  kvrelay_admission_config *acfg = NULL;
  kvrelay_admission *adm = NULL;
  kvrelay_admission_config_new(&acfg);
  kvrelay_admission_config_set_trusted(acfg, true);
  CHECK(kvrelay_admission_new(acfg, &adm) == KVRELAY_OK);
  kvrelay_admission_config_free(acfg);
  char hint[1024];
  int hn = snprintf(hint, sizeof hint,
                    "{\"protocol_version\":\"0.1\",\"message_id\":\"m1\",\"actions\":[{\"action_id\":\"a1\","
                    "\"action_type\":\"kv.fetch\",\"action_version\":\"1.0\",\"payload\":{"
                    "\"source_control_endpoint\":\"%s\",\"block_hashes\":[%llu,%llu,%llu,%llu,%llu,%llu]}}]}",
                    ea, (unsigned long long)names[0], (unsigned long long)names[1], (unsigned long long)names[2],
                    (unsigned long long)names[3], (unsigned long long)names[4], (unsigned long long)names[5]);
  kvrelay_outcome out;
  out.size = sizeof out;
  kvrelay_snapshot *snap = NULL;
  CHECK(kvrelay_admit(adm, (const uint8_t *)hint, (size_t)hn, &out, &snap) == KVRELAY_OK);
  CHECK(out.kind == KVRELAY_OUTCOME_ADMITTED);

  /* orchestrate: one authorized named binding, the source's endpoint in the trusted registry */
  kvrelay_capabilities_builder *cb = NULL;
  kvrelay_capabilities *caps = NULL;
  kvrelay_policy_config *pc = NULL;
  kvrelay_orchestrator *orch = NULL;
  kvrelay_capabilities_builder_new(&cb);
  kvrelay_capabilities_builder_add(cb, "agent", 5, "kv.fetch", 8, "1.0", 3);
  CHECK(kvrelay_capabilities_build(cb, &caps) == KVRELAY_OK);
  kvrelay_policy_config_new(&pc);
  kvrelay_policy_config_add_binding(pc, "kv-agent", 8, "agent", 5, KVRELAY_ADDRESSING_NAMED, true);
  kvrelay_policy_config_binding_support(pc, "kv-agent", 8, "kv.fetch", 8, "1.0", 3);
  CHECK(kvrelay_policy_config_add_endpoint(pc, ea, strlen(ea)) == KVRELAY_OK);
  kvrelay_provider prov = {sizeof(kvrelay_provider), NULL, provider_validate, provider_fetch, NULL};
  CHECK(kvrelay_orchestrator_new(caps, pc, &prov, &orch) == KVRELAY_OK);
  kvrelay_request_info ri = {sizeof(kvrelay_request_info), true, false};
  kvrelay_decision d;
  d.size = sizeof d;
  plan pl = {{0}, 0};
  CHECK(kvrelay_orchestrate_with_context(orch, &ri, snap, &pl, &d) == KVRELAY_OK);
  CHECK(d.kind == KVRELAY_DECISION_NAMED_FETCH && pl.accepted && strcmp(pl.endpoint, ea) == 0);

  /* fetch into this instance's pool: it holds block 0 already; the run is what the hint covers */
  pool p;
  cache c = {PTHREAD_MUTEX_INITIALIZER, {0}, {0}, {0}, 0};
  if (device >= 0 && cuda_open(device) != 0) return 1;
  if (pool_new(&p) != 0) return 1;
  kvrelay_agent *b = agent_new(&p, &c, "", NULL, 7); /* fetch-only */
  CHECK(b != NULL);
  if (!b) return 1;
  const uint64_t request[NAMES + 1] = {names[0], names[1], names[2], names[3], names[4], names[5], 0x2001};
  size_t run = 0;
  CHECK(kvrelay_fetch_run_length(request, NAMES + 1, 1, names, NAMES, &run) == KVRELAY_OK && run == 5);
  const uint32_t dst[5] = {9, 3, 14, 4, 5};
  size_t blocks = 0;
  CHECK(fetch_failure(b, pl.endpoint, request, NAMES + 1, 1, dst, run, &blocks) == KVRELAY_FETCH_OK);
  CHECK(blocks == 5);
  for (size_t i = 0; i < blocks; i++) CHECK(block_is(&p, dst[i], names[1 + i]));
  printf("destination: fetched %zu blocks through the agent into %s, every byte checked\n", blocks,
         device >= 0 ? "GPU memory" : "host memory");
  double est = 0;
  CHECK(kvrelay_agent_estimate(b, ea, strlen(ea), 5, &est) == KVRELAY_OK && est > 0);
  /* the runtime's own import of fetched blocks joins the estimate once it reports it */
  double imp = -1, est2 = 0;
  CHECK(kvrelay_agent_import_estimate(b, 5, &imp) == KVRELAY_OK && imp == 0);
  CHECK(kvrelay_agent_record_import(b, 5, 0.5) == KVRELAY_OK);
  CHECK(kvrelay_agent_record_import(b, 5, -1.0) == KVRELAY_ERR_INVALID_ARGUMENT);
  CHECK(kvrelay_agent_record_import(b, 5, 1e300) == KVRELAY_ERR_INVALID_ARGUMENT);
  CHECK(kvrelay_agent_record_import(b, BLOCKS + 1, 0.5) == KVRELAY_ERR_INVALID_ARGUMENT);
  /* one block count reported: a fixed cost (no slope yet); a second count gives the slope */
  CHECK(kvrelay_agent_import_estimate(b, 10, &imp) == KVRELAY_OK && imp > 0.49 && imp < 0.51);
  CHECK(kvrelay_agent_estimate(b, ea, strlen(ea), 5, &est2) == KVRELAY_OK && est2 > est + 0.49 && est2 < est + 0.51);
  CHECK(kvrelay_agent_record_import(b, 15, 1.5) == KVRELAY_OK); /* 0.1 s a block, nothing fixed */
  CHECK(kvrelay_agent_import_estimate(b, 30, &imp) == KVRELAY_OK && imp > 2.99 && imp < 3.01);

  /* every failure a runtime sees has its reason */
  const uint64_t missing[1] = {0x9999};
  const uint32_t one[1] = {0};
  CHECK(fetch_failure(b, ea, missing, 1, 0, one, 1, NULL) == KVRELAY_FETCH_SOURCE_MISS);
  CHECK(fetch_failure(b, "tcp://127.0.0.1:1", names, NAMES, 0, one, 1, NULL) == KVRELAY_FETCH_CONNECT);
  kvrelay_agent *other = agent_new(&p, &c, "", NULL, 8); /* another naming scheme */
  CHECK(fetch_failure(other, ea, names, NAMES, 0, one, 1, NULL) == KVRELAY_FETCH_FINGERPRINT_MISMATCH);
  kvrelay_agent_free(other);
  CHECK(strcmp(kvrelay_fetch_failure_name(KVRELAY_FETCH_CORRUPT), "corrupt") == 0);
  CHECK(strcmp(kvrelay_fetch_failure_name(1234), "unknown") == 0);

  /* authentication accepted and refused */
  kvrelay_agent *bk = agent_new(&p, &c, "", KEY, 7);
  kvrelay_agent *bw = agent_new(&p, &c, "", "a key the source does not hold", 7);
  const uint32_t two[2] = {10, 11};
  CHECK(fetch_failure(bk, ek, names, NAMES, 0, two, 2, &blocks) == KVRELAY_FETCH_OK && blocks == 2);
  CHECK(block_is(&p, 10, names[0]) && block_is(&p, 11, names[1]));
  CHECK(fetch_failure(bw, ek, names, NAMES, 0, one, 1, NULL) == KVRELAY_FETCH_AUTH_FAILED);
  CHECK(fetch_failure(b, ek, names, NAMES, 0, one, 1, NULL) == KVRELAY_FETCH_AUTH_FAILED);
  kvrelay_agent_free(bk);
  kvrelay_agent_free(bw);

  /* bad arguments are refused before anything runs; so is a fetch by name alone (no digests)
   * unless the limit KVRELAY_LIMIT_UNCHECKED_FETCH allows it */
  kvrelay_fetch *f = NULL;
  kvrelay_fetch_params plain = {sizeof(kvrelay_fetch_params), {ea, strlen(ea)}, names, NAMES, 0, one, 1, 1000};
  CHECK(kvrelay_agent_fetch(b, &plain, NULL, NULL, &f) == KVRELAY_ERR_INVALID_ARGUMENT && f == NULL);
  const uint32_t dup[2] = {1, 1};
  kvrelay_fetch_params bad = {sizeof(kvrelay_fetch_params), {ea, strlen(ea)}, names, NAMES, 0, dup, 2, 1000};
  CHECK(kvrelay_agent_fetch(b, &bad, NULL, NULL, &f) == KVRELAY_ERR_INVALID_ARGUMENT && f == NULL);
  CHECK(kvrelay_agent_fetch(b, NULL, NULL, NULL, &f) == KVRELAY_ERR_NULL);
  bad.dst_blocks = one;
  bad.dst_len = 1;
  bad.deadline_ms = 0;
  CHECK(kvrelay_agent_fetch(b, &bad, NULL, NULL, &f) == KVRELAY_ERR_INVALID_ARGUMENT);
  CHECK(atomic_load(&callbacks) == 7); /* one per completed fetch, none for refused submissions */

  /* garbage on the source's port gets a refusal frame; an idle connection is closed */
  int g = connect_to(ea);
  CHECK(g >= 0);
  const char junk[] = "GET / HTTP/1.1\r\n\r\n";
  CHECK(write(g, junk, sizeof junk - 1) == (ssize_t)(sizeof junk - 1));
  unsigned char reply[64];
  ssize_t rn = read(g, reply, sizeof reply);
  CHECK(rn >= 13 && memcmp(reply, "KVRA", 4) == 0 && reply[5] == 7);
  close(g);
  int idle = connect_to(ea);
  CHECK(idle >= 0);
  CHECK(read(idle, reply, sizeof reply) == 0); /* closed at the handshake deadline */
  close(idle);

  kvrelay_agent_free(b);
  CHECK(c.destroyed);
  pool_free(&p);
  kvrelay_orchestrator_free(orch);
  kvrelay_policy_config_free(pc);
  kvrelay_capabilities_free(caps);
  kvrelay_snapshot_release(snap);
  kvrelay_admission_free(adm);
  return failures != 0;
}

int main(void) {
  const char *dv = getenv("KVRELAY_EXAMPLE_DEVICE");
  if (dv && *dv) device = atoi(dv);
  if (device >= 0) {
    /* probe in a child: CUDA must start after the fork, in each process */
    pid_t probe = fork();
    if (probe == 0) _exit(cuda_open(device) == 0 ? 0 : 1);
    int st = 0;
    waitpid(probe, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      printf("agent_fetch: KVRELAY_EXAMPLE_DEVICE=%d but no CUDA driver or device here: skipped\n", device);
      return 0;
    }
  }
  int fds[2];
  if (pipe(fds) != 0) return 1;
  pid_t child = fork(); /* before any kvrelay thread exists */
  if (child < 0) return 1;
  if (child == 0) {
    close(fds[1]);
    int rc = run_destination(fds[0]);
    fflush(stdout); /* _exit skips stdio's buffers */
    _exit(rc);
  }
  close(fds[0]);
  int rc = run_source(fds[1], child);
  printf("agent_fetch: %s\n", rc == 0 ? "ok" : "FAILED");
  return rc;
}
