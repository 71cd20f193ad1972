/* The `mse` observer of encode_int: one group's scale (and zero point) by the search of
 * qtool.kernels.mse, bit for bit its torch reference (tests/test_mse_observer.py). With dt(.)
 * rounding a float32 result to the weight's dtype (the scale's dtype here):
 *
 *   symmetric   scale_k = dt(f32(amax * p_k) / ((qmax - qmin) / 2)),  p_k = f32(1 - k / 100), k < 40
 *               (the shrink search of GPTQ's find_params(mse=True) / llm-compressor's `mse`
 *               observer, which stops at 20 steps); k = 0, 10, 20, then the best k -3, +3,
 *               then the best k -1, +1 (7 trials)
 *   asymmetric  lo_i = dt(min * p_i), hi_j = dt(max * p_j), p_i = f32(1 - i * step), i, j < 7,
 *               step 0.05, 0.1 for int2 (qmax 1), then
 *               min-max's scale and zero point on (lo_i, hi_j); i, j in {0, 3, 6}, then the
 *               best one's 8 neighbours
 *   refit x2    scale = dt(f32(sum(x * w) / sum(w * w))), w = q - zp, codes and zp fixed
 *               (llama.cpp's make_qkx2_quants refit, ggml-quants.c), kept if the error falls
 *
 * Each trial quantizes as encode_int does (affine.c's quantize_group) and sums (x - x^)^2 in
 * double; candidate 0 is min-max's own (k = 0, i = j = 0: the products by 1 are exact), and a
 * later one wins only when strictly better, so no group gets worse than min-max.
 */
#include "qtool_native.h"

#pragma GCC diagnostic ignored "-Wpsabi" /* vector helpers are inlined into the AVX2 clone */

/* the search's constants, qtool/kernels/mse.py's (see there for where each comes from) */
#define SHRINK_STEPS 40
#define SHRINK_STEP 0.01
static const int SHRINK_START[] = {0, 10, 20};
static const int SHRINK_REFINE[] = {3, 1}; /* then the best k - 3, k + 3; then k - 1, k + 1 */
#define GRID_STEPS 7
#define GRID_STEP 0.05
#define GRID_STEP_INT2 0.1
#define GRID_COARSE 3
#define REFITS 2

/* 8 floats, 8 int32 lanes, 4 doubles: one AVX2 register each (two SSE2 registers in the
 * default clone). Casts between them reinterpret bits, as in kquant_lanes.h. */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef double vd4 __attribute__((vector_size(32)));

