/* GGUF block encoders, fused: encode_gguf(type_name, src, dtype, cols, out, row0, row1)
 *   -> (xx, xe, ee, max_abs_err, finite)
 *
 * Each encoder is gguf-py's numpy quantizer (gguf/quants.py of gguf 0.19, `quantize_blocks`,
 * itself a port of ggml-quants.c's quantize_row_*_ref) redone on blocks of 32 values: the
 * bytes are `gguf.quants.quantize(values.astype(float32), type)`'s. In the same pass each block
 * is decoded as `gguf.quants.dequantize` decodes it and the error sums of
 * qtool.error_measures.ErrorStats are taken in float64.
 *
 * gguf-py works on float32 arrays, and numpy 2 keeps every step in float32 (a Python scalar
 * is weak under NEP 50, and np.where(d == 0, 0, 1 / d) stays float32 too), so each step below
 * is one float32 operation, rounded, in gguf-py's order. With id = 1 / d, or 0 where d == 0,
 * and d, m stored as float16 (numpy's astype: nearest even, subnormals kept, overflow to inf),
 * the decoded x^ taken from the stored halves:
 *
 *   Q8_0  d = max|x| / 127          q = round_away(x * id)                        x^ = q * d
 *   Q4_0  d = xm / -8               q = min(15, u8(trunc(x * id + 8.5)))          x^ = d * (q - 8)
 *   Q5_0  d = xm / -16              q = min(31, u8(trunc(x * id + 16.5)))         x^ = d * (q - 16)
 *   Q4_1  d = (max - min) / 15      q = min(15, u8(trunc((x - min) * id + 0.5)))  x^ = d * q + min
 *   Q5_1  d = (max - min) / 31      q = min(31, u8(trunc((x - min) * id + 0.5)))  x^ = d * q + min
 *
 * xm is the first value of largest |x| (numpy's argmax), so xm is signed and an all-zero
 * block stores d = -0. round_away is gguf-py's np_roundf, half away from zero. Where gguf-py's
 * bytes are not a function of the values alone we pick:
 *
 * - u8() and Q8_0's int8 are numpy's float -> integer casts on x86: truncation through int32,
 *   NaN, +-inf and |v| >= 2^31 giving INT32_MIN, then the low byte. Non-finite codes happen
 *   only where 1 / d overflows (d under 2^-128: a block whose largest |x| is under ~2^-121);
 *   gguf-py on x86 then stores code 0 there, an ARM numpy (which saturates) may not.
 * - Q4_1/Q5_1's min or max is a zero with both +0 and -0 in the block: numpy's SIMD reduction
 *   order picks the sign, which differs between machines. We take the first, as ggml's C
 *   reference does. Only the sign bit of a zero d or m can differ; the decoded values cannot.
 */
#include "qtool_native.h"

#include <stdlib.h>

#define QT_INLINE static inline __attribute__((always_inline))
#define LANES 8 /* independent float64 partial sums */

/* |v| < 2^31 (not NaN nor inf) as a mask. Integer compares keep the block loops branch-free:
 * under the default -ftrapping-math GCC will not if-convert a float compare feeding a select,
 * and leaves the loop scalar. */
QT_INLINE uint32_t int32_range(float v) { return (qt_bits(v) & 0x7FFFFFFFu) < 0x4F000000u ? 0xFFFFFFFFu : 0u; }

/* numpy's float32 -> int cast on x86 (cvttss2si): truncation, INT32_MIN for NaN and out of range */
QT_INLINE int32_t x86_int32(float v) {
    const uint32_t ok = int32_range(v);
    const int32_t i = (int32_t)qt_float(qt_bits(v) & ok);
    return ok ? i : INT32_MIN;
}

/* .astype(np.uint8).clip(0, top) of np.trunc(v): the cast truncates anyway, its low byte is
 * the uint8, so only the top needs a clip */
QT_INLINE uint8_t code_u8(float v, uint8_t top) {
    const uint8_t u = (uint8_t)(uint32_t)x86_int32(v);
    return u > top ? top : u;
}

/* x86_int32(np_roundf(v)): gguf-py's round half away from zero, floor(a) + floor(2 * (a -
 * floor(a))) with a = |v|, signed. a - floor(a) is exact and so is doubling it, so the second
 * floor is (a - floor(a) >= 0.5), compared as bits (both >= 0). |v| >= 2^31, inf and NaN
 * (np_roundf makes NaN of inf) cast to INT32_MIN. */
