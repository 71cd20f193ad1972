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

/* The searches run KQG groups of NW sub-blocks at once, statement by statement (`EACH`), so that
 * the groups' running sums, each a chain of dependent adds, overlap in the pipeline. Arrays are
 * [value][group]. */
#ifndef KQG
#define KQG 2
#define EACH _Pragma("GCC unroll 2") for (int g = 0; g < KQG; g++)
#endif

/* make_qkx2_quants: codes L in [0, nmax], the scale, and the_min = -min, the trial of nstep + 1
 * with the least weighted error */
QT_INLINE void KQ(qkx2)(int n, int nmax, const vf x[][KQG], const vf w[][KQG], vi L[][KQG], vf *scale_out, vf *the_min, float rmin, float rdelta, int nstep, int use_mad) {
    vf min[KQG], max[KQG], sum_w[KQG], sum_x[KQG], flat_min[KQG], scale[KQG], best_error[KQG], iscale[KQG], range[KQG];
    vi flat[KQG];
    const vi top = isplat(nmax);
    EACH min[g] = x[0][g], max[g] = x[0][g], sum_w[g] = w[0][g], sum_x[g] = sum_w[g] * x[0][g];
    for (int i = 1; i < n; i++) {
        EACH {
            min[g] = sel(x[i][g] < min[g], x[i][g], min[g]);
            max[g] = sel(x[i][g] > max[g], x[i][g], max[g]);
            sum_w[g] += w[i][g];
            sum_x[g] += w[i][g] * x[i][g];
        }
    }
    EACH {
        min[g] = sel(min[g] > 0.0f, splat(0.0f), min[g]);
        flat[g] = max[g] == min[g]; /* the scalar code returns here: L = 0, scale 0 */
        flat_min[g] = min[g];
        iscale[g] = (float)nmax / (max[g] - min[g]);
        scale[g] = 1.0f / iscale[g];
        best_error[g] = splat(0.0f);
    }
    for (int i = 0; i < n; i++) {
        EACH {
            L[i][g] = KQ(clamp0)(vnearest(iscale[g] * (x[i][g] - min[g])), top);
            vf diff = scale[g] * tofloat(L[i][g]) + min[g] - x[i][g];
            diff = use_mad ? vabs(diff) : diff * diff;
            best_error[g] += w[i][g] * diff;
        }
    }
    vf aux[32][KQG];
    for (int is = 0; is <= nstep; is++) {
        const float numerator = rmin + rdelta * (float)is + (float)nmax;
        vf sum_l[KQG], sum_l2[KQG], sum_xl[KQG], cur_error[KQG], this_scale[KQG], this_min[KQG], D[KQG];
        vi better[KQG];
        EACH {
            range[g] = max[g] - min[g];
            iscale[g] = numerator / range[g];
            sum_l[g] = sum_l2[g] = sum_xl[g] = splat(0.0f);
        }
        for (int i = 0; i < n; i++) {
            EACH {
                const vf l = tofloat(KQ(clamp0)(vnearest(iscale[g] * (x[i][g] - min[g])), top));
                aux[i][g] = l;
                const vf wl = w[i][g] * l; /* w*l, w*l*l, w*l*x: w*l rounds the same each time */
                sum_l[g] += wl;
                sum_l2[g] += wl * l;
                sum_xl[g] += wl * x[i][g];
            }
        }
        EACH {
            D[g] = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g];
            this_scale[g] = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / D[g];
            this_min[g] = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / D[g];
            const vi positive = this_min[g] > 0.0f;
            this_min[g] = sel(positive, splat(0.0f), this_min[g]);
            this_scale[g] = sel(positive, sum_xl[g] / sum_l2[g], this_scale[g]);
            cur_error[g] = splat(0.0f);
        }
        for (int i = 0; i < n; i++) {
            EACH {
                vf diff = this_scale[g] * aux[i][g] + this_min[g] - x[i][g];
                diff = use_mad ? vabs(diff) : diff * diff;
                cur_error[g] += w[i][g] * diff;
            }
        }
        vi any = isplat(0);
        EACH {
            better[g] = (D[g] > 0.0f) & (cur_error[g] < best_error[g]);
            any |= better[g];
        }
        if (KQ(any)(any)) {
            for (int i = 0; i < n; i++)
                EACH L[i][g] = isel(better[g], __builtin_convertvector(aux[i][g], vi), L[i][g]);
            EACH {
                best_error[g] = sel(better[g], cur_error[g], best_error[g]);
                scale[g] = sel(better[g], this_scale[g], scale[g]);
                min[g] = sel(better[g], this_min[g], min[g]);
            }
        }
    }
    for (int i = 0; i < n; i++) EACH L[i][g] = ~flat[g] & L[i][g];
    EACH {
        the_min[g] = -sel(flat[g], flat_min[g], min[g]);
        scale_out[g] = sel(flat[g], splat(0.0f), scale[g]);
    }
}

