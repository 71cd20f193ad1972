/* The `mse` observer of encode_int: one group's scale (and zero point) by the search of
 * qtool.kernels.mse, bit for bit its torch reference (tests/test_mse_observer.py). With dt(.)
 * rounding a float32 result to the weight's dtype (the scale's dtype here):
 *
 *   symmetric   scale_k = dt(f32(amax * p_k) / ((qmax - qmin) / 2)),  p_k = f32(1 - k / 100), k < 40
 *               (the shrink search of GPTQ's find_params(mse=True) / llm-compressor's `mse`
 *               observer, which stops at 20 steps)
 *   asymmetric  lo_i = dt(min * p_i), hi_j = dt(max * p_j), p_i = f32(1 - i * step), i, j < 7,
 *               step 0.05, 0.1 for int2 (qmax 1), then
 *               min-max's scale and zero point on (lo_i, hi_j)
 *   refit x2    scale = dt(f32(sum(x * w) / sum(w * w))), w = q - zp, codes and zp fixed
 *               (llama.cpp's make_qkx2_quants refit, ggml-quants.c), kept if the error falls
 *
 * Each trial quantizes as encode_int does (affine.c's quantize_group) and sums (x - x^)^2 in
 * double; candidate 0 is min-max's own (k = 0, i = j = 0: the products by 1 are exact), and a
 * later one wins only when strictly better, so no group gets worse than min-max.
 */
#include "qtool_native.h"

#define MSE_LANES 8
#define SHRINK_STEPS 40
#define GRID_STEPS 7

