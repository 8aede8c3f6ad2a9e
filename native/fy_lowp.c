/* See fy_lowp.h. Code c of the signed codec has t_signed(c) <= |r| < t_signed(c + 1)
 * (below code 1: -inf; above 127: +inf), of the unsigned codec t_unsigned likewise.
 *
 * r = x / max(s, FLT_MIN) is in [-1, 1] or NaN (|x| <= s, and a correctly rounded
 * division is monotonic). Two ways to the same code, both exact:
 *
 * AVX2 (where the CPU has it): a guess g >= 1, then one exact comparison: the code is
 *   g - 1 if not r >= t(g) (also for NaN), else g.
 *   Unsigned: g = floor(256 y), y = vrsqrtps(vrsqrtps(max(r, 2^-30))). Each vrsqrtps is
 *   within a relative 1.5 * 2^-12 (the architectural bound, Intel and AMD alike), y
 *   within 5.5e-4 of r^(1/4), 256 y within 0.141 of 256 r^(1/4) = w + 1/2, where w's
 *   integer points are the thresholds (up to their fp32 rounding, ~1e-5 codes): so
 *   floor(w + 0.359) <= g <= floor(w + 0.641), and the code, floor(w), is g or g - 1.
 *   t(g) = ((g + 1/2)^2)^2 * 2^-32 in fp32 is one rounding of an exact product, as
 *   lowp.py's is of its exact double value. Below 2^-30 (under t(1); also NaN and r < 0)
 *   r is guessed as 2^-30: g = 1 (256 * 2^-7.5 = 1.41), and code 0. g <= 256: t(256) > 1.
 *   Signed: g = floor(127 sqrt(a) + 3/4), sqrt(a) from a * vrsqrtps(a), a = max(|r|, 2^-17)
 *   (error at most 0.047 codes, the same argument with w = 127 sqrt|r| + 1/2; below t(1),
 *   g = 1), t(g) = (g - 1/2)^2 / 16129, one correctly rounded division of exact numbers.
 *   Both formulas give the tables' thresholds for every code (checked when the tables are
 *   built: if not, the AVX2 code is not used). The sign comes last, from r's.
 *
 * Portable: a table. For r >= 0 the order of floats is the order of their bit patterns,
 *   and the top 15 bits of a pattern (sign, exponent, 6 bits of mantissa) name a "bin" of
 *   floats 1/64 to 1/128 of an octave wide. Neighbouring thresholds are at least 1.57%
 *   apart (t(k+1) / t(k) >= (256.5 / 255.5)^4 = 1.0157 unsigned, (126.5 / 125.5)^2 =
 *   1.0159 signed), more than a bin's width (at most 1/64), so a bin holds at most one
 *   threshold (checked when the tables are built; else a binary search). An entry per
 *   bin holds the count of thresholds below the bin and the low 17 bits of the one in
 *   it (or 2^17: none), and the code is base + (low 17 bits of r >= the threshold's).
 *   Everything past the bin of 1.0 (NaN, and negative r of the unsigned codec, by its
 *   pattern) and below the first threshold's bin shares the last entry (code 0).
 *
 * A NaN's code is 0 (its block's scale is NaN and the step is refused). */
#include "fy_lowp.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* The AVX2 path: x86 with GCC >= 4.9 or clang (the target attribute with intrinsics).
 * -DFY_LOWP_PORTABLE builds without it; fy_lowp_simd(0) turns it off at run time. */
#if !defined(FY_LOWP_PORTABLE) && (defined(__x86_64__) || defined(__i386__)) && \
    (defined(__clang__) || (defined(__GNUC__) && (__GNUC__ > 4 || (__GNUC__ == 4 && __GNUC_MINOR__ >= 9))))
#define FY_AVX2 1
#include <immintrin.h>
#define FY_TARGET_AVX2 __attribute__((target("avx2")))
#else
#define FY_AVX2 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define FY_INLINE static inline __attribute__((always_inline))
#else
#define FY_INLINE static inline
#endif

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

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* One codec's tables: T = [-inf, thresholds..., +inf] (code c has T[c] <= r < T[c + 1]),
 * and the bins of the comment above: r's is (bits >> 17) - j0 if in [0, nb), else nb
 * (code 0). */