QT_INLINE int32_t round_away_int(float v) {
    const uint32_t ok = int32_range(v);
    const float a = qt_float(qt_bits(v) & 0x7FFFFFFFu & ok);
    const int32_t f = (int32_t)a;
    const uint32_t b = (uint32_t)f + (qt_bits(a - (float)f) >= 0x3F000000u);
    const uint32_t negative = (uint32_t)((int32_t)qt_bits(v) >> 31);
    return (int32_t)((((b ^ negative) - negative) & ok) | (0x80000000u & ~ok));
}

/* max |x| as float bits (x finite: the integer order is |x|'s order), a vectorizable reduction */
QT_INLINE uint32_t abs_max_bits(const float *x) {
    uint32_t m = 0;
    for (int j = 0; j < 32; j++) {
        const uint32_t a = qt_bits(x[j]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* the first value of largest |x|: abs(blocks).argmax() then take_along_axis */
QT_INLINE float first_abs_max(const float *x) {
    const uint32_t m = abs_max_bits(x);
    if (m == 0) return 0.0f; /* ggml starts from +0 and keeps it for an all-zero block; gguf-py keeps a -0 */
    int at = 31;
    for (int j = 0; j < 32; j++) {
        const int candidate = (qt_bits(x[j]) & 0x7FFFFFFFu) == m ? j : 31;
        at = candidate < at ? candidate : at;
    }
    return x[at];
}

/* a float's bits as an int32 that orders as the float does, -0 just below +0 (self-inverse) */
QT_INLINE int32_t order_key(uint32_t bits) { return (int32_t)(bits ^ ((uint32_t)((int32_t)bits >> 31) & 0x7FFFFFFFu)); }

/* min and max, the first of equal values kept, as ggml's loop keeps it: only +0 and -0 tell the
 * difference, so the integer reductions run free and a zero result is the block's first zero */
QT_INLINE void first_min_max(const float *x, float *lo, float *hi) {
    int32_t kmin = INT32_MAX, kmax = INT32_MIN;
    for (int j = 0; j < 32; j++) {
        const int32_t k = order_key(qt_bits(x[j]));
        kmin = k < kmin ? k : kmin;
        kmax = k > kmax ? k : kmax;
    }
    float mn = qt_float((uint32_t)order_key((uint32_t)kmin)), mx = qt_float((uint32_t)order_key((uint32_t)kmax));
    if (mn == 0.0f || mx == 0.0f) {
        int j = 0;
        while (x[j] != 0.0f) j++; /* a zero is there: min <= 0 <= max */
        mn = mn == 0.0f ? x[j] : mn;
        mx = mx == 0.0f ? x[j] : mx;
    }
    *lo = mn, *hi = mx;
}

/* 16 bytes: code j in the low nibble, code j + 16 in the high one (its fifth bit dropped), as
 * eight-byte words: a shifted word carries each byte's top nibble into the next byte's bottom,
 * which the mask clears */
QT_INLINE void pack_nibbles(const uint8_t *q, uint8_t *y) {
    for (int w = 0; w < 2; w++) {
        uint64_t lo, hi;
        memcpy(&lo, q + 8 * w, 8);
        memcpy(&hi, q + 16 + 8 * w, 8);
        const uint64_t packed = (lo & 0x0F0F0F0F0F0F0F0Full) | ((hi << 4) & 0xF0F0F0F0F0F0F0F0ull);
        memcpy(y + 8 * w, &packed, 8);
    }
}

/* the 5-bit codes' fifth bits, code j at bit j of a little-endian u32, then their low nibbles */
QT_INLINE void pack5(const uint8_t *q, uint8_t *y) {
    uint32_t qh = 0;
    for (int j = 0; j < 32; j++) qh |= (uint32_t)(q[j] >> 4) << j;
    memcpy(y, &qh, 4);
    pack_nibbles(q, y + 4);
}

/* -- scales, CHUNK blocks at a time ------------------------------------------------------------ */

/* Blocks whose scales are worked out together, in one loop apart from the codes: the
 * divisions and float16 conversions of many blocks then overlap, instead of each heading its
 * block's chain of dependent steps (1.3 ns -> 1.0 ns a value, Q4_0, one core). */
enum { CHUNK = 64 };

typedef struct {
    float id[CHUNK]; /* 1 / d, or 0 where d == 0 */
    float d[CHUNK];  /* d as stored: its float16, widened */
    uint16_t d_half[CHUNK];
    float m[CHUNK]; /* Q4_1/Q5_1: min as stored */
    uint16_t m_half[CHUNK];
} Scales;

/* d = top / divisor for n blocks, its inverse (the zero test and its selects on bits) and its
 * float16, kept and widened */
QT_INLINE void chunk_scales(const float *top, float divisor, int n, Scales *s) {
    for (int k = 0; k < n; k++) {
        const float d = top[k] / divisor;
        const uint32_t zero = (qt_bits(d) & 0x7FFFFFFFu) == 0 ? 0xFFFFFFFFu : 0u;
        const float inverse = 1.0f / qt_float(qt_bits(d) | (zero & 0x3F800000u)); /* 1 / +-1 where d is 0 */
        s->id[k] = qt_float(qt_bits(inverse) & ~zero);
        s->d_half[k] = qt_f32_to_f16_hw(d);
        s->d[k] = qt_f16_to_f32_hw(s->d_half[k]);
    }
}

QT_INLINE void chunk_mins(const float *mn, int n, Scales *s) {
    for (int k = 0; k < n; k++) {
        s->m_half[k] = qt_f32_to_f16_hw(mn[k]);
        s->m[k] = qt_f16_to_f32_hw(s->m_half[k]);
    }
}

/* -- one block's codes into y (past its halves), its decoded values into r ---------------------- */

/* Q8_0: [d f16][32 x i8] */
QT_INLINE void q8_0_codes(const float *restrict x, float id, float d, uint8_t *restrict y, float *restrict r) {
    int8_t q[32];
    for (int j = 0; j < 32; j++) q[j] = (int8_t)(uint8_t)(uint32_t)round_away_int(x[j] * id);
    memcpy(y, q, 32);
    for (int j = 0; j < 32; j++) r[j] = (float)q[j] * d;
}

/* Q4_0: [d f16][16 B: value j low nibble, j + 16 high] */
QT_INLINE void q4_0_codes(const float *restrict x, float id, float d, uint8_t *restrict y, float *restrict r) {
    uint8_t q[32];
    for (int j = 0; j < 32; j++) q[j] = code_u8(x[j] * id + 8.5f, 15);
    pack_nibbles(q, y);
    for (int j = 0; j < 32; j++) r[j] = d * (float)((int)q[j] - 8);
}

/* Q5_0: [d f16][qh u32][16 B low nibbles] */
QT_INLINE void q5_0_codes(const float *restrict x, float id, float d, uint8_t *restrict y, float *restrict r) {
    uint8_t q[32];
    for (int j = 0; j < 32; j++) q[j] = code_u8(x[j] * id + 16.5f, 31);
    pack5(q, y);
    for (int j = 0; j < 32; j++) r[j] = d * (float)((int)q[j] - 16);
}

/* Q4_1: [d f16][m f16][16 B as Q4_0] */
QT_INLINE void q4_1_codes(const float *restrict x, float mn, float id, float d, float m, uint8_t *restrict y, float *restrict r) {
    uint8_t q[32];
    for (int j = 0; j < 32; j++) q[j] = code_u8((x[j] - mn) * id + 0.5f, 15);
    pack_nibbles(q, y);
    for (int j = 0; j < 32; j++) r[j] = d * (float)q[j] + m;
}

/* Q5_1: [d f16][m f16][qh u32][16 B low nibbles] */
QT_INLINE void q5_1_codes(const float *restrict x, float mn, float id, float d, float m, uint8_t *restrict y, float *restrict r) {
    uint8_t q[32];
    for (int j = 0; j < 32; j++) q[j] = code_u8((x[j] - mn) * id + 0.5f, 31);
    pack5(q, y);
    for (int j = 0; j < 32; j++) r[j] = d * (float)q[j] + m;
}

/* -- rows: blocks' bytes into out, decoded values into rec --------------------------------------- */

QT_INLINE float abs_max(const float *x) { return qt_float(abs_max_bits(x)); }

/* Q8_0, Q4_0, Q5_0: d = TOP(block) / DIVISOR */
#define QT_SYMMETRIC_ROW(NAME, TS, TOP, DIVISOR)                                                  \
    static QT_HOT_WIDE void NAME##_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) { \
        Scales s;                                                                                 \
        float top[CHUNK];                                                                         \
        for (Py_ssize_t b0 = 0; b0 < blocks; b0 += CHUNK) {                                       \
            const int n = blocks - b0 < CHUNK ? (int)(blocks - b0) : CHUNK;                       \
            for (int k = 0; k < n; k++) top[k] = TOP(x + 32 * (b0 + k));                          \
            chunk_scales(top, DIVISOR, n, &s);                                                    \
            for (int k = 0; k < n; k++) {                                                         \
                uint8_t *y = out + (TS) * (b0 + k);                                               \
                memcpy(y, &s.d_half[k], 2);                                                       \
                NAME##_codes(x + 32 * (b0 + k), s.id[k], s.d[k], y + 2, rec + 32 * (b0 + k));     \
            }                                                                                     \
        }                                                                                         \
    }

/* Q4_1, Q5_1: d = (max - min) / DIVISOR, min stored beside it */
#define QT_AFFINE_ROW(NAME, TS, DIVISOR)                                                          \
    static QT_HOT_WIDE void NAME##_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) { \
        Scales s;                                                                                 \
        float range[CHUNK], mn[CHUNK];                                                            \
        for (Py_ssize_t b0 = 0; b0 < blocks; b0 += CHUNK) {                                       \
            const int n = blocks - b0 < CHUNK ? (int)(blocks - b0) : CHUNK;                       \
            for (int k = 0; k < n; k++) {                                                         \
                float mx;                                                                         \
                first_min_max(x + 32 * (b0 + k), &mn[k], &mx);                                    \
                range[k] = mx - mn[k];                                                            \
            }                                                                                     \
            chunk_scales(range, DIVISOR, n, &s);                                                  \
            chunk_mins(mn, n, &s);                                                                \
            for (int k = 0; k < n; k++) {                                                         \
                uint8_t *y = out + (TS) * (b0 + k);                                               \
                memcpy(y, &s.d_half[k], 2);                                                       \
                memcpy(y + 2, &s.m_half[k], 2);                                                   \
                NAME##_codes(x + 32 * (b0 + k), mn[k], s.id[k], s.d[k], s.m[k], y + 4, rec + 32 * (b0 + k)); \
            }                                                                                     \
        }                                                                                         \
    }

QT_SYMMETRIC_ROW(q8_0, 34, abs_max, 127.0f)
QT_SYMMETRIC_ROW(q4_0, 18, first_abs_max, -8.0f)
QT_SYMMETRIC_ROW(q5_0, 22, first_abs_max, -16.0f)
QT_AFFINE_ROW(q4_1, 20, 15.0f)
QT_AFFINE_ROW(q5_1, 24, 31.0f)

/* Q8_0 by AVX-512 intrinsics, where the CPU has them: a requantize to Q8_0 is mostly this
 * row, and GCC leaves the one above at ~5 instructions a value (its scales one block at a
 * time, its codes in 256-bit halves). The same bytes and decoded values, op for op:
 *   - the scales of 16 blocks at once: d = top / 127 (vdivps), id = 1 / d or 0, d's float16
 *     by vcvtps2ph and back (qt_f32_to_f16_hw: the portable bits for the finite d of a finite
 *     row, the only rows a row encoder is given);
 *   - round_away_int(v): t = trunc(v), then t + sign(v) where |v - t| >= 0.5 (v - t is exact);
 *     vcvttps2dq gives INT32_MIN for NaN, inf and |t| >= 2^31 as the x86 cast does, and
 *     vpmovdb keeps the low byte as the (int8_t)(uint8_t)(uint32_t) cast does;
 *   - x^ = (float)q * d from the stored int8 code.
 * tests/test_native_gguf_encode.py checks the bytes and sums against gguf-py on both paths. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#define QT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c")))
#define QT_HAVE_AVX512_ROWS 1

static QT_AVX512 void q8_0_row_avx512(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) {
    const __m512i abs_bits = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512 abs_mask = _mm512_castsi512_ps(abs_bits), sign_mask = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    for (Py_ssize_t b0 = 0; b0 < blocks; b0 += 16) {
        const int n = blocks - b0 < 16 ? (int)(blocks - b0) : 16;
        uint32_t top[16] = {0};
        for (int k = 0; k < n; k++) {
            const float *p = x + 32 * (b0 + k);
            const __m512i a = _mm512_and_si512(_mm512_loadu_si512(p), abs_bits), b = _mm512_and_si512(_mm512_loadu_si512(p + 16), abs_bits);
            top[k] = _mm512_reduce_max_epu32(_mm512_max_epu32(a, b));
        }
        const __m512 d = _mm512_div_ps(_mm512_castsi512_ps(_mm512_loadu_si512(top)), _mm512_set1_ps(127.0f));
        const __mmask16 zero = _mm512_testn_epi32_mask(_mm512_castps_si512(d), abs_bits);
        const __m512 id = _mm512_maskz_div_ps((__mmask16)~zero, one, d);
        const __m256i d_half = _mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        float ids[16], ds[16];
        uint16_t halves[16];
        _mm512_storeu_ps(ids, id);
        _mm512_storeu_ps(ds, _mm512_cvtph_ps(d_half));
        _mm256_storeu_si256((__m256i *)halves, d_half);
        for (int k = 0; k < n; k++) {
            const float *p = x + 32 * (b0 + k);
            uint8_t *y = out + 34 * (b0 + k);
            float *r = rec + 32 * (b0 + k);
            memcpy(y, &halves[k], 2);
            const __m512 vid = _mm512_set1_ps(ids[k]), vd = _mm512_set1_ps(ds[k]);
            for (int h = 0; h < 32; h += 16) {
                const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(p + h), vid);
                __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                const __mmask16 up = _mm512_cmp_ps_mask(_mm512_and_ps(_mm512_sub_ps(v, t), abs_mask), half, _CMP_GE_OQ);
                t = _mm512_mask_add_ps(t, up, t, _mm512_or_ps(_mm512_and_ps(v, sign_mask), one));
                const __m128i q = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(t));
                _mm_storeu_si128((__m128i *)(y + 2 + h), q);
                _mm512_storeu_ps(r + h, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), vd));
            }
        }
    }
}
#endif

/* -1 unknown, 0 portable, 1 AVX-512 (tests switch it: gguf_set_avx512) */
static int qt_rows_avx512 = -1;

static int rows_avx512(void) {
#ifdef QT_HAVE_AVX512_ROWS
    if (qt_rows_avx512 < 0)
        qt_rows_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
    return qt_rows_avx512;
#else
    return 0;
#endif
}

static void q8_0_row_any(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) {
#ifdef QT_HAVE_AVX512_ROWS
    if (rows_avx512()) {
        q8_0_row_avx512(x, blocks, out, rec);
        return;
    }
#endif
    q8_0_row(x, blocks, out, rec);
}

/* `exact_nonfinite`: the row encoder gives the reference's bytes for rows holding inf or NaN too
 * (the K-quants, which gguf-py cannot encode at all), so such rows are encoded, not refused.
 * `weighted`: the K-quant and IQ rows, which take importance weights (or NULL); `imatrix`: 1
 * where an importance matrix changes the bytes (all but Q8_0, which llama.cpp quantizes without),
 * 2 where the type cannot be made without one (llama.cpp asserts it has quant_weights) */
static const struct {
    const char *name;
    Py_ssize_t block_size, type_size; /* values and bytes per block */
    qt_encode_row row;
    qt_encode_row_w weighted;
    int exact_nonfinite, imatrix;
} qt_encoders[] = {
    {"Q8_0", 32, 34, q8_0_row_any, NULL, 0, 0},          {"Q4_0", 32, 18, q4_0_row, NULL, 0, 1},
    {"Q4_1", 32, 20, q4_1_row, NULL, 0, 1},          {"Q5_0", 32, 22, q5_0_row, NULL, 0, 1},
    {"Q5_1", 32, 24, q5_1_row, NULL, 0, 1},          {"Q2_K", 256, 84, NULL, qt_q2_k_row, 1, 1},
    {"Q3_K", 256, 110, NULL, qt_q3_k_row, 1, 1},     {"Q4_K", 256, 144, NULL, qt_q4_k_row, 1, 1},
    {"Q5_K", 256, 176, NULL, qt_q5_k_row, 1, 1},     {"Q6_K", 256, 210, NULL, qt_q6_k_row, 1, 1},
    {"IQ4_NL", 32, 18, NULL, qt_iq4_nl_row, 1, 1},   {"IQ4_XS", 256, 136, NULL, qt_iq4_xs_row, 1, 1},
    {"IQ3_S", 256, 110, NULL, qt_iq3_s_row, 1, 1}, /* rows with inf/NaN: ours (llama.cpp aborts on them) */
    {"IQ3_XXS", 256, 98, NULL, qt_iq3_xxs_row, 1, 1},
    {"IQ2_XXS", 256, 66, NULL, qt_iq2_xxs_row, 1, 2}, /* 2: importance weights required */
    {"IQ2_XS", 256, 74, NULL, qt_iq2_xs_row, 1, 2},
    {"IQ2_S", 256, 82, NULL, qt_iq2_s_row, 1, 1}, /* llama.cpp's has a path without weights (llama-quantize refuses it) */
};
#define QT_ENCODERS ((int)(sizeof qt_encoders / sizeof qt_encoders[0]))

typedef struct {
    double xx, xe, ee;
    uint64_t max_err_bits; /* |x - x^| as float64 bits: the integer order is the float order, NaN above inf */
} Sums;

static QT_HOT_WIDE int row_is_finite(const float *x, Py_ssize_t n) {
    uint32_t m = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        const uint32_t u = qt_bits(x[j]) & 0x7FFFFFFFu;
        m = u > m ? u : m;
    }
    return m < 0x7F800000u;
}

