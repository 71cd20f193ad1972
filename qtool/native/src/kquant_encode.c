/* GGUF K-quant encoders (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_NL, byte for byte llama.cpp's
 * reference quantizers without an importance matrix: quantize_row_qN_K_ref and
 * quantize_iq4_nl(..., quant_weights = NULL) of ggml/src/ggml-quants.c, as llama-quantize runs
 * them (llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f; tests/fixtures/gguf_kquants holds
 * the proof, made by compiling that file).
 *
 * Why this is exact: ggml-base compiles ggml-quants.c for baseline x86-64 (no FMA, no
 * fast-math), so every float expression there is a chain of separately rounded float32 add,
 * sub, mul, div and sqrt, in the order C evaluates it; `w*x*l` is (w*x)*(float)l. We do the same
 * operations in the same order. The searches (make_qkx2_quants, make_q3_quants,
 * make_qx_quants, the IQ4_NL scale search) walk each sub-block's values in order and keep
 * running float sums, so they cannot be vectorized along a sub-block without changing the
 * rounding. Instead each vector lane runs one sub-block: lane k does exactly the scalar
 * sequence of sub-block k, and IEEE arithmetic is exact per lane. Branches on a sub-block's
 * data become per-lane selects: both sides are computed, the scalar path's choice kept
 * (a path not taken may compute inf or NaN; it is never kept). Lanes that finished early (the
 * all-zero sub-block, make_q3_quants' converged passes) are left as the scalar code leaves them.
 *
 * nearest_int is ggml's magic-number rounding: f + 1.5*2^23, then the low 23 mantissa bits
 * minus 2^22. It is a float add and integer bit ops, so it vectorizes exactly and is defined
 * for every float (NaN and inf give fixed garbage, as in llama.cpp), so rows holding NaN or
 * inf get llama.cpp's bytes too.
 *
 * The once-per-super-block parts (scale codes, fp16 rounding of d and dmin, the final codes
 * from the rounded scales, the bit packing) are written as plain scalar code on each block.
 */
#include "qtool_native.h"

/* the lane vectors live in registers of always-inline functions; no ABI is crossed */
#pragma GCC diagnostic ignored "-Wpsabi"

#define QT_INLINE static inline __attribute__((always_inline))

/* -- lanes -------------------------------------------------------------------------------------- */

enum { W = 16 }; /* sub-blocks run side by side: 16 x 4 B = two AVX2 registers, four SSE2 ones */
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

QT_INLINE vf splat(float f) { return (vf){0} + f; }
QT_INLINE vi isplat(int32_t i) { return (vi){0} + i; }
QT_INLINE vf sel(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }
QT_INLINE vi isel(vi m, vi a, vi b) { return (m & a) | (~m & b); }
QT_INLINE vf vabs(vf x) { return (vf)((vi)x & 0x7FFFFFFF); }
QT_INLINE vf tofloat(vi l) { return __builtin_convertvector(l, vf); }
QT_INLINE vi clamp(vi l, int lo, int hi) {
    l = isel(l < lo, isplat(lo), l);
    return isel(l > hi, isplat(hi), l);
}
QT_INLINE int any(vi m) {
    int32_t r = 0;
    for (int k = 0; k < W; k++) r |= m[k];
    return r != 0;
}

/* ggml's nearest_int, per lane and scalar */
QT_INLINE vi vnearest(vf f) { return ((vi)(f + 12582912.0f) & 0x007FFFFF) - 0x00400000; }
QT_INLINE int32_t nearest(float f) { return (int32_t)(qt_bits(f + 12582912.0f) & 0x007FFFFFu) - 0x00400000; }

/* lanes[i][k] = value i of sub-block k (sub-block k = x[n*k .. n*k + n)); lanes past `valid`
 * are zeros, computed and thrown away */
QT_INLINE void to_lanes(const float *x, int n, int valid, vf *lanes) {
    for (int i = 0; i < n; i++)
        for (int k = 0; k < W; k++) lanes[i][k] = k < valid ? x[n * k + i] : 0.0f;
}