static inline float rne(float v) { return (v + 12582912.0f) - 12582912.0f; }
static inline float round_bf16_finite(float f) {
    uint32_t u = qt_bits(f);
    return qt_float((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}
static inline float round_f16(float f) { return qt_f16_to_f32(qt_f32_to_f16(f)); }
static inline float round_f32(float f) { return f; }

/* sum (x - x^)^2 in double of one trial, codes into q (as floats). A trial stops early once
 * its partial sum exceeds `bound` (the best so far; returned as is then): the terms are >= 0
 * and rounding is monotone, so such a trial could not have won, and the choice is the same. */
#define TRIAL(NAME, ROUND)                                                                               \
    static QT_HOT double NAME(const float *x, Py_ssize_t n, float scale, float zp, float qmin, float qmax, float *q, \
                              double bound) {                                                            \
        double lanes[MSE_LANES] = {0};                                                                   \
        Py_ssize_t j = 0;                                                                                \
        while (j + MSE_LANES <= n) {                                                                     \
            const Py_ssize_t stop = j + 4 * MSE_LANES <= n ? j + 4 * MSE_LANES : n - (n - j) % MSE_LANES; \
            for (; j < stop; j += MSE_LANES)                                                             \
                for (int k = 0; k < MSE_LANES; k++) {                                                    \
                    float v = ROUND(ROUND(x[j + k] / scale) + zp);                                       \
                    v = v < qmin ? qmin : v;                                                             \
                    v = v > qmax ? qmax : v;                                                             \
                    v = rne(v);                                                                          \
                    q[j + k] = v;                                                                        \
                    double e = (double)x[j + k] - (double)ROUND((v - zp) * scale);                       \
                    lanes[k] += e * e;                                                                   \
                }                                                                                        \
            double partial = 0;                                                                          \
            for (int k = 0; k < MSE_LANES; k++) partial += lanes[k];                                     \
            if (partial > bound) return partial;                                                         \
        }                                                                                                \
        for (; j < n; j++) {                                                                             \
            float v = ROUND(ROUND(x[j] / scale) + zp);                                                   \
            v = v < qmin ? qmin : v;                                                                     \
            v = v > qmax ? qmax : v;                                                                     \
            v = rne(v);                                                                                  \
            q[j] = v;                                                                                    \
            double e = (double)x[j] - (double)ROUND((v - zp) * scale);                                   \
            lanes[0] += e * e;                                                                           \
        }                                                                                                \
        double total = 0;                                                                                \
        for (int k = 0; k < MSE_LANES; k++) total += lanes[k];                                           \
        return total;                                                                                    \
    }

TRIAL(trial_bf16, round_bf16_finite)
TRIAL(trial_f16, round_f16)
TRIAL(trial_f32, round_f32)

static double trial(const float *x, Py_ssize_t n, float scale, float zp, float qmin, float qmax, int dt, float *q, double bound) {
    if (dt == QT_BF16) return trial_bf16(x, n, scale, zp, qmin, qmax, q, bound);
    if (dt == QT_F16) return trial_f16(x, n, scale, zp, qmin, qmax, q, bound);
    return trial_f32(x, n, scale, zp, qmin, qmax, q, bound);
}

/* sum(x * w) and sum(w * w) in double, w = q - zp (exact products) */
static QT_HOT void refit_sums(const float *x, const float *q, Py_ssize_t n, float zp, double *xw, double *ww) {
    double a[MSE_LANES] = {0}, b[MSE_LANES] = {0};
    Py_ssize_t j = 0;
    for (; j + MSE_LANES <= n; j += MSE_LANES)
        for (int k = 0; k < MSE_LANES; k++) {
            double w = (double)q[j + k] - (double)zp;
            a[k] += (double)x[j + k] * w;
            b[k] += w * w;
        }
    for (; j < n; j++) {
        double w = (double)q[j] - (double)zp;
        a[0] += (double)x[j] * w;
        b[0] += w * w;
    }
    *xw = 0;
    *ww = 0;
    for (int k = 0; k < MSE_LANES; k++) {
        *xw += a[k];
        *ww += b[k];
    }
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

void qt_mse_group(const float *x, Py_ssize_t n, int dt, float qmin, float qmax, int symmetric, float lo, float hi, float *scale_out,
                  float *zp_out, float *q, float *best_q) {
    float best_scale, best_zp = 0.0f;
    double best;
    if (symmetric) {
        const float half = (qmax - qmin) / 2.0f;
        const float amax = -lo > hi ? -lo : hi;
        for (int k = 0; k < SHRINK_STEPS; k++) {
            const float factor = (float)(1.0 - k * 0.01);
            float s = qt_round_to((amax * factor) / half, dt);
            if (s == 0.0f) s = EPS_BY_DT[dt];
            const double err = trial(x, n, s, 0.0f, qmin, qmax, dt, k == 0 ? best_q : q, k == 0 ? __builtin_inf() : best);
            if (k == 0 || err < best) {
                best = err;
                best_scale = s;
                if (k) memcpy(best_q, q, (size_t)n * sizeof(float));
            }
        }
    } else {
        int first = 1;
        const double step = qmax < 2.0f ? 0.1 : 0.05;
        for (int i = 0; i < GRID_STEPS; i++) {
            const float low = qt_round_to(lo * (float)(1.0 - i * step), dt);
            for (int j = 0; j < GRID_STEPS; j++) {
                const float high = qt_round_to(hi * (float)(1.0 - j * step), dt);
                float s, z;
                asym_params(low, high, qmin, qmax, dt, &s, &z);
                const double err = trial(x, n, s, z, qmin, qmax, dt, first ? best_q : q, first ? __builtin_inf() : best);
                if (first || err < best) {
                    best = err;
                    best_scale = s;
                    best_zp = z;
                    if (!first) memcpy(best_q, q, (size_t)n * sizeof(float));
                }
                first = 0;
            }
        }
    }
    for (int refit = 0; refit < 2; refit++) {
        double xw, ww;
        refit_sums(x, best_q, n, best_zp, &xw, &ww);
        if (!(ww > 0)) continue;
        const float s = qt_round_to((float)(xw / ww), dt);
        if (!(s > 0) || s == __builtin_inff()) continue;
        const double err = trial(x, n, s, best_zp, qmin, qmax, dt, q, best);
        if (err < best) {
            best = err;
            best_scale = s;
            memcpy(best_q, q, (size_t)n * sizeof(float));
        }
    }
    *scale_out = best_scale;
    *zp_out = best_zp;
}
