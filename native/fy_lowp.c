/* See fy_lowp.h. Code c of the signed codec has t_signed(c) <= |r| < t_signed(c + 1)
 * (below code 1: -inf; above 127: +inf), of the unsigned codec t_unsigned likewise. */
#include "fy_lowp.h"

#include <float.h>
#include <math.h>

/* The thresholds, as lowp.py computes them: in double, rounded to float once. */
static inline float t_signed(int k) {  /* code k's lower threshold, k in 1..127 */
    double x = ((double)k - 0.5) / 127.0;
    return (float)(x * x);
}

static inline float t_unsigned(int k) {  /* code k's lower threshold, k in 1..255 */
    double y = ((double)k + 0.5) / 256.0;
    double y2 = y * y;
    return (float)(y2 * y2);
}

/* [-inf, thresholds..., +inf]: code c has T[c] <= value < T[c + 1]. Filled once (the
 * values are the same whoever fills them, so a race is harmless). */
static float TS[129], TU[257];
static volatile int tables_ready;

static void fill_tables(void) {
    TS[0] = TU[0] = -INFINITY;
    for (int k = 1; k <= 127; k++) TS[k] = t_signed(k);
    for (int k = 1; k <= 255; k++) TU[k] = t_unsigned(k);
    TS[128] = TU[256] = INFINITY;
    tables_ready = 1;
}

/* A code from a guess at most one off (the guess comes from a correctly rounded square
 * root; the thresholds are halfway between codes): one step each way, branch-free. */
static inline int code_of(float r, int g, int last, const float *t) {
    g = g < 0 ? 0 : (g > last ? last : g);
    return g + (r >= t[g + 1]) - (r < t[g]);
}

#define MAXBLOCK 4096

/* The block's largest |x| (abs) or x; NaN if any element is NaN. */
static inline float block_max(const float *x, size_t n, int absolute) {
    float s = 0.0f;
    int nan = 0;
    for (size_t i = 0; i < n; i++) {
        float v = absolute ? fabsf(x[i]) : x[i];
        nan |= isnan(v);
        s = v > s ? v : s;
    }
    return nan ? NAN : s;
}

void fy_encode_signed(const float *restrict x, int8_t *restrict codes, float *restrict scales, size_t n, size_t block) {
    if (!tables_ready) fill_tables();
    for (size_t b = 0, lo = 0; lo < n; b++, lo += block) {
        size_t k = n - lo < block ? n - lo : block;
        float s = block_max(x + lo, k, 1);
        float d = s < FLT_MIN ? FLT_MIN : s;
        scales[b] = s;
        float a[MAXBLOCK];
        int g[MAXBLOCK];
        for (size_t i = 0; i < k; i++) {  /* (vectorizes: divide, root, guess) */
            a[i] = fabsf(x[lo + i] / d);
            float q = sqrtf(a[i]) * 127.0f + 0.5f;
            g[i] = q < 200.0f ? (int)q : 0;  /* (NaN: 0) */
        }
        for (size_t i = 0; i < k; i++) {
            int c = code_of(a[i], g[i], 127, TS);
            codes[lo + i] = (int8_t)(x[lo + i] < 0.0f ? -c : c);
        }
    }
}

void fy_decode_signed(const int8_t *restrict codes, const float *restrict scales, float *restrict out, size_t n, size_t block) {
    for (size_t b = 0, lo = 0; lo < n; b++, lo += block) {
        size_t k = n - lo < block ? n - lo : block;
        float s = scales[b];
        for (size_t i = 0; i < k; i++) {
            float y = (float)codes[lo + i] / 127.0f;
            out[lo + i] = (y * fabsf(y)) * s;
        }
    }
}

void fy_encode_unsigned(const float *restrict x, uint8_t *restrict codes, float *restrict scales, size_t n, size_t block) {
    if (!tables_ready) fill_tables();
    for (size_t b = 0, lo = 0; lo < n; b++, lo += block) {
        size_t k = n - lo < block ? n - lo : block;
        float s = block_max(x + lo, k, 0) + 0.0f;  /* (-0 -> +0, as lowp.py) */
        float d = s < FLT_MIN ? FLT_MIN : s;
        scales[b] = s;
        float a[MAXBLOCK];
        int g[MAXBLOCK];
        for (size_t i = 0; i < k; i++) {
            a[i] = x[lo + i] / d;
            float q = sqrtf(sqrtf(a[i] > 0.0f ? a[i] : 0.0f)) * 256.0f + 0.5f;
            g[i] = q < 300.0f ? (int)q - 1 : 0;
        }
        for (size_t i = 0; i < k; i++)
            codes[lo + i] = (uint8_t)code_of(a[i], g[i], 255, TU);
    }
}

void fy_decode_unsigned(const uint8_t *restrict codes, const float *restrict scales, float *restrict out, size_t n, size_t block) {
    for (size_t b = 0, lo = 0; lo < n; b++, lo += block) {
        size_t k = n - lo < block ? n - lo : block;
        float s = scales[b];
        for (size_t i = 0; i < k; i++) {
            float y = ((float)codes[lo + i] + 1.0f) / 256.0f;
            float y2 = y * y;
            out[lo + i] = (y2 * y2) * s;
        }
    }
}
