/* The lane-parallel searches of kquant_encode.c, included once per vector width.
 *
 * Before including: NW (lanes: 8 for AVX2, 4 for SSE2 / NEON), KQ(name) (a per-width name) and
 * KQ_TARGET (the target attribute of the entry points). The vectors are the machine's own width
 * on purpose: GCC splits wider generic vectors for arithmetic but turns their float compares
 * into one scalar compare and branch per lane.
 *
 * Each lane runs one sub-block through exactly the scalar op sequence of ggml-quants.c (see
 * kquant_encode.c for why that is exact); branches on a sub-block's data are per-lane selects.
 */

typedef float KQ(vf) __attribute__((vector_size(4 * NW)));
typedef int32_t KQ(vi) __attribute__((vector_size(4 * NW)));
#define vf KQ(vf)
#define vi KQ(vi)

QT_INLINE vf KQ(splat)(float f) { return (vf){0} + f; }
QT_INLINE vi KQ(isplat)(int32_t i) { return (vi){0} + i; }
QT_INLINE vf KQ(sel)(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }
QT_INLINE vi KQ(isel)(vi m, vi a, vi b) { return (m & a) | (~m & b); }
QT_INLINE vf KQ(vabs)(vf x) { return (vf)((vi)x & 0x7FFFFFFF); }
QT_INLINE vf KQ(tofloat)(vi l) { return __builtin_convertvector(l, vf); }
/* l clamped to [lo, hi], vectors made once outside the loops: GCC otherwise rebuilds the splat of
 * an int, lane by lane, in every iteration */
QT_INLINE vi KQ(clamp)(vi l, vi lo, vi hi) {
    l = KQ(isel)(l < lo, lo, l);
    return KQ(isel)(l > hi, hi, l);
}
QT_INLINE vi KQ(clamp0)(vi l, vi top) {
    l = l & (vi)(l >= 0);
    return KQ(isel)(l > top, top, l);
}
QT_INLINE int KQ(any)(vi m) {
    int32_t r = 0;
    for (int k = 0; k < NW; k++) r |= m[k];
    return r != 0;
}
/* ggml's nearest_int per lane: f + 1.5 * 2^23, low 23 bits, minus 2^22 */
QT_INLINE vi KQ(vnearest)(vf f) { return ((vi)(f + 12582912.0f) & 0x007FFFFF) - 0x00400000; }

#define splat KQ(splat)
#define isplat KQ(isplat)
#define sel KQ(sel)
#define isel KQ(isel)
#define vabs KQ(vabs)
#define tofloat KQ(tofloat)
#define clamp KQ(clamp)
#define vnearest KQ(vnearest)

/* lanes[i][k] = value i of sub-block k (x[n*k .. n*k + n)); lanes past `valid` are zeros,
 * searched and thrown away */
QT_INLINE void KQ(to_lanes)(const float *x, int n, int valid, vf *lanes) {
    for (int i = 0; i < n; i++)
        for (int k = 0; k < NW; k++) lanes[i][k] = k < valid ? x[n * k + i] : 0.0f;
}

/* the first value of largest |x|: `if (ax > amax) { amax = ax; max = x; }` from 0, 0 */
QT_INLINE void KQ(first_abs_max)(const vf *x, int n, vf *amax, vf *max) {
    vf a = splat(0.0f), m = splat(0.0f);
    for (int i = 0; i < n; i++) {
        const vf ax = vabs(x[i]);
        const vi bigger = ax > a;
        a = sel(bigger, ax, a);
        m = sel(bigger, x[i], m);
    }
    *amax = a, *max = m;
}

/* make_qkx2_quants: codes L in [0, nmax], the scale, and the_min = -min, the trial of nstep + 1
 * with the least weighted error */