#define BIN_SHIFT 17
#define LOW_MASK 0x1FFFF
#define NONE (1 << BIN_SHIFT)  /* "no threshold in this bin": above every low part */
#define BASE_SHIFT 18
#define MAXBINS 2048

struct codec {
    int last;                /* the largest code: 127 or 255 */
    float t[257];            /* T[0..last + 1] */
    int32_t j0, nb;
    int binned;              /* the bin tables were built (the thresholds allow them) */
    int32_t bin[MAXBINS];    /* base << BASE_SHIFT | the low bits of its threshold (or NONE) */
};

static struct codec CS, CU;

static int build_bins(struct codec *c) {
    int last = c->last;
    uint32_t first = bits_of(c->t[1]);
    c->j0 = (int32_t)(first >> BIN_SHIFT) - 1;  /* entry 0: a bin below every threshold */
    c->nb = (int32_t)(bits_of(1.0f) >> BIN_SHIFT) - c->j0 + 1;
    if (c->j0 < 0 || c->nb + 1 > MAXBINS || !(c->t[last] <= 1.0f)) return 0;
    int k = 1;  /* the first threshold not below the bin */
    for (int32_t i = 0; i < c->nb; i++) {
        uint32_t start = (uint32_t)(c->j0 + i) << BIN_SHIFT, end = start + NONE;
        while (k <= last && bits_of(c->t[k]) < start) k++;
        int32_t low = NONE;
        if (k <= last && bits_of(c->t[k]) < end) {
            low = (int32_t)(bits_of(c->t[k]) - start);
            if (k + 1 <= last && bits_of(c->t[k + 1]) < end) return 0;  /* two in one bin */
        }
        c->bin[i] = (int32_t)(k - 1) << BASE_SHIFT | low;
    }
    c->bin[c->nb] = NONE;  /* past 1.0: NaN (or a negative unsigned r), code 0 */
    for (int j = 1; j <= last; j++)  /* increasing, positive */
        if (!(c->t[j] > c->t[j - 1]) || !(c->t[j] > 0.0f)) return 0;
    return 1;
}

#if FY_AVX2
static volatile int use_avx2;
static int avx2_exact;  /* the AVX2 code's thresholds are the tables' (see the top) */

static int thresholds_computable(void) {
    for (int k = 1; k <= 127; k++) {
        float h = (float)k - 0.5f;
        if (bits_of((h * h) / 16129.0f) != bits_of(CS.t[k])) return 0;
    }
    for (int k = 1; k <= 255; k++) {
        float q = (float)k + 0.5f;
        q = q * q;
        if (bits_of((q * q) * 0x1p-32f) != bits_of(CU.t[k])) return 0;
    }
    return 1;
}
#endif

static void fill_tables(void) {
    CS.last = 127;
    CU.last = 255;
    CS.t[0] = CU.t[0] = -INFINITY;
    for (int k = 1; k <= 127; k++) CS.t[k] = t_signed(k);
    for (int k = 1; k <= 255; k++) CU.t[k] = t_unsigned(k);
    CS.t[128] = CU.t[256] = INFINITY;
    CS.binned = build_bins(&CS);
    CU.binned = build_bins(&CU);
#if FY_AVX2
    avx2_exact = thresholds_computable();
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && avx2_exact;
#endif
}

/* The tables are filled when the library is loaded (before any call can be made). */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((constructor)) static void fy_lowp_init(void) { fill_tables(); }
#define ENSURE_TABLES() ((void)0)
#else
static volatile int tables_ready;
#define ENSURE_TABLES() (tables_ready ? (void)0 : (fill_tables(), (void)(tables_ready = 1)))
#endif

int fy_lowp_simd(int enable) {
    ENSURE_TABLES();
#if FY_AVX2
    if (enable >= 0) {
        __builtin_cpu_init();
        use_avx2 = enable && __builtin_cpu_supports("avx2") && avx2_exact;
    }
    return use_avx2;
#else
    (void)enable;
    return 0;
#endif
}

/* The code of a non-negative r (or NaN: 0) from its bit pattern: a, of the unsigned
 * codec any pattern (negative: code 0). */
