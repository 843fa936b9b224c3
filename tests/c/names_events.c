/* Block naming and KV events from C: the names and the block content digests equal an
 * independent implementation's (the golden values of src/names.rs), a chain continued block by
 * block equals the whole, the size query and the sized struct's rules hold, and a KV events
 * publisher starts on loopback, counts what it publishes and stops. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "expect.h"
#include "kvrelay.h"

#define NAME_SEED 0x6b7672656c617931ull /* kvrelay's base seed, as the golden values used */

static void test_names(void) {
  uint32_t toks[69];
  for (uint32_t i = 0; i < 69; i++) toks[i] = i + 1;
  kvrelay_naming n;
  memset(&n, 0, sizeof n);
  n.size = sizeof n;
  n.seed = NAME_SEED;
  n.block_tokens = 32;
  uint64_t names[4] = {0, 0, 0, 0};
  size_t got = 99;
  /* size query: 69 tokens are two full blocks of 32 */
  EXPECT(kvrelay_block_names(&n, 0, 0, toks, 69, NULL, 0, &got) == KVRELAY_ERR_BUFFER_TOO_SMALL && got == 2);
  EXPECT(kvrelay_block_names(&n, 0, 0, toks, 69, names, 1, &got) == KVRELAY_ERR_BUFFER_TOO_SMALL && names[0] == 0);
  EXPECT(kvrelay_block_names(&n, 0, 0, toks, 69, names, 4, &got) == KVRELAY_OK && got == 2);
  EXPECT(names[0] == 0xc2f3e1bd5c718de7ull && names[1] == 0x6fafdd40f9a822b3ull);
  /* a salt changes block 0 and so every later name */
  const char *salt = "tenant";
  n.salt = (const uint8_t *)salt;
  n.salt_len = strlen(salt);
  EXPECT(kvrelay_block_names(&n, 0, 0, toks, 69, names, 4, &got) == KVRELAY_OK && got == 2);
  EXPECT(names[0] == 0x4fbf583dc3398fa1ull && names[1] == 0xadde4186a4e5c742ull);
  /* continued from the first block's name: the second block's name */
  uint64_t second = 0;
  EXPECT(kvrelay_block_names(&n, names[0], 1, toks + 32, 37, &second, 1, &got) == KVRELAY_OK && got == 1);
  EXPECT(second == names[1]);
  n.salt = NULL;
  n.salt_len = 0;
  n.block_tokens = 16;
  n.lora_id = 7;
  EXPECT(kvrelay_block_names(&n, 0, 0, toks, 69, names, 4, &got) == KVRELAY_OK && got == 4);
  EXPECT(names[0] == 0xdf905853c945ade6ull && names[3] == 0xf6a11b17e3d86c41ull);
  uint64_t seed = 0;
  EXPECT(kvrelay_name_seed((const uint8_t *)"llama-identity", 14, &seed) == KVRELAY_OK && seed == 0xe3b18970a1cc684full);
  /* refusals: no tokens per block, a struct of no version, NULLs */
  n.block_tokens = 0;
  EXPECT(kvrelay_block_names(&n, 0, 0, toks, 69, names, 4, &got) == KVRELAY_ERR_INVALID_ARGUMENT);
  n.block_tokens = 16;
  n.size = 8;
  EXPECT(kvrelay_block_names(&n, 0, 0, toks, 69, names, 4, &got) == KVRELAY_ERR_INVALID_ARGUMENT);
  n.size = sizeof n;
  EXPECT(kvrelay_block_names(NULL, 0, 0, toks, 69, names, 4, &got) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_block_names(&n, 0, 0, NULL, 3, names, 4, &got) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_block_names(&n, 0, 0, toks, 69, names, 4, NULL) == KVRELAY_ERR_NULL);
  /* no full block: nothing to write, NULL output is fine */
  EXPECT(kvrelay_block_names(&n, 0, 0, toks, 15, NULL, 0, &got) == KVRELAY_OK && got == 0);
}