static inline float rne(float v) { return (v + 12582912.0f) - 12582912.0f; }
static inline float round_bf16_finite(float f) {
    uint32_t u = qt_bits(f);
    return qt_float((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}
static inline float round_f16(float f) { return qt_f16_to_f32(qt_f32_to_f16(f)); }
static inline float round_f32(float f) { return f; }

static inline __attribute__((always_inline)) vf8 vsplat(float f) { return (vf8){0} + f; }
static inline __attribute__((always_inline)) vu8 vusplat(uint32_t u) { return (vu8){0} + u; }
static inline __attribute__((always_inline)) vf8 vsel(vi8 m, vf8 a, vf8 b) { return (vf8)((m & (vi8)a) | (~m & (vi8)b)); }
static inline __attribute__((always_inline)) vu8 vusel(vi8 m, vu8 a, vu8 b) { return (vu8)((m & (vi8)a) | (~m & (vi8)b)); }

/* the scalar roundings above, lane by lane, op for op (round_f16: qt_f32_to_f16 then
 * qt_f16_to_f32 of qtool_native.h) */
static inline __attribute__((always_inline)) vf8 vround_f32(vf8 f) { return f; }
static inline __attribute__((always_inline)) vf8 vround_bf16(vf8 f) {
    const vu8 u = (vu8)f;
    return (vf8)((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}
static inline __attribute__((always_inline)) vf8 vround_f16(vf8 f) {
    const vu8 w = (vu8)f;
    const vu8 shl1_w = w + w;
    const vu8 sign = w & 0x80000000u;
    vu8 bias = shl1_w & 0xFF000000u;
    bias = vusel(bias > vusplat(0x71000000u), bias, vusplat(0x71000000u));
    vf8 base = ((vf8)(w & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
    base = (vf8)((bias >> 1) + 0x07800000u) + base;
    const vu8 bits = (vu8)base;
    const vu8 nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    const vu8 nan = (vu8)(shl1_w > vusplat(0xFF000000u));
    const vu8 h = ((sign >> 16) | (nan & 0x7E00u) | (~nan & nonsign)) & 0xFFFFu;
    const vu8 w2 = h << 16;
    const vu8 two_w = w2 + w2;
    const vf8 normalized = (vf8)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const vf8 denormalized = (vf8)((two_w >> 17) | (126u << 23)) - 0.5f;
    return (vf8)((w2 & 0x80000000u) | vusel(two_w < vusplat(1u << 27), (vu8)denormalized, (vu8)normalized));
}

/* One group's codes for (scale, zp), 8 lanes: affine.c's quantize_group, op for op. With zp = 0
 * (symmetric) dt(dt(y) + 0) is dt(y) but for the sign of a zero, which rne() below drops, and
 * (v - 0) * scale is v * scale: the SYM forms skip those ops and give the same codes and x^. */
#define ADD_ZP(VROUND, Y) VROUND(VROUND(Y) + vz)
#define NO_ZP(VROUND, Y) VROUND(Y)
#define SUB_ZP(V) ((V) - vz)
#define KEEP(V) (V)
#define ADD_ZP1(ROUND, Y) ROUND(ROUND(Y) + zp)
#define NO_ZP1(ROUND, Y) ROUND(Y)
/* The codes past the last whole vector, one at a time, as the vectors compute them: the error
 * sum's tail (`tail`) and the refit sums' tails (`ta`, `tb`). ADDZ1 is ADD_ZP1 or NO_ZP1. */
#define SCALAR_CODE(ROUND, ADDZ1)                                                                        \
    float v = ADDZ1(ROUND, x[j] / scale);                                                                \
    v = v < qmin ? qmin : v;                                                                             \
    v = v > qmax ? qmax : v;                                                                             \
    v = rne(v);
#define ERROR_TAIL(ROUND, ADDZ1)                                                                         \
    double tail = 0;                                                                                     \
    for (; j < n; j++) {                                                                                 \
        SCALAR_CODE(ROUND, ADDZ1)                                                                        \
        const double e = (double)x[j] - (double)ROUND((v - zp) * scale);                                 \
        tail += e * e;                                                                                   \
    }
#define REFIT_TAIL(ROUND, ADDZ1)                                                                         \
    double ta = 0, tb = 0;                                                                               \
    for (; j < n; j++) {                                                                                 \
        SCALAR_CODE(ROUND, ADDZ1)                                                                        \
        const double w = (double)v - (double)zp;                                                         \
        ta += (double)x[j] * w;                                                                          \
        tb += w * w;                                                                                     \
    }

#define VCODES(VROUND, ADDZ)                                                                             \
    vf8 v = ADDZ(VROUND, xv / vs);                                                                       \
    v = vsel(v < vlo, vlo, v);                                                                           \
    v = vsel(v > vhi, vhi, v);                                                                           \
    v = (v + magic) - magic;

#define VSETUP                                                                                           \
    const vf8 vs = vsplat(scale), vz = vsplat(zp), vlo = vsplat(qmin), vhi = vsplat(qmax), magic = vsplat(12582912.0f); \
    (void)vz;

static inline __attribute__((always_inline)) vd4 vlow(vf8 v) { return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), vd4); }
static inline __attribute__((always_inline)) vd4 vhigh(vf8 v) { return __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), vd4); }
static inline __attribute__((always_inline)) double vsum(vd4 a) { return (a[0] + a[1]) + (a[2] + a[3]); }

/* sum (x - x^)^2 in double of one trial. A trial stops early once its partial sum exceeds
 * `bound` (the best so far; returned as is then): the terms are >= 0 and rounding is monotone,
 * so such a trial could not have won, and the choice is the same. */
#define TRIAL(NAME, VROUND, ROUND, ADDZ, SUBZ)                                                                   \
    static QT_HOT double NAME(const float *x, Py_ssize_t n, float scale, float zp, float qmin, float qmax, double bound) { \
        VSETUP                                                                                           \
        vd4 a = {0}, b = {0};                                                                            \
        Py_ssize_t j = 0;                                                                                \
        while (j + 8 <= n) {                                                                             \
            const Py_ssize_t stop = j + 32 <= n ? j + 32 : n - (n - j) % 8;                              \
            for (; j < stop; j += 8) {                                                                   \
                vf8 xv;                                                                                  \
                memcpy(&xv, x + j, sizeof xv);                                                           \
                VCODES(VROUND, ADDZ)                                                                     \
                const vf8 d = VROUND(SUBZ(v) * vs);                                                      \
                const vd4 e0 = vlow(xv) - vlow(d), e1 = vhigh(xv) - vhigh(d);                            \
                a += e0 * e0;                                                                            \
                b += e1 * e1;                                                                            \
            }                                                                                            \
            const double partial = vsum(a + b);                                                          \
            if (partial > bound) return partial;                                                         \
        }                                                                                                \
        ERROR_TAIL(ROUND, ADDZ##1)                                                                       \
        return vsum(a + b) + tail;                                                                       \
    }

/* sum(x * w) and sum(w * w) in double, w = q - zp (exact products), q the codes of (scale, zp) */
#define REFIT(NAME, VROUND, ROUND, ADDZ)                                                                   \
    static QT_HOT void NAME(const float *x, Py_ssize_t n, float scale, float zp, float qmin, float qmax, double *xw, double *ww) { \
        VSETUP                                                                                           \
        const vd4 dz = (vd4){0} + (double)zp;                                                            \
        vd4 a = {0}, b = {0};                                                                            \
        Py_ssize_t j = 0;                                                                                \
        for (; j + 8 <= n; j += 8) {                                                                     \
            vf8 xv;                                                                                      \
            memcpy(&xv, x + j, sizeof xv);                                                               \
            VCODES(VROUND, ADDZ)                                                                         \
            const vd4 w0 = vlow(v) - dz, w1 = vhigh(v) - dz;                                             \
            a += vlow(xv) * w0 + vhigh(xv) * w1;                                                         \
            b += w0 * w0 + w1 * w1;                                                                      \
        }                                                                                                \
        REFIT_TAIL(ROUND, ADDZ##1)                                                                       \
        *xw = vsum(a) + ta;                                                                              \
        *ww = vsum(b) + tb;                                                                              \
    }

TRIAL(trial_bf16, vround_bf16, round_bf16_finite, ADD_ZP, SUB_ZP)
TRIAL(trial_f16, vround_f16, round_f16, ADD_ZP, SUB_ZP)
TRIAL(trial_f32, vround_f32, round_f32, ADD_ZP, SUB_ZP)
TRIAL(trial_sym_bf16, vround_bf16, round_bf16_finite, NO_ZP, KEEP)
TRIAL(trial_sym_f16, vround_f16, round_f16, NO_ZP, KEEP)
REFIT(refit_bf16, vround_bf16, round_bf16_finite, ADD_ZP)
REFIT(refit_f16, vround_f16, round_f16, ADD_ZP)
REFIT(refit_f32, vround_f32, round_f32, ADD_ZP)

/* The same trials and refit sums with AVX2 intrinsics (+ FMA, F16C), where the CPU has them:
 * the same codes and the same double sums, lane for lane, in fewer instructions. Three
 * rewrites change no result:
 *   - bf16 and f16 weights (scales in the same dtype) quantize x * r, r = f32(1 / scale), not
 *     x / scale: dt(x * r) == dt(x / scale) for every finite bf16 x and bf16 scale with r
 *     finite, and for every f16 pair where the result is a normal f16 (a subnormal one is code
 *     0 or zp either way): checked on all 2^31 pairs of each. f32 weights still divide.
 *   - bf16 and f16: e = x - x^ in float32 is exact (both hold <= 11 significant bits and are
 *     within a few binades of each other unless x^ is 0), and e^2 in double is exact, so
 *     fma(e, e, acc) adds the same term as (x - x^)^2 taken in double. f32: double, as above.
 *   - f16 rounding by F16C's vcvtps2ph / vcvtph2ps: equal to qt_f32_to_f16 / qt_f16_to_f32 on
 *     all 2^32 float32 inputs but NaN (none here: x is finite, the scale > 0). Round half to
 *     even by vroundps (the 1.5 * 2^23 trick's value; a -0 code decodes to the same error). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#define MSE_X86 1
#define X86 __attribute__((target("avx2,fma,f16c")))
#define X86_INLINE static inline __attribute__((always_inline)) X86

X86_INLINE __m256 x_round_bf16(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32((int)0xFFFF0000u)));
}
X86_INLINE __m256 x_round_f16(__m256 f) { return _mm256_cvtph_ps(_mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
X86_INLINE __m256 x_round_f32(__m256 f) { return f; }
X86_INLINE double x_sum(__m256d a) {
    const __m128d lo = _mm256_castpd256_pd128(a), hi = _mm256_extractf128_pd(a, 1);
    return (_mm_cvtsd_f64(lo) + _mm_cvtsd_f64(_mm_unpackhi_pd(lo, lo))) + (_mm_cvtsd_f64(hi) + _mm_cvtsd_f64(_mm_unpackhi_pd(hi, hi)));
}
#define X_BY_RECIP(XV) _mm256_mul_ps(XV, vr)
#define X_BY_DIV(XV) _mm256_div_ps(XV, vs)
#define X_ADD_ZP(XROUND, Y) XROUND(_mm256_add_ps(XROUND(Y), vz))
#define X_NO_ZP(XROUND, Y) XROUND(Y)
#define X_ADD_ZP1 ADD_ZP1 /* the scalar tail's forms */
#define X_NO_ZP1 NO_ZP1
#define X_SUB_ZP(V) _mm256_sub_ps(V, vz)
/* the codes of 8 values, then their decoded values d */
#define X_CODES(XROUND, QUOT, ADDZ)                                                                      \
    __m256 v = ADDZ(XROUND, QUOT(xv));                                                                   \
    v = _mm256_min_ps(_mm256_max_ps(v, vlo), vhi);                                                       \
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
/* a (lanes 0-3) and b (lanes 4-7) += (x - d)^2 */
#define X_ERR_EXACT_F32                                                                                  \
    const __m256 e = _mm256_sub_ps(xv, d);                                                               \
    const __m256d e0 = _mm256_cvtps_pd(_mm256_castps256_ps128(e)), e1 = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)); \
    a = _mm256_fmadd_pd(e0, e0, a);                                                                      \
    b = _mm256_fmadd_pd(e1, e1, b);
#define X_ERR_DOUBLE                                                                                     \
    const __m256d e0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(xv)), _mm256_cvtps_pd(_mm256_castps256_ps128(d))); \
    const __m256d e1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(xv, 1)), _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1))); \
    a = _mm256_add_pd(a, _mm256_mul_pd(e0, e0));                                                         \
    b = _mm256_add_pd(b, _mm256_mul_pd(e1, e1));
