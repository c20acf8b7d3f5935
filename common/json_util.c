/* json_util.c -- jansson helpers with error messages for humans. */
#include "common/json_util.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"

int pd_json_load_file(const char *path, json_t **out, char *err)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errf(err, PD_EIO, "cannot open %s: %s", path, strerror(errno));
    json_error_t je;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
    fclose(f);
    if (!root)
        return pd_errf(err, PD_EFORMAT, "%s: malformed JSON at line %d column %d: %s", path,
                       je.line, je.column, je.text);
    *out = root;
    return 0;
}

int pd_json_get_int(const json_t *obj, const char *key, int64_t *out, const char *what, char *err)
{
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return 1;
    if (json_is_integer(v)) {
        *out = (int64_t)json_integer_value(v);
        return 0;
    }
    if (json_is_real(v)) { /* accept 2.0 but not 2.5 */
        double d = json_real_value(v);
        /* range check first: casting a double outside int64 is undefined behaviour */
        if (d >= -0x1p63 && d < 0x1p63 && d == (double)(int64_t)d) {
            *out = (int64_t)d;
            return 0;
        }
    }
    return pd_errf(err, PD_EFORMAT, "%s: \"%s\" must be an integer", what, key);
}

int pd_json_get_i32(const json_t *obj, const char *key, int32_t *out, const char *what, char *err)
{
    int64_t v = 0;
    int rc = pd_json_get_int(obj, key, &v, what, err);
    if (rc != 0) return rc;
    if (v < INT32_MIN || v > INT32_MAX)
        return pd_errf(err, PD_EFORMAT, "%s: \"%s\" = %lld is out of range", what, key,
                       (long long)v);
    *out = (int32_t)v;
    return 0;
}

int pd_json_get_double(const json_t *obj, const char *key, double *out, const char *what,
                       char *err)
{
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return 1;
    if (!json_is_number(v))
        return pd_errf(err, PD_EFORMAT, "%s: \"%s\" must be a number", what, key);
    *out = json_number_value(v);
    return 0;
}

int pd_json_get_bool(const json_t *obj, const char *key, bool *out, const char *what, char *err)
{
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return 1;
    if (!json_is_boolean(v))
        return pd_errf(err, PD_EFORMAT, "%s: \"%s\" must be true or false", what, key);
    *out = json_is_true(v);
    return 0;
}
