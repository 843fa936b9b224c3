/* The C side of benches/python/overhead.py: the same calls the Python package makes, timed in
 * a loop from C (the anchor): kvrelay_admit + kvrelay_snapshot_release, kvrelay_agent_submit
 * (what Agent.fetch calls, without callbacks). Prints "admit_ns N" and "fetch_submit_ns N". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include "kvrelay.h"

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static size_t pin(void *u, const uint64_t *names, size_t n, uint32_t *ids) {
  (void)u; (void)names; (void)n; (void)ids;
  return 0;
}
static void unpin(void *u, const uint32_t *ids, size_t n) { (void)u; (void)ids; (void)n; }

int main(int argc, char **argv) {
  const char *env = argc > 1 ? argv[1] : "{}";
  long iters = argc > 2 ? atol(argv[2]) : 200000;
  kvrelay_admission_config *cfg;
  kvrelay_admission *adm;
  if (kvrelay_admission_config_new(&cfg) || kvrelay_admission_config_set_trusted(cfg, true) ||
      kvrelay_admission_new(cfg, &adm))
    return 1;
  kvrelay_admission_config_free(cfg);
  double best = 1e30;
  for (int rep = 0; rep < 5; rep++) {
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) {
      kvrelay_outcome o;
      o.size = sizeof o;
      kvrelay_snapshot *s = NULL;
      if (kvrelay_admit(adm, (const uint8_t *)env, strlen(env), &o, &s)) return 2;
      kvrelay_snapshot_release(s);
    }
    double per = (now_ns() - t0) / (double)iters;
    if (per < best) best = per;
  }
  printf("admit_ns %.1f\n", best);
  kvrelay_admission_free(adm);

  /* fetch submission: a fetch-only agent over a small host pool with one fetch thread, kept
   * busy by a "plug" fetch to a listener that never answers, so that the timed submissions
   * queue behind it and no agent thread competes for the CPU while they are timed (2 vCPUs);
   * then every fetch is cancelled and waited for (untimed) */
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa;
  socklen_t sl = sizeof sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (ls < 0 || bind(ls, (struct sockaddr *)&sa, sizeof sa) || listen(ls, 64) ||
      getsockname(ls, (struct sockaddr *)&sa, &sl))
    return 7;
  char plug_ep[64];
  snprintf(plug_ep, sizeof plug_ep, "tcp://127.0.0.1:%d", ntohs(sa.sin_port));
  static uint8_t pool[16 * 4096];
  kvrelay_kv_layout *layout;
  if (kvrelay_kv_layout_all_layers_per_block((uint64_t)(uintptr_t)pool, 1, 16, 4096, &layout)) return 3;
  kvrelay_agent_fingerprint fp = {sizeof(kvrelay_agent_fingerprint), 32, 1, 1, 64, 2, 1};
  kvrelay_agent_config *ac;
  if (kvrelay_agent_config_new(&fp, &ac) || kvrelay_agent_config_set_listen(ac, "", 0)) return 4;
  kvrelay_agent_config_set_limit(ac, KVRELAY_LIMIT_MAX_QUEUED_FETCHES, 100000);
  kvrelay_agent_config_set_limit(ac, KVRELAY_LIMIT_FETCH_THREADS, 1);
  kvrelay_agent_config_set_limit(ac, KVRELAY_LIMIT_UNCHECKED_FETCH, 1); /* the call is measured */
  kvrelay_block_holder h = {sizeof(kvrelay_block_holder), NULL, pin, unpin, NULL, NULL};
  kvrelay_agent *agent;
  if (kvrelay_agent_new(ac, layout, &h, &agent)) return 5;
  kvrelay_agent_config_free(ac);
  const char *ep = argc > 3 ? argv[3] : "tcp://127.0.0.1:9";
  uint64_t names[4] = {1, 2, 3, 4};
  uint32_t dst[4] = {0, 1, 2, 3};
  kvrelay_fetch_params p = {sizeof(kvrelay_fetch_params), {ep, strlen(ep)}, names, 4, 0, dst, 4, 1000};
  kvrelay_fetch_params plug_p = {sizeof(kvrelay_fetch_params), {plug_ep, strlen(plug_ep)}, names, 4, 0, dst, 4, 60000};
  long n = 2000;
  kvrelay_fetch **fs = calloc((size_t)n, sizeof *fs);
  best = 1e30;
  for (int rep = 0; rep < 5; rep++) {
    kvrelay_fetch *plug;
    if (kvrelay_agent_submit(agent, &plug_p, NULL, &plug)) return 6;
    struct timespec settle = {0, 20 * 1000 * 1000}; /* the fetch thread takes the plug */
    nanosleep(&settle, NULL);
    double t0 = now_ns();
    for (long i = 0; i < n; i++)
      if (kvrelay_agent_submit(agent, &p, NULL, &fs[i])) return 6;
    double per = (now_ns() - t0) / (double)n;
    if (per < best) best = per;
    kvrelay_fetch_result r;
    r.size = sizeof r;
    for (long i = 0; i < n; i++) kvrelay_fetch_cancel(fs[i]);
    kvrelay_fetch_cancel(plug);
    for (long i = 0; i < n; i++) {
      kvrelay_fetch_wait(fs[i], 30000, &r);
      kvrelay_fetch_free(fs[i]);
    }
    kvrelay_fetch_wait(plug, 30000, &r);
    kvrelay_fetch_free(plug);
  }
  printf("fetch_submit_ns %.1f\n", best);
  free(fs);
  kvrelay_agent_free(agent);
  kvrelay_kv_layout_free(layout);
  close(ls);
  return 0;
}