static void test_digests(void) {
  uint32_t toks[69];
  for (uint32_t i = 0; i < 69; i++) toks[i] = i + 1;
  kvrelay_naming n;
  memset(&n, 0, sizeof n);
  n.size = sizeof n;
  n.seed = NAME_SEED;
  n.block_tokens = 32;
  const char *id = "llama-identity";
  const uint8_t *idp = (const uint8_t *)id;
  const size_t id_len = strlen(id);
  /* the first digest of tokens 1..=69 under "llama-identity", blocks of 32, no LoRA, no salt
   * (Python's hashlib, the formula of src/names.rs) */
  static const uint8_t golden[KVRELAY_BLOCK_DIGEST_BYTES] = {
      0x03, 0xbc, 0x20, 0x92, 0xf8, 0x85, 0x74, 0x09, 0x69, 0x43, 0xd2, 0x6f, 0x28, 0xc6, 0x93, 0x85,
      0x6a, 0xb0, 0xe8, 0x7e, 0x48, 0x13, 0xa8, 0x6d, 0x81, 0xe0, 0xd2, 0x57, 0xba, 0x50, 0x26, 0xab};
  uint8_t digests[4 * KVRELAY_BLOCK_DIGEST_BYTES];
  memset(digests, 0, sizeof digests);
  size_t got = 99;
  EXPECT(KVRELAY_BLOCK_DIGEST_BYTES == 32);
  /* size query: two full blocks; a buffer of one digest is too small and left alone */
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 0, toks, 69, NULL, 0, &got) == KVRELAY_ERR_BUFFER_TOO_SMALL && got == 2);
  got = 99;
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 0, toks, 69, digests, 1, &got) == KVRELAY_ERR_BUFFER_TOO_SMALL && got == 2);
  static const uint8_t zeros[KVRELAY_BLOCK_DIGEST_BYTES];
  EXPECT(memcmp(digests, zeros, sizeof zeros) == 0);
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 0, toks, 69, digests, 4, &got) == KVRELAY_OK && got == 2);
  EXPECT(memcmp(digests, golden, sizeof golden) == 0);
  EXPECT(memcmp(digests, digests + KVRELAY_BLOCK_DIGEST_BYTES, KVRELAY_BLOCK_DIGEST_BYTES) != 0);
  /* continued from the first block's digest: the second block's digest */
  uint8_t second[KVRELAY_BLOCK_DIGEST_BYTES];
  EXPECT(kvrelay_block_digests(&n, idp, id_len, digests, 1, toks + 32, 37, second, 1, &got) == KVRELAY_OK && got == 1);
  EXPECT(memcmp(second, digests + KVRELAY_BLOCK_DIGEST_BYTES, sizeof second) == 0);
  /* the parent may lie in the output buffer (it is read first) */
  uint8_t chain[2 * KVRELAY_BLOCK_DIGEST_BYTES];
  memcpy(chain, digests, KVRELAY_BLOCK_DIGEST_BYTES);
  EXPECT(kvrelay_block_digests(&n, idp, id_len, chain, 1, toks + 32, 32, chain, 1, &got) == KVRELAY_OK && got == 1);
  EXPECT(memcmp(chain, second, sizeof second) == 0);
  /* a parent is required past block 0, ignored at block 0 */
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 1, toks + 32, 37, second, 1, &got) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_block_digests(&n, idp, id_len, second, 0, toks, 32, chain, 1, &got) == KVRELAY_OK && got == 1);
  EXPECT(memcmp(chain, golden, sizeof golden) == 0);
  /* another identity, another digest; (NULL, 0) is the empty identity */
  EXPECT(kvrelay_block_digests(&n, idp, id_len - 1, NULL, 0, toks, 32, chain, 1, &got) == KVRELAY_OK);
  EXPECT(memcmp(chain, golden, sizeof golden) != 0);
  uint8_t empty[KVRELAY_BLOCK_DIGEST_BYTES];
  EXPECT(kvrelay_block_digests(&n, NULL, 0, NULL, 0, toks, 32, empty, 1, &got) == KVRELAY_OK && got == 1);
  EXPECT(kvrelay_block_digests(&n, (const uint8_t *)"", 0, NULL, 0, toks, 32, chain, 1, &got) == KVRELAY_OK);
  EXPECT(memcmp(chain, empty, sizeof empty) == 0);
  EXPECT(kvrelay_block_digests(&n, NULL, 3, NULL, 0, toks, 32, chain, 1, &got) == KVRELAY_ERR_INVALID_ARGUMENT);
  /* refusals: no tokens per block, a struct of no version, NULLs */
  n.block_tokens = 0;
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 0, toks, 69, digests, 4, &got) == KVRELAY_ERR_INVALID_ARGUMENT);
  n.block_tokens = 32;
  n.size = 8;
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 0, toks, 69, digests, 4, &got) == KVRELAY_ERR_INVALID_ARGUMENT);
  n.size = sizeof n;
  EXPECT(kvrelay_block_digests(NULL, idp, id_len, NULL, 0, toks, 69, digests, 4, &got) == KVRELAY_ERR_NULL);
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 0, NULL, 3, digests, 4, &got) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 0, toks, 69, NULL, 4, &got) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 0, toks, 69, digests, 4, NULL) == KVRELAY_ERR_NULL);
  /* no full block: nothing to write, NULL output is fine */
  EXPECT(kvrelay_block_digests(&n, idp, id_len, NULL, 0, toks, 31, NULL, 0, &got) == KVRELAY_OK && got == 0);
}