/* x.x, x.e, e.e and max |e| with e = x - x^, each term in float64 as numpy's float64 would */
static QT_HOT_WIDE void add_errors(const float *x, const float *rec, Py_ssize_t n, Sums *sums) {
    double xx[LANES] = {0}, xe[LANES] = {0}, ee[LANES] = {0};
    uint64_t me[LANES] = {0};
    for (Py_ssize_t j = 0; j < n; j += LANES) /* n is a multiple of 32 */
        for (int k = 0; k < LANES; k++) {
            const double xv = (double)x[j + k], e = xv - (double)rec[j + k];
            uint64_t eb;
            memcpy(&eb, &e, 8);
            eb &= 0x7FFFFFFFFFFFFFFFull;
            xx[k] += xv * xv;
            xe[k] += xv * e;
            ee[k] += e * e;
            me[k] = eb > me[k] ? eb : me[k];
        }
    for (int k = 0; k < LANES; k++) {
        sums->xx += xx[k];
        sums->xe += xe[k];
        sums->ee += ee[k];
        sums->max_err_bits = me[k] > sums->max_err_bits ? me[k] : sums->max_err_bits;
    }
}

#ifdef QT_HAVE_AVX512_ROWS
/* add_errors with one zmm a sum: lane k takes values j + k (j = 0, 8, ..) as LANES does, each
 * step a separate multiply and add, and the lanes added in the same order: the same sums */
