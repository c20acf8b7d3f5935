/* kvt_harness.h -- Support for pdserve-kvt-bench and the kvtransfer tests: a length-prefixed
 * control channel over a socket (standing in for the gRPC control plane), deterministic block
 * contents to fill and verify, an event loop over a kvt_ctx plus one socket, and checks for
 * shared-memory segments left behind. Not used by the services. */
#ifndef PD_KVT_HARNESS_H
#define PD_KVT_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvtransfer/kvtransfer.h"

/* Writes one frame {type, len, payload}. Returns 0 or -1 (peer gone). */
int kvh_send(int fd, uint32_t type, const void *payload, size_t len);
/* Reads one frame, waiting at most timeout_ms (-1 = forever). *payload is malloc'ed (caller
 * frees; NULL when len is 0). Returns 0, -1 on EOF/error, -2 on timeout. */
int kvh_recv(int fd, uint32_t *type, void **payload, size_t *len, int timeout_ms);

/* Fills / checks one block with contents that depend on (seed, layer, kv, block). Check
 * returns -1 when all bytes match, else the byte offset of the first difference. */
void kvh_fill(void *dst, size_t bytes, uint64_t seed, int32_t layer, int kv, int32_t block);
long kvh_check(const void *src, size_t bytes, uint64_t seed, int32_t layer, int kv, int32_t block);

/* Fills every block of every layer of pool (K and V) with kvh_fill(seed, ..., block id). */
void kvh_fill_pool(kvt_pool *pool, uint64_t seed);

/* Progresses ctx; when idle, sleeps on its fd and on fd (if >= 0) for at most max_ms.
 * Returns 1 when fd is readable, 0 otherwise. */
int kvh_loop(kvt_ctx *ctx, int fd, int max_ms);

/* Milliseconds since an arbitrary start (monotonic). */
double kvh_ms(void);

/* Counts what the processes pids left behind: SysV segments they created (from
 * /proc/sysvipc/shm) and /dev/shm/ucx* entries not in before (a newline-joined list from
 * kvh_devshm_list, may be NULL). Logs each to stderr. */
int kvh_shm_leftovers(const pid_t *pids, int n_pids, const char *devshm_before);
/* Newline-joined names in /dev/shm (caller frees). */
char *kvh_devshm_list(void);

/* A deterministic permutation of 0..n-1 (xorshift seeded). */
void kvh_permute(int32_t *ids, int32_t n, uint64_t seed);

#endif
