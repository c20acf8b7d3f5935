/* dtype.c -- Element sizes, names and half-precision conversions. */
#include "common/dtype.h"

#include <math.h>
#include <string.h>

size_t pd_dtype_size(pd_dtype t)
{
    switch (t) {
    case PD_DTYPE_F32: return 4;
    case PD_DTYPE_BF16: return 2;
    case PD_DTYPE_F16: return 2;
    case PD_DTYPE_I32: return 4;
    case PD_DTYPE_F8E4M3: return 1;
    }
    return 0;
}

const char *pd_dtype_name(pd_dtype t)
{
    switch (t) {
    case PD_DTYPE_F32: return "F32";
    case PD_DTYPE_BF16: return "BF16";
    case PD_DTYPE_F16: return "F16";
    case PD_DTYPE_I32: return "I32";
    case PD_DTYPE_F8E4M3: return "F8_E4M3";
    }
    return "?";
}

float pd_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h >> 15) & 1u;
    uint32_t exp = (uint32_t)(h >> 10) & 0x1fu;
    uint32_t man = (uint32_t)h & 0x3ffu;
    float v;
    if (exp == 0) {
        v = ldexpf((float)man, -24); /* subnormal (or zero) */
    } else if (exp == 31) {
        v = man ? NAN : INFINITY;
    } else {
        v = ldexpf((float)(man | 0x400u), (int)exp - 25);
    }
    return sign ? -v : v;
}

uint16_t pd_f32_to_f16(float f)
{
    union { uint32_t u; float f; } v = {.f = f};
    uint32_t sign = (v.u >> 16) & 0x8000u;
    uint32_t a = v.u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);        /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);       /* overflow -> inf */
    if (a < 0x38800000u) {                                          /* subnormal or zero */
        float m = fabsf(f) * 16777216.0f;                          /* 2^24 */
        return (uint16_t)(sign | (uint32_t)nearbyintf(m));
    }
    uint32_t r = a - 0x38000000u;                                   /* rebias 127 -> 15 */
    uint32_t half = (r >> 13);
    uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;
    return (uint16_t)(sign | half);
}

float pd_e4m3_to_f32(uint8_t b)
{
    const int e = (b >> 3) & 0xf, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = ldexpf((float)m, -9);          /* subnormal: m/8 * 2^-6 */
    else v = ldexpf((float)(8 + m), e - 10);            /* (1 + m/8) * 2^(e-7) */
    return (b & 0x80) ? -v : v;
}

uint8_t pd_f32_to_e4m3(float f)
{
    if (isnan(f)) return 0x7f;
    const uint8_t sign = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (a >= PD_FP8_MAX) return sign | 0x7e;
    if (a == 0.0f) return sign;
    int ex;
    (void)frexpf(a, &ex);                               /* a = fr * 2^ex, fr in [0.5, 1) */
    int e = ex - 1;                                     /* a in [2^e, 2^(e+1)) */
    if (e < -6) e = -6;                                 /* subnormals share 2^-6's step */
    /* steps of 2^(e-3): q in [8, 16] for normals, [0, 8] for subnormals; scaling by a power
     * of two is exact, nearbyintf rounds half to even */
    const int q = (int)nearbyintf(ldexpf(a, 3 - e));
    int code = (e + 6) * 8 + q;                         /* q = 16 carries into the exponent */
    if (code > 0x7e) code = 0x7e;
    return (uint8_t)(sign | code);
}

void pd_fp8_quant_row(const float *x, float *out, int32_t k, int32_t group, pd_act_quant act,
                      float in_scale)
{
    if (act == PD_ACT_NONE) {
        if (out != x) memmove(out, x, (size_t)k * sizeof *out);
        return;
    }
    if (group <= 0) group = k;
    for (int32_t g0 = 0; g0 < k; g0 += group) {
        const int32_t g1 = k - g0 > group ? g0 + group : k;
        float s = in_scale;
        if (act == PD_ACT_DYNAMIC) {
            float amax = 0.0f;
            for (int32_t j = g0; j < g1; j++)
                if (fabsf(x[j]) > amax) amax = fabsf(x[j]);
            s = amax / PD_FP8_MAX;
            if (!(s >= PD_FP8_MIN_SCALE)) s = PD_FP8_MIN_SCALE; /* also NaN */
        }
        for (int32_t j = g0; j < g1; j++) out[j] = pd_e4m3_to_f32(pd_f32_to_e4m3(x[j] / s)) * s;
    }
}

void pd_convert_to_f32(float *dst, const void *src, pd_dtype src_type, size_t n)
{
    switch (src_type) {
    case PD_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        break;
    case PD_DTYPE_BF16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = pd_bf16_to_f32(s[i]);
        break;
    }
    case PD_DTYPE_F16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = pd_f16_to_f32(s[i]);
        break;
    }
    case PD_DTYPE_I32: {
        const int32_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = (float)s[i];
        break;
    }
    case PD_DTYPE_F8E4M3: {
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = pd_e4m3_to_f32(s[i]);
        break;
    }
    }
}