QT_INLINE void KQ(qkx2)(int n, int nmax, const vf *x, const vf *w, vi *L, vf *scale_out, vf *the_min, float rmin, float rdelta, int nstep, int use_mad) {
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
    const vi top = isplat(nmax);
    vf iscale = (float)nmax / (max - min);
    vf scale = 1.0f / iscale;
    vf best_error = splat(0.0f);
    for (int i = 0; i < n; i++) {
        L[i] = KQ(clamp0)(vnearest(iscale * (x[i] - min)), top);
        vf diff = scale * tofloat(L[i]) + min - x[i];
        diff = use_mad ? vabs(diff) : diff * diff;
        best_error += w[i] * diff;
    }
    vf aux[32];
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * (float)is + (float)nmax) / (max - min);
        vf sum_l = splat(0.0f), sum_l2 = splat(0.0f), sum_xl = splat(0.0f);
        for (int i = 0; i < n; i++) {
            const vf l = tofloat(KQ(clamp0)(vnearest(iscale * (x[i] - min)), top));
            aux[i] = l;
            const vf wl = w[i] * l;
            sum_l += wl;
            sum_l2 += wl * l;
            sum_xl += wl * x[i];
        }
        const vf D = sum_w * sum_l2 - sum_l * sum_l;
        vf this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
        vf this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        const vi positive = this_min > 0.0f;
        this_min = sel(positive, splat(0.0f), this_min);
        this_scale = sel(positive, sum_xl / sum_l2, this_scale);
        vf cur_error = splat(0.0f);
        for (int i = 0; i < n; i++) {
            vf diff = this_scale * aux[i] + this_min - x[i];
            diff = use_mad ? vabs(diff) : diff * diff;
            cur_error += w[i] * diff;
        }
        const vi better = (D > 0.0f) & (cur_error < best_error);
        if (KQ(any)(better)) {
            for (int i = 0; i < n; i++) L[i] = isel(better, __builtin_convertvector(aux[i], vi), L[i]);
            best_error = sel(better, cur_error, best_error);
            scale = sel(better, this_scale, scale);
            min = sel(better, this_min, min);
        }
    }
    for (int i = 0; i < n; i++) L[i] = isel(flat, isplat(0), L[i]);
    *the_min = -sel(flat, flat_min, min);
    *scale_out = sel(flat, splat(0.0f), scale);
}

/* make_q3_quants(n, nmax, x, L, do_rmse = true): codes in [0, 2 nmax), the scale; an all-zero
 * sub-block (|x| < 1e-15) gets codes 0 (not nmax) and scale 0 */
QT_INLINE vf KQ(q3)(int n, int nmax, const vf *x, vi *L) {
    vf amax, max;
    KQ(first_abs_max)(x, n, &amax, &max);
    const vi zero = amax < 1e-15f;
    const vf iscale = (float)(-nmax) / max;
    const vi lo = isplat(-nmax), hi = isplat(nmax - 1), offset = isplat(nmax);
    vf sumlx = splat(0.0f), suml2 = splat(0.0f);
    vf wx[16], w[16];
    for (int i = 0; i < n; i++) {
        L[i] = clamp(vnearest(iscale * x[i]), lo, hi);
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
            const vi new_l = clamp(vnearest(x[i] * sl2 / slx), lo, hi);
            const vf nl = tofloat(new_l);
            const vf slx2 = slx + wx[i] * nl;
            const vf sl22 = sl2 + w[i] * nl * nl;
            const vi take = (slx > 0.0f) & (new_l != L[i]) & (sl22 > 0.0f) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22);
            L[i] = isel(take, new_l, L[i]);
            sumlx = sel(take, slx2, sumlx);
            suml2 = sel(take, sl22, suml2);
            changed |= take;
        }
        if (!KQ(any)(changed)) break;
    }
    for (int i = 0; i < n; i++) L[i] = ~zero & (L[i] + offset);
    return sel(zero | ~(suml2 > 0.0f), splat(0.0f), sumlx / suml2);
}

/* make_qx_quants(n, nmax, x, L, rmse_type = 1, qw = NULL): codes in [0, 2 nmax), the scale */
QT_INLINE vf KQ(qx)(int n, int nmax, const vf *x, vi *L) {
    vf amax, max;
    KQ(first_abs_max)(x, n, &amax, &max);
    const vi zero = amax < 1e-15f;
    vf iscale = (float)(-nmax) / max;
    const vi lo = isplat(-nmax), hi = isplat(nmax - 1), offset = isplat(nmax);
    vf sumlx = splat(0.0f), suml2 = splat(0.0f);
    vf wx[16], w[16];
    for (int i = 0; i < n; i++) {
        const vi l = clamp(vnearest(iscale * x[i]), lo, hi);
        L[i] = l + offset;
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
            const vi l = clamp(vnearest(iscale * x[i]), lo, hi);
            trial[i] = l;
            const vf lf = tofloat(l);
            sumlx += wx[i] * lf;
            suml2 += w[i] * lf * lf;
        }
        const vi better = (suml2 > 0.0f) & (sumlx * sumlx > best * suml2);
        if (KQ(any)(better)) {
            for (int i = 0; i < n; i++) L[i] = isel(better, trial[i] + offset, L[i]);
            const vf s = sumlx / suml2;
            scale = sel(better, s, scale);
            best = sel(better, s * sumlx, best);
        }
    }
    for (int i = 0; i < n; i++) L[i] = isel(zero, isplat(0), L[i]);
    return sel(zero, splat(0.0f), scale);
}