/* make_q3_quants(n, nmax, x, L, do_rmse = true): codes in [0, 2 nmax), the scale; an all-zero
 * sub-block (|x| < 1e-15) gets codes 0 (not nmax) and scale 0 */
QT_INLINE void KQ(q3)(int n, int nmax, const vf x[][KQG], vi L[][KQG], vf *scale) {
    const vi lo = isplat(-nmax), hi = isplat(nmax - 1), offset = isplat(nmax);
    vf amax[KQG], max[KQG], iscale[KQG], sumlx[KQG], suml2[KQG], wx[16][KQG], w[16][KQG];
    vi zero[KQG];
    EACH {
        vf column[16];
        for (int i = 0; i < n; i++) column[i] = x[i][g];
        KQ(first_abs_max)(column, n, &amax[g], &max[g]);
        zero[g] = amax[g] < 1e-15f;
        iscale[g] = (float)(-nmax) / max[g];
        sumlx[g] = suml2[g] = splat(0.0f);
    }
    for (int i = 0; i < n; i++) {
        EACH {
            L[i][g] = clamp(vnearest(iscale[g] * x[i][g]), lo, hi);
            w[i][g] = x[i][g] * x[i][g];
            wx[i][g] = w[i][g] * x[i][g];
            const vf l = tofloat(L[i][g]);
            sumlx[g] += wx[i][g] * l;
            suml2[g] += w[i][g] * l * l;
        }
    }
    for (int itry = 0; itry < 5; itry++) {
        vi changed = isplat(0); /* a lane whose pass changed nothing would change nothing again */
        for (int i = 0; i < n; i++) {
            EACH {
                const vf l = tofloat(L[i][g]);
                const vf slx = sumlx[g] - wx[i][g] * l;
                const vf sl2 = suml2[g] - w[i][g] * l * l;
                const vi new_l = clamp(vnearest(x[i][g] * sl2 / slx), lo, hi);
                const vf nl = tofloat(new_l);
                const vf slx2 = slx + wx[i][g] * nl;
                const vf sl22 = sl2 + w[i][g] * nl * nl;
                const vi take = (slx > 0.0f) & (new_l != L[i][g]) & (sl22 > 0.0f) & (slx2 * slx2 * suml2[g] > sumlx[g] * sumlx[g] * sl22);
                L[i][g] = isel(take, new_l, L[i][g]);
                sumlx[g] = sel(take, slx2, sumlx[g]);
                suml2[g] = sel(take, sl22, suml2[g]);
                changed |= take;
            }
        }
        if (!KQ(any)(changed)) break;
    }
    for (int i = 0; i < n; i++) EACH L[i][g] = ~zero[g] & (L[i][g] + offset);
    EACH scale[g] = sel(zero[g] | ~(suml2[g] > 0.0f), splat(0.0f), sumlx[g] / suml2[g]);
}

/* make_qx_quants(n, nmax, x, L, rmse_type = 1, qw): codes in [0, 2 nmax), the scale; w holds
 * the weights (x^2 where qw is NULL, the importance weights otherwise), n <= 32 */
