#include <stdio.h>
#include "kvrelay.h"

int main(void) {
  kvrelay_admission_config *cfg = NULL;
  kvrelay_admission *adm = NULL;
  if (kvrelay_admission_config_new(&cfg) != KVRELAY_OK) return 1;
  kvrelay_admission_config_set_trusted(cfg, true); /* or _trust_from_env(cfg, NULL, 0) */
  kvrelay_status st = kvrelay_admission_new(cfg, &adm);
  kvrelay_admission_config_free(cfg);
  if (st != KVRELAY_OK) return 1;

  const char hint[] = "{\"protocol_version\":\"0.1\",\"message_id\":\"m1\",\"actions\":[]}";
  kvrelay_outcome out;
  out.size = sizeof out; /* every struct that may grow carries its size */
  kvrelay_snapshot *snap = NULL;
  st = kvrelay_admit(adm, (const uint8_t *)hint, sizeof hint - 1, &out, &snap);
  if (st != KVRELAY_OK) {
    fprintf(stderr, "kvrelay_admit: %s\n", kvrelay_status_message(st));
    return 1;
  }
  if (out.kind == KVRELAY_OUTCOME_ADMITTED) {
    kvrelay_str id;
    kvrelay_snapshot_message_id(snap, &id);
    printf("admitted %.*s\n", (int)id.len, id.ptr);
    kvrelay_snapshot *child = kvrelay_snapshot_retain(snap); /* e.g. for a child request */
    kvrelay_snapshot_release(child);
    kvrelay_snapshot_release(snap);
  } else {
    printf("no hint used (%s)\n", kvrelay_reason_name(out.reason)); /* inference continues */
  }
  kvrelay_admission_free(adm);
  return out.kind == KVRELAY_OUTCOME_ADMITTED ? 0 : 1;
}