#define X_SETUP                                                                                          \
    const __m256 vs = _mm256_set1_ps(scale), vr = _mm256_set1_ps(recip), vz = _mm256_set1_ps(zp);        \
    const __m256 vlo = _mm256_set1_ps(qmin), vhi = _mm256_set1_ps(qmax);                                 \
    (void)vs;                                                                                            \
    (void)vr;                                                                                            \
    (void)vz;

/* TRIAL's loop (same partial sums, same early stop, same scalar tail) */
#define X_TRIAL(NAME, XROUND, ROUND, QUOT, ADDZ, SUBZ, ERR)                                              \
    static X86 double NAME(const float *x, Py_ssize_t n, float scale, float recip, float zp, float qmin, float qmax, double bound) { \
        X_SETUP                                                                                          \
        __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();                                        \
        Py_ssize_t j = 0;                                                                                \
        while (j + 8 <= n) {                                                                             \
            const Py_ssize_t stop = j + 64 <= n ? j + 64 : n - (n - j) % 8;                              \
            for (; j < stop; j += 8) {                                                                   \
                const __m256 xv = _mm256_loadu_ps(x + j);                                                \
                X_CODES(XROUND, QUOT, ADDZ)                                                              \
                const __m256 d = XROUND(_mm256_mul_ps(SUBZ(v), vs));                                     \
                ERR                                                                                      \
            }                                                                                            \
            const double partial = x_sum(_mm256_add_pd(a, b));                                           \
            if (partial > bound) return partial;                                                         \
        }                                                                                                \
        ERROR_TAIL(ROUND, ADDZ##1)                                                                       \
        return x_sum(_mm256_add_pd(a, b)) + tail;                                                        \
    }

#define X_REFIT(NAME, XROUND, ROUND, QUOT)                                                               \
    static X86 void NAME(const float *x, Py_ssize_t n, float scale, float recip, float zp, float qmin, float qmax, double *xw, double *ww) { \
        X_SETUP                                                                                          \
        const __m256d dz = _mm256_set1_pd((double)zp);                                                   \
        __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();                                        \
        Py_ssize_t j = 0;                                                                                \
        for (; j + 8 <= n; j += 8) {                                                                     \
            const __m256 xv = _mm256_loadu_ps(x + j);                                                    \
            X_CODES(XROUND, QUOT, X_ADD_ZP)                                                              \
            const __m256d w0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), dz);            \
            const __m256d w1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), dz);          \
            const __m256d x0 = _mm256_cvtps_pd(_mm256_castps256_ps128(xv)), x1 = _mm256_cvtps_pd(_mm256_extractf128_ps(xv, 1)); \
            a = _mm256_add_pd(a, _mm256_add_pd(_mm256_mul_pd(x0, w0), _mm256_mul_pd(x1, w1)));          \
            b = _mm256_add_pd(b, _mm256_add_pd(_mm256_mul_pd(w0, w0), _mm256_mul_pd(w1, w1)));          \
        }                                                                                                \
        REFIT_TAIL(ROUND, ADD_ZP1)                                                                       \
        *xw = x_sum(a) + ta;                                                                             \
        *ww = x_sum(b) + tb;                                                                             \
    }

