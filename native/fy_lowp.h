/* fy_lowp: the block-wise int8 codec of fuyoud's reduced-precision AdamW state
 * (fuyoud/optimizer/lowp.py defines the arithmetic; this is its fast path).
 *
 * Every value is computed with single IEEE float operations in the order lowp.py
 * states (no fused multiply-add: build with -ffp-contract=off), and a code is the
 * number of thresholds at or below the value, found by exact comparisons with
 * thresholds computed as lowp.py computes them: the results are the same bits as
 * lowp.py's torch path on any CPU. */
#ifndef FY_LOWP_H
#define FY_LOWP_H
#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
void fy_encode_signed(const float *restrict x, int8_t *restrict codes, float *restrict scales, size_t n, size_t block);
void fy_decode_signed(const int8_t *restrict codes, const float *restrict scales, float *restrict out, size_t n, size_t block);
void fy_encode_unsigned(const float *restrict x, uint8_t *restrict codes, float *restrict scales, size_t n, size_t block);
void fy_decode_unsigned(const uint8_t *restrict codes, const float *restrict scales, float *restrict out, size_t n, size_t block);
/* Whether the AVX2 code runs (where built and the CPU has it): the same bits as the
 * portable code. enable 0 turns it off, 1 on where possible, -1 only asks (for tests). */
int fy_lowp_simd(int enable);
/* cdef-end */
#endif
