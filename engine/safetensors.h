/* safetensors.h -- Read-only, mmap-backed access to a model's safetensors weights: a single
 * model.safetensors, or shards listed by model.safetensors.index.json. Every header is
 * validated (dtype, shape, offsets within the file) before any tensor is handed out. */
#ifndef PD_SAFETENSORS_H
#define PD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

#define ST_MAX_DIMS 8

typedef struct {
    const char *name;          /* tensor name, e.g. "model.layers.0.self_attn.q_proj.weight" */
    const char *file;          /* path of the file it lives in */
    pd_dtype dtype;            /* F32, BF16, F16 or F8E4M3 */
    int32_t n_dims;            /* 0..ST_MAX_DIMS */
    int64_t shape[ST_MAX_DIMS];
    int64_t n_elems;           /* product of shape */
    const void *data;          /* points into the mapping; valid until st_close */
    size_t nbytes;
} st_tensor;

typedef struct st_model st_model; /* opaque */

/* Opens the weights of the model in dir: model.safetensors.index.json if present (every shard
 * it names is mapped; a tensor listed in the index but absent from its shard is an error),
 * otherwise model.safetensors. Returns 0, PD_EIO (missing/unreadable file), PD_EFORMAT
 * (truncated file, bad header, offsets outside the file, shape/size mismatch, duplicate name),
 * PD_EUNSUPPORTED (a dtype other than F32/BF16/F16/F8_E4M3, naming the tensor), PD_ENOMEM.
 * err receives a message naming the file and tensor. Close with st_close. */
int st_open(const char *dir, st_model **out, char *err);
/* Opens one .safetensors file. Same errors as st_open. */
int st_open_file(const char *path, st_model **out, char *err);
/* Parses a whole .safetensors file held in memory: size bytes at data (borrowed; must outlive
 * the model, tensors point into it), the 8-byte little-endian header length, the JSON header
 * and the data section. name stands for the file in messages and in st_tensor.file. Every
 * tensor's dtype, shape and offsets are checked against the data section as st_open_file
 * does (which maps the file and parses it with the same code). Same errors as st_open_file
 * but PD_EIO. Close with st_close. */
int st_open_buffer(const void *data, size_t size, const char *name, st_model **out, char *err);
void st_close(st_model *m); /* NULL is a no-op */

/* Returns the tensor called name, or NULL. Borrowed; valid until st_close. */
const st_tensor *st_find(const st_model *m, const char *name);
int32_t st_count(const st_model *m);
const st_tensor *st_get(const st_model *m, int32_t i); /* 0 <= i < st_count */

#endif