static QT_AVX512 void add_errors_avx512(const float *x, const float *rec, Py_ssize_t n, Sums *sums) {
    __m512d xx = _mm512_setzero_pd(), xe = _mm512_setzero_pd(), ee = _mm512_setzero_pd();
    __m512i me = _mm512_setzero_si512();
    const __m512i abs_bits = _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFll);
    for (Py_ssize_t j = 0; j < n; j += LANES) {
        const __m512d xv = _mm512_cvtps_pd(_mm256_loadu_ps(x + j)), e = _mm512_sub_pd(xv, _mm512_cvtps_pd(_mm256_loadu_ps(rec + j)));
        xx = _mm512_add_pd(xx, _mm512_mul_pd(xv, xv));
        xe = _mm512_add_pd(xe, _mm512_mul_pd(xv, e));
        ee = _mm512_add_pd(ee, _mm512_mul_pd(e, e));
        me = _mm512_max_epu64(me, _mm512_and_si512(_mm512_castpd_si512(e), abs_bits));
    }
    double lx[LANES], le[LANES], lee[LANES];
    uint64_t lm[LANES];
    _mm512_storeu_pd(lx, xx), _mm512_storeu_pd(le, xe), _mm512_storeu_pd(lee, ee), _mm512_storeu_si512(lm, me);
    for (int k = 0; k < LANES; k++) {
        sums->xx += lx[k];
        sums->xe += le[k];
        sums->ee += lee[k];
        sums->max_err_bits = lm[k] > sums->max_err_bits ? lm[k] : sums->max_err_bits;
    }
}
#endif