QT_INLINE void KQ(qx)(int n, int nmax, const vf x[][KQG], const vf w[][KQG], vi L[][KQG], vf *scale) {
    const vi lo = isplat(-nmax), hi = isplat(nmax - 1), offset = isplat(nmax);
    vf amax[KQG], max[KQG], sumlx[KQG], suml2[KQG], best[KQG], wx[32][KQG];
    vi zero[KQG];
    EACH {
        vf column[32];
        for (int i = 0; i < n; i++) column[i] = x[i][g];
        KQ(first_abs_max)(column, n, &amax[g], &max[g]);
        zero[g] = amax[g] < 1e-15f;
        sumlx[g] = suml2[g] = splat(0.0f);
    }
    for (int i = 0; i < n; i++) {
        EACH {
            const vi l = clamp(vnearest((float)(-nmax) / max[g] * x[i][g]), lo, hi);
            L[i][g] = l + offset;
            wx[i][g] = w[i][g] * x[i][g];
            const vf lf = tofloat(l);
            sumlx[g] += wx[i][g] * lf;
            suml2[g] += w[i][g] * lf * lf;
        }
    }
    EACH {
        scale[g] = sel(suml2[g] != 0.0f, sumlx[g] / suml2[g], splat(0.0f)); /* `suml2 ? ... : 0`: NaN is true */
        best[g] = scale[g] * sumlx[g];
    }
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        const float numerator = -((float)nmax + 0.1f * (float)is);
        vf iscale[KQG];
        vi trial[32][KQG], better[KQG], any = isplat(0);
        EACH {
            iscale[g] = numerator / max[g];
            sumlx[g] = suml2[g] = splat(0.0f);
        }
        for (int i = 0; i < n; i++) {
            EACH {
                const vi l = clamp(vnearest(iscale[g] * x[i][g]), lo, hi);
                trial[i][g] = l;
                const vf lf = tofloat(l);
                sumlx[g] += wx[i][g] * lf;
                suml2[g] += w[i][g] * lf * lf;
            }
        }
        EACH {
            better[g] = (suml2[g] > 0.0f) & (sumlx[g] * sumlx[g] > best[g] * suml2[g]);
            any |= better[g];
        }
        if (KQ(any)(any)) {
            for (int i = 0; i < n; i++) EACH L[i][g] = isel(better[g], trial[i][g] + offset, L[i][g]);
            EACH {
                const vf s = sumlx[g] / suml2[g];
                scale[g] = sel(better[g], s, scale[g]);
                best[g] = sel(better[g], s * sumlx[g], best[g]);
            }
        }
    }
    for (int i = 0; i < n; i++) EACH L[i][g] = ~zero[g] & L[i][g];
    EACH scale[g] = sel(zero[g], splat(0.0f), scale[g]);
}

/* -- entry points: `count` sub-blocks (any count) at x; codes into L (row order), scales ------- */

/* [value][group] lanes of KQG * NW sub-blocks of n values from x; `valid` of them real */
QT_INLINE void KQ(to_groups)(const float *x, int n, int valid, vf lanes[][KQG]) {
    EACH {
        vf column[32];
        const int here = valid - g * NW;
        KQ(to_lanes)(x + n * NW * g, n, here < 0 ? 0 : here, column);
        for (int i = 0; i < n; i++) lanes[i][g] = column[i];
    }
}

/* the codes of the first `valid` sub-blocks back in row order */
QT_INLINE void KQ(from_groups)(vi codes[][KQG], int n, int valid, uint8_t *L) {
    for (int s = 0; s < valid; s++)
        for (int i = 0; i < n; i++) L[n * s + i] = (uint8_t)codes[i][s / NW][s % NW];
}

/* Q4_K (nmax 15, rmin -1, 20 steps) and Q5_K (31, -0.5, 15): sub-blocks of 32 weighted
 * av_x + |x| with av_x = sqrt(mean x^2), make_qkx2_quants(..., rdelta 0.1, use_mad false) */