/* L[n*k + i] = lanes[i][k] for the first `valid` sub-blocks */
QT_INLINE void from_lanes(const vi *lanes, int n, int valid, uint8_t *L) {
    for (int k = 0; k < valid; k++)
        for (int i = 0; i < n; i++) L[n * k + i] = (uint8_t)lanes[i][k];
}

/* the first value of largest |x| (ggml's `if (ax > amax) { amax = ax; max = x; }`) */
QT_INLINE void first_abs_max(const vf *x, int n, vf *amax, vf *max) {
    vf a = splat(0.0f), m = splat(0.0f);
    for (int i = 0; i < n; i++) {
        const vf ax = vabs(x[i]);
        const vi bigger = ax > a;
        a = sel(bigger, ax, a);
        m = sel(bigger, x[i], m);
    }
    *amax = a, *max = m;
}

/* -- the searches, one sub-block per lane -------------------------------------------------------- */

/* make_qkx2_quants: codes L in [0, nmax] and scale, min (returned negated, as the_min) minimizing
 * the weighted error over nstep + 1 trial scales */
QT_INLINE void qkx2_lanes(int n, int nmax, const vf *x, const vf *w, vi *L, vf *scale_out, vf *the_min, float rmin, float rdelta, int nstep, int use_mad) {
    vf min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        min = sel(x[i] < min, x[i], min);
        max = sel(x[i] > max, x[i], max);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    min = sel(min > 0.0f, splat(0.0f), min);
    const vi flat = max == min; /* the scalar code returns here: L = 0, scale 0 */
    const vf flat_min = min;
    vf iscale = (float)nmax / (max - min);
    vf scale = 1.0f / iscale;
    vf best_error = splat(0.0f);
    for (int i = 0; i < n; i++) {
        L[i] = clamp(vnearest(iscale * (x[i] - min)), 0, nmax);
        vf diff = scale * tofloat(L[i]) + min - x[i];
        diff = use_mad ? vabs(diff) : diff * diff;
        best_error += w[i] * diff;
    }
    vi aux[32];
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * (float)is + (float)nmax) / (max - min);
        vf sum_l = splat(0.0f), sum_l2 = splat(0.0f), sum_xl = splat(0.0f);
        for (int i = 0; i < n; i++) {
            aux[i] = clamp(vnearest(iscale * (x[i] - min)), 0, nmax);
            const vf l = tofloat(aux[i]);
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const vf D = sum_w * sum_l2 - sum_l * sum_l;
        vf this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
        vf this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        const vi positive = this_min > 0.0f;
        this_min = sel(positive, splat(0.0f), this_min);
        this_scale = sel(positive, sum_xl / sum_l2, this_scale);
        vf cur_error = splat(0.0f);
        for (int i = 0; i < n; i++) {
            vf diff = this_scale * tofloat(aux[i]) + this_min - x[i];
            diff = use_mad ? vabs(diff) : diff * diff;
            cur_error += w[i] * diff;
        }
        const vi better = (D > 0.0f) & (cur_error < best_error);
        for (int i = 0; i < n; i++) L[i] = isel(better, aux[i], L[i]);
        best_error = sel(better, cur_error, best_error);
        scale = sel(better, this_scale, scale);
        min = sel(better, this_min, min);
    }
    for (int i = 0; i < n; i++) L[i] = isel(flat, isplat(0), L[i]);
    *the_min = -sel(flat, flat_min, min);
    *scale_out = sel(flat, splat(0.0f), scale);
}

/* make_q3_quants(n, nmax, x, L, do_rmse = true): codes in [0, 2 nmax), scale; an all-zero
 * sub-block (|x| < 1e-15) gets codes 0 (not nmax) and scale 0 */