static void add_errors_any(const float *x, const float *rec, Py_ssize_t n, Sums *sums) {
#ifdef QT_HAVE_AVX512_ROWS
    if (rows_avx512()) {
        add_errors_avx512(x, rec, n, sums);
        return;
    }
#endif
    add_errors(x, rec, n, sums);
}

/* gguf_set_avx512(on): tests only; False keeps the legacy rows and error sums on the portable code */
PyObject *qt_py_gguf_set_avx512(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    qt_rows_avx512 = -1;
    if (on) rows_avx512();
    else qt_rows_avx512 = 0;
    return PyBool_FromLong(rows_avx512());
}

/* Where an encoder's rows come from: `dt` values (F32, F16, BF16) widened, or, with `decode` set,
 * the blocks of another GGUF type decoded (gguf.c's decoders, float32 as decode_gguf makes
 * them), `sbs` values and `sts` bytes a block: a requantize without the float32 copy of the
 * whole weight in memory, the same values row by row. */
typedef struct {
    int dt;
    qt_gguf_run decode;
    Py_ssize_t sbs, sts;
} RowSource;

static PyObject *encode_rows(const char *type_name, const RowSource *from, Py_buffer *src, Py_ssize_t cols, Py_buffer *out, Py_ssize_t row0,
                             Py_ssize_t row1, PyObject *importance) {
    PyObject *result = NULL;
    Py_buffer qw_buffer = {0};
    float *qw = NULL;
    int found = -1;
    for (int i = 0; i < QT_ENCODERS; i++)
        if (strcmp(type_name, qt_encoders[i].name) == 0) found = i;
    if (found < 0) {
        PyErr_Format(PyExc_ValueError, "no native encoder for GGUF %s", type_name);
        goto done;
    }
    const Py_ssize_t bs = qt_encoders[found].block_size;
    if (cols < 0 || cols % bs || row0 < 0 || row1 < row0 || (from->decode && cols % from->sbs)) {
        PyErr_Format(PyExc_ValueError, "encode_gguf: bad layout: cols %zd (a multiple of %zd), rows [%zd, %zd)", cols, from->decode && cols % from->sbs ? from->sbs : bs,
                     row0, row1);
        goto done;
    }
    /* bytes of one source row */
    const Py_ssize_t ts = qt_encoders[found].type_size, row_bytes = from->decode ? qt_mul(cols / from->sbs, from->sts) : qt_mul(cols, qt_itemsize(from->dt)),
                     blocks = cols / bs;
    if (!qt_check_size(src, qt_mul(row1, row_bytes), "encode_gguf src") || !qt_check_size(out, qt_mul(qt_mul(row1, blocks), ts), "encode_gguf out"))
        goto done;
    if (qt_encoders[found].imatrix == 2 && importance == Py_None) {
        PyErr_Format(PyExc_ValueError, "encode_gguf: %s needs importance weights (llama.cpp quantizes it only with an imatrix)", type_name);
        goto done;
    }
    if ((qt_encoders[found].weighted == qt_iq3_s_row && !qt_iq3_s_ready()) || (qt_encoders[found].weighted == qt_iq3_xxs_row && !qt_iq3_xxs_ready()) ||
        (qt_encoders[found].weighted == qt_iq2_xxs_row && !qt_iq2_xxs_ready()) || (qt_encoders[found].weighted == qt_iq2_xs_row && !qt_iq2_xs_ready()) ||
        (qt_encoders[found].weighted == qt_iq2_s_row && !qt_iq2_s_ready())) {
        PyErr_NoMemory();
        goto done;
    }
    if (importance != Py_None && qt_encoders[found].imatrix) {
        /* one float32 weight per column, the same for every row; copied, so aligned */
        if (PyObject_GetBuffer(importance, &qw_buffer, PyBUF_SIMPLE) < 0) goto done;
        if (!qt_check_size(&qw_buffer, qt_mul(cols, 4), "encode_gguf importance")) goto done;
        qw = malloc((size_t)(cols > 0 ? cols : 1) * sizeof(float));
        if (!qw) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(qw, qw_buffer.buf, (size_t)cols * sizeof(float));
    }
    Sums sums = {0, 0, 0, 0};
    int finite = 1;
    if (row1 > row0 && cols > 0) { /* cols * item <= src.len now, so the row buffers are bounded */
        float *x = malloc((size_t)cols * sizeof(float)), *rec = malloc((size_t)cols * sizeof(float));
        if (!x || !rec) {
            free(x);
            free(rec);
            PyErr_NoMemory();
            goto done;
        }
        const qt_encode_row row = qt_encoders[found].row;
        const qt_encode_row_w weighted = qt_encoders[found].weighted;
        const int exact_nonfinite = qt_encoders[found].exact_nonfinite || qw != NULL; /* llama.cpp's _impl bytes, any row */
        const char *in = (const char *)src->buf;
        uint8_t *o = (uint8_t *)out->buf;
        const RowSource source = *from;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = row0; r < row1; r++) {
            if (source.decode) source.decode((const uint8_t *)in + r * row_bytes, x, QT_F32, 0, cols / source.sbs);
            else qt_widen(in + r * row_bytes, source.dt, x, cols);
            if (!row_is_finite(x, cols)) { /* no error sums: the caller encodes this weight with gguf-py, or */
                finite = 0;               /* keeps the exact bytes of the rest of the rows, encoded anyway */
                if (!exact_nonfinite) break;
            }
            uint8_t *y = o + r * blocks * ts;
            if (weighted) weighted(x, qw, blocks, y, rec);
            else if (qw) qt_legacy_w_row(type_name, x, qw, blocks, y, rec);
            else row(x, blocks, y, rec);
            if (finite) add_errors_any(x, rec, cols, &sums);
        }
        Py_END_ALLOW_THREADS
        free(x);
        free(rec);
    }
    double max_err;
    memcpy(&max_err, &sums.max_err_bits, 8);
    result = Py_BuildValue("ddddO", sums.xx, sums.xe, sums.ee, max_err, finite ? Py_True : Py_False);
