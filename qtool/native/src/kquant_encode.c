/* GGUF K-quant encoders (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_NL, byte for byte llama.cpp's
 * reference quantizers without an importance matrix: quantize_row_qN_K_ref and
 * quantize_iq4_nl(..., quant_weights = NULL) of ggml/src/ggml-quants.c, as llama-quantize runs
 * them (llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f; tests/fixtures/gguf_kquants holds
 * the proof, made by compiling that file).
 *
 * Why this is exact: ggml-base compiles ggml-quants.c for baseline x86-64 (no FMA, no
 * fast-math), so every float expression there is a chain of separately rounded float32 add,
 * sub, mul, div and sqrt, in the order C evaluates it; `w*x*l` is (w*x)*(float)l. We do the same
 * operations in the same order. (A llama.cpp built where the compiler contracts a*b+c into FMA by
 * default, e.g. GCC on aarch64, can write other bytes: the reference is the x86-64 build.) The searches (make_qkx2_quants, make_q3_quants,
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

#ifdef __FAST_MATH__
#error "kquant_encode.c must be built without -ffast-math: its bytes depend on IEEE float32 rounding"
#endif

/* the lane vectors live in registers of always-inline functions; no ABI is crossed */
#pragma GCC diagnostic ignored "-Wpsabi"

#define QT_INLINE static inline __attribute__((always_inline))

QT_INLINE int32_t nearest(float f) { return (int32_t)(qt_bits(f + 12582912.0f) & 0x007FFFFFu) - 0x00400000; }

QT_INLINE void put_f16(uint8_t *p, float f) {
    const uint16_t h = qt_f32_to_f16(f);
    memcpy(p, &h, 2);
}
QT_INLINE float get_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return qt_f16_to_f32(h);
}

/* IQ4_NL's 16 values (kvalues_iq4nl) */
static const int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* -- the searches, at the machine's vector width (kquant_lanes.h) --------------------------------- */

#if defined(__GNUC__) && defined(__x86_64__)
#define QT_KQ_X86 1
#define NW 8
#define KQ(name) name##_avx2
#define KQ_TARGET __attribute__((target("avx2")))
#include "kquant_lanes.h"
#undef NW
#undef KQ
#undef KQ_TARGET
#endif

#define NW 4
#define KQ(name) name##_v4
#define KQ_TARGET
#include "kquant_lanes.h"
#undef NW
#undef KQ
#undef KQ_TARGET

/* The widest build the CPU runs (AVX2 8 lanes, else 4: SSE2 on x86, NEON elsewhere), capped by
 * qt_kquant_set_lanes. Both give the same bytes: a lane's arithmetic is the same whatever the
 * width. (A 16-lane AVX-512 build of the same code measured slower than AVX2 here, so there is
 * none.) */
static int qt_kq_max_lanes = 8;
void qt_kquant_set_lanes(int lanes) { qt_kq_max_lanes = lanes; }
PyObject *qt_py_kquant_set_lanes(PyObject *self, PyObject *args) {
    (void)self;
    int lanes;
    if (!PyArg_ParseTuple(args, "i", &lanes)) return NULL;
    qt_kquant_set_lanes(lanes);
    Py_RETURN_NONE;
}