/* bf16 weights with codes of at most 4 bits: x^ = dt((q - zp) * scale) takes at most 16
 * values per trial, so it is looked up (vpermps) instead of computed. The clamp comes first
 * (clamp and the dtype rounding commute: qmin, qmax and qmin - zp, qmax - zp are small
 * integers, exact in bf16), which keeps |y| <= 2^9, where x_round_bf16_small is bf16's round to
 * nearest even (checked on every float32 up to 2^100; a subnormal y stays below 2^-120 and
 * so gives the same code); y + (2^23 - qmin) then rounds to the integer half to even (qmin
 * is even) and leaves q - qmin in the low bits: the table index. */
X86_INLINE __m256 x_round_bf16_small(__m256 y) {
    const __m256i u = _mm256_castps_si256(y);
    const __m256 m = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFF800000u)), _mm256_set1_epi32(16 << 23)));
    return _mm256_sub_ps(_mm256_add_ps(y, m), m);
}
#define X_LUT_ZP(Y) x_round_bf16_small(_mm256_add_ps(Y, vz))
#define X_LUT_NO_ZP(Y) (Y)
#define X_LUT8(IDX) _mm256_permutevar8x32_ps(t_lo, IDX)
#define X_LUT16(IDX) _mm256_blendv_ps(_mm256_permutevar8x32_ps(t_lo, IDX), _mm256_permutevar8x32_ps(t_hi, IDX), _mm256_castsi256_ps(_mm256_slli_epi32(IDX, 28)))
#define X_TRIAL_LUT(NAME, ADDZ, ADDZ1, LOOKUP)                                                           \
    static X86 double NAME(const float *x, Py_ssize_t n, float scale, float recip, float zp, float qmin, float qmax, double bound) { \
        const __m256 vs = _mm256_set1_ps(scale), vr = _mm256_set1_ps(recip), vz = _mm256_set1_ps(zp);    \
        const __m256 ylo = _mm256_set1_ps(qmin - zp), yhi = _mm256_set1_ps(qmax - zp);                   \
        const __m256 magic = _mm256_set1_ps(8388608.0f - qmin);                                          \
        const __m256 codes = _mm256_add_ps(_mm256_set1_ps(qmin), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)); \
        const __m256 t_lo = x_round_bf16(_mm256_mul_ps(_mm256_sub_ps(codes, vz), vs));                  \
        const __m256 t_hi = x_round_bf16(_mm256_mul_ps(_mm256_sub_ps(_mm256_add_ps(codes, _mm256_set1_ps(8.0f)), vz), vs)); \
        (void)vz;                                                                                        \
        (void)t_hi;                                                                                      \
        __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();                                        \
        Py_ssize_t j = 0;                                                                                \
        while (j + 8 <= n) {                                                                             \
            const Py_ssize_t stop = j + 64 <= n ? j + 64 : n - (n - j) % 8;                              \
            for (; j < stop; j += 8) {                                                                   \
                const __m256 xv = _mm256_loadu_ps(x + j);                                                \
                __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(xv, vr), ylo), yhi);                \
                y = ADDZ(x_round_bf16_small(y));                                                         \
                const __m256i idx = _mm256_castps_si256(_mm256_add_ps(y, magic));                        \
                const __m256 d = LOOKUP(idx);                                                            \
                X_ERR_EXACT_F32                                                                          \
            }                                                                                            \
            const double partial = x_sum(_mm256_add_pd(a, b));                                           \
            if (partial > bound) return partial;                                                         \
        }                                                                                                \
        ERROR_TAIL(round_bf16_finite, ADDZ1)                                                             \
        return x_sum(_mm256_add_pd(a, b)) + tail;                                                        \
    }
