/* api_smoke.c — the C API from plain C99: one tiny float32 attention on host buffers (variant
 * EXACT, the CPU reference) whose every output row must be a convex combination of V's rows, and
 * one bad argument that must come back as an error with a message. Compiled as C, linked against
 * the shared libsage. Prints "1 passed, 0 failed" or "0 passed, 1 failed". Any architecture. */
#include <stdio.h>
#include <string.h>

#include "sage/sage.h"

#define B 1
#define HQ 2
#define HKV 1
#define NQ 5
#define NK 7
#define D 16

static float q[B * HQ * NQ * D], k[B * HKV * NK * D], v[B * HKV * NK * D];
static float o[B * HQ * NQ * D], o_before[B * HQ * NQ * D];

static int failures = 0;

static void check(int ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "FAILED: %s (last error: \"%s\")\n", what, sage_last_error());
    ++failures;
  }
}

/* A small deterministic generator: values in [-2, 2). */
static float next_value(unsigned* state) {
  *state = *state * 1664525u + 1013904223u;
  return (float)(*state >> 8) / (float)(1u << 24) * 4.0f - 2.0f;
}

static int is_finite(float x) {
  return x == x && x - x == 0.0f;
}

static void fill_args(sage_attention_args* args) {
  args->q = q;
  args->k = k;
  args->v = v;
  args->o = o;
  args->batch = B;
  args->heads_q = HQ;
  args->heads_kv = HKV;
  args->seq_q = NQ;
  args->seq_kv = NK;
  args->head_dim = D;
  args->layout = SAGE_LAYOUT_HND;
  args->dtype = SAGE_DTYPE_FP32;
  args->variant = SAGE_VARIANT_EXACT;
  args->backend = SAGE_BACKEND_CPU;
}

int main(void) {
  sage_attention_args args;
  sage_status status;
  unsigned state = 12345u;
  int i, b, h, n, j, d, outside = 0;

  for (i = 0; i < B * HQ * NQ * D; ++i) q[i] = next_value(&state);
  for (i = 0; i < B * HKV * NK * D; ++i) k[i] = next_value(&state);
  for (i = 0; i < B * HKV * NK * D; ++i) v[i] = next_value(&state);
  for (i = 0; i < B * HQ * NQ * D; ++i) o[i] = -1.0e30f; /* poison */

  check(sage_attention_args_init(&args) == SAGE_OK, "sage_attention_args_init");
  fill_args(&args);
  status = sage_attention(&args);
  check(status == SAGE_OK, "sage_attention on a valid problem returns SAGE_OK");
  check(strcmp(sage_last_error(), "") == 0, "the last error is empty after success");

  /* Softmax weights are positive and sum to 1: each output element lies within the min and max
   * of its V column (GQA: query head h reads kv head h / (HQ / HKV)). */
  for (b = 0; b < B; ++b)
    for (h = 0; h < HQ; ++h)
      for (n = 0; n < NQ; ++n)
        for (d = 0; d < D; ++d) {
          const float* vc = v + ((b * HKV + h / (HQ / HKV)) * NK) * D + d;
          const float x = o[((b * HQ + h) * NQ + n) * D + d];
          float lo = vc[0], hi = vc[0], tol;
          for (j = 1; j < NK; ++j) {
            if (vc[j * D] < lo) lo = vc[j * D];
            if (vc[j * D] > hi) hi = vc[j * D];
          }
          tol = 1e-5f * (1.0f + (hi > -lo ? hi : -lo));
          if (!is_finite(x) || x < lo - tol || x > hi + tol) {
            if (outside == 0)
              fprintf(stderr, "o[b=%d h=%d n=%d d=%d] = %g is outside V's column range [%g, %g]\n",
                      b, h, n, d, (double)x, (double)lo, (double)hi);
            ++outside;
          }
        }
  check(outside == 0, "output rows are convex combinations of V rows");

  /* A bad argument: heads_q = 2 is not a multiple of heads_kv = 3. o must stay as it is. */
  memcpy(o_before, o, sizeof(o));
  args.heads_kv = 3;
  status = sage_attention(&args);
  check(status == SAGE_ERROR_INVALID_ARGUMENT, "heads_kv = 3 gives SAGE_ERROR_INVALID_ARGUMENT");
  check(strstr(sage_last_error(), "heads_kv") != NULL, "the message names heads_kv");
  check(memcmp(o_before, o, sizeof(o)) == 0, "a rejected call leaves o untouched");
  check(sage_status_string(status) != NULL && sage_status_string(status)[0] != '\0',
        "sage_status_string describes the status");

  if (failures == 0) {
    printf("1 passed, 0 failed\n");
    return 0;
  }
  printf("0 passed, 1 failed\n");
  return 1;
}