static int kq_lanes(void) {
#ifdef QT_KQ_X86
    if (qt_kq_max_lanes >= 8 && __builtin_cpu_supports("avx2")) return 8;
#endif
    return 4;
}
#ifdef QT_KQ_X86
#define QT_KQ_CALL(lanes, name, ...) \
    ((lanes) == 8 ? name##_avx2(__VA_ARGS__) : name##_v4(__VA_ARGS__))
#else
#define QT_KQ_CALL(lanes, name, ...) name##_v4(__VA_ARGS__)
#endif

/* -- super-blocks: the scalar parts, once per 256 values ------------------------------------------ */

/* 2-bit codes: byte 32*(j/128) + j%32 holds codes j, j+32, j+64, j+96 (j%128 < 32), low bits first */
QT_INLINE void pack2(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < 256; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* the 6-bit scale and min codes of Q4_K/Q5_K sub-blocks 0..7 into 12 bytes, and back
 * (ggml's get_scale_min_k4) */
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

/* the largest value above 0, else 0 (`if (v > best) best = v` from 0: NaN never taken) */
QT_INLINE float positive_max(const float *v, int n) {
    float m = 0.0f;
    for (int j = 0; j < n; j++) m = v[j] > m ? v[j] : m;
    return m;
}

/* Q4_K / Q5_K after the search: d, dmin and the 12 scale bytes at y; L's codes redone from the
 * rounded scales where d * scale is not 0 */
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
            const int l = nearest((x[32 * j + i] + dm) / d);
            L[32 * j + i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        }
    }
}

/* Q4_K: [d][dmin][12 B scales][128 B: per 64 values, 32 bytes, value j low nibble, j+32 high] */
static QT_HOT void q4_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L2[512];
    float scales2[16], mins2[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        const int second = b & 1; /* super-blocks searched in pairs: 16 sub-blocks, whole vectors at any width */
        if (!second) QT_KQ_CALL(lanes, k4_search, xb, nb - b > 1 ? 16 : 8, 15, -1.0f, 20, L2, scales2, mins2);
        uint8_t *L = L2 + 256 * second;
        const float *scales = scales2 + 8 * second, *mins = mins2 + 8 * second;
        uint8_t *y = out + 144 * b;
        k4_finish(xb, scales, mins, 15, L, y);
        uint8_t *q = y + 16;
        for (int j = 0; j < 256; j += 64, q += 32)
            for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
    }
}

/* Q5_K: [d][dmin][12 B scales][32 B fifth bits: bit 2r of qh[j] for value 64r + j, 2r+1 for
 * 64r + 32 + j][128 B low nibbles as Q4_K] */
static QT_HOT void q5_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L2[512];
    float scales2[16], mins2[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        const int second = b & 1; /* super-blocks searched in pairs: 16 sub-blocks, whole vectors at any width */
        if (!second) QT_KQ_CALL(lanes, k4_search, xb, nb - b > 1 ? 16 : 8, 31, -0.5f, 15, L2, scales2, mins2);
        uint8_t *L = L2 + 256 * second;
        const float *scales = scales2 + 8 * second, *mins = mins2 + 8 * second;
        uint8_t *y = out + 176 * b;
        k4_finish(xb, scales, mins, 31, L, y);
        uint8_t *qh = y + 16, *ql = y + 48;
        memset(qh, 0, 32);
        uint8_t m1 = 1, m2 = 2;
        for (int n = 0; n < 256; n += 64, ql += 32, m1 <<= 2, m2 <<= 2) {
            for (int j = 0; j < 32; j++) {
                int l1 = L[n + j], l2 = L[n + j + 32];
                if (l1 > 15) l1 -= 16, qh[j] |= m1;
                if (l2 > 15) l2 -= 16, qh[j] |= m2;
                ql[j] = (uint8_t)(l1 | (l2 << 4));
            }
        }
    }
}

/* Q2_K: [16 B: scale code | min code << 4][64 B 2-bit codes][d][dmin], sub-blocks of 16 */
static QT_HOT void q2_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L[256];
    float scales[16], mins[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        uint8_t *y = out + 84 * b, *sc = y;
        QT_KQ_CALL(lanes, q2_search, xb, 16, L, scales, mins);
        const float max_scale = positive_max(scales, 16), max_min = positive_max(mins, 16);
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
                const int l = nearest((xb[16 * j + i] + dm) / d);
                L[16 * j + i] = (uint8_t)(l < 0 ? 0 : l > 3 ? 3 : l);
            }
        }
        pack2(L, y + 16);
    }
}

