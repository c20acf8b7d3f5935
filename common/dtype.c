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
    }
}