FY_INLINE int code_of_bits(uint32_t a, const int32_t *bin, int32_t j0, int32_t nb) {
    uint32_t j = (a >> BIN_SHIFT) - (uint32_t)j0;  /* (below bin 0: wraps, to the last) */
    j = j > (uint32_t)nb ? (uint32_t)nb : j;
    int32_t e = bin[j];
    return (e >> BASE_SHIFT) + ((int32_t)(a & LOW_MASK) >= (e & (2 * NONE - 1)));
}

/* The same by counting (only where the bins could not be built): binary search. */
static int code_by_search(float r, const struct codec *c) {
    if (!(r >= c->t[1])) return 0;  /* (NaN: 0) */
    int lo = 1, hi = c->last;  /* t[lo] <= r; find the largest such */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (r >= c->t[mid]) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Codes of x[0..k) / d into codes (int8 with x's sign, or uint8). */
FY_INLINE void codes_portable(const float *restrict x, uint8_t *restrict codes, size_t k, float d, int sgn) {
    const struct codec *c = sgn ? &CS : &CU;
    if (!c->binned) {
        for (size_t i = 0; i < k; i++) {
            float r = x[i] / d;
            int v = code_by_search(sgn ? fabsf(r) : r, c);
            codes[i] = (uint8_t)(sgn && r < 0.0f ? -v : v);
        }
        return;
    }
    const int32_t *bin = c->bin, j0 = c->j0, nb = c->nb;
    for (size_t lo = 0; lo < k; lo += 64) {  /* (divisions first: they vectorize) */
        size_t m = k - lo < 64 ? k - lo : 64;
        float r[64];
        for (size_t i = 0; i < m; i++) r[i] = x[lo + i] / d;
        for (size_t i = 0; i < m; i++) {
            uint32_t u = bits_of(r[i]);
            if (sgn) {
                int32_t neg = -(int32_t)(u >> 31);  /* r < 0 (or -0, -NaN: code 0): -1 */
                int32_t v = code_of_bits(u & 0x7FFFFFFFu, bin, j0, nb);
                codes[lo + i] = (uint8_t)((v ^ neg) - neg);
            } else {
                codes[lo + i] = (uint8_t)code_of_bits(u, bin, j0, nb);
            }
        }
    }
}

/* The block's largest |x| (abs) or x, at least +0.0; NaN if any element is NaN. */
FY_INLINE float block_max(const float *x, size_t n, int absolute) {
    float s = 0.0f;
    int nan = 0;
    for (size_t i = 0; i < n; i++) {
        float v = absolute ? fabsf(x[i]) : x[i];
        nan |= isnan(v);
        s = v > s ? v : s;
    }
    return nan ? NAN : s;
}

/* -- portable ----------------------------------------------------------------------- */
static void encode_signed_portable(const float *restrict x, int8_t *restrict codes, float *restrict scales,
                                   size_t n, size_t block) {
    for (size_t b = 0, lo = 0; lo < n; b++, lo += block) {
        size_t k = n - lo < block ? n - lo : block;
        float s = block_max(x + lo, k, 1);
        float d = s < FLT_MIN ? FLT_MIN : s;
        scales[b] = s;
        codes_portable(x + lo, (uint8_t *)codes + lo, k, d, 1);
    }
}

static void encode_unsigned_portable(const float *restrict x, uint8_t *restrict codes, float *restrict scales,
                                     size_t n, size_t block) {
    for (size_t b = 0, lo = 0; lo < n; b++, lo += block) {
        size_t k = n - lo < block ? n - lo : block;
        float s = block_max(x + lo, k, 0) + 0.0f;  /* (-0 -> +0, as lowp.py) */
        float d = s < FLT_MIN ? FLT_MIN : s;
        scales[b] = s;
        codes_portable(x + lo, codes + lo, k, d, 0);
    }
}

/* The decodes: plain loops the compiler vectorizes (also for AVX2, below). */
FY_INLINE void decode_signed_body(const int8_t *restrict codes, const float *restrict scales,
                                  float *restrict out, size_t n, size_t block) {
    for (size_t b = 0, lo = 0; lo < n; b++, lo += block) {
        size_t k = n - lo < block ? n - lo : block;
        float s = scales[b];
        for (size_t i = 0; i < k; i++) {
            float y = (float)codes[lo + i] / 127.0f;
            out[lo + i] = (y * fabsf(y)) * s;
        }
    }
}

FY_INLINE void decode_unsigned_body(const uint8_t *restrict codes, const float *restrict scales,
                                    float *restrict out, size_t n, size_t block) {
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

/* -- AVX2 ------------------------------------------------------------------------------ */
#if FY_AVX2
/* The largest |x| (absolute) or x of a block, at least +0.0; NaN if any is NaN. The
 * result is that of block_max: a maximum of values >= +0 in any order (a NaN never
 * replaces the running maximum, it only sets the flag). */
FY_TARGET_AVX2 FY_INLINE float block_max_avx2(const float *x, size_t n, int absolute) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, nan = s0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        if (absolute) {
            v0 = _mm256_and_ps(v0, absmask);
            v1 = _mm256_and_ps(v1, absmask);
        }
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
        s0 = _mm256_max_ps(v0, s0);  /* v0 > s0 ? v0 : s0 (NaN: s0) */
        s1 = _mm256_max_ps(v1, s1);
    }
    s0 = _mm256_max_ps(s0, s1);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float s = _mm_cvtss_f32(h);
    int isnan_ = _mm256_movemask_ps(nan) != 0;
    for (; i < n; i++) {
        float v = absolute ? fabsf(x[i]) : x[i];
        isnan_ |= isnan(v);
        s = v > s ? v : s;
    }
    return isnan_ ? NAN : s;
}

/* Eight codes (int32) of r = x / d (the block's d broadcast), as the comment at the top
 * says: a guess g >= 1 from vrsqrtps, then the code is g or g - 1 by one exact
 * comparison with the threshold t(g), computed exactly; "not >=", so a NaN is code 0. */
FY_TARGET_AVX2 FY_INLINE __m256i codes8_avx2(const float *x, __m256 d, int sgn) {
    __m256 r = _mm256_div_ps(_mm256_loadu_ps(x), d);
    if (sgn) {
        __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), r);  /* |r| */
        __m256 ac = _mm256_max_ps(a, _mm256_set1_ps(0x1p-17f));  /* (NaN: 2^-17) */
        __m256 u = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(ac, _mm256_rsqrt_ps(ac)), _mm256_set1_ps(127.0f)),
                                 _mm256_set1_ps(0.75f));  /* 127 sqrt|r| + 1/2 + 1/4 */
        __m256 gf = _mm256_floor_ps(u);
        __m256 h = _mm256_sub_ps(gf, _mm256_set1_ps(0.5f));
        __m256 t = _mm256_div_ps(_mm256_mul_ps(h, h), _mm256_set1_ps(16129.0f));  /* t(g) */
        __m256i c = _mm256_add_epi32(_mm256_cvttps_epi32(gf), _mm256_castps_si256(_mm256_cmp_ps(a, t, _CMP_NGE_UQ)));
        return _mm256_sign_epi32(c, _mm256_castps_si256(r));  /* r's sign (c is 0 for +-0, NaN) */
    }
    __m256 rc = _mm256_max_ps(r, _mm256_set1_ps(0x1p-30f));  /* (NaN, r < 0: 2^-30) */
    __m256 gf = _mm256_floor_ps(_mm256_mul_ps(_mm256_rsqrt_ps(_mm256_rsqrt_ps(rc)), _mm256_set1_ps(256.0f)));
    __m256 q = _mm256_add_ps(gf, _mm256_set1_ps(0.5f));
    q = _mm256_mul_ps(q, q);
    __m256 t = _mm256_mul_ps(_mm256_mul_ps(q, q), _mm256_set1_ps(0x1p-32f));  /* t(g) */
    return _mm256_add_epi32(_mm256_cvttps_epi32(gf), _mm256_castps_si256(_mm256_cmp_ps(r, t, _CMP_NGE_UQ)));
}