KQ_TARGET static void KQ(k4_search)(const float *x, int count, int nmax, float rmin, int nstep, uint8_t *L, float *scales, float *mins) {
    for (int s0 = 0; s0 < count; s0 += KQG * NW) {
        const int valid = count - s0 < KQG * NW ? count - s0 : KQG * NW;
        vf xs[32][KQG], w[32][KQG], scale[KQG], the_min[KQG];
        vi codes[32][KQG];
        KQ(to_groups)(x + 32 * s0, 32, valid, xs);
        EACH {
            vf sum_x2 = splat(0.0f), av_x;
            for (int i = 0; i < 32; i++) sum_x2 += xs[i][g] * xs[i][g];
            for (int k = 0; k < NW; k++) av_x[k] = __builtin_sqrtf(sum_x2[k] / 32.0f);
            for (int i = 0; i < 32; i++) w[i][g] = av_x + vabs(xs[i][g]);
        }
        KQ(qkx2)(32, nmax, xs, w, codes, scale, the_min, rmin, 0.1f, nstep, 0);
        KQ(from_groups)(codes, 32, valid, L + 32 * s0);
        for (int s = 0; s < valid; s++) scales[s0 + s] = scale[s / NW][s % NW], mins[s0 + s] = the_min[s / NW][s % NW];
    }
}

/* Q2_K: sub-blocks of 16 weighted |x|, make_qkx2_quants(16, 3, ..., -0.5, 0.1, 15, use_mad true) */
KQ_TARGET static void KQ(q2_search)(const float *x, int count, uint8_t *L, float *scales, float *mins) {
    for (int s0 = 0; s0 < count; s0 += KQG * NW) {
        const int valid = count - s0 < KQG * NW ? count - s0 : KQG * NW;
        vf xs[16][KQG], w[16][KQG], scale[KQG], the_min[KQG];
        vi codes[16][KQG];
        KQ(to_groups)(x + 16 * s0, 16, valid, xs);
        for (int i = 0; i < 16; i++) EACH w[i][g] = vabs(xs[i][g]);
        KQ(qkx2)(16, 3, xs, w, codes, scale, the_min, -0.5f, 0.1f, 15, 1);
        KQ(from_groups)(codes, 16, valid, L + 16 * s0);
        for (int s = 0; s < valid; s++) scales[s0 + s] = scale[s / NW][s % NW], mins[s0 + s] = the_min[s / NW][s % NW];
    }
}

/* Q3_K: make_q3_quants(16, 4, ..., true); Q6_K: make_qx_quants(16, 32, ..., 1, NULL) */
KQ_TARGET static void KQ(q3_search)(const float *x, int count, uint8_t *L, float *scales) {
    for (int s0 = 0; s0 < count; s0 += KQG * NW) {
        const int valid = count - s0 < KQG * NW ? count - s0 : KQG * NW;
        vf xs[16][KQG], scale[KQG];
        vi codes[16][KQG];
        KQ(to_groups)(x + 16 * s0, 16, valid, xs);
        KQ(q3)(16, 4, xs, codes, scale);
        KQ(from_groups)(codes, 16, valid, L + 16 * s0);
        for (int s = 0; s < valid; s++) scales[s0 + s] = scale[s / NW][s % NW];
    }
}
KQ_TARGET static void KQ(q6_search)(const float *x, int count, uint8_t *L, float *scales) {
    for (int s0 = 0; s0 < count; s0 += KQG * NW) {
        const int valid = count - s0 < KQG * NW ? count - s0 : KQG * NW;
        vf xs[16][KQG], scale[KQG];
        vi codes[16][KQG];
        vf w[16][KQG];
        KQ(to_groups)(x + 16 * s0, 16, valid, xs);
        for (int i = 0; i < 16; i++) EACH w[i][g] = xs[i][g] * xs[i][g];
        KQ(qx)(16, 32, xs, w, codes, scale);
        KQ(from_groups)(codes, 16, valid, L + 16 * s0);
        for (int s = 0; s < valid; s++) scales[s0 + s] = scale[s / NW][s % NW];
    }
}

/* -- with importance weights (llama.cpp's quant_weights): the weights come in, one per value ---- */

/* make_qkx3_quants(n, nmax, x, w, L, &the_min, Laux, -0.9, 0.05, 36, use_mad false) on `count`
 * sub-blocks of n (16 or 32): Q2_K, Q4_K, Q5_K, Q4_1, Q5_1 with an imatrix. With the weights
 * given it is make_qkx2_quants' search (`max <= min` and `max == min` agree: min <= max). */
