/* admit: read a hint file, admit it untrusted and trusted, print the outcomes, the snapshot's
 * fields and the Prometheus text. Written so that it also compiles as C++ (admit_as_cxx.cpp).
 *
 *   admit HINT.json
 *
 * Exit status: 0 when everything behaved as documented, 1 otherwise, 2 for usage errors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrelay.h"

/* Print why the last kvrelay call on this thread failed (the status's message and, where
 * kvrelay knows more, the detail: which value was refused, which driver call failed). */
static void print_last_error(const char *where, const char *call) {
  char msg[512];
  size_t need = 0;
  if (kvrelay_last_error_message(msg, sizeof msg, &need) != KVRELAY_OK) msg[0] = '\0';
  fprintf(stderr, "%s: %s: %s\n", where, call, msg);
}

#define CHECK(call)                             \
  do {                                          \
    kvrelay_status s_ = (call);                 \
    if (s_ != KVRELAY_OK) {                     \
      print_last_error(__FILE__, #call);        \
      exit(1);                                  \
    }                                           \
  } while (0)

static unsigned char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 4096, n = 0;
  unsigned char *buf = (unsigned char *)malloc(cap);
  size_t got;
  while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
    n += got;
    if (n == cap) {
      unsigned char *bigger = (unsigned char *)realloc(buf, cap *= 2);
      if (!bigger) {
        free(buf);
        buf = NULL;
      }
      buf = bigger;
    }
  }
  fclose(f);
  *len = n;
  return buf;
}

static void print_outcome(const char *edge, const kvrelay_outcome *o) {
  if (o->kind == KVRELAY_OUTCOME_ADMITTED) {
    printf("%s edge: admitted\n", edge);
  } else if (o->kind == KVRELAY_OUTCOME_ABSENT) {
    printf("%s edge: absent\n", edge);
  } else {
    printf("%s edge: ignored (%s)%s%s\n", edge, kvrelay_reason_name(o->reason), o->detail[0] ? ": " : "", o->detail);
  }
}

static kvrelay_admission *edge(bool trusted) {
  kvrelay_admission_config *cfg = NULL;
  kvrelay_admission *adm = NULL;
  CHECK(kvrelay_admission_config_new(&cfg));
  CHECK(kvrelay_admission_config_set_trusted(cfg, trusted));
  CHECK(kvrelay_admission_new(cfg, &adm));
  kvrelay_admission_config_free(cfg);
  return adm;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: admit HINT.json\n");
    return 2;
  }
  size_t len = 0;
  unsigned char *json = read_file(argv[1], &len);
  if (!json) {
    fprintf(stderr, "admit: cannot read %s\n", argv[1]);
    return 2;
  }
  printf("kvrelay %s (header %d.%d.%d)\n", kvrelay_version(), KVRELAY_VERSION_MAJOR, KVRELAY_VERSION_MINOR,
         KVRELAY_VERSION_PATCH);

  kvrelay_admission *untrusted = edge(false);
  kvrelay_admission *trusted = edge(true);
  kvrelay_outcome o;
  o.size = sizeof o;
  kvrelay_snapshot *snap = NULL;
  int failures = 0;

  CHECK(kvrelay_admit(untrusted, json, len, &o, &snap));
  print_outcome("untrusted", &o);
  if (o.kind != KVRELAY_OUTCOME_IGNORED || o.reason != KVRELAY_REASON_UNTRUSTED || snap != NULL) failures++;

  CHECK(kvrelay_admit(trusted, json, len, &o, &snap));
  print_outcome("trusted", &o);
  if (snap) {
    kvrelay_str s;
    kvrelay_bytes b;
    size_t n = 0;
    CHECK(kvrelay_snapshot_protocol_version(snap, &s));
    printf("  protocol_version: %.*s\n", (int)s.len, s.ptr);
    CHECK(kvrelay_snapshot_message_id(snap, &s));
    printf("  message_id: %.*s\n", (int)s.len, s.ptr);
    CHECK(kvrelay_snapshot_canonical(snap, &b));
    printf("  canonical (%zu bytes): %.*s\n", b.len, (int)b.len, (const char *)b.ptr);
    CHECK(kvrelay_snapshot_action_count(snap, &n));
    for (size_t i = 0; i < n; i++) {
      kvrelay_action a;
      a.size = sizeof a;
      CHECK(kvrelay_snapshot_action(snap, i, &a));
      printf("  action %zu: id=%.*s type=%.*s version=%.*s payload=%.*s\n", a.index, (int)a.id.len, a.id.ptr,
             (int)a.action_type.len, a.action_type.ptr, (int)a.version.len, a.version.ptr, (int)a.payload.len,
             (const char *)a.payload.ptr);
    }
    kvrelay_snapshot_release(snap);
  }

  size_t need = 0;
  kvrelay_status st = kvrelay_admission_prometheus(trusted, NULL, 0, &need);
  if (st != KVRELAY_ERR_BUFFER_TOO_SMALL && st != KVRELAY_OK) failures++;
  char *text = (char *)malloc(need);
  CHECK(kvrelay_admission_prometheus(trusted, text, need, &need));
  printf("\n%s", text);
  free(text);

  kvrelay_admission_free(trusted);
  kvrelay_admission_free(untrusted);
  free(json);
  if (failures) fprintf(stderr, "admit: %d unexpected results\n", failures);
  return failures ? 1 : 0;
}
