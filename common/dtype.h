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
} pd_dtype;

/* Bytes per element. */
size_t pd_dtype_size(pd_dtype t);
/* "F32", "BF16", "F16", "I32". */
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
uint16_t pd_f32_to_f16(float f);

/* Converts n elements of type src_type at src into f32 at dst (I32 is converted by value). */
void pd_convert_to_f32(float *dst, const void *src, pd_dtype src_type, size_t n);

#endif