QT_INLINE vf q3_lanes(int n, int nmax, const vf *x, vi *L) {
    vf amax, max;
    first_abs_max(x, n, &amax, &max);
    const vi zero = amax < 1e-15f;
    const vf iscale = (float)(-nmax) / max;
    vf sumlx = splat(0.0f), suml2 = splat(0.0f);
    vf wx[16], w[16];
    for (int i = 0; i < n; i++) {
        L[i] = clamp(vnearest(iscale * x[i]), -nmax, nmax - 1);
        w[i] = x[i] * x[i];
        wx[i] = w[i] * x[i];
        const vf l = tofloat(L[i]);
        sumlx += wx[i] * l;
        suml2 += w[i] * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        vi changed = isplat(0); /* a lane whose pass changed nothing would change nothing again */
        for (int i = 0; i < n; i++) {
            const vf l = tofloat(L[i]);
            const vf slx = sumlx - wx[i] * l;
            const vf sl2 = suml2 - w[i] * l * l;
            const vi new_l = clamp(vnearest(x[i] * sl2 / slx), -nmax, nmax - 1);
            const vf nl = tofloat(new_l);
            const vf slx2 = slx + wx[i] * nl;
            const vf sl22 = sl2 + w[i] * nl * nl;
            const vi take = (slx > 0.0f) & (new_l != L[i]) & (sl22 > 0.0f) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22);
            L[i] = isel(take, new_l, L[i]);
            sumlx = sel(take, slx2, sumlx);
            suml2 = sel(take, sl22, suml2);
            changed |= take;
        }
        if (!any(changed)) break;
    }
    for (int i = 0; i < n; i++) L[i] = isel(zero, isplat(0), L[i] + nmax);
    return sel(zero | ~(suml2 > 0.0f), splat(0.0f), sumlx / suml2);
}

/* make_qx_quants(n, nmax, x, L, rmse_type = 1, qw = NULL): codes in [0, 2 nmax), scale */
QT_INLINE vf qx_lanes(int n, int nmax, const vf *x, vi *L) {
    vf amax, max;
    first_abs_max(x, n, &amax, &max);
    const vi zero = amax < 1e-15f;
    vf iscale = (float)(-nmax) / max;
    vf sumlx = splat(0.0f), suml2 = splat(0.0f);
    vf wx[16], w[16];
    for (int i = 0; i < n; i++) {
        const vi l = clamp(vnearest(iscale * x[i]), -nmax, nmax - 1);
        L[i] = l + nmax;
        w[i] = x[i] * x[i];
        wx[i] = w[i] * x[i];
        const vf lf = tofloat(l);
        sumlx += wx[i] * lf;
        suml2 += w[i] * lf * lf;
    }
    vf scale = sel(suml2 != 0.0f, sumlx / suml2, splat(0.0f)); /* `suml2 ? ... : 0`: NaN is true */
    vf best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -((float)nmax + 0.1f * (float)is) / max;
        vi trial[16];
        sumlx = suml2 = splat(0.0f);
        for (int i = 0; i < n; i++) {
            const vi l = clamp(vnearest(iscale * x[i]), -nmax, nmax - 1);
            trial[i] = l;
            const vf lf = tofloat(l);
            sumlx += wx[i] * lf;
            suml2 += w[i] * lf * lf;
        }
        const vi better = (suml2 > 0.0f) & (sumlx * sumlx > best * suml2);
        for (int i = 0; i < n; i++) L[i] = isel(better, trial[i] + nmax, L[i]);
        const vf s = sumlx / suml2;
        scale = sel(better, s, scale);
        best = sel(better, s * sumlx, best);
    }
    for (int i = 0; i < n; i++) L[i] = isel(zero, isplat(0), L[i]);
    return sel(zero, splat(0.0f), scale);
}

/* -- super-blocks ------------------------------------------------------------------------------- */

QT_INLINE void put_f16(uint8_t *p, float f) {
    const uint16_t h = qt_f32_to_f16(f);
    memcpy(p, &h, 2);
}
QT_INLINE float get_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return qt_f16_to_f32(h);
}

