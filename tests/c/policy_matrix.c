/* The starred activation cases, from C, with a mock provider that counts contacts:
 *  - the registry check blocks an unauthorized destination when provider validation is
 *    bypassed, and the provider check blocks it when the registry check is bypassed;
 *  - a request-paired binding is rejected before any lookup, connection or submission;
 *  - LoRA requests never reach candidate collection; eligible ones still do.
 * Prints "N passed, M failed". */
#include <stdio.h>
#include <string.h>

#include "kvrelay.h"

#include "expect.h"

typedef struct {
  int validations, submissions, destroyed;
  int reject_validate;
} mock;

static int32_t mock_validate(void *u, const kvrelay_fetch_request *r) {
  mock *m = (mock *)u;
  m->validations++;
  (void)r;
  return m->reject_validate ? 13 : 0;
}
static int32_t mock_fetch(void *u, const kvrelay_fetch_request *r) {
  mock *m = (mock *)u;
  m->submissions++;
  /* the envelope handed on is one canonical action */
  return (r->envelope.len > 0 && r->endpoint.len > 0) ? 0 : 1;
}
static void mock_destroy(void *u) { ((mock *)u)->destroyed++; }

#define S(x) x, strlen(x)

static kvrelay_snapshot *admit(const char *endpoint, const char *type) {
  char hint[512];
  snprintf(hint, sizeof hint,
           "{\"protocol_version\":\"0.1\",\"message_id\":\"m\",\"actions\":[{\"action_id\":\"a\",\"action_type\":\"%s\","
           "\"action_version\":\"1.0\",\"payload\":{\"source_control_endpoint\":\"%s\",\"block_hashes\":[1,2]}}]}",
           type, endpoint);
  kvrelay_admission_config *cfg = NULL;
  kvrelay_admission *adm = NULL;
  kvrelay_admission_config_new(&cfg);
  kvrelay_admission_config_set_trusted(cfg, true);
  kvrelay_admission_new(cfg, &adm);
  kvrelay_admission_config_free(cfg);
  kvrelay_outcome o;
  o.size = sizeof o;
  kvrelay_snapshot *s = NULL;
  kvrelay_admit(adm, (const uint8_t *)hint, strlen(hint), &o, &s);
  kvrelay_admission_free(adm);
  return s;
}

static kvrelay_capabilities *caps(void) {
  kvrelay_capabilities_builder *b = NULL;
  kvrelay_capabilities *c = NULL;
  kvrelay_capabilities_builder_new(&b);
  kvrelay_capabilities_builder_add(b, S("nixl"), S("kv.fetch"), S("1.0"));
  EXPECT(kvrelay_capabilities_build(b, &c) == KVRELAY_OK);
  return c;
}

static kvrelay_orchestrator *orchestrator(kvrelay_capabilities *c, int addressing, const char *registry_endpoint, mock *m) {
  kvrelay_policy_config *cfg = NULL;
  kvrelay_orchestrator *o = NULL;
  kvrelay_policy_config_new(&cfg);
  EXPECT(kvrelay_policy_config_add_binding(cfg, S("b1"), S("nixl"), addressing, true) == KVRELAY_OK);
  EXPECT(kvrelay_policy_config_binding_support(cfg, S("b1"), S("kv.fetch"), S("1.0")) == KVRELAY_OK);
  EXPECT(kvrelay_policy_config_add_endpoint(cfg, S(registry_endpoint)) == KVRELAY_OK);
  kvrelay_provider p = {sizeof(kvrelay_provider), m, mock_validate, mock_fetch, mock_destroy};
  EXPECT(kvrelay_orchestrator_new(c, cfg, &p, &o) == KVRELAY_OK);
  kvrelay_policy_config_free(cfg);
  return o;
}

static const kvrelay_request_info GEN = {sizeof(kvrelay_request_info), true, false};

static int32_t decide(kvrelay_orchestrator *o, kvrelay_request_info r, kvrelay_snapshot *s) {
  kvrelay_decision d;
  d.size = sizeof d;
  EXPECT(kvrelay_orchestrate(o, &r, s, &d) == KVRELAY_OK);
  return d.kind == KVRELAY_DECISION_NAMED_FETCH ? 0 : d.discard;
}