X_TRIAL_LUT(x_trial_lut8_bf16, X_LUT_ZP, ADD_ZP1, X_LUT8)
X_TRIAL_LUT(x_trial_lut16_bf16, X_LUT_ZP, ADD_ZP1, X_LUT16)
X_TRIAL_LUT(x_trial_lut8_sym_bf16, X_LUT_NO_ZP, NO_ZP1, X_LUT8)
X_TRIAL_LUT(x_trial_lut16_sym_bf16, X_LUT_NO_ZP, NO_ZP1, X_LUT16)

/* REFIT's sums for the same cases: w = q - zp comes out of the rounding constant exactly;
 * x * w is exact in float32 (8 significant bits times at most 5; |x| < 2^120 for the group,
 * so no overflow), so converting the product is the double product; sum(w * w) of small
 * integers is exact in float32 lanes, and so is its total in double. */
#define X_REFIT_LUT(NAME, ADDZ, ADDZ1)                                                                  \
    static X86 void NAME(const float *x, Py_ssize_t n, float scale, float recip, float zp, float qmin, float qmax, double *xw, double *ww) { \
        const __m256 vr = _mm256_set1_ps(recip), vz = _mm256_set1_ps(zp);                                \
        const __m256 ylo = _mm256_set1_ps(qmin - zp), yhi = _mm256_set1_ps(qmax - zp);                   \
        const __m256 magic = _mm256_set1_ps(8388608.0f - qmin), magic_zp = _mm256_set1_ps(8388608.0f - qmin + zp); \
        (void)vz;                                                                                        \
        __m256d a = _mm256_setzero_pd();                                                                 \
        __m256 b = _mm256_setzero_ps();                                                                  \
        Py_ssize_t j = 0;                                                                                \
        for (; j + 8 <= n; j += 8) {                                                                     \
            const __m256 xv = _mm256_loadu_ps(x + j);                                                    \
            __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(xv, vr), ylo), yhi);                    \
            y = ADDZ(x_round_bf16_small(y));                                                             \
            const __m256 w = _mm256_sub_ps(_mm256_add_ps(y, magic), magic_zp);                           \
            const __m256 p = _mm256_mul_ps(xv, w);                                                       \
            a = _mm256_add_pd(a, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(p)), _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)))); \
            b = _mm256_fmadd_ps(w, w, b);                                                                \
        }                                                                                                \
        REFIT_TAIL(round_bf16_finite, ADDZ1)                                                             \
        *xw = x_sum(a) + ta;                                                                             \
        *ww = x_sum(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(b)), _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)))) + tb; \
    }
