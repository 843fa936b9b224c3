/* Bad input at the C boundary: NULL pointers, (NULL, 0) inputs, undersized buffers, invented
 * status values, invalid UTF-8, invalid config, out-of-range indexes, double release (detected
 * by debug builds of the library). None may crash or leak (run under ASan's leak checker).
 * Also compiled as C++ (abi_edge_cases_as_cxx.cpp). Prints "N passed, M failed". */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrelay.h"

#include "expect.h"

static const char HINT[] =
    "{\"protocol_version\":\"0.1\",\"message_id\":\"m\",\"actions\":[{\"action_id\":\"a\",\"action_type\":"
    "\"kv.fetch\",\"action_version\":\"1.0\",\"payload\":{\"block_hashes\":[1,2]}}]}";

static kvrelay_admission *trusted_edge(void) {
  kvrelay_admission_config *cfg = NULL;
  kvrelay_admission *adm = NULL;
  kvrelay_admission_config_new(&cfg);
  kvrelay_admission_config_set_trusted(cfg, true);
  kvrelay_admission_new(cfg, &adm);
  kvrelay_admission_config_free(cfg);
  return adm;
}

static void null_pointers(kvrelay_admission *adm, kvrelay_snapshot *snap) {
  kvrelay_outcome o;
  o.size = sizeof o;
  kvrelay_snapshot *s = NULL;
  kvrelay_bytes b;
  kvrelay_str str;
  kvrelay_action a;
  a.size = sizeof a;
  kvrelay_counters c;
  c.size = sizeof c;
  size_t n = 0;
  EXPECT(kvrelay_admission_config_new(NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admission_config_set_trusted(NULL, true) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admission_config_set_max_bytes(NULL, 1) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admission_config_set_metric_prefix(NULL, "x", 1) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admission_new(NULL, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admit(NULL, (const uint8_t *)HINT, sizeof HINT - 1, &o, &s) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admit(adm, (const uint8_t *)HINT, sizeof HINT - 1, NULL, &s) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admit(adm, (const uint8_t *)HINT, sizeof HINT - 1, &o, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admit_batch(adm, NULL, 0, 1, NULL, &s, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admission_counters(NULL, &c) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admission_counters(adm, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admission_prometheus(adm, NULL, 0, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_admission_decode_msgpack(NULL, NULL, 0, &o, &s) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_canonical(NULL, &b) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_canonical(snap, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_message_id(NULL, &str) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_protocol_version(snap, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_action_count(NULL, &n) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_action(snap, 0, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_action(NULL, 0, &a) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_decode(NULL, NULL, 0, &n) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_decode(snap, NULL, 0, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_msgpack(snap, NULL, 0, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_action_envelope(snap, 0, NULL, 0, NULL) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_snapshot_retain(NULL) == NULL);
  kvrelay_snapshot_release(NULL);
  kvrelay_admission_free(NULL);
  kvrelay_admission_config_free(NULL);
  passed++;
}

static void empty_and_invalid_inputs(kvrelay_admission *adm) {
  kvrelay_outcome o;
  o.size = sizeof o;
  kvrelay_snapshot *s = (kvrelay_snapshot *)&o; /* poison: must be overwritten with NULL */
  EXPECT(kvrelay_admit(adm, NULL, 0, &o, &s) == KVRELAY_OK);
  EXPECT(o.kind == KVRELAY_OUTCOME_ABSENT && s == NULL);
  /* (NULL, n > 0) is an invalid argument and writes nothing */
  o.kind = 77;
  EXPECT(kvrelay_admit(adm, NULL, 5, &o, &s) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(o.kind == 77);
  /* malformed hint: an outcome, not an error, with a detail that holds no hint bytes */
  const char bad[] = "{\"protocol_version\":\"0.1\",\"message_id\":\"SECRET\",\"actions\":[7]}";
  EXPECT(kvrelay_admit(adm, (const uint8_t *)bad, sizeof bad - 1, &o, &s) == KVRELAY_OK);
  EXPECT(o.kind == KVRELAY_OUTCOME_IGNORED && o.reason == KVRELAY_REASON_MALFORMED && s == NULL);
  EXPECT(strlen(o.detail) > 0 && strlen(o.detail) < KVRELAY_DETAIL_CAPACITY && strstr(o.detail, "SECRET") == NULL);
  /* invalid UTF-8 inside the hint is malformed */
  const char utf[] = "{\"protocol_version\":\"0.1\",\"message_id\":\"\xff\",\"actions\":[]}";
  EXPECT(kvrelay_admit(adm, (const uint8_t *)utf, sizeof utf - 1, &o, &s) == KVRELAY_OK);
  EXPECT(o.reason == KVRELAY_REASON_MALFORMED);
  /* garbage MessagePack is an ignored outcome */
  const uint8_t junk[] = {0xc1, 0x00, 0xff};
  EXPECT(kvrelay_admission_decode_msgpack(adm, junk, sizeof junk, &o, &s) == KVRELAY_OK);
  EXPECT(o.kind == KVRELAY_OUTCOME_IGNORED && s == NULL);
}

static void config_errors(void) {
  kvrelay_admission_config *cfg = NULL;
  kvrelay_admission *adm = NULL;
  EXPECT(kvrelay_admission_config_new(&cfg) == KVRELAY_OK);
  EXPECT(kvrelay_admission_config_set_metric_prefix(cfg, "\xff\xfe", 2) == KVRELAY_ERR_INVALID_UTF8);
  EXPECT(kvrelay_admission_config_trust_from_env(cfg, "\xc0\xaf", 2) == KVRELAY_ERR_INVALID_UTF8);
  EXPECT(kvrelay_admission_config_trust_from_env(cfg, "A=B", 3) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_admission_config_trust_from_env(cfg, NULL, 0) == KVRELAY_OK);
  EXPECT(kvrelay_admission_config_set_metric_prefix(cfg, NULL, 4) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_admission_config_set_metric_prefix(cfg, "9 bad", 5) == KVRELAY_OK); /* checked at _new */
  EXPECT(kvrelay_admission_new(cfg, &adm) == KVRELAY_ERR_INVALID_CONFIG && adm == NULL);
  EXPECT(kvrelay_admission_config_set_metric_prefix(cfg, "ok_prefix", 9) == KVRELAY_OK);
  EXPECT(kvrelay_admission_config_set_max_depth(cfg, 0) == KVRELAY_OK);
  EXPECT(kvrelay_admission_new(cfg, &adm) == KVRELAY_ERR_INVALID_CONFIG && adm == NULL);
  EXPECT(kvrelay_admission_config_set_max_depth(cfg, 16) == KVRELAY_OK);
  EXPECT(kvrelay_admission_new(cfg, &adm) == KVRELAY_OK && adm != NULL);
  kvrelay_admission_free(adm);
  kvrelay_admission_config_free(cfg);
  /* a NULL config means the defaults: trust off */
  adm = NULL;
  EXPECT(kvrelay_admission_new(NULL, &adm) == KVRELAY_OK);
  kvrelay_outcome o;
  o.size = sizeof o;
  kvrelay_snapshot *s = NULL;
  EXPECT(kvrelay_admit(adm, (const uint8_t *)HINT, sizeof HINT - 1, &o, &s) == KVRELAY_OK);
  EXPECT(o.reason == KVRELAY_REASON_UNTRUSTED && s == NULL);
  kvrelay_admission_free(adm);
}

static void buffers(kvrelay_admission *adm, kvrelay_snapshot *snap) {
  unsigned char buf[16];
  size_t need = 0, n = 0;
  memset(buf, 0xAB, sizeof buf);
  EXPECT(kvrelay_snapshot_decode(snap, buf, sizeof buf, &need) == KVRELAY_ERR_BUFFER_TOO_SMALL);
  EXPECT(need == sizeof HINT - 1);
  for (size_t i = 0; i < sizeof buf; i++) EXPECT(buf[i] == 0xAB); /* nothing written */
  EXPECT(kvrelay_snapshot_decode(snap, NULL, 5, &need) == KVRELAY_ERR_INVALID_ARGUMENT);
  unsigned char *full = (unsigned char *)malloc(need);
  EXPECT(kvrelay_snapshot_decode(snap, full, need, &n) == KVRELAY_OK && n == need);
  EXPECT(memcmp(full, HINT, need) == 0);
  free(full);

  EXPECT(kvrelay_snapshot_msgpack(snap, NULL, 0, &need) == KVRELAY_ERR_BUFFER_TOO_SMALL && need > 0);
  uint8_t *mp = (uint8_t *)malloc(need);
  EXPECT(kvrelay_snapshot_msgpack(snap, mp, need, &n) == KVRELAY_OK && n == need);
  kvrelay_outcome o;
  o.size = sizeof o;
  kvrelay_snapshot *back = NULL;
  EXPECT(kvrelay_admission_decode_msgpack(adm, mp, n, &o, &back) == KVRELAY_OK && back != NULL);
  kvrelay_bytes a, b;
  kvrelay_snapshot_canonical(snap, &a);
  kvrelay_snapshot_canonical(back, &b);
  EXPECT(a.len == b.len && memcmp(a.ptr, b.ptr, a.len) == 0);
  kvrelay_snapshot_release(back);
  free(mp);

  EXPECT(kvrelay_snapshot_action_envelope(snap, 0, buf, 4, &need) == KVRELAY_ERR_BUFFER_TOO_SMALL);
  EXPECT(need == sizeof HINT - 1);
  EXPECT(kvrelay_snapshot_action_envelope(snap, 1, NULL, 0, &need) == KVRELAY_ERR_OUT_OF_RANGE);

  char text[8];
  memset(text, 'z', sizeof text);
  EXPECT(kvrelay_admission_prometheus(adm, text, sizeof text, &need) == KVRELAY_ERR_BUFFER_TOO_SMALL);
  EXPECT(need > sizeof text && text[0] == 'z');
  char *prom = (char *)malloc(need);
  EXPECT(kvrelay_admission_prometheus(adm, prom, need, &n) == KVRELAY_OK && prom[n - 1] == '\0');
  EXPECT(strstr(prom, "kvrelay_kv_hints_admitted_total ") != NULL);
  free(prom);
}

static void ranges_and_messages(kvrelay_snapshot *snap) {
  kvrelay_action a;
  a.size = sizeof a;
  a.index = 12345;
  EXPECT(kvrelay_snapshot_action(snap, 1, &a) == KVRELAY_ERR_OUT_OF_RANGE);
  EXPECT(a.index == 12345); /* untouched on failure */
  EXPECT(kvrelay_snapshot_action(snap, (size_t)-1, &a) == KVRELAY_ERR_OUT_OF_RANGE);
  EXPECT(kvrelay_snapshot_action(snap, 0, &a) == KVRELAY_OK);
  EXPECT(a.payload.len == strlen("{\"block_hashes\":[1,2]}") && memcmp(a.payload.ptr, "{\"block_hashes\":[1,2]}", a.payload.len) == 0);
  EXPECT(a.action_type.len == 8 && memcmp(a.action_type.ptr, "kv.fetch", 8) == 0);
  EXPECT(strcmp(kvrelay_status_message(KVRELAY_OK), "ok") == 0);
  EXPECT(strcmp(kvrelay_status_message(-7), "unknown kvrelay status") == 0);
  EXPECT(strcmp(kvrelay_status_message(1000), "unknown kvrelay status") == 0);
  EXPECT(strcmp(kvrelay_reason_name(42), "unknown") == 0);
  EXPECT(strcmp(kvrelay_reason_name(KVRELAY_REASON_OVERSIZED), "oversized") == 0);
}

static void batch(kvrelay_admission *adm) {
  kvrelay_outcome o[3];
  kvrelay_snapshot *s[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3; i++) o[i].size = sizeof o[i];
  bool shared = true;
  char list[512];
  snprintf(list, sizeof list, "[%s,null,%s]", HINT, HINT);
  o[0].kind = 99;
  EXPECT(kvrelay_admit_batch(adm, (const uint8_t *)list, strlen(list), 2, o, s, &shared) == KVRELAY_ERR_BATCH_LENGTH_MISMATCH);
  EXPECT(o[0].kind == 99 && s[0] == NULL);
  EXPECT(kvrelay_admit_batch(adm, (const uint8_t *)list, strlen(list), 3, o, s, &shared) == KVRELAY_OK);
  EXPECT(!shared && o[0].kind == KVRELAY_OUTCOME_ADMITTED && o[1].kind == KVRELAY_OUTCOME_ABSENT && s[1] == NULL);
  EXPECT(s[0] != NULL && s[2] != NULL && s[0] != s[2]);
  for (int i = 0; i < 3; i++) kvrelay_snapshot_release(s[i]);
  EXPECT(kvrelay_admit_batch(adm, (const uint8_t *)HINT, sizeof HINT - 1, 3, o, s, &shared) == KVRELAY_OK);
  EXPECT(shared && s[0] == s[1] && s[1] == s[2]); /* one snapshot, one reference per prompt */
  for (int i = 0; i < 3; i++) kvrelay_snapshot_release(s[i]);
}

/* The hint of a request body, found in the body's own bytes and admitted from them. */
static void find_hint(kvrelay_admission *adm) {
  char body[1024];
  int32_t spelling = -1;
  size_t at = 99, len = 99;
  snprintf(body, sizeof body, "{\"model\":\"m\",\"kv_transfer_params\":{\"router_hint\": %s },\"n\":1}", HINT);
  EXPECT(kvrelay_find_hint((const uint8_t *)body, strlen(body), &spelling, &at, &len) == KVRELAY_OK);
  EXPECT(spelling == KVRELAY_HINT_TRANSFER_ROUTER_HINT && len == sizeof HINT - 1 && memcmp(body + at, HINT, len) == 0);
  kvrelay_outcome o;
  o.size = sizeof o;
  kvrelay_snapshot *s = NULL;
  EXPECT(kvrelay_admit(adm, (const uint8_t *)body + at, len, &o, &s) == KVRELAY_OK);
  EXPECT(o.kind == KVRELAY_OUTCOME_ADMITTED && s != NULL);
  kvrelay_snapshot_release(s);
  /* kv_hints (for kvrelay_admit_batch), and null as absent */
  snprintf(body, sizeof body, "{\"kv_hint\":null,\"kv_hints\":[%s,null]}", HINT);
  EXPECT(kvrelay_find_hint((const uint8_t *)body, strlen(body), &spelling, &at, &len) == KVRELAY_OK);
  EXPECT(spelling == KVRELAY_HINT_KV_HINTS && body[at] == '[' && at + len == strlen(body) - 1);
  EXPECT(kvrelay_find_hint((const uint8_t *)"{\"kv_hints\":null}", 17, &spelling, &at, &len) == KVRELAY_OK);
  EXPECT(spelling == KVRELAY_HINT_NONE && len == 0);
  /* two hints: the client's error, with both named; nothing written */
  spelling = -1;
  const char *two = "{\"kv_hint\":{},\"router_hint\":{}}";
  EXPECT(kvrelay_find_hint((const uint8_t *)two, strlen(two), &spelling, &at, &len) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(spelling == -1);
  char msg[512];
  size_t n = 0;
  EXPECT(kvrelay_last_error_message(msg, sizeof msg, &n) == KVRELAY_OK && strstr(msg, "router_hint") != NULL);
  /* not an object, NULL pointers */
  EXPECT(kvrelay_find_hint((const uint8_t *)"[1]", 3, &spelling, &at, &len) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_find_hint(NULL, 0, &spelling, &at, &len) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_find_hint((const uint8_t *)"{}", 2, NULL, &at, &len) == KVRELAY_ERR_NULL);
}

static void double_release(kvrelay_admission *adm) {
  if (!kvrelay_debug_checks()) {
    printf("double release: skipped (release build of the library does not track handles)\n");
    return;
  }
  kvrelay_outcome o;
  o.size = sizeof o;
  kvrelay_snapshot *s = NULL;
  EXPECT(kvrelay_admit(adm, (const uint8_t *)HINT, sizeof HINT - 1, &o, &s) == KVRELAY_OK);
  kvrelay_snapshot *t = kvrelay_snapshot_retain(s);
  kvrelay_snapshot_release(t);
  kvrelay_snapshot_release(s);
  /* s is gone now: detected, not undefined */
  kvrelay_bytes b;
  EXPECT(kvrelay_snapshot_canonical(s, &b) == KVRELAY_ERR_INVALID_HANDLE);
  kvrelay_snapshot_release(s); /* reported on stderr and ignored */
  EXPECT(kvrelay_snapshot_retain(s) == NULL);
  printf("double release: detected\n");
}

/* The 0.4 epoch's sized structs: a caller declares its struct's size, for outputs too. An
 * output of no version's size is refused before anything happens (nothing admitted, counted or
 * written); a newer header's larger output gets the fields this library knows and zeros past
 * them, never a byte past its size; a batch's outcomes must all carry one size; an input of a
 * newer header with a field this library does not know set is refused. */
typedef struct newer_outcome {
  kvrelay_outcome known;
  uint64_t future; /* a field a later 0.4.x might append */
  uint64_t guard;  /* past the declared size: never written */
} newer_outcome;

static void sized_structs(kvrelay_admission *adm) {
  kvrelay_counters before, after;
  before.size = sizeof before;
  after.size = sizeof after;
  EXPECT(kvrelay_admission_counters(adm, &before) == KVRELAY_OK);
  kvrelay_outcome o;
  memset(&o, 0xAB, sizeof o);
  o.size = 0; /* a caller that forgot it */
  kvrelay_snapshot *s = NULL;
  EXPECT(kvrelay_admit(adm, (const uint8_t *)HINT, sizeof HINT - 1, &o, &s) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(s == NULL && o.kind == (int32_t)0xABABABAB);
  o.size = sizeof o - 8; /* smaller than the first version's */
  EXPECT(kvrelay_admit(adm, (const uint8_t *)HINT, sizeof HINT - 1, &o, &s) == KVRELAY_ERR_INVALID_ARGUMENT);
  o.size = sizeof o + 4; /* not a multiple of the alignment */
  EXPECT(kvrelay_admit(adm, (const uint8_t *)HINT, sizeof HINT - 1, &o, &s) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_admission_counters(adm, &after) == KVRELAY_OK);
  EXPECT(after.admitted == before.admitted); /* refused before admitting: nothing counted */

  newer_outcome n;
  memset(&n, 0xAB, sizeof n);
  n.known.size = offsetof(newer_outcome, guard);
  EXPECT(kvrelay_admit(adm, (const uint8_t *)HINT, sizeof HINT - 1, &n.known, &s) == KVRELAY_OK);
  EXPECT(n.known.size == offsetof(newer_outcome, guard) && n.known.kind == KVRELAY_OUTCOME_ADMITTED);
  EXPECT(n.future == 0 && n.guard == 0xABABABABABABABABull);
  kvrelay_snapshot_release(s);

  kvrelay_outcome b[2];
  kvrelay_snapshot *bs[2] = {NULL, NULL};
  b[0].size = sizeof b[0];
  b[1].size = 0;
  EXPECT(kvrelay_admit_batch(adm, (const uint8_t *)HINT, sizeof HINT - 1, 2, b, bs, NULL) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(bs[0] == NULL && bs[1] == NULL);

  /* an input from a newer header: a zero unknown field is accepted, a set one refused */
  struct {
    kvrelay_request_info info;
    uint64_t future;
  } ri;
  memset(&ri, 0, sizeof ri);
  ri.info.size = sizeof ri;
  ri.info.generation_only = true;
  kvrelay_capabilities_builder *cb = NULL;
  kvrelay_capabilities *caps = NULL;
  kvrelay_policy_config *pc = NULL;
  kvrelay_orchestrator *orch = NULL;
  kvrelay_provider prov;
  memset(&prov, 0, sizeof prov);
  prov.size = sizeof prov;
  EXPECT(kvrelay_capabilities_builder_new(&cb) == KVRELAY_OK);
  EXPECT(kvrelay_capabilities_build(cb, &caps) == KVRELAY_OK);
  EXPECT(kvrelay_policy_config_new(&pc) == KVRELAY_OK);
  EXPECT(kvrelay_orchestrator_new(caps, pc, &prov, &orch) == KVRELAY_OK);
  kvrelay_decision d;
  d.size = sizeof d;
  EXPECT(kvrelay_orchestrate(orch, &ri.info, NULL, &d) == KVRELAY_OK);
  EXPECT(d.kind == KVRELAY_DECISION_KEEP_PAIRED_PATH);
  ri.future = 1;
  d.kind = 99;
  EXPECT(kvrelay_orchestrate(orch, &ri.info, NULL, &d) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(d.kind == 99);
  /* a provider of no version's size is refused */
  kvrelay_orchestrator *orch2 = NULL;
  prov.size = 8;
  EXPECT(kvrelay_orchestrator_new(caps, pc, &prov, &orch2) == KVRELAY_ERR_INVALID_ARGUMENT && orch2 == NULL);
  kvrelay_orchestrator_free(orch);
  kvrelay_policy_config_free(pc);
  kvrelay_capabilities_free(caps); /* the build took the builder */
  passed++;
}

int main(void) {
  kvrelay_admission *adm = trusted_edge();
  EXPECT(adm != NULL);
  kvrelay_outcome o;
  o.size = sizeof o;
  kvrelay_snapshot *snap = NULL;
  EXPECT(kvrelay_admit(adm, (const uint8_t *)HINT, sizeof HINT - 1, &o, &snap) == KVRELAY_OK);
  EXPECT(o.kind == KVRELAY_OUTCOME_ADMITTED && snap != NULL);

  null_pointers(adm, snap);
  empty_and_invalid_inputs(adm);
  config_errors();
  buffers(adm, snap);
  ranges_and_messages(snap);
  batch(adm);
  find_hint(adm);
  double_release(adm);
  sized_structs(adm);

  kvrelay_snapshot_release(snap);
  kvrelay_admission_free(adm);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
