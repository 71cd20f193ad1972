/* llama.cpp's make_qp_quants (ggml/src/ggml-quants.c, llama.cpp
 * 0c1e57098bba43ac29e6e3b677cdceebdd22334f), byte for byte: the K-quants' sub-block scale and
 * min codes (kquant_encode.c) and IQ2_XXS's scale seed (iq2_encode.c) both use it. It lives below
 * both so that the C files form layers: in kquant_encode.c, iq2_encode.c's call closed a cycle
 * gguf.c -> iq2_encode.c -> kquant_encode.c -> gguf.c (tests/test_native_layers.py). The same
 * float32 operations in the same order as there (kquant_encode.c's header says why that is exact).
 */
#include "qtool_native.h"

#ifdef __FAST_MATH__
#error "kquant_common.c must be built without -ffast-math: its bytes depend on IEEE float32 rounding"
#endif

/* ggml's nearest_int, as kquant_encode.c's `nearest`: f + 1.5*2^23, the low 23 mantissa bits minus 2^22 */
static inline int32_t nearest(float f) { return (int32_t)(qt_bits(f + 12582912.0f) & 0x007FFFFFu) - 0x00400000; }

/* make_qp_quants(n, nmax, x, L, w): non-negative codes (held as ggml holds them, in uint8) for
 * the sub-block scales or mins x, weighted; returns the super-block scale (IQ2_XXS uses it too) */
float qt_qp_quants(int n, int nmax, const float *x, uint8_t *L, const float *w) {
    float max = 0.0f;
    for (int i = 0; i < n; i++) max = max > x[i] ? max : x[i];
    if (max < 1e-15f) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = (float)nmax / max;
    for (int i = 0; i < n; i++) L[i] = (uint8_t)nearest(iscale * x[i]);
    const float scale = 1.0f / iscale;
    float best_mse = 0.0f;
    for (int i = 0; i < n; i++) {
        const float diff = x[i] - scale * (float)L[i];
        best_mse += w[i] * diff * diff;
    }
    for (int is = -4; is <= 4; is++) {
        if (is == 0) continue;
        const float iscale_is = (0.1f * (float)is + (float)nmax) / max, scale_is = 1.0f / iscale_is;
        float mse = 0.0f;
        for (int i = 0; i < n; i++) {
            int l = nearest(iscale_is * x[i]);
            l = l < nmax ? l : nmax;
            const float diff = x[i] - scale_is * (float)l;
            mse += w[i] * diff * diff;
        }
        if (mse < best_mse) best_mse = mse, iscale = iscale_is;
    }
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < n; i++) {
        int l = nearest(iscale * x[i]);
        l = l < nmax ? l : nmax;
        L[i] = (uint8_t)l;
        sumlx += w[i] * x[i] * (float)l;
        suml2 += w[i] * (float)l * (float)l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            const float li = (float)L[i];
            float slx = sumlx - w[i] * x[i] * li, sl2 = suml2 - w[i] * li * li;
            if (slx > 0.0f && sl2 > 0.0f) {
                int new_l = nearest(x[i] * sl2 / slx);
                new_l = new_l < nmax ? new_l : nmax;
                if (new_l != (int)L[i]) {
                    slx += w[i] * x[i] * (float)new_l;
                    sl2 += w[i] * (float)new_l * (float)new_l;
                    if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (uint8_t)new_l, sumlx = slx, suml2 = sl2;
                        changed++;
                    }
                }
            }
        }
        if (!changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}
