/* json_util.h -- Small helpers over jansson that turn JSON reading mistakes into
 * error messages naming the file and the key. */
#ifndef PD_JSON_UTIL_H
#define PD_JSON_UTIL_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

/* Loads a JSON file. Returns 0 and a new reference in *out (caller frees with json_decref),
 * PD_EIO if the file cannot be read, PD_EFORMAT if it is not valid JSON (err names the file,
 * line and column). */
int pd_json_load_file(const char *path, json_t **out, char *err);

/* Typed field readers. Each returns 0 when the key is present with the right type, 1 when it is
 * absent or null (out untouched, so set the default first), PD_EFORMAT when present with a wrong
 * type or a value out of the type's range (err names `what` and the key). */
int pd_json_get_int(const json_t *obj, const char *key, int64_t *out, const char *what, char *err);
int pd_json_get_i32(const json_t *obj, const char *key, int32_t *out, const char *what, char *err);
int pd_json_get_double(const json_t *obj, const char *key, double *out, const char *what,
                       char *err);
int pd_json_get_bool(const json_t *obj, const char *key, bool *out, const char *what, char *err);

#endif