KQ_TARGET static void KQ(qkx3_search)(const float *x, const float *wt, int n, int count, int nmax, uint8_t *L, float *scales, float *mins) {
    for (int s0 = 0; s0 < count; s0 += KQG * NW) {
        const int valid = count - s0 < KQG * NW ? count - s0 : KQG * NW;
        vf xs[32][KQG], w[32][KQG], scale[KQG], the_min[KQG];
        vi codes[32][KQG];
        KQ(to_groups)(x + n * s0, n, valid, xs);
        KQ(to_groups)(wt + n * s0, n, valid, w);
        KQ(qkx2)(n, nmax, xs, w, codes, scale, the_min, -0.9f, 0.05f, 36, 0);
        KQ(from_groups)(codes, n, valid, L + n * s0);
        for (int s = 0; s < valid; s++) scales[s0 + s] = scale[s / NW][s % NW], mins[s0 + s] = the_min[s / NW][s % NW];
    }
}

/* make_qx_quants(n, nmax, x, L, 1, w) on `count` sub-blocks of n (16 or 32): Q3_K, Q6_K, Q4_0,
 * Q5_0 with an imatrix; codes in [0, 2 nmax) */
KQ_TARGET static void KQ(qx_search)(const float *x, const float *wt, int n, int count, int nmax, uint8_t *L, float *scales) {
    for (int s0 = 0; s0 < count; s0 += KQG * NW) {
        const int valid = count - s0 < KQG * NW ? count - s0 : KQG * NW;
        vf xs[32][KQG], w[32][KQG], scale[KQG];
        vi codes[32][KQG];
        KQ(to_groups)(x + n * s0, n, valid, xs);
        KQ(to_groups)(wt + n * s0, n, valid, w);
        KQ(qx)(n, nmax, xs, w, codes, scale);
        KQ(from_groups)(codes, n, valid, L + n * s0);
        for (int s = 0; s < valid; s++) scales[s0 + s] = scale[s / NW][s % NW];
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

/* quantize_row_iq4_nl_impl's scale search (ntry 7) on one block of 32 per lane: d from a
 * 15-step search with weights w (x^2 without quant_weights), 0 for an all-zero block */
QT_INLINE vf KQ(iq4_d)(const vf *xs, const vf *w) {
    vf amax, max, q;
    KQ(first_abs_max)(xs, 32, &amax, &max);
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
    return sel(zero, splat(0.0f), d);
}

/* the weights of `valid` blocks of 32 into lanes: wt's, or x^2 where wt is NULL */
QT_INLINE void KQ(iq4_weights)(const vf *xs, const float *wt, int valid, vf *w) {
    if (wt) KQ(to_lanes)(wt, 32, valid, w);
    else for (int i = 0; i < 32; i++) w[i] = xs[i] * xs[i];
}

/* IQ4_XS's first stage: d of each of `count` blocks of 32 (weights wt, or x^2 where NULL) */
KQ_TARGET static void KQ(iq4_search)(const float *x, const float *wt, int count, float *d_out) {
    for (int s0 = 0; s0 < count; s0 += NW) {
        const int valid = count - s0 < NW ? count - s0 : NW;
        vf xs[32], w[32];
        KQ(to_lanes)(x + 32 * s0, 32, valid, xs);
        KQ(iq4_weights)(xs, wt ? wt + 32 * s0 : NULL, valid, w);
        const vf d = KQ(iq4_d)(xs, w);
        for (int k = 0; k < valid; k++) d_out[s0 + k] = d[k];
    }
}

/* quantize_iq4_nl (quantize_row_iq4_nl_impl(32, 32, ..., ntry 7)) on `count` blocks of 32:
 * weights wt (qw * sqrt(sigma2 + x^2), made by the caller), or x^2 where wt is NULL */
KQ_TARGET static void KQ(iq4_nl_blocks)(const float *x, const float *wt, int count, uint8_t *out) {
    for (int s0 = 0; s0 < count; s0 += NW) {
        const int valid = count - s0 < NW ? count - s0 : NW;
        vf xs[32], w[32], q;
        KQ(to_lanes)(x + 32 * s0, 32, valid, xs);
        KQ(iq4_weights)(xs, wt ? wt + 32 * s0 : NULL, valid, w);
        const vf d = KQ(iq4_d)(xs, w);
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