FY_TARGET_AVX2 FY_INLINE void encode_avx2(const float *restrict x, uint8_t *restrict codes, float *restrict scales,
                                          size_t n, size_t block, int sgn) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (size_t b = 0, lo = 0; lo < n; b++, lo += block) {
        size_t k = n - lo < block ? n - lo : block;
        const float *xb = x + lo;
        uint8_t *cb = codes + lo;
        float s = block_max_avx2(xb, k, sgn);
        if (!sgn) s += 0.0f;  /* (-0 -> +0, as lowp.py) */
        float d = s < FLT_MIN ? FLT_MIN : s;
        scales[b] = s;
        __m256 vd = _mm256_set1_ps(d);
        size_t i = 0;
        for (; i + 32 <= k; i += 32) {  /* 32 codes: packed with saturation (signed or unsigned) */
            __m256i c0 = codes8_avx2(xb + i, vd, sgn), c1 = codes8_avx2(xb + i + 8, vd, sgn);
            __m256i c2 = codes8_avx2(xb + i + 16, vd, sgn), c3 = codes8_avx2(xb + i + 24, vd, sgn);
            __m256i p01 = _mm256_packs_epi32(c0, c1), p23 = _mm256_packs_epi32(c2, c3);
            __m256i p = sgn ? _mm256_packs_epi16(p01, p23) : _mm256_packus_epi16(p01, p23);
            _mm256_storeu_si256((__m256i *)(cb + i), _mm256_permutevar8x32_epi32(p, order));
        }
        for (; i + 8 <= k; i += 8) {
            __m256i c = codes8_avx2(xb + i, vd, sgn);
            __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
            p = sgn ? _mm_packs_epi16(p, p) : _mm_packus_epi16(p, p);
            _mm_storel_epi64((__m128i *)(cb + i), p);
        }
        codes_portable(xb + i, cb + i, k - i, d, sgn);  /* (the same codes) */
    }
}