int main(void) {
  kvrelay_capabilities *c = caps();
  const char *evil = "tcp://evil.example:23280";

  /* registry blocks when provider validation is bypassed (accept-all provider) */
  mock m1 = {0, 0, 0, 0};
  kvrelay_orchestrator *o = orchestrator(c, KVRELAY_ADDRESSING_NAMED, "tcp://10.0.0.7:23280", &m1);
  kvrelay_snapshot *s = admit(evil, "kv.fetch");
  EXPECT(strcmp(kvrelay_discard_name(decide(o, GEN, s)), "endpoint_not_trusted") == 0);
  EXPECT(m1.validations == 0 && m1.submissions == 0);
  kvrelay_orchestrator_free(o);
  EXPECT(m1.destroyed == 1);

  /* provider blocks when the registry check is bypassed (registry lists the destination) */
  mock m2 = {0, 0, 0, 1};
  o = orchestrator(c, KVRELAY_ADDRESSING_NAMED, evil, &m2);
  EXPECT(strcmp(kvrelay_discard_name(decide(o, GEN, s)), "provider_rejected") == 0);
  EXPECT(m2.validations == 1 && m2.submissions == 0);
  {
    /* the decision carries what the provider answered */
    kvrelay_decision d;
    d.size = sizeof d;
    EXPECT(kvrelay_orchestrate(o, &GEN, s, &d) == KVRELAY_OK);
    EXPECT(d.discard == KVRELAY_DISCARD_PROVIDER_REJECTED && d.provider_code == 13);
    char why[256];
    size_t need = 0;
    EXPECT(kvrelay_last_error_message(why, sizeof why, &need) == KVRELAY_OK && strstr(why, "provider_rejected") != NULL &&
           strstr(why, "13") != NULL);
    printf("a provider refusal says: %s\n", why);
  }
  kvrelay_orchestrator_free(o);

  /* request-paired binding: rejected before any lookup, connection or submission */
  mock m3 = {0, 0, 0, 0};
  o = orchestrator(c, KVRELAY_ADDRESSING_REQUEST_PAIRED, "tcp://10.0.0.7:23280", &m3);
  kvrelay_snapshot *bad_ep = admit("not an endpoint", "kv.fetch");
  EXPECT(strcmp(kvrelay_discard_name(decide(o, GEN, s)), "request_paired") == 0);
  EXPECT(strcmp(kvrelay_discard_name(decide(o, GEN, bad_ep)), "request_paired") == 0);
  EXPECT(m3.validations == 0 && m3.submissions == 0);
  kvrelay_orchestrator_free(o);

  /* LoRA: no candidate collection, no contact; eligible requests still collect and fetch */
  mock m4 = {0, 0, 0, 0};
  o = orchestrator(c, KVRELAY_ADDRESSING_NAMED, "tcp://10.0.0.7:23280", &m4);
  kvrelay_snapshot *good = admit("tcp://10.0.0.7:23280", "kv.fetch");
  kvrelay_snapshot *unsupported = admit("tcp://10.0.0.7:23280", "kv.other");
  kvrelay_request_info lora = {sizeof(kvrelay_request_info), true, true};
  EXPECT(strcmp(kvrelay_discard_name(decide(o, lora, good)), "lora_adapter") == 0);
  EXPECT(strcmp(kvrelay_discard_name(decide(o, lora, unsupported)), "lora_adapter") == 0);
  EXPECT(m4.validations == 0 && m4.submissions == 0);
  EXPECT(strcmp(kvrelay_discard_name(decide(o, GEN, unsupported)), "no_candidate") == 0);
  EXPECT(decide(o, GEN, good) == 0);
  EXPECT(m4.validations == 1 && m4.submissions == 1);
  EXPECT(strcmp(kvrelay_discard_name(decide(o, GEN, NULL)), "no_hint") == 0);

  /* candidates from C, with the size query */
  size_t n = 0;
  kvrelay_candidate cand[2];
  kvrelay_candidate_counts counts;
  counts.size = sizeof counts;
  counts.unknown_type = 77;
  counts.no_matching_version = 78;
  EXPECT(kvrelay_collect_candidates(good, c, NULL, 0, &n, &counts) == KVRELAY_ERR_BUFFER_TOO_SMALL && n == 1);
  /* the header promises nothing but the count is written when the buffer is too small */
  EXPECT(counts.unknown_type == 77 && counts.no_matching_version == 78);
  EXPECT(kvrelay_collect_candidates(good, c, cand, 2, &n, &counts) == KVRELAY_OK && n == 1);
  EXPECT(cand[0].action_index == 0 && cand[0].families == 1 && counts.unknown_type == 0);
  EXPECT(kvrelay_collect_candidates(unsupported, c, cand, 2, &n, &counts) == KVRELAY_OK && n == 0 && counts.unknown_type == 1);

  /* refused bindings say why (kvrelay_last_error_message) */
  {
    char why[256];
    size_t need = 0;
    kvrelay_policy_config *pc_bad = NULL;
    EXPECT(kvrelay_policy_config_new(&pc_bad) == KVRELAY_OK);
    EXPECT(kvrelay_policy_config_binding_support(pc_bad, S("ghost"), S("kv.fetch"), S("1.0")) == KVRELAY_ERR_INVALID_ARGUMENT);
    EXPECT(kvrelay_last_error_message(why, sizeof why, &need) == KVRELAY_OK && strstr(why, "ghost") != NULL);
    EXPECT(kvrelay_policy_config_add_binding(pc_bad, S("b-unknown"), S("no-such-family"), KVRELAY_ADDRESSING_NAMED, true) == KVRELAY_OK);
    kvrelay_provider none = {sizeof(kvrelay_provider), NULL, NULL, NULL, NULL};
    kvrelay_orchestrator *bad_o = NULL;
    EXPECT(kvrelay_orchestrator_new(c, pc_bad, &none, &bad_o) == KVRELAY_ERR_INVALID_CONFIG && bad_o == NULL);
    EXPECT(kvrelay_last_error_message(why, sizeof why, &need) == KVRELAY_OK && strstr(why, "b-unknown") != NULL);
    printf("a refused binding says: %s\n", why);
    kvrelay_policy_config_free(pc_bad);
  }

  /* counters, as a struct: the unsupported envelope's action counts once per request */
  kvrelay_policy_counters pc;
  pc.size = sizeof pc;
  EXPECT(kvrelay_orchestrator_counters(o, &pc) == KVRELAY_OK);
  EXPECT(pc.named_fetch == 1 && pc.discarded[KVRELAY_DISCARD_LORA_ADAPTER] == 2 && pc.discarded[KVRELAY_DISCARD_NONE] == 0);
  EXPECT(pc.discarded[KVRELAY_DISCARD_NO_CANDIDATE] == 1 && pc.discarded[KVRELAY_DISCARD_NO_HINT] == 1);
  /* the kv.other action of the one eligible request that reached collection; LoRA ones did not */
  EXPECT(pc.unknown_type == 1 && pc.no_matching_version == 0);
  EXPECT(kvrelay_orchestrator_counters(o, NULL) == KVRELAY_ERR_NULL);

  /* metrics */
  size_t need = 0;
  char text[4096];
  EXPECT(kvrelay_orchestrator_prometheus(o, text, sizeof text, &need) == KVRELAY_OK);
  EXPECT(strstr(text, "kvrelay_kv_policy_discarded_total{reason=\"lora_adapter\"} 2\n") != NULL);
  EXPECT(strstr(text, "kvrelay_kv_policy_named_fetch_total 1\n") != NULL);
  kvrelay_orchestrator_free(o);

  /* bad config: binding of an unknown family; the provider is still destroyed */
  mock m5 = {0, 0, 0, 0};
  kvrelay_policy_config *cfg = NULL;
  kvrelay_policy_config_new(&cfg);
  kvrelay_policy_config_add_binding(cfg, S("x"), S("nope"), KVRELAY_ADDRESSING_NAMED, true);
  EXPECT(kvrelay_policy_config_add_binding(cfg, S("y"), S("nixl"), 7, true) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_policy_config_add_endpoint(cfg, S("tcp://*:1")) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_policy_config_binding_support(cfg, S("zz"), S("kv.fetch"), S("1")) == KVRELAY_ERR_INVALID_ARGUMENT);
  kvrelay_provider p = {sizeof(kvrelay_provider), &m5, mock_validate, mock_fetch, mock_destroy};
  EXPECT(kvrelay_orchestrator_new(c, cfg, &p, &o) == KVRELAY_ERR_INVALID_CONFIG);
  EXPECT(m5.destroyed == 1);
  EXPECT(kvrelay_orchestrate(NULL, &GEN, good, NULL) == KVRELAY_ERR_NULL);
  kvrelay_policy_config_free(cfg);

  kvrelay_snapshot_release(s);
  kvrelay_snapshot_release(bad_ep);
  kvrelay_snapshot_release(good);
  kvrelay_snapshot_release(unsupported);
  kvrelay_capabilities_free(c);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
