/* safetensors_write.h -- Writes safetensors checkpoints that st_open (and the HuggingFace
 * safetensors library) reads: one file, or shards with model.safetensors.index.json. The
 * tensors are declared first (the header holds every offset), then their bytes are streamed
 * in the order declared, so that no more than one piece of a tensor need be held in memory. */
#ifndef PD_SAFETENSORS_WRITE_H
#define PD_SAFETENSORS_WRITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "engine/safetensors.h"

/* HuggingFace's default largest shard ("5GB" in save_pretrained: decimal gigabytes). */
#define STW_SHARD_BYTES_DEFAULT ((uint64_t)5000000000)

/* ---- one file ---- */

typedef struct stw_file stw_file; /* opaque */

/* Creates (truncates) path for writing. Nothing is written before stw_file_begin. Returns 0,
 * PD_EIO (naming path) or PD_ENOMEM. Close with stw_file_close or stw_file_destroy. */
int stw_file_create(const char *path, stw_file **out, char *err);
/* Declares the next tensor: name (copied), dtype (F32, BF16, F16, F8E4M3 or I32), n_dims in
 * 0..ST_MAX_DIMS dims of shape (each >= 0; 0 dims is a scalar of one element). Returns 0,
 * PD_EINVAL (a duplicate or empty name, a bad dtype or shape, or called after
 * stw_file_begin) or PD_ENOMEM. */
int stw_file_add(stw_file *f, const char *name, pd_dtype dtype, int32_t n_dims,
                 const int64_t *shape, char *err);
/* Writes the header: {"__metadata__": {"format": "pt"}, then each tensor's dtype, shape and
 * data_offsets in the order added}, padded with spaces to a multiple of 8 bytes, after its
 * 8-byte little-endian length. Returns 0, PD_ESTATE (called twice) or PD_EIO. */
int stw_file_begin(stw_file *f, char *err);
/* Appends n bytes of tensor data: the tensors' bytes in the order they were added, split into
 * calls as the caller likes (a call may span tensors). Returns 0, PD_ESTATE (before
 * stw_file_begin, or more bytes than the tensors declared hold, naming the tensor) or
 * PD_EIO. */
int stw_file_write(stw_file *f, const void *data, size_t n, char *err);
/* Name of the tensor the next stw_file_write bytes belong to, or NULL when all are written. */
const char *stw_file_current(const stw_file *f);
/* Finishes the file: every declared byte must have been written (else PD_ESTATE naming the
 * first incomplete tensor), the data is flushed and fsync'ed and the file closed (PD_EIO).
 * Frees f in every case. */
int stw_file_close(stw_file *f, char *err);
/* Closes and frees f without finishing it, and removes the file if it is not complete.
 * NULL is a no-op. */
void stw_file_destroy(stw_file *f);

/* ---- a checkpoint: one file or shards ---- */

typedef struct stw_ckpt stw_ckpt; /* opaque */

typedef struct {
    const char *dir;            /* output directory (borrowed; must outlive the writer); it
                                 * must exist */
    uint64_t shard_bytes_max;   /* largest tensor bytes per shard; 0 = STW_SHARD_BYTES_DEFAULT.
                                 * A total within it gives one model.safetensors, otherwise
                                 * model-0000i-of-0000n.safetensors and the index */
    const char *tmp_suffix;     /* appended to every file name while it is written, e.g.
                                 * ".tmp"; NULL = ".pdtmp"; stw_ckpt_commit renames */
} stw_params;

stw_params stw_default_params(void);

/* Creates a checkpoint writer; nothing touches the disk before stw_ckpt_begin. Returns 0,
 * PD_EINVAL (no dir) or PD_ENOMEM. Free with stw_ckpt_destroy. */
int stw_ckpt_create(const stw_params *p, stw_ckpt **out, char *err);
/* Declares the next tensor, as stw_file_add. Returns 0, PD_EINVAL or PD_ENOMEM. */
int stw_ckpt_add(stw_ckpt *w, const char *name, pd_dtype dtype, int32_t n_dims,
                 const int64_t *shape, char *err);
/* Splits the declared tensors into shards in order (a shard is closed before the tensor that
 * would take it past shard_bytes_max; a tensor larger than that gets a shard of its own) and
 * opens the first file. Returns 0, PD_ESTATE (twice, or no tensors), PD_EIO or PD_ENOMEM. */
int stw_ckpt_begin(stw_ckpt *w, char *err);
/* Streams tensor bytes in the order declared, across shard boundaries (each shard file is
 * finished and closed when its last byte arrives). Returns 0, PD_ESTATE or PD_EIO. */
int stw_ckpt_write(stw_ckpt *w, const void *data, size_t n, char *err);
/* Name of the tensor the next bytes belong to, or NULL when all are written. */
const char *stw_ckpt_current(const stw_ckpt *w);
/* Finishes the last shard and, when sharded, writes the index ({"metadata": {"total_size":
 * bytes of all tensors}, "weight_map": {name: file}}), all still under their temporary names.
 * Returns 0, PD_ESTATE (bytes missing, naming the tensor) or PD_EIO. */
int stw_ckpt_finish(stw_ckpt *w, char *err);
/* Renames the finished files to their final names. Returns 0, PD_ESTATE (not finished) or
 * PD_EIO (the files renamed so far keep their final names). */
int stw_ckpt_commit(stw_ckpt *w, char *err);
/* Number of files the checkpoint has (shards plus the index); after stw_ckpt_begin. */
int32_t stw_ckpt_n_files(const stw_ckpt *w);
/* Final name (no directory) of file i, 0 <= i < stw_ckpt_n_files; borrowed, valid until
 * stw_ckpt_destroy. */
const char *stw_ckpt_file_name(const stw_ckpt *w, int32_t i);
/* Bytes of tensor data declared so far. */
uint64_t stw_ckpt_total_bytes(const stw_ckpt *w);
/* Frees w. Files not yet committed are removed (a failed or abandoned write leaves nothing
 * behind). NULL is a no-op. */
void stw_ckpt_destroy(stw_ckpt *w);

#endif