X_REFIT_LUT(x_refit_lut_bf16, X_LUT_ZP, ADD_ZP1)
X_REFIT_LUT(x_refit_lut_sym_bf16, X_LUT_NO_ZP, NO_ZP1)

X_TRIAL(x_trial_bf16, x_round_bf16, round_bf16_finite, X_BY_RECIP, X_ADD_ZP, X_SUB_ZP, X_ERR_EXACT_F32)
X_TRIAL(x_trial_sym_bf16, x_round_bf16, round_bf16_finite, X_BY_RECIP, X_NO_ZP, KEEP, X_ERR_EXACT_F32)
X_TRIAL(x_trial_div_bf16, x_round_bf16, round_bf16_finite, X_BY_DIV, X_ADD_ZP, X_SUB_ZP, X_ERR_EXACT_F32)
X_TRIAL(x_trial_f16, x_round_f16, round_f16, X_BY_RECIP, X_ADD_ZP, X_SUB_ZP, X_ERR_EXACT_F32)
X_TRIAL(x_trial_sym_f16, x_round_f16, round_f16, X_BY_RECIP, X_NO_ZP, KEEP, X_ERR_EXACT_F32)
X_TRIAL(x_trial_f32, x_round_f32, round_f32, X_BY_DIV, X_ADD_ZP, X_SUB_ZP, X_ERR_DOUBLE)
X_REFIT(x_refit_bf16, x_round_bf16, round_bf16_finite, X_BY_RECIP)
X_REFIT(x_refit_div_bf16, x_round_bf16, round_bf16_finite, X_BY_DIV)
X_REFIT(x_refit_f16, x_round_f16, round_f16, X_BY_RECIP)
X_REFIT(x_refit_f32, x_round_f32, round_f32, X_BY_DIV)

