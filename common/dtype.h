/* dtype.h -- Element types of tensors in checkpoints and backend buffers, with the
 * scalar conversions between them (bf16/f16 <-> f32). */
#ifndef PD_DTYPE_H
#define PD_DTYPE_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    PD_DTYPE_F32 = 0,
    PD_DTYPE_BF16,
    PD_DTYPE_F16,
    PD_DTYPE_I32,
    PD_DTYPE_F8E4M3,   /* float8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no
                        * infinities, 0x7f / 0xff NaN, largest finite 448 (docs/quantization.md) */
} pd_dtype;

/* The largest finite e4m3fn value, and the smallest scale a dynamic quantization takes
 * (an all-zero row gets it: max(amax / 448, PD_FP8_MIN_SCALE)). */
#define PD_FP8_MAX 448.0f
#define PD_FP8_MIN_SCALE (1.0f / (448.0f * 512.0f))

/* Bytes per element. */
size_t pd_dtype_size(pd_dtype t);
/* "F32", "BF16", "F16", "I32", "F8_E4M3" (the safetensors names). */
const char *pd_dtype_name(pd_dtype t);

static inline float pd_bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* Round to nearest even; NaN stays NaN. */
static inline uint16_t pd_f32_to_bf16(float f)
{
    union { uint32_t u; float f; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}

float pd_f16_to_f32(uint16_t h);
/* e4m3fn byte -> f32 (exact). */
float pd_e4m3_to_f32(uint8_t b);
/* f32 -> e4m3fn, round to nearest even, saturating: beyond +-448 gives +-448 (as CUDA's
 * __NV_SATFINITE conversion); NaN gives 0x7f. */
uint8_t pd_f32_to_e4m3(float f);
uint16_t pd_f32_to_f16(float f);

/* Converts n elements of type src_type at src into f32 at dst (I32 is converted by value). */
void pd_convert_to_f32(float *dst, const void *src, pd_dtype src_type, size_t n);

/* How a quantized linear's input rows are quantized before the product. */
typedef enum {
    PD_ACT_NONE = 0,   /* not at all: weight-only (W8A16) */
    PD_ACT_DYNAMIC,    /* per token, in column groups: for each row and group of `group`
                        * columns, s = max(amax / 448, PD_FP8_MIN_SCALE) (f32 ops) */
    PD_ACT_STATIC,     /* one scale for every row: in_scale (the checkpoint's input_scale) */
} pd_act_quant;

/* The FP8 activation quantization every backend's op equals: each element of the row x[k]
 * becomes e4m3(x / s) * s (f32 division, e4m3 as pd_f32_to_e4m3, f32 product), s as act says
 * for its group of `group` columns (the last group may be shorter). PD_ACT_NONE copies.
 * x and out may alias. */
void pd_fp8_quant_row(const float *x, float *out, int32_t k, int32_t group, pd_act_quant act,
                      float in_scale);

#endif
