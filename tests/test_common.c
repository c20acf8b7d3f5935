/* test_common.c -- Tests for common/: the error table (names, messages, pd_errf), dtype sizes
 * and the bf16/f16 <-> f32 conversions (rounding, subnormals, inf, NaN), and the jansson
 * helpers in json_util (typed readers, file loading and their error messages), and the
 * listening addresses of net.h. */
#include <arpa/inet.h>
#include <errno.h>
#include <float.h>
#include <jansson.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/dtype.h"
#include "common/error.h"
#include "common/json_util.h"
#include "common/net.h"
#include "test_util.h"

static uint32_t f32_bits(float f)
{
    union { float f; uint32_t u; } v = {.f = f};
    return v.u;
}

static float f32_from_bits(uint32_t u)
{
    union { uint32_t u; float f; } v = {.u = u};
    return v.f;
}

/* ------------------------------------------------------------------ error.h */

static void test_errors(void)
{
    /* Every code of the table maps to its own name and message. */
    int n = 0;
#define X_CHECK(name, val, msg)                                        \
    CHECK_EQ_INT(PD_##name, val);                                      \
    CHECK(strcmp(pd_err_name(val), "PD_" #name) == 0);                 \
    CHECK(strcmp(pd_strerror(val), msg) == 0);                         \
    CHECK(strcmp(pd_strerror(val), "unknown error") != 0);             \
    n++;
    PD_ERRNO_MAP(X_CHECK)
#undef X_CHECK
    CHECK_EQ_INT(n, 15);

    /* Codes are distinct and negative; names are distinct. */
    static const int codes[] = {
#define X_CODE(name, val, msg) val,
        PD_ERRNO_MAP(X_CODE)
#undef X_CODE
    };
    for (int i = 0; i < n; i++) {
        CHECK(codes[i] < 0);
        for (int j = i + 1; j < n; j++) {
            CHECK(codes[i] != codes[j]);
            CHECK(strcmp(pd_err_name(codes[i]), pd_err_name(codes[j])) != 0);
        }
    }

    /* Spot checks written out, independent of the table. */
    CHECK(strcmp(pd_err_name(PD_EINVAL), "PD_EINVAL") == 0);
    CHECK(strcmp(pd_err_name(-5), "PD_EUNSUPPORTED") == 0);
    CHECK(strcmp(pd_strerror(PD_EIO), "input/output error") == 0);
    CHECK(strcmp(pd_strerror(PD_ESTATE), "operation not valid in this state") == 0);

    CHECK(strcmp(pd_strerror(PD_OK), "success") == 0);
    CHECK(strcmp(pd_err_name(PD_OK), "PD_OK") == 0);

    /* Values outside the table. */
    const int unknown[] = {-16, -999, 1, 42, INT32_MIN};
    for (int i = 0; i < 5; i++) {
        CHECK(strcmp(pd_strerror(unknown[i]), "unknown error") == 0);
        CHECK(strcmp(pd_err_name(unknown[i]), "PD_E?") == 0);
    }

    /* pd_errf formats, returns the code, and accepts a NULL buffer. */
    char err[PD_ERR_LEN];
    CHECK_EQ_INT(pd_errf(err, PD_EFORMAT, "%s: key \"%s\" = %d", "cfg.json", "x", -7), PD_EFORMAT);
    CHECK(strcmp(err, "cfg.json: key \"x\" = -7") == 0);
    CHECK_EQ_INT(pd_errf(NULL, PD_ENOMEM, "lost %d bytes", 12), PD_ENOMEM);
    CHECK_EQ_INT(pd_errf(err, 0, "%s", ""), 0);
    CHECK(err[0] == '\0');

    /* A message longer than PD_ERR_LEN is cut and terminated inside the buffer. */
    char big[PD_ERR_LEN + 64];
    memset(big, '#', sizeof big);
    char longmsg[2 * PD_ERR_LEN];
    memset(longmsg, 'a', sizeof longmsg - 1);
    longmsg[sizeof longmsg - 1] = '\0';
    CHECK_EQ_INT(pd_errf(big, PD_EINVAL, "%s", longmsg), PD_EINVAL);
    CHECK_EQ_INT(strlen(big), PD_ERR_LEN - 1);
    CHECK(big[PD_ERR_LEN] == '#');
}

/* ------------------------------------------------------------------ dtype.h */

static void test_dtype_basics(void)
{
    CHECK_EQ_INT(pd_dtype_size(PD_DTYPE_F32), 4);
    CHECK_EQ_INT(pd_dtype_size(PD_DTYPE_BF16), 2);
    CHECK_EQ_INT(pd_dtype_size(PD_DTYPE_F16), 2);
    CHECK_EQ_INT(pd_dtype_size(PD_DTYPE_I32), 4);
    CHECK(strcmp(pd_dtype_name(PD_DTYPE_F32), "F32") == 0);
    CHECK(strcmp(pd_dtype_name(PD_DTYPE_BF16), "BF16") == 0);
    CHECK(strcmp(pd_dtype_name(PD_DTYPE_F16), "F16") == 0);
    CHECK(strcmp(pd_dtype_name(PD_DTYPE_I32), "I32") == 0);
}

static void test_bf16(void)
{
    CHECK_EQ_INT(pd_f32_to_bf16(1.0f), 0x3f80);
    CHECK_EQ_INT(pd_f32_to_bf16(-2.0f), 0xc000);
    CHECK_EQ_INT(pd_f32_to_bf16(0.0f), 0x0000);
    CHECK_EQ_INT(pd_f32_to_bf16(-0.0f), 0x8000);
    CHECK_NEAR(pd_bf16_to_f32(0x3f80), 1.0, 0);
    CHECK_NEAR(pd_bf16_to_f32(0x4049), 3.140625, 0);
    CHECK_NEAR(pd_bf16_to_f32(0xc2f7), -123.5, 0);

    /* Every non-NaN bf16 survives bf16 -> f32 -> bf16. */
    int bad = 0;
    for (uint32_t h = 0; h <= 0xffff; h++) {
        if ((h & 0x7fff) > 0x7f80) continue;
        if (pd_f32_to_bf16(pd_bf16_to_f32((uint16_t)h)) != h) bad++;
    }
    CHECK_EQ_INT(bad, 0);

    /* Round to nearest, ties to even. */
    CHECK_EQ_INT(pd_f32_to_bf16(f32_from_bits(0x3f807fffu)), 0x3f80); /* below half */
    CHECK_EQ_INT(pd_f32_to_bf16(f32_from_bits(0x3f808000u)), 0x3f80); /* tie, even below */
    CHECK_EQ_INT(pd_f32_to_bf16(f32_from_bits(0x3f808001u)), 0x3f81); /* above half */
    CHECK_EQ_INT(pd_f32_to_bf16(f32_from_bits(0x3f818000u)), 0x3f82); /* tie, odd -> up */
    CHECK_EQ_INT(pd_f32_to_bf16(f32_from_bits(0xbf818000u)), 0xbf82); /* negative tie */
    CHECK_EQ_INT(pd_f32_to_bf16(f32_from_bits(0x3fff8000u)), 0x4000); /* carry into exponent */
    CHECK_EQ_INT(pd_f32_to_bf16(1.0f + 1.0f / 256.0f), 0x3f80);       /* 1 + 2^-8: tie */
    CHECK_EQ_INT(pd_f32_to_bf16(1.0f + 3.0f / 256.0f), 0x3f82);       /* 1 + 3*2^-8: tie */

    /* Infinities, overflow, NaN. */
    CHECK_EQ_INT(pd_f32_to_bf16(INFINITY), 0x7f80);
    CHECK_EQ_INT(pd_f32_to_bf16(-INFINITY), 0xff80);
    CHECK_EQ_INT(pd_f32_to_bf16(FLT_MAX), 0x7f80); /* rounds past the largest bf16 */
    CHECK_EQ_INT(pd_f32_to_bf16(f32_from_bits(0x7f7f7fffu)), 0x7f7f);
    CHECK(isinf(pd_bf16_to_f32(0x7f80)) && pd_bf16_to_f32(0x7f80) > 0);
    CHECK(isinf(pd_bf16_to_f32(0xff80)) && pd_bf16_to_f32(0xff80) < 0);
    const uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7f80ffffu};
    for (int i = 0; i < 5; i++) {
        uint16_t b = pd_f32_to_bf16(f32_from_bits(nans[i]));
        CHECK_MSG((b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0, "NaN 0x%08x -> 0x%04x", nans[i], b);
        CHECK(isnan(pd_bf16_to_f32(b)));
        CHECK_EQ_INT(b >> 15, nans[i] >> 31); /* sign kept */
    }
    CHECK(isnan(pd_bf16_to_f32(0x7fc0)));
    CHECK(isnan(pd_bf16_to_f32(0x7f81)));
}

/* Value of an f16 bit pattern computed from the IEEE definition, independent of dtype.c. */
static double f16_ref(uint16_t h)
{
    int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    double v = exp == 0 ? ldexp(man, -24) : ldexp(1024 + man, exp - 25);
    return sign ? -v : v;
}

static void test_f16(void)
{
    CHECK_NEAR(pd_f16_to_f32(0x3c00), 1.0, 0);
    CHECK_NEAR(pd_f16_to_f32(0xc000), -2.0, 0);
    CHECK_NEAR(pd_f16_to_f32(0x3555), 0.333251953125, 0);
    CHECK_NEAR(pd_f16_to_f32(0x7bff), 65504.0, 0);
    CHECK_NEAR(pd_f16_to_f32(0xfbff), -65504.0, 0);
    CHECK_NEAR(pd_f16_to_f32(0x0001), 5.9604644775390625e-8, 0); /* 2^-24 */
    CHECK_NEAR(pd_f16_to_f32(0x03ff), 1023.0 * 5.9604644775390625e-8, 0);
    CHECK_NEAR(pd_f16_to_f32(0x0400), 6.103515625e-5, 0); /* 2^-14 */
    CHECK_NEAR(pd_f16_to_f32(0x8001), -5.9604644775390625e-8, 0);
    CHECK(pd_f16_to_f32(0x0000) == 0.0f && !signbit(pd_f16_to_f32(0x0000)));
    CHECK(pd_f16_to_f32(0x8000) == 0.0f && signbit(pd_f16_to_f32(0x8000)));
    CHECK(isinf(pd_f16_to_f32(0x7c00)) && pd_f16_to_f32(0x7c00) > 0);
    CHECK(isinf(pd_f16_to_f32(0xfc00)) && pd_f16_to_f32(0xfc00) < 0);
    CHECK(isnan(pd_f16_to_f32(0x7e00)));
    CHECK(isnan(pd_f16_to_f32(0x7c01)));
    CHECK(isnan(pd_f16_to_f32(0xfe00)));

    /* Decoding matches the IEEE definition for every finite pattern, and encoding gives the
     * pattern back. */
    int bad_dec = 0, bad_rt = 0;
    for (uint32_t h = 0; h <= 0xffff; h++) {
        if ((h & 0x7c00) == 0x7c00) continue;
        if ((double)pd_f16_to_f32((uint16_t)h) != f16_ref((uint16_t)h)) bad_dec++;
        if (pd_f32_to_f16(pd_f16_to_f32((uint16_t)h)) != h) bad_rt++;
    }
    CHECK_EQ_INT(bad_dec, 0);
    CHECK_EQ_INT(bad_rt, 0);

    /* Encoding of special values and edges. */
    CHECK_EQ_INT(pd_f32_to_f16(1.0f), 0x3c00);
    CHECK_EQ_INT(pd_f32_to_f16(-0.0f), 0x8000);
    CHECK_EQ_INT(pd_f32_to_f16(65504.0f), 0x7bff);
    CHECK_EQ_INT(pd_f32_to_f16(65519.0f), 0x7bff);  /* below the 65520 midpoint */
    CHECK_EQ_INT(pd_f32_to_f16(65520.0f), 0x7c00);  /* tie with odd 0x7bff -> inf */
    CHECK_EQ_INT(pd_f32_to_f16(-65520.0f), 0xfc00);
    CHECK_EQ_INT(pd_f32_to_f16(1e6f), 0x7c00);
    CHECK_EQ_INT(pd_f32_to_f16(FLT_MAX), 0x7c00);
    CHECK_EQ_INT(pd_f32_to_f16(INFINITY), 0x7c00);
    CHECK_EQ_INT(pd_f32_to_f16(-INFINITY), 0xfc00);
    uint16_t qn = pd_f32_to_f16(NAN);
    CHECK((qn & 0x7c00) == 0x7c00 && (qn & 0x3ff) != 0);
    uint16_t sn = pd_f32_to_f16(f32_from_bits(0xff800001u)); /* payload only in low bits */
    CHECK((sn & 0x7c00) == 0x7c00 && (sn & 0x3ff) != 0 && (sn & 0x8000));

    /* Subnormals and underflow, ties to even. */
    CHECK_EQ_INT(pd_f32_to_f16(ldexpf(1.0f, -24)), 0x0001);
    CHECK_EQ_INT(pd_f32_to_f16(ldexpf(1.0f, -25)), 0x0000);          /* tie with 0 -> 0 */
    CHECK_EQ_INT(pd_f32_to_f16(ldexpf(1.0001f, -25)), 0x0001);       /* just above the tie */
    CHECK_EQ_INT(pd_f32_to_f16(ldexpf(3.0f, -26)), 0x0001);          /* 0.75 * 2^-24 -> 1 */
    CHECK_EQ_INT(pd_f32_to_f16(ldexpf(3.0f, -25)), 0x0002);          /* 1.5 * 2^-24 -> even 2 */
    CHECK_EQ_INT(pd_f32_to_f16(ldexpf(5.0f, -25)), 0x0002);          /* 2.5 * 2^-24 -> even 2 */
    CHECK_EQ_INT(pd_f32_to_f16(-ldexpf(1.0f, -24)), 0x8001);
    CHECK_EQ_INT(pd_f32_to_f16(ldexpf(1.0f, -30)), 0x0000);
    CHECK_EQ_INT(pd_f32_to_f16(ldexpf(2047.0f, -25)), 0x0400);       /* 1023.5 * 2^-24 -> normal */
    CHECK_EQ_INT(pd_f32_to_f16(ldexpf(1.0f, -14)), 0x0400);

    /* Normals, ties to even. */
    CHECK_EQ_INT(pd_f32_to_f16(1.0f + ldexpf(1.0f, -11)), 0x3c00);        /* tie, even below */
    CHECK_EQ_INT(pd_f32_to_f16(1.0f + ldexpf(3.0f, -11)), 0x3c02);        /* tie, odd -> up */
    CHECK_EQ_INT(pd_f32_to_f16(1.0f + ldexpf(1.0f, -11) + ldexpf(1.0f, -20)), 0x3c01);
    CHECK_EQ_INT(pd_f32_to_f16(2.0f - ldexpf(1.0f, -12)), 0x4000);        /* carry to 2.0 */
    CHECK_EQ_INT(pd_f32_to_f16(0.1f), 0x2e66);

    /* Pseudo-random f32 values in the f16 range: the result is the nearest f16, ties even. */
    uint32_t s = 12345u;
    int bad_near = 0;
    for (int k = 0; k < 200000; k++) {
        s = s * 1664525u + 1013904223u;
        /* exponents 2^-27 .. 2^15 (f32 biased 100 .. 142), any mantissa and sign */
        uint32_t bits = (s & 0x807fffffu) | ((100u + (s >> 23) % 43u) << 23);
        float f = f32_from_bits(bits);
        if (fabsf(f) >= 65520.0f) continue;
        uint16_t h = pd_f32_to_f16(f);
        uint16_t mag = h & 0x7fff;
        double x = fabs((double)f), d = fabs(x - f16_ref(mag));
        int ok = (h >> 15) == (bits >> 31) || mag == 0;
        if (mag > 0) {
            double dl = fabs(x - f16_ref((uint16_t)(mag - 1)));
            ok = ok && (d < dl || (d == dl && (mag & 1) == 0));
        }
        if (mag < 0x7bff) {
            double du = fabs(x - f16_ref((uint16_t)(mag + 1)));
            ok = ok && (d < du || (d == du && (mag & 1) == 0));
        }
        if (!ok && bad_near++ < 5)
            fprintf(stderr, "f32 0x%08x -> f16 0x%04x is not the nearest\n", bits, h);
    }
    CHECK_EQ_INT(bad_near, 0);
}

static void test_convert(void)
{
    float out[4];
    const float f32[4] = {1.5f, -0.0f, 3e38f, -7.25f};
    pd_convert_to_f32(out, f32, PD_DTYPE_F32, 4);
    CHECK(memcmp(out, f32, sizeof out) == 0);

    const uint16_t bf[4] = {0x3f80, 0xc2f7, 0x7f80, 0x0001};
    pd_convert_to_f32(out, bf, PD_DTYPE_BF16, 4);
    CHECK_NEAR(out[0], 1.0, 0);
    CHECK_NEAR(out[1], -123.5, 0);
    CHECK(isinf(out[2]));
    CHECK_EQ_INT(f32_bits(out[3]), 0x00010000u);

    const uint16_t hf[4] = {0x3c00, 0x0001, 0xfbff, 0x7e00};
    pd_convert_to_f32(out, hf, PD_DTYPE_F16, 4);
    CHECK_NEAR(out[0], 1.0, 0);
    CHECK_NEAR(out[1], 5.9604644775390625e-8, 0);
    CHECK_NEAR(out[2], -65504.0, 0);
    CHECK(isnan(out[3]));

    const int32_t iv[4] = {0, -7, 16777217, INT32_MIN};
    pd_convert_to_f32(out, iv, PD_DTYPE_I32, 4);
    CHECK_NEAR(out[0], 0.0, 0);
    CHECK_NEAR(out[1], -7.0, 0);
    CHECK_NEAR(out[2], 16777216.0, 0); /* nearest float to 2^24 + 1 */
    CHECK_NEAR(out[3], -2147483648.0, 0);

    /* n = 0 writes nothing. */
    out[0] = 42.0f;
    pd_convert_to_f32(out, hf, PD_DTYPE_F16, 0);
    CHECK_NEAR(out[0], 42.0, 0);
}

/* ------------------------------------------------------------------ json_util.h */

static void test_json_getters(void)
{
    json_error_t je;
    json_t *o = json_loads("{\"two\": 2, \"twof\": 2.0, \"half\": 2.5, \"str\": \"2\","
                           " \"nul\": null, \"t\": true, \"big\": 1e300, \"neg\": -3.0,"
                           " \"i32max\": 2147483647, \"i32min\": -2147483648,"
                           " \"over\": 2147483648, \"under\": -2147483649,"
                           " \"i64\": 9007199254740993, \"pi\": 3.25, \"two63\": 9223372036854775808.0}",
                           0, &je);
    CHECK_MSG(o != NULL, "%s", je.text);
    if (!o) return;
    char err[PD_ERR_LEN];
    int64_t v;
    int32_t w;

    v = -1;
    CHECK_EQ_INT(pd_json_get_int(o, "two", &v, "t.json", err), 0);
    CHECK_EQ_INT(v, 2);
    v = -1;
    CHECK_EQ_INT(pd_json_get_int(o, "twof", &v, "t.json", err), 0);
    CHECK_EQ_INT(v, 2);
    CHECK_EQ_INT(pd_json_get_int(o, "neg", &v, "t.json", err), 0);
    CHECK_EQ_INT(v, -3);
    CHECK_EQ_INT(pd_json_get_int(o, "i64", &v, "t.json", err), 0);
    CHECK_EQ_INT(v, 9007199254740993LL);

    v = 99;
    err[0] = '\0';
    CHECK_EQ_INT(pd_json_get_int(o, "half", &v, "t.json", err), PD_EFORMAT);
    CHECK_EQ_INT(v, 99);
    CHECK_STR_CONTAINS(err, "t.json");
    CHECK_STR_CONTAINS(err, "\"half\"");
    CHECK_EQ_INT(pd_json_get_int(o, "str", &v, "t.json", err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "\"str\"");
    CHECK_EQ_INT(pd_json_get_int(o, "t", &v, "t.json", err), PD_EFORMAT);
    /* Reals outside int64 are rejected (and must not reach an undefined float->int cast). */
    CHECK_EQ_INT(pd_json_get_int(o, "big", &v, "t.json", err), PD_EFORMAT);
    CHECK_EQ_INT(pd_json_get_int(o, "two63", &v, "t.json", err), PD_EFORMAT);
    CHECK_EQ_INT(v, 99);

    CHECK_EQ_INT(pd_json_get_int(o, "absent", &v, "t.json", err), 1);
    CHECK_EQ_INT(pd_json_get_int(o, "nul", &v, "t.json", err), 1);
    CHECK_EQ_INT(v, 99);

    CHECK_EQ_INT(pd_json_get_i32(o, "i32max", &w, "t.json", err), 0);
    CHECK_EQ_INT(w, INT32_MAX);
    CHECK_EQ_INT(pd_json_get_i32(o, "i32min", &w, "t.json", err), 0);
    CHECK_EQ_INT(w, INT32_MIN);
    w = 5;
    CHECK_EQ_INT(pd_json_get_i32(o, "over", &w, "t.json", err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "\"over\"");
    CHECK_STR_CONTAINS(err, "range");
    CHECK_EQ_INT(pd_json_get_i32(o, "under", &w, "t.json", err), PD_EFORMAT);
    CHECK_EQ_INT(pd_json_get_i32(o, "half", &w, "t.json", err), PD_EFORMAT);
    CHECK_EQ_INT(pd_json_get_i32(o, "absent", &w, "t.json", err), 1);
    CHECK_EQ_INT(w, 5);
    CHECK_EQ_INT(pd_json_get_i32(o, "twof", &w, "t.json", err), 0);
    CHECK_EQ_INT(w, 2);

    double d = -1;
    CHECK_EQ_INT(pd_json_get_double(o, "two", &d, "t.json", err), 0);
    CHECK_NEAR(d, 2.0, 0);
    CHECK_EQ_INT(pd_json_get_double(o, "pi", &d, "t.json", err), 0);
    CHECK_NEAR(d, 3.25, 0);
    CHECK_EQ_INT(pd_json_get_double(o, "str", &d, "t.json", err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "\"str\"");
    CHECK_EQ_INT(pd_json_get_double(o, "nul", &d, "t.json", err), 1);
    CHECK_NEAR(d, 3.25, 0);

    bool b = false;
    CHECK_EQ_INT(pd_json_get_bool(o, "t", &b, "t.json", err), 0);
    CHECK(b);
    CHECK_EQ_INT(pd_json_get_bool(o, "two", &b, "t.json", err), PD_EFORMAT);
    CHECK_STR_CONTAINS(err, "\"two\"");
    CHECK_EQ_INT(pd_json_get_bool(o, "absent", &b, "t.json", err), 1);
    CHECK(b);

    json_decref(o);
}

static void test_json_load_file(void)
{
    char dir[] = "/tmp/pd_test_common_XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK_MSG(0, "mkdtemp: %s", strerror(errno));
        return;
    }
    char path[256], err[PD_ERR_LEN];
    json_t *root = (json_t *)&root; /* must be reset to NULL on failure */

    snprintf(path, sizeof path, "%s/missing.json", dir);
    CHECK_EQ_INT(pd_json_load_file(path, &root, err), PD_EIO);
    CHECK(root == NULL);
    CHECK_STR_CONTAINS(err, path);

    snprintf(path, sizeof path, "%s/bad.json", dir);
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (f) {
        fputs("{\n  \"a\": 1,\n  \"b\": [1, 2,,]\n}\n", f);
        fclose(f);
        root = (json_t *)&root;
        CHECK_EQ_INT(pd_json_load_file(path, &root, err), PD_EFORMAT);
        CHECK(root == NULL);
        CHECK_STR_CONTAINS(err, path);
        CHECK_STR_CONTAINS(err, "line 3");
    }
    unlink(path);

    /* Duplicate keys are rejected rather than silently resolved. */
    snprintf(path, sizeof path, "%s/dup.json", dir);
    f = fopen(path, "wb");
    CHECK(f != NULL);
    if (f) {
        fputs("{\"a\": 1, \"a\": 2}", f);
        fclose(f);
        CHECK_EQ_INT(pd_json_load_file(path, &root, err), PD_EFORMAT);
        CHECK_STR_CONTAINS(err, path);
    }
    unlink(path);

    snprintf(path, sizeof path, "%s/good.json", dir);
    f = fopen(path, "wb");
    CHECK(f != NULL);
    if (f) {
        fputs("{\"a\": [1, 2, 3], \"b\": \"x\"}", f);
        fclose(f);
        CHECK_EQ_INT(pd_json_load_file(path, &root, err), 0);
        CHECK(json_is_object(root));
        CHECK_EQ_INT(json_array_size(json_object_get(root, "a")), 3);
        json_decref(root);
    }
    unlink(path);

    CHECK_EQ_INT(rmdir(dir), 0);
}

/* e4m3fn against its definition: every byte decodes to (-1)^s 2^(e-7) (1 + m/8) (subnormal
 * 2^-6 m/8), 0x7f/0xff NaN; encoding is the nearest value with ties to an even mantissa,
 * saturating at 448, checked against a brute-force nearest search in double. */
static void test_e4m3(void)
{
    CHECK_EQ_INT(pd_dtype_size(PD_DTYPE_F8E4M3), 1);
    CHECK(strcmp(pd_dtype_name(PD_DTYPE_F8E4M3), "F8_E4M3") == 0);
    double val[256];
    int bad = 0;
    for (int b = 0; b < 256; b++) {
        const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
        double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1 + m / 8.0, e - 7);
        if (s) v = -v;
        val[b] = v;
        const float got = pd_e4m3_to_f32((uint8_t)b);
        if ((b & 0x7f) == 0x7f) bad += !isnan(got);
        else bad += got != (float)v;
    }
    CHECK_MSG(bad == 0, "%d bytes decode wrong", bad);
    CHECK(val[0x7e] == 448.0);
    /* encode: random values over the whole range, and every midpoint */
    uint64_t st = 12345;
    int wrong = 0;
    for (int i = 0; i < 200000 + 254; i++) {
        float x;
        if (i < 254) { /* midpoints between neighbours (positive codes 0..0x7e) */
            const int b = i % 127;
            x = (float)((val[b] + val[b + 1]) / 2);
            if (i >= 127) x = -x;
        } else {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            const double u = (double)(st >> 11) / 9007199254740992.0;
            x = (float)((u - 0.5) * ldexp(1.0, (int)(st % 24) - 12) * 2);
        }
        /* nearest finite value, ties to the even code */
        int best = 0;
        double bd = INFINITY;
        for (int b = 0; b < 256; b++) {
            if ((b & 0x7f) == 0x7f) continue;
            const double d = fabs(val[b] - (double)x);
            if (d < bd || (d == bd && ((b & 1) == 0 && (best & 1) == 1))) { bd = d; best = b; }
        }
        if (fabs((double)x) >= 448) best = x < 0 ? 0xfe : 0x7e;
        const uint8_t got = pd_f32_to_e4m3(x);
        if (got != best && !(val[got] == 0 && val[best] == 0)) {
            if (wrong++ < 5) fprintf(stderr, "  e4m3(%.9g) = %02x, want %02x\n", x, got, best);
        }
    }
    CHECK_MSG(wrong == 0, "%d values encode to another e4m3 than the nearest-even one", wrong);
    CHECK_EQ_INT(pd_f32_to_e4m3(1e9f), 0x7e);
    CHECK_EQ_INT(pd_f32_to_e4m3(-INFINITY), 0xfe);
    CHECK_EQ_INT(pd_f32_to_e4m3(NAN), 0x7f);
    CHECK_EQ_INT(pd_f32_to_e4m3(ldexpf(1, -10)), 0);    /* half the smallest subnormal: even */
    CHECK_EQ_INT(pd_f32_to_e4m3(ldexpf(3, -11)), 1);    /* 1.5 steps: rounds to 2^-9 */
    float buf[3] = {1.0f, 2.0f, 3.0f};
    float out[3];
    pd_convert_to_f32(out, (const uint8_t[]){0x38, 0x40, 0xc4}, PD_DTYPE_F8E4M3, 3);
    CHECK(out[0] == 1.0f && out[1] == 2.0f && out[2] == -3.0f);
    (void)buf;
}

/* The activation quantization rule (pd_fp8_quant_row), recomputed here from its statement. */
static void test_fp8_quant_row(void)
{
    enum { K = 300 };
    float x[K], out[K];
    uint64_t st = 99;
    for (int i = 0; i < K; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)(((double)(st >> 11) / 9007199254740992.0 - 0.5) * (i % 7 + 1));
    }
    for (int mode = 0; mode < 4; mode++) {
        const int32_t group = mode == 1 ? 128 : K;
        const pd_act_quant act = mode == 2 ? PD_ACT_STATIC : mode == 3 ? PD_ACT_NONE : PD_ACT_DYNAMIC;
        const float in_scale = 0.002f; /* static: 448 * 0.002 < max |x|: some saturate */
        pd_fp8_quant_row(x, out, K, group, act, in_scale);
        int bad = 0, sat = 0;
        for (int g0 = 0; g0 < K; g0 += group) {
            const int g1 = g0 + group < K ? g0 + group : K;
            float amax = 0;
            for (int j = g0; j < g1; j++) amax = fmaxf(amax, fabsf(x[j]));
            const float s = act == PD_ACT_STATIC ? in_scale : amax / 448.0f;
            for (int j = g0; j < g1; j++) {
                float want = x[j];
                if (act != PD_ACT_NONE) {
                    float q = x[j] / s;
                    if (fabsf(q) >= 448) { q = copysignf(448, q); sat++; }
                    want = pd_e4m3_to_f32(pd_f32_to_e4m3(q)) * s;
                    /* within half an e4m3 step (2^-4 relative) of the value, or saturated */
                    if (fabsf(x[j] / s) < 448 && fabsf(want - x[j]) > fabsf(x[j]) / 16 + s * 1e-3f)
                        bad++;
                }
                bad += out[j] != want;
            }
        }
        CHECK_MSG(bad == 0, "mode %d: %d elements differ from the rule", mode, bad);
        if (act == PD_ACT_STATIC) CHECK(sat > 0);
        if (act == PD_ACT_DYNAMIC) CHECK(sat <= K / group + 1); /* only the amax itself */
    }
    /* a zero row takes the smallest scale (no division by zero), and stays zero */
    float z[4] = {0, 0, 0, 0};
    pd_fp8_quant_row(z, z, 4, 4, PD_ACT_DYNAMIC, 0);
    CHECK(z[0] == 0 && z[3] == 0 && !signbit(z[1]));
}

/* ------------------------------------------------------------------ net.h */

static void test_listen_addr(void)
{
    char err[PD_ERR_LEN];
    struct addrinfo *a = NULL;
    /* "", NULL and 0.0.0.0: every IPv4 address (a passive, wildcard address) */
    const char *any[] = {"", NULL, "0.0.0.0"};
    for (int i = 0; i < 3; i++) {
        CHECK_EQ_INT(pd_net_listen_addr(any[i], 8080, &a, err), 0);
        CHECK(a && a->ai_family == AF_INET && a->ai_socktype == SOCK_STREAM);
        if (a) CHECK_EQ_INT(ntohs(((struct sockaddr_in *)a->ai_addr)->sin_port), 8080);
        if (a) CHECK(((struct sockaddr_in *)a->ai_addr)->sin_addr.s_addr == htonl(INADDR_ANY));
        if (a) freeaddrinfo(a);
    }
    CHECK_EQ_INT(pd_net_listen_addr("127.0.0.1", 0, &a, err), 0);
    CHECK(a && a->ai_family == AF_INET);
    if (a) freeaddrinfo(a);
    /* IPv6, bracketed as in host:port strings or not */
    const char *v6[] = {"[::1]", "::1"};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ_INT(pd_net_listen_addr(v6[i], 9, &a, err), 0);
        CHECK(a && a->ai_family == AF_INET6);
        if (a) freeaddrinfo(a);
    }
    struct addrinfo sentinel;
    a = &sentinel; /* set to NULL on failure */
    CHECK_EQ_INT(pd_net_listen_addr("127.0.0.1", 65536, &a, err), PD_EINVAL);
    CHECK(a == NULL);
    CHECK_STR_CONTAINS(err, "65536");
}

int main(void)
{
    test_errors();
    test_dtype_basics();
    test_bf16();
    test_f16();
    test_convert();
    test_e4m3();
    test_fp8_quant_row();
    test_json_getters();
    test_json_load_file();
    test_listen_addr();
    return pd_test_result("test_common");
}