done:
    free(qw);
    if (qw_buffer.obj) PyBuffer_Release(&qw_buffer);
    return result;
}

PyObject *qt_py_encode_gguf(PyObject *self, PyObject *args) {
    (void)self;
    const char *type_name;
    Py_buffer src, out;
    int dt;
    Py_ssize_t cols, row0, row1;
    PyObject *importance = Py_None;
    if (!PyArg_ParseTuple(args, "sy*inw*nn|O", &type_name, &src, &dt, &cols, &out, &row0, &row1, &importance)) return NULL;
    PyObject *result = NULL;
    if (qt_check_dtype(dt, "encode_gguf")) {
        const RowSource from = {dt, NULL, 0, 0};
        result = encode_rows(type_name, &from, &src, cols, &out, row0, row1, importance);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

/* transcode_gguf(type_name, src_type, src, cols, out, row0, row1, importance=None): encode_gguf
 * of rows held as GGUF `src_type` blocks, each row decoded as decode_gguf decodes it to float32 */
PyObject *qt_py_transcode_gguf(PyObject *self, PyObject *args) {
    (void)self;
    const char *type_name, *src_type;
    Py_buffer src, out;
    Py_ssize_t cols, row0, row1;
    PyObject *importance = Py_None;
    if (!PyArg_ParseTuple(args, "ssy*nw*nn|O", &type_name, &src_type, &src, &cols, &out, &row0, &row1, &importance)) return NULL;
    PyObject *result = NULL;
    RowSource from = {QT_F32, NULL, 0, 0};
    from.decode = qt_gguf_decoder(src_type, &from.sbs, &from.sts);
    if (from.decode == NULL) PyErr_Format(PyExc_ValueError, "no native decoder for GGUF %s", src_type);
    else result = encode_rows(type_name, &from, &src, cols, &out, row0, row1, importance);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

/* gguf_encoders() -> {type name: (values, bytes) per block}, the table above */
PyObject *qt_py_gguf_encoders(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    PyObject *table = PyDict_New();
    for (int i = 0; table && i < QT_ENCODERS; i++) {
        PyObject *size = Py_BuildValue("nn", qt_encoders[i].block_size, qt_encoders[i].type_size);
        if (!size || PyDict_SetItemString(table, qt_encoders[i].name, size) < 0) Py_CLEAR(table);
        Py_XDECREF(size);
    }
    return table;
}