static int x86_ok = -1; /* -1: not asked yet */
static int use_x86(void) {
    if (x86_ok < 0) x86_ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return x86_ok;
}
#endif

/* tests: False keeps the search on the portable kernels above (the same results, slower) */
PyObject *qt_py_mse_set_x86(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
#ifdef MSE_X86
    x86_ok = on ? -1 : 0;
#endif
    Py_RETURN_NONE;
}

static double trial(const float *x, Py_ssize_t n, float scale, float zp, float qmin, float qmax, int dt, double bound) {
#ifdef MSE_X86
    if (use_x86()) {
        const float r = 1.0f / scale; /* inf only for a bf16 scale below 2^-128: divide then */
        if (dt == QT_BF16 && r == __builtin_inff()) return x_trial_div_bf16(x, n, scale, r, zp, qmin, qmax, bound);
        if (dt == QT_BF16 && qmax - qmin < 8.0f)
            return zp == 0.0f ? x_trial_lut8_sym_bf16(x, n, scale, r, zp, qmin, qmax, bound) : x_trial_lut8_bf16(x, n, scale, r, zp, qmin, qmax, bound);
        if (dt == QT_BF16 && qmax - qmin < 16.0f)
            return zp == 0.0f ? x_trial_lut16_sym_bf16(x, n, scale, r, zp, qmin, qmax, bound) : x_trial_lut16_bf16(x, n, scale, r, zp, qmin, qmax, bound);
        if (dt == QT_BF16) return zp == 0.0f ? x_trial_sym_bf16(x, n, scale, r, zp, qmin, qmax, bound) : x_trial_bf16(x, n, scale, r, zp, qmin, qmax, bound);
        if (dt == QT_F16) return zp == 0.0f ? x_trial_sym_f16(x, n, scale, r, zp, qmin, qmax, bound) : x_trial_f16(x, n, scale, r, zp, qmin, qmax, bound);
        return x_trial_f32(x, n, scale, r, zp, qmin, qmax, bound);
    }
#endif
    if (dt == QT_BF16) return zp == 0.0f ? trial_sym_bf16(x, n, scale, zp, qmin, qmax, bound) : trial_bf16(x, n, scale, zp, qmin, qmax, bound);
    if (dt == QT_F16) return zp == 0.0f ? trial_sym_f16(x, n, scale, zp, qmin, qmax, bound) : trial_f16(x, n, scale, zp, qmin, qmax, bound);
    return trial_f32(x, n, scale, zp, qmin, qmax, bound);
}

static void refit_sums(const float *x, Py_ssize_t n, float scale, float zp, float qmin, float qmax, int dt, float amax, double *xw, double *ww) {
#ifdef MSE_X86
    if (use_x86()) {
        const float r = 1.0f / scale;
        if (dt == QT_BF16 && r == __builtin_inff()) x_refit_div_bf16(x, n, scale, r, zp, qmin, qmax, xw, ww);
        else if (dt == QT_BF16 && qmax - qmin < 16.0f && amax < 0x1.0p120f && zp == 0.0f) x_refit_lut_sym_bf16(x, n, scale, r, zp, qmin, qmax, xw, ww);
        else if (dt == QT_BF16 && qmax - qmin < 16.0f && amax < 0x1.0p120f) x_refit_lut_bf16(x, n, scale, r, zp, qmin, qmax, xw, ww);
        else if (dt == QT_BF16) x_refit_bf16(x, n, scale, r, zp, qmin, qmax, xw, ww);
        else if (dt == QT_F16) x_refit_f16(x, n, scale, r, zp, qmin, qmax, xw, ww);
        else x_refit_f32(x, n, scale, r, zp, qmin, qmax, xw, ww);
        return;
    }
#endif
    if (dt == QT_BF16) refit_bf16(x, n, scale, zp, qmin, qmax, xw, ww);
    else if (dt == QT_F16) refit_f16(x, n, scale, zp, qmin, qmax, xw, ww);
    else refit_f32(x, n, scale, zp, qmin, qmax, xw, ww);
}

static const float EPS_BY_DT[3] = {0x1.0p-23f, 0x1.0p-10f, 0x1.0p-7f};