/* -- entry points: `count` sub-blocks (any count) at x; codes into L (row order), scales ------- */

/* Q4_K (nmax 15, rmin -1, 20 steps) and Q5_K (31, -0.5, 15): sub-blocks of 32 weighted
 * av_x + |x| with av_x = sqrt(mean x^2), make_qkx2_quants(..., rdelta 0.1, use_mad false) */
KQ_TARGET static void KQ(k4_search)(const float *x, int count, int nmax, float rmin, int nstep, uint8_t *L, float *scales, float *mins) {
    for (int s0 = 0; s0 < count; s0 += NW) {
        const int valid = count - s0 < NW ? count - s0 : NW;
        vf xs[32], w[32];
        vi codes[32];
        KQ(to_lanes)(x + 32 * s0, 32, valid, xs);
        vf sum_x2 = splat(0.0f);
        for (int i = 0; i < 32; i++) sum_x2 += xs[i] * xs[i];
        vf av_x;
        for (int k = 0; k < NW; k++) av_x[k] = __builtin_sqrtf(sum_x2[k] / 32.0f);
        for (int i = 0; i < 32; i++) w[i] = av_x + vabs(xs[i]);
        vf scale, the_min;
        KQ(qkx2)(32, nmax, xs, w, codes, &scale, &the_min, rmin, 0.1f, nstep, 0);
        for (int k = 0; k < valid; k++) {
            scales[s0 + k] = scale[k], mins[s0 + k] = the_min[k];
            for (int i = 0; i < 32; i++) L[32 * (s0 + k) + i] = (uint8_t)codes[i][k];
        }
    }
}

/* Q2_K: sub-blocks of 16 weighted |x|, make_qkx2_quants(16, 3, ..., -0.5, 0.1, 15, use_mad true) */
KQ_TARGET static void KQ(q2_search)(const float *x, int count, uint8_t *L, float *scales, float *mins) {
    for (int s0 = 0; s0 < count; s0 += NW) {
        const int valid = count - s0 < NW ? count - s0 : NW;
        vf xs[16], w[16];
        vi codes[16];
        KQ(to_lanes)(x + 16 * s0, 16, valid, xs);
        for (int i = 0; i < 16; i++) w[i] = vabs(xs[i]);
        vf scale, the_min;
        KQ(qkx2)(16, 3, xs, w, codes, &scale, &the_min, -0.5f, 0.1f, 15, 1);
        for (int k = 0; k < valid; k++) {
            scales[s0 + k] = scale[k], mins[s0 + k] = the_min[k];
            for (int i = 0; i < 16; i++) L[16 * (s0 + k) + i] = (uint8_t)codes[i][k];
        }
    }
}

/* Q3_K: make_q3_quants(16, 4, ..., true); Q6_K: make_qx_quants(16, 32, ..., 1, NULL) */
KQ_TARGET static void KQ(q3_search)(const float *x, int count, uint8_t *L, float *scales) {
    for (int s0 = 0; s0 < count; s0 += NW) {
        const int valid = count - s0 < NW ? count - s0 : NW;
        vf xs[16];
        vi codes[16];
        KQ(to_lanes)(x + 16 * s0, 16, valid, xs);
        const vf scale = KQ(q3)(16, 4, xs, codes);
        for (int k = 0; k < valid; k++) {
            scales[s0 + k] = scale[k];
            for (int i = 0; i < 16; i++) L[16 * (s0 + k) + i] = (uint8_t)codes[i][k];
        }
    }
}
KQ_TARGET static void KQ(q6_search)(const float *x, int count, uint8_t *L, float *scales) {
    for (int s0 = 0; s0 < count; s0 += NW) {
        const int valid = count - s0 < NW ? count - s0 : NW;
        vf xs[16];
        vi codes[16];
        KQ(to_lanes)(x + 16 * s0, 16, valid, xs);
        const vf scale = KQ(qx)(16, 32, xs, codes);
        for (int k = 0; k < valid; k++) {
            scales[s0 + k] = scale[k];
            for (int i = 0; i < 16; i++) L[16 * (s0 + k) + i] = (uint8_t)codes[i][k];
        }
    }
}