FY_TARGET_AVX2 static void encode_signed_avx2(const float *restrict x, int8_t *restrict codes,
                                              float *restrict scales, size_t n, size_t block) {
    encode_avx2(x, (uint8_t *)codes, scales, n, block, 1);
}

FY_TARGET_AVX2 static void encode_unsigned_avx2(const float *restrict x, uint8_t *restrict codes,
                                                float *restrict scales, size_t n, size_t block) {
    encode_avx2(x, codes, scales, n, block, 0);
}

FY_TARGET_AVX2 static void decode_signed_avx2(const int8_t *restrict codes, const float *restrict scales,
                                              float *restrict out, size_t n, size_t block) {
    decode_signed_body(codes, scales, out, n, block);
}

FY_TARGET_AVX2 static void decode_unsigned_avx2(const uint8_t *restrict codes, const float *restrict scales,
                                                float *restrict out, size_t n, size_t block) {
    decode_unsigned_body(codes, scales, out, n, block);
}
#endif

/* -- the entry points ---------------------------------------------------------------- */
void fy_encode_signed(const float *restrict x, int8_t *restrict codes, float *restrict scales, size_t n, size_t block) {
    ENSURE_TABLES();
#if FY_AVX2
    if (use_avx2) {
        encode_signed_avx2(x, codes, scales, n, block);
        return;
    }
#endif
    encode_signed_portable(x, codes, scales, n, block);
}

void fy_encode_unsigned(const float *restrict x, uint8_t *restrict codes, float *restrict scales, size_t n, size_t block) {
    ENSURE_TABLES();
#if FY_AVX2
    if (use_avx2) {
        encode_unsigned_avx2(x, codes, scales, n, block);
        return;
    }
#endif
    encode_unsigned_portable(x, codes, scales, n, block);
}

void fy_decode_signed(const int8_t *restrict codes, const float *restrict scales, float *restrict out, size_t n, size_t block) {
#if FY_AVX2
    if (use_avx2) {
        decode_signed_avx2(codes, scales, out, n, block);
        return;
    }
#endif
    decode_signed_body(codes, scales, out, n, block);
}

void fy_decode_unsigned(const uint8_t *restrict codes, const float *restrict scales, float *restrict out, size_t n, size_t block) {
#if FY_AVX2
    if (use_avx2) {
        decode_unsigned_avx2(codes, scales, out, n, block);
        return;
    }
#endif
    decode_unsigned_body(codes, scales, out, n, block);
}
