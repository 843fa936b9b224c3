/* A minimal check harness shared by the C ABI tests: EXPECT counts, and prints what failed. */
#ifndef KVRELAY_TESTS_EXPECT_H
#define KVRELAY_TESTS_EXPECT_H
#include <stdio.h>

static int passed, failed;

#define EXPECT(cond)                                                      \
  do {                                                                    \
    if (cond) {                                                           \
      passed++;                                                           \
    } else {                                                              \
      failed++;                                                           \
      fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
    }                                                                     \
  } while (0)

#endif