static void test_events(void) {
  const char *at = "tcp://127.0.0.1:0";
  kvrelay_kv_events_config *c = NULL;
  EXPECT(kvrelay_kv_events_config_new(at, strlen(at), 0, &c) == KVRELAY_ERR_INVALID_CONFIG && c == NULL);
  EXPECT(kvrelay_kv_events_config_new(at, strlen(at), 4, &c) == KVRELAY_OK && c != NULL);
  EXPECT(kvrelay_kv_events_config_set(c, KVRELAY_KV_EVENTS_MEDIUM, "DISK", 4) == KVRELAY_ERR_INVALID_CONFIG);
  EXPECT(kvrelay_kv_events_config_set(c, KVRELAY_KV_EVENTS_MEDIUM, "GPU", 3) == KVRELAY_OK);
  EXPECT(kvrelay_kv_events_config_set(c, KVRELAY_KV_EVENTS_ALLOW_PEER, "not an address", 14) == KVRELAY_ERR_INVALID_CONFIG);
  EXPECT(kvrelay_kv_events_config_set(c, 99, "x", 1) == KVRELAY_ERR_INVALID_CONFIG);
  /* a key file: one that cannot be read, one too short to be a key, one that is */
  EXPECT(kvrelay_kv_events_config_set(c, KVRELAY_KV_EVENTS_KEY_FILE, "/nonexistent/kvrelay-key", 24) == KVRELAY_ERR_IO);
  char key_path[] = "/tmp/kvrelay-events-key-XXXXXX";
  int fd = mkstemp(key_path);
  EXPECT(fd >= 0);
  EXPECT(write(fd, "short\n", 6) == 6);
  EXPECT(kvrelay_kv_events_config_set(c, KVRELAY_KV_EVENTS_KEY_FILE, key_path, strlen(key_path)) == KVRELAY_ERR_INVALID_CONFIG);
  EXPECT(write(fd, "-but-now-long-enough\n", 21) == 21);
  /* a key others may read proves nothing: refused until it is its owner's alone */
  EXPECT(fchmod(fd, 0644) == 0);
  EXPECT(kvrelay_kv_events_config_set(c, KVRELAY_KV_EVENTS_KEY_FILE, key_path, strlen(key_path)) == KVRELAY_ERR_INVALID_CONFIG);
  EXPECT(fchmod(fd, 0600) == 0);
  EXPECT(kvrelay_kv_events_config_set(c, KVRELAY_KV_EVENTS_KEY_FILE, key_path, strlen(key_path)) == KVRELAY_OK);
  close(fd);
  unlink(key_path);
  kvrelay_kv_events *ev = NULL;
  EXPECT(kvrelay_kv_events_start(c, &ev) == KVRELAY_OK && ev != NULL);
  kvrelay_kv_events_config_free(c);
  if (ev == NULL) return;
  char buf[64];
  size_t len = 0;
  EXPECT(kvrelay_kv_events_endpoint(ev, false, buf, sizeof buf, &len) == KVRELAY_OK);
  EXPECT(len > 16 && strncmp(buf, "tcp://127.0.0.1:", 16) == 0 && !(len == 17 && buf[16] == '0'));
  uint32_t toks[4] = {1, 2, 3, 4};
  EXPECT(kvrelay_kv_events_stored(ev, 11, false, 0, toks, 4) == KVRELAY_OK);
  EXPECT(kvrelay_kv_events_stored(ev, 12, true, 11, toks, 4) == KVRELAY_OK);
  EXPECT(kvrelay_kv_events_removed(ev, 11) == KVRELAY_OK);
  EXPECT(kvrelay_kv_events_stored(NULL, 11, false, 0, toks, 4) == KVRELAY_ERR_NULL);
  /* wait for the publishing thread's counter: the first AllBlocksCleared and the three above */
  kvrelay_kv_events_stats s;
  memset(&s, 0, sizeof s);
  for (int i = 0; i < 20000 && s.published < 4; i++) {
    EXPECT(kvrelay_kv_events_read_stats(ev, &s, sizeof s) == KVRELAY_OK);
    struct timespec t = {0, 1000000};
    nanosleep(&t, NULL);
  }
  EXPECT(s.published == 4 && s.dropped == 0);
  EXPECT(kvrelay_kv_events_read_stats(ev, &s, 3) == KVRELAY_ERR_INVALID_ARGUMENT);
  EXPECT(kvrelay_kv_events_prometheus(ev, "llamacpp", 8, NULL, 0, &len) == KVRELAY_ERR_BUFFER_TOO_SMALL && len > 0);
  EXPECT(kvrelay_kv_events_prometheus(ev, "bad prefix", 10, NULL, 0, &len) == KVRELAY_ERR_INVALID_ARGUMENT);
  kvrelay_kv_events_free(ev);
  kvrelay_kv_events_free(NULL);
}

int main(void) {
  test_names();
  test_digests();
  test_events();
  printf("names_events: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