/* min-max's asymmetric scale and zero point of a clip range, as affine.c computes them */
static void asym_params(float lo, float hi, float qmin, float qmax, int dt, float *scale, float *zp) {
    float s = qt_round_to(qt_round_to(hi - lo, dt) / (qmax - qmin), dt);
    float z = qt_round_to(qmin - qt_round_to(lo / s, dt), dt);
    z = z != z ? 0.0f : rne(z < qmin ? qmin : z > qmax ? qmax : z);
    *scale = s == 0.0f ? EPS_BY_DT[dt] : s;
    *zp = z;
}

/* One candidate: its trial against the best so far, which it replaces only when strictly
 * better (the first candidate, min-max's own, is always taken). */
typedef struct {
    double error;
    float scale, zp;
    int i, j, any;
} Best;

static void consider(const float *x, Py_ssize_t n, int dt, float qmin, float qmax, float scale, float zp, int i, int j, Best *best) {
    const double err = trial(x, n, scale, zp, qmin, qmax, dt, best->any ? best->error : __builtin_inf());
    if (!best->any || err < best->error) *best = (Best){err, scale, zp, i, j, 1};
}

static void consider_shrink(const float *x, Py_ssize_t n, int dt, float qmin, float qmax, float amax, int k, Best *best) {
    const float factor = (float)(1.0 - k * SHRINK_STEP);
    float s = qt_round_to((amax * factor) / ((qmax - qmin) / 2.0f), dt);
    consider(x, n, dt, qmin, qmax, s == 0.0f ? EPS_BY_DT[dt] : s, 0.0f, k, 0, best);
}

static void consider_clip(const float *x, Py_ssize_t n, int dt, float qmin, float qmax, float lo, float hi, int i, int j, Best *best) {
    const double step = qmax < 2.0f ? GRID_STEP_INT2 : GRID_STEP;
    const float low = qt_round_to(lo * (float)(1.0 - i * step), dt);
    const float high = qt_round_to(hi * (float)(1.0 - j * step), dt);
    float s, z;
    asym_params(low, high, qmin, qmax, dt, &s, &z);
    consider(x, n, dt, qmin, qmax, s, z, i, j, best);
}

void qt_mse_group(const float *x, Py_ssize_t n, int dt, float qmin, float qmax, int symmetric, float lo, float hi, float *scale_out,
                  float *zp_out) {
    Best best = {0};
    if (symmetric) {
        const float amax = -lo > hi ? -lo : hi;
        for (size_t t = 0; t < sizeof SHRINK_START / sizeof *SHRINK_START; t++) consider_shrink(x, n, dt, qmin, qmax, amax, SHRINK_START[t], &best);
        for (size_t t = 0; t < sizeof SHRINK_REFINE / sizeof *SHRINK_REFINE; t++) {
            const int c = best.i, d = SHRINK_REFINE[t];
            if (c - d >= 0) consider_shrink(x, n, dt, qmin, qmax, amax, c - d, &best);
            if (c + d < SHRINK_STEPS) consider_shrink(x, n, dt, qmin, qmax, amax, c + d, &best);
        }
    } else {
        for (int i = 0; i < GRID_STEPS; i += GRID_COARSE)
            for (int j = 0; j < GRID_STEPS; j += GRID_COARSE) consider_clip(x, n, dt, qmin, qmax, lo, hi, i, j, &best);
        const int ci = best.i, cj = best.j;
        for (int i = ci - 1; i <= ci + 1; i++)
            for (int j = cj - 1; j <= cj + 1; j++)
                if (i >= 0 && j >= 0 && i < GRID_STEPS && j < GRID_STEPS && (i % GRID_COARSE || j % GRID_COARSE))
                    consider_clip(x, n, dt, qmin, qmax, lo, hi, i, j, &best);
    }
    /* A refit that keeps the scale, or does not lower the error, leaves the next refit the
     * same codes, so the same sums and the same outcome: the loop stops there. */
    for (int refit = 0; refit < REFITS; refit++) {
        double xw, ww;
        refit_sums(x, n, best.scale, best.zp, qmin, qmax, dt, -lo > hi ? -lo : hi, &xw, &ww);
        if (!(ww > 0)) break;
        const float s = qt_round_to((float)(xw / ww), dt);
        if (!(s > 0) || s == __builtin_inff() || s == best.scale) break;
        const double err = trial(x, n, s, best.zp, qmin, qmax, dt, best.error);
        if (!(err < best.error)) break;
        best.error = err;
        best.scale = s;
    }
    *scale_out = best.scale;
    *zp_out = best.zp;
}