/* 2-bit codes: byte 32*(j/128) + j%32 holds codes j, j+32, j+64, j+96 (j%128 < 32), low bits first */
QT_INLINE void pack2(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < 256; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* the 6-bit scale and min codes of Q4_K/Q5_K sub-blocks 0..7 into 12 bytes (get_scale_min_k4) */
QT_INLINE void pack_k4_scales(const uint8_t *ls, const uint8_t *lm, uint8_t *s) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (uint8_t)((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
            s[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            s[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
}
QT_INLINE void k4_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63, *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* largest positive value, 0 if none (the scalar `if (v > best) best = v` from 0: NaN skipped) */
QT_INLINE float positive_max(const float *v, int n) {
    float m = 0.0f;
    for (int j = 0; j < n; j++) m = v[j] > m ? v[j] : m;
    return m;
}

/* Q4_K / Q5_K scales and mins of one super-block, from its 8 sub-blocks' searches: writes d,
 * dmin and the 12 scale bytes at y, and replaces L's codes where the rounded scale is not 0 */
QT_INLINE void k4_finish(const float *x, const float *scales, const float *mins, int nmax, uint8_t *L, uint8_t *y) {
    const float max_scale = positive_max(scales, 8), max_min = positive_max(mins, 8);
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        const uint8_t a = (uint8_t)nearest(inv_scale * scales[j]), b = (uint8_t)nearest(inv_min * mins[j]);
        ls[j] = a < 63 ? a : 63;
        lm[j] = b < 63 ? b : 63;
    }
    put_f16(y, max_scale / 63.0f);
    put_f16(y + 2, max_min / 63.0f);
    pack_k4_scales(ls, lm, y + 4);
    const float d_all = get_f16(y), dmin_all = get_f16(y + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k4_scale_min(y + 4, j, &sc, &m);
        const float d = d_all * (float)sc;
        if (d == 0.0f) continue;
        const float dm = dmin_all * (float)m;
        for (int i = 0; i < 32; i++) {
            int l = nearest((x[32 * j + i] + dm) / d);
            l = l < 0 ? 0 : l > nmax ? nmax : l;
            L[32 * j + i] = (uint8_t)l;
        }
    }
}

/* Q4_K / Q5_K search: sub-block weights av_x + |x|, av_x = sqrt(mean x^2); nb super-blocks at x
 * (nb = 1 or 2, 8 lanes each) */
QT_INLINE void k4_search(const float *x, int nb, int nmax, float rmin, int nstep, uint8_t *L, float *scales, float *mins) {
    vf xs[32], w[32];
    vi codes[32];
    to_lanes(x, 32, 8 * nb, xs);
    vf sum_x2 = splat(0.0f);
    for (int i = 0; i < 32; i++) sum_x2 += xs[i] * xs[i];
    vf av_x;
    for (int k = 0; k < W; k++) av_x[k] = __builtin_sqrtf(sum_x2[k] / 32.0f);
    for (int i = 0; i < 32; i++) w[i] = av_x + vabs(xs[i]);
    vf scale, the_min;
    qkx2_lanes(32, nmax, xs, w, codes, &scale, &the_min, rmin, 0.1f, nstep, 0);
    from_lanes(codes, 32, 8 * nb, L);
    for (int k = 0; k < 8 * nb; k++) scales[k] = scale[k], mins[k] = the_min[k];
}

/* Q4_K: [d][dmin][12 B scales][128 B: per 64 values, 32 bytes, value j low nibble, j+32 high] */
static void q4_k_pair(const float *x, int nb, uint8_t *out) {
    uint8_t L[512];
    float scales[16], mins[16];
    k4_search(x, nb, 15, -1.0f, 20, L, scales, mins);
    for (int b = 0; b < nb; b++) {
        uint8_t *y = out + 144 * b, *Lb = L + 256 * b;
        k4_finish(x + 256 * b, scales + 8 * b, mins + 8 * b, 15, Lb, y);
        uint8_t *q = y + 16;
        for (int j = 0; j < 256; j += 64, q += 32)
            for (int l = 0; l < 32; l++) q[l] = (uint8_t)(Lb[j + l] | (Lb[j + l + 32] << 4));
    }
}

/* Q5_K: [d][dmin][12 B scales][32 B fifth bits: bit 2r of qh[j] for value 64r + j, 2r+1 for
 * 64r + 32 + j][128 B low nibbles as Q4_K] */
static void q5_k_pair(const float *x, int nb, uint8_t *out) {
    uint8_t L[512];
    float scales[16], mins[16];
    k4_search(x, nb, 31, -0.5f, 15, L, scales, mins);
    for (int b = 0; b < nb; b++) {
        uint8_t *y = out + 176 * b, *Lb = L + 256 * b;
        k4_finish(x + 256 * b, scales + 8 * b, mins + 8 * b, 31, Lb, y);
        uint8_t *qh = y + 16, *ql = y + 48;
        memset(qh, 0, 32);
        uint8_t m1 = 1, m2 = 2;
        for (int n = 0; n < 256; n += 64, ql += 32, m1 <<= 2, m2 <<= 2) {
            for (int j = 0; j < 32; j++) {
                int l1 = Lb[n + j], l2 = Lb[n + j + 32];
                if (l1 > 15) l1 -= 16, qh[j] |= m1;
                if (l2 > 15) l2 -= 16, qh[j] |= m2;
                ql[j] = (uint8_t)(l1 | (l2 << 4));
            }
        }
    }
}

/* Q2_K: [16 B scale | min << 4][64 B 2-bit codes][d][dmin], 16 sub-blocks of 16 */
static void q2_k_block(const float *x, uint8_t *y) {
    vf xs[16], w[16];
    vi codes[16];
    uint8_t L[256];
    to_lanes(x, 16, 16, xs);
    for (int i = 0; i < 16; i++) w[i] = vabs(xs[i]);
    vf vscale, vmin;
    qkx2_lanes(16, 3, xs, w, codes, &vscale, &vmin, -0.5f, 0.1f, 15, 1);
    from_lanes(codes, 16, 16, L);
    float scales[16], mins[16];
    for (int k = 0; k < 16; k++) scales[k] = vscale[k], mins[k] = vmin[k];
    const float max_scale = positive_max(scales, 16), max_min = positive_max(mins, 16);
    uint8_t *sc = y;
    if (max_scale > 0) {
        const float iscale = 15.0f / max_scale;
        for (int j = 0; j < 16; j++) sc[j] = (uint8_t)nearest(iscale * scales[j]);
        put_f16(y + 80, max_scale / 15.0f);
    } else {
        memset(sc, 0, 16);
        put_f16(y + 80, 0.0f);
    }
    if (max_min > 0) {
        const float iscale = 15.0f / max_min;
        for (int j = 0; j < 16; j++) sc[j] |= (uint8_t)((uint32_t)nearest(iscale * mins[j]) << 4);
        put_f16(y + 82, max_min / 15.0f);
    } else {
        put_f16(y + 82, 0.0f);
    }
    const float d_all = get_f16(y + 80), dmin_all = get_f16(y + 82);
    for (int j = 0; j < 16; j++) {
        const float d = d_all * (float)(sc[j] & 0xF);
        if (d == 0.0f) continue;
        const float dm = dmin_all * (float)(sc[j] >> 4);
        for (int i = 0; i < 16; i++) {
            int l = nearest((x[16 * j + i] + dm) / d);
            l = l < 0 ? 0 : l > 3 ? 3 : l;
            L[16 * j + i] = (uint8_t)l;
        }
    }
    pack2(L, y + 16);
}

/* Q3_K: [32 B high bits: bit j/32 of hmask[j%32]][64 B low 2 bits as Q2_K][12 B 6-bit scales][d] */
static void q3_k_block(const float *x, uint8_t *y) {
    vf xs[16];
    vi codes[16];
    int8_t L[256];
    to_lanes(x, 16, 16, xs);
    const vf vscale = q3_lanes(16, 4, xs, codes);
    for (int k = 0; k < 16; k++)
        for (int i = 0; i < 16; i++) L[16 * k + i] = (int8_t)codes[i][k];
    float max_scale = 0.0f, amax = 0.0f;
    for (int k = 0; k < 16; k++) {
        const float a = __builtin_fabsf(vscale[k]);
        if (a > amax) amax = a, max_scale = vscale[k];
    }
    uint8_t *s = y + 96;
    memset(s, 0, 12);
    if (max_scale != 0.0f) { /* NaN too, as C's `if (max_scale)` */
        const float iscale = -32.0f / max_scale;
        for (int j = 0; j < 16; j++) {
            int l = (int8_t)(uint8_t)(uint32_t)nearest(iscale * vscale[j]); /* kept in an int8_t first */
            l = (l < -32 ? -32 : l > 31 ? 31 : l) + 32;
            if (j < 8) s[j] = (uint8_t)(l & 0xF);
            else s[j - 8] |= (uint8_t)((l & 0xF) << 4);
            s[j % 4 + 8] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
        }
        put_f16(y + 108, 1.0f / iscale);
    } else {
        put_f16(y + 108, 0.0f);
    }
    const float d_all = get_f16(y + 108);
    for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
        const int sc = (low | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
        const float d = d_all * (float)sc;
        if (d == 0.0f) continue;
        for (int i = 0; i < 16; i++) {
            int l = nearest(x[16 * j + i] / d);
            l = l < -4 ? -4 : l > 3 ? 3 : l;
            L[16 * j + i] = (int8_t)(l + 4);
        }
    }
    uint8_t *hmask = y, codes2[256];
    memset(hmask, 0, 32);
    for (int j = 0; j < 256; j++) {
        int l = L[j];
        if (l > 3) hmask[j % 32] |= (uint8_t)(1u << (j / 32)), l -= 4;
        codes2[j] = (uint8_t)l;
    }
    pack2(codes2, y + 32);
}

/* Q6_K: [128 B low nibbles][64 B high 2 bits][16 x i8 scales][d] (layout in gguf.c's dq_q6_k) */
static void q6_k_block(const float *x, uint8_t *y) {
    vf xs[16];
    vi codes[16];
    uint8_t L[256];
    to_lanes(x, 16, 16, xs);
    const vf vscale = qx_lanes(16, 32, xs, codes);
    from_lanes(codes, 16, 16, L);
    float max_scale = 0.0f, max_abs_scale = 0.0f;
    for (int k = 0; k < 16; k++) {
        const float a = __builtin_fabsf(vscale[k]);
        if (a > max_abs_scale) max_abs_scale = a, max_scale = vscale[k];
    }
    if (max_abs_scale < 1e-15f) {
        memset(y, 0, 210);
        return;
    }
    const float iscale = -128.0f / max_scale;
    put_f16(y + 208, 1.0f / iscale);
    int8_t *sc = (int8_t *)(y + 192);
    for (int j = 0; j < 16; j++) {
        const int32_t l = nearest(iscale * vscale[j]);
        sc[j] = (int8_t)(uint8_t)(uint32_t)(l < 127 ? l : 127);
    }
    const float d_all = get_f16(y + 208);
    for (int j = 0; j < 16; j++) {
        const float d = d_all * (float)sc[j];
        if (d == 0.0f) continue;
        for (int i = 0; i < 16; i++) {
            int l = nearest(x[16 * j + i] / d);
            l = l < -32 ? -32 : l > 31 ? 31 : l;
            L[16 * j + i] = (uint8_t)(l + 32);
        }
    }
    uint8_t *ql = y, *qh = y + 128;
    for (int j = 0; j < 256; j += 128, ql += 64, qh += 32) {
        for (int l = 0; l < 32; l++) {
            const uint8_t *c = L + j + l;
            ql[l] = (uint8_t)((c[0] & 0xF) | ((c[64] & 0xF) << 4));
            ql[l + 32] = (uint8_t)((c[32] & 0xF) | ((c[96] & 0xF) << 4));
            qh[l] = (uint8_t)((c[0] >> 4) | ((c[32] >> 4) << 2) | ((c[64] >> 4) << 4) | ((c[96] >> 4) << 6));
        }
    }
}

/* -- IQ4_NL: [d f16][16 B: value j low nibble, j + 16 high], codes index kvalues_iq4nl ------------ */

static const int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ggml's best_index_int8 over the table: the nearest value's index, the lower on a tie; x at or
 * below the first value 0, at or above the last (or NaN) 15. The binary search there lands on
 * mu = the number of table values <= x. */
QT_INLINE vi iq4nl_index(vf x) {
    vi mu = isplat(0);
    for (int k = 0; k < 16; k++) mu -= (vi)(x >= (float)iq4nl_values[k]);
    vf lo = splat(0.0f), hi = splat(0.0f);
    for (int k = 1; k < 16; k++) { /* val[mu - 1], val[mu] for 1 <= mu <= 15 */
        const vi here = mu == k;
        lo = sel(here, splat((float)iq4nl_values[k - 1]), lo);
        hi = sel(here, splat((float)iq4nl_values[k]), hi);
    }
    const vi index = isel(x - lo < hi - x, mu - 1, mu);
    const vi first = x <= (float)iq4nl_values[0], last = (x >= (float)iq4nl_values[15]) | (x != x);
    return isel(first, isplat(0), isel(last, isplat(15), index));
}

/* quantize_row_iq4_nl_impl(32, 32, ..., quant_weights = NULL, ntry = 7) on `valid` blocks */
static void iq4_nl_lanes(const float *x, int valid, uint8_t *out) {
    vf xs[32], w[32];
    to_lanes(x, 32, valid, xs);
    vf amax, max;
    first_abs_max(xs, 32, &amax, &max);
    for (int i = 0; i < 32; i++) w[i] = xs[i] * xs[i];
    const vi zero = amax < 1e-15f;
    const float v0 = (float)iq4nl_values[0];
    vf id = 1.0f / (-max / v0);
    vf sumqx = splat(0.0f), sumq2 = splat(0.0f);
    for (int i = 0; i < 32; i++) {
        const vi l = iq4nl_index(id * xs[i]);
        vf q;
        for (int k = 0; k < W; k++) q[k] = (float)iq4nl_values[l[k]];
        sumqx += w[i] * q * xs[i];
        sumq2 += w[i] * q * q;
    }
    vf d = sel(sumq2 > 0.0f, sumqx / sumq2, splat(0.0f));
    vf best = d * sumqx;
    for (int itry = -7; itry <= 7; itry++) {
        id = (float)(itry + iq4nl_values[0]) / max;
        sumqx = sumq2 = splat(0.0f);
        for (int i = 0; i < 32; i++) {
            const vi l = iq4nl_index(id * xs[i]);
            vf q;
            for (int k = 0; k < W; k++) q[k] = (float)iq4nl_values[l[k]];
            sumqx += w[i] * q * xs[i];
            sumq2 += w[i] * q * q;
        }
        const vi better = (sumq2 > 0.0f) & (sumqx * sumqx > best * sumq2);
        const vf s = sumqx / sumq2;
        d = sel(better, s, d);
        best = sel(better, s * sumqx, best);
    }
    d = sel(zero, splat(0.0f), d);
    const vf inv = sel(d != 0.0f, 1.0f / d, splat(0.0f));
    vi codes[32];
    for (int i = 0; i < 32; i++) codes[i] = iq4nl_index(inv * xs[i]);
    for (int k = 0; k < valid; k++) {
        uint8_t *y = out + 18 * k;
        put_f16(y, d[k]);
        for (int j = 0; j < 16; j++) y[2 + j] = (uint8_t)(codes[j][k] | (codes[j + 16][k] << 4));
    }
}

/* -- rows: qt_encode_row's contract (qtool_native.h): blocks' bytes into out, decoded into rec -- */

QT_HOT void qt_q2_k_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b++) q2_k_block(x + 256 * b, out + 84 * b);
    qt_gguf_decode_f32("Q2_K", out, rec, blocks);
}
QT_HOT void qt_q3_k_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b++) q3_k_block(x + 256 * b, out + 110 * b);
    qt_gguf_decode_f32("Q3_K", out, rec, blocks);
}
QT_HOT void qt_q4_k_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b += 2) q4_k_pair(x + 256 * b, blocks - b > 1 ? 2 : 1, out + 144 * b);
    qt_gguf_decode_f32("Q4_K", out, rec, blocks);
}
QT_HOT void qt_q5_k_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b += 2) q5_k_pair(x + 256 * b, blocks - b > 1 ? 2 : 1, out + 176 * b);
    qt_gguf_decode_f32("Q5_K", out, rec, blocks);
}
QT_HOT void qt_q6_k_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b++) q6_k_block(x + 256 * b, out + 210 * b);
    qt_gguf_decode_f32("Q6_K", out, rec, blocks);
}
QT_HOT void qt_iq4_nl_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b += W) iq4_nl_lanes(x + 32 * b, blocks - b < W ? (int)(blocks - b) : W, out + 18 * b);
    qt_gguf_decode_f32("IQ4_NL", out, rec, blocks);
}