/* Q3_K: [32 B high bits: bit j/32 of hmask[j%32]][64 B low 2 bits as Q2_K][12 B 6-bit scales][d] */
static QT_HOT void q3_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L[256];
    float scales[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        uint8_t *y = out + 110 * b, *s = y + 96;
        QT_KQ_CALL(lanes, q3_search, xb, 16, L, scales);
        float max_scale = 0.0f, amax = 0.0f;
        for (int j = 0; j < 16; j++) {
            const float a = __builtin_fabsf(scales[j]);
            if (a > amax) amax = a, max_scale = scales[j];
        }
        memset(s, 0, 12);
        if (max_scale != 0.0f) { /* NaN too, as C's `if (max_scale)` */
            const float iscale = -32.0f / max_scale;
            for (int j = 0; j < 16; j++) {
                int l = (int8_t)(uint8_t)(uint32_t)nearest(iscale * scales[j]); /* ggml keeps it in an int8_t */
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
                const int l = nearest(xb[16 * j + i] / d);
                L[16 * j + i] = (uint8_t)((l < -4 ? -4 : l > 3 ? 3 : l) + 4);
            }
        }
        uint8_t *hmask = y; /* bit p of hmask[j]: code 32p + j is above 3 (and loses its 4) */
        for (int j = 0; j < 32; j++) {
            uint8_t h = 0;
            for (int p = 0; p < 8; p++) {
                const uint8_t high = L[32 * p + j] > 3;
                h |= (uint8_t)(high << p);
                L[32 * p + j] -= (uint8_t)(4 * high);
            }
            hmask[j] = h;
        }
        pack2(L, y + 32);
    }
}

/* Q6_K: [128 B low nibbles][64 B high 2 bits][16 x i8 scales][d] (layout in gguf.c's dq_q6_k) */
static QT_HOT void q6_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L[256];
    float scales[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        uint8_t *y = out + 210 * b;
        QT_KQ_CALL(lanes, q6_search, xb, 16, L, scales);
        float max_scale = 0.0f, max_abs_scale = 0.0f;
        for (int j = 0; j < 16; j++) {
            const float a = __builtin_fabsf(scales[j]);
            if (a > max_abs_scale) max_abs_scale = a, max_scale = scales[j];
        }
        if (max_abs_scale < 1e-15f) {
            memset(y, 0, 210);
            continue;
        }
        const float iscale = -128.0f / max_scale;
        put_f16(y + 208, 1.0f / iscale);
        int8_t *sc = (int8_t *)(y + 192);
        for (int j = 0; j < 16; j++) {
            const int32_t l = nearest(iscale * scales[j]);
            sc[j] = (int8_t)(uint8_t)(uint32_t)(l < 127 ? l : 127);
        }
        const float d_all = get_f16(y + 208);
        for (int j = 0; j < 16; j++) {
            const float d = d_all * (float)sc[j];
            if (d == 0.0f) continue;
            for (int i = 0; i < 16; i++) {
                const int l = nearest(xb[16 * j + i] / d);
                L[16 * j + i] = (uint8_t)((l < -32 ? -32 : l > 31 ? 31 : l) + 32);
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
}

/* -- rows: qt_encode_row's contract (qtool_native.h): blocks' bytes into out, decoded into rec -- */

#define QT_KQUANT_ROW(NAME, TYPE)                                                     \
    void qt_##NAME##_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) { \
        NAME##_blocks(x, blocks, out);                                                  \
        qt_gguf_decode_f32(TYPE, out, rec, blocks);                                     \
    }
QT_KQUANT_ROW(q2_k, "Q2_K")
QT_KQUANT_ROW(q3_k, "Q3_K")
QT_KQUANT_ROW(q4_k, "Q4_K")
QT_KQUANT_ROW(q5_k, "Q5_K")
QT_KQUANT_ROW(q6_k, "Q6_K")

void qt_iq4_nl_row(const float *x, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b += 1024) /* int counts inside */
        QT_KQ_CALL(kq_lanes(), iq4_nl_blocks, x + 32 * b, blocks - b < 1024 ? (int)(blocks - b) : 1024, out + 18 * b);
    qt_gguf_decode_f32("IQ4_NL", out, rec, blocks);
}