/* -- IQ4_NL -------------------------------------------------------------------------------------- */

/* ggml's best_index_int8 over kvalues_iq4nl, and the value it picks: the nearest value's index,
 * the lower on a tie; at or below the first value 0, at or above the last (or NaN) 15. Its
 * binary search lands on mu = the number of table values <= x, then picks mu - 1 or mu. */
QT_INLINE vi KQ(iq4nl_index)(vf x, vf *value) {
    vi mu = isplat(0);
    for (int k = 0; k < 16; k++) mu -= (vi)(x >= (float)iq4nl_values[k]);
    vf lo = splat(0.0f), hi = splat(0.0f);
    for (int k = 1; k < 16; k++) { /* val[mu - 1], val[mu] for 1 <= mu <= 15 */
        const vi here = mu == k;
        lo = sel(here, splat((float)iq4nl_values[k - 1]), lo);
        hi = sel(here, splat((float)iq4nl_values[k]), hi);
    }
    const vi lower = x - lo < hi - x;
    vi index = isel(lower, mu - 1, mu);
    vf v = sel(lower, lo, hi);
    const vi first = x <= (float)iq4nl_values[0], last = (x >= (float)iq4nl_values[15]) | (x != x);
    index = isel(first, isplat(0), isel(last, isplat(15), index));
    *value = sel(first, splat((float)iq4nl_values[0]), sel(last, splat((float)iq4nl_values[15]), v));
    return index;
}

/* quantize_iq4_nl without quant_weights (quantize_row_iq4_nl_impl(32, 32, ..., NULL, ntry 7))
 * on `count` blocks of 32: d from a 15-step search, weights x^2 */
KQ_TARGET static void KQ(iq4_nl_blocks)(const float *x, int count, uint8_t *out) {
    for (int s0 = 0; s0 < count; s0 += NW) {
        const int valid = count - s0 < NW ? count - s0 : NW;
        vf xs[32], w[32], q;
        KQ(to_lanes)(x + 32 * s0, 32, valid, xs);
        vf amax, max;
        KQ(first_abs_max)(xs, 32, &amax, &max);
        for (int i = 0; i < 32; i++) w[i] = xs[i] * xs[i];
        const vi zero = amax < 1e-15f;
        vf id = 1.0f / (-max / (float)iq4nl_values[0]);
        vf sumqx = splat(0.0f), sumq2 = splat(0.0f);
        for (int i = 0; i < 32; i++) {
            KQ(iq4nl_index)(id * xs[i], &q);
            sumqx += w[i] * q * xs[i];
            sumq2 += w[i] * q * q;
        }
        vf d = sel(sumq2 > 0.0f, sumqx / sumq2, splat(0.0f));
        vf best = d * sumqx;
        for (int itry = -7; itry <= 7; itry++) {
            id = (float)(itry + iq4nl_values[0]) / max;
            sumqx = sumq2 = splat(0.0f);
            for (int i = 0; i < 32; i++) {
                KQ(iq4nl_index)(id * xs[i], &q);
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
        for (int i = 0; i < 32; i++) codes[i] = KQ(iq4nl_index)(inv * xs[i], &q);
        for (int k = 0; k < valid; k++) {
            uint8_t *y = out + 18 * (s0 + k);
            put_f16(y, d[k]);
            for (int j = 0; j < 16; j++) y[2 + j] = (uint8_t)(codes[j][k] | (codes[j + 16][k] << 4));
        }
    }
}

#undef splat
#undef isplat
#undef sel
#undef isel
#undef vabs
#undef tofloat
#undef clamp
#undef vnearest
#undef vf
#undef vi
