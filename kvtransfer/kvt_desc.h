/* kvt_desc.h -- The pool descriptor's wire format and its strict parser, the structural checks
 * of the UCX blobs it carries (packed remote keys, packed worker address), and the shared-secret
 * primitives (loading, HMAC-SHA256, comparison, nonces). Pure code: nothing here calls UCX, so
 * the parser can be unit-tested and fuzzed on its own (tests/fuzz/fuzz_kv_descriptor.c).
 * Internal to kvtransfer; not part of the public API. */
#ifndef PD_KVT_DESC_H
#define PD_KVT_DESC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtransfer/kvtransfer.h"

/* Descriptor layout (all integers little-endian), version KVT_DESC_VERSION:
 *   u32 magic "KVTD" | u32 version | flags << 16 | u64 ctx id | u64 pool id | char boot_id[40]
 *   | char model_id[64] | u32 dtype, n_layers, block_size, n_kv_heads, head_dim | u64 layout
 *   fingerprint | u32 n_blocks | u64 block bytes | u32 address length | address
 *   | u32 n_rkeys | n_rkeys x (u32 length | packed rkey) | 2 n_layers x (u64 region base
 *   | u32 rkey index) (both absent, n_rkeys 0, if KVT_DESC_STAGED) | [u32 length | device export, if KVT_DESC_DEVICE]
 *   | [32-byte HMAC-SHA256 of everything before it, if KVT_DESC_SIGNED]
 *   | u64 xxh64 of everything before it. */
#define KVT_DESC_MAGIC 0x4454564bu /* "KVTD" */
#define KVT_DESC_VERSION 2u        /* 2: SIGNED flag and MAC; HELLO with authentication */
#define KVT_DESC_ALLOCATED 1u      /* flag: the pool is one UCX allocation (one rkey) */
#define KVT_DESC_CUDA 2u           /* flag: the pool is device memory */
#define KVT_DESC_SIGNED 4u         /* flag: a MAC precedes the checksum */
#define KVT_DESC_DEVICE 8u         /* flag: a device export follows the region table */
#define KVT_DESC_STAGED 16u        /* flag: device blocks behind a host ring: no remote keys, no
                                      region table (n_rkeys 0); data only by active messages */
#define KVT_DESC_FLAGS_KNOWN (KVT_DESC_ALLOCATED | KVT_DESC_CUDA | KVT_DESC_SIGNED | \
                              KVT_DESC_DEVICE | KVT_DESC_STAGED)
/* bytes of a device export: the serving layer's has 16 bytes a layer (an 80-layer Llama-3-70B
 * needs 1,408), so room for every layer KVT_DESC_MAX_LAYERS allows and a head */
#define KVT_DESC_MAX_DEVICE (16 * KVT_DESC_MAX_LAYERS + 1024)

#define KVT_DESC_MAX_ADDR 8192     /* bytes of a worker address (38-79 B seen; many NICs more) */
#define KVT_DESC_MAX_RKEY 4096     /* bytes of one packed rkey (10-23 B seen) */
#define KVT_DESC_MAX_LAYERS 4096   /* as kvt_pool_create allows */
#define KVT_DESC_MAX_POOL (1ull << 48) /* bytes of a whole remote pool (256 TiB) */
#define KVT_MAC_LEN 32

/* ---------------------------------------------------------------- shared secret */

#define KVT_SECRET_MIN 16   /* bytes; shorter secrets are refused */
#define KVT_SECRET_MAX 4096

typedef struct {
    size_t len;                  /* 0 = no secret */
    uint8_t key[KVT_SECRET_MAX];
} kvt__secret;

/* Reads the secret from path: the whole file, less one trailing "\n" or "\r\n" (as `echo`
 * writes it). Returns 0, or PD_EIO (unreadable) / PD_EINVAL (shorter than KVT_SECRET_MIN or
 * longer than KVT_SECRET_MAX) with err naming the file but never its contents. */
int kvt__secret_load(const char *path, kvt__secret *out, char *err);
/* Overwrites the key (also through an optimizing compiler) and sets len to 0. */
void kvt__secret_wipe(kvt__secret *s);
/* HMAC-SHA256 with the secret over the concatenation of n parts. Returns 0 or PD_EIO
 * (libcrypto failed; out is then zeroed). */
int kvt__hmac(const kvt__secret *s, int n, const void *const *parts, const size_t *lens,
              uint8_t out[KVT_MAC_LEN]);
/* Constant-time comparison of two MACs. */
bool kvt__mac_equal(const uint8_t a[KVT_MAC_LEN], const uint8_t b[KVT_MAC_LEN]);
/* Fills buf with n cryptographically random bytes. Returns 0 or PD_EIO. */
int kvt__random(void *buf, size_t n);
/* MAC of a descriptor body (the bytes before the MAC). Returns 0 or PD_EIO. */
int kvt__desc_mac(const kvt__secret *s, const void *body, size_t len, uint8_t out[KVT_MAC_LEN]);

/* ---------------------------------------------------------------- descriptor */

/* A parsed descriptor. Pointers borrow from the parsed buffer (which must outlive them);
 * rkey_off is allocated: release with kvt__desc_free. */
typedef struct {
    uint32_t flags;          /* KVT_DESC_* */
    uint64_t remote_ctx;     /* the receiver's context id */
    uint64_t pool_id;
    char boot_id[40];        /* the receiver's host boot id, NUL-terminated ("" = unknown) */
    kvt_layout layout;
    uint64_t fingerprint;    /* equals kvt_layout_fingerprint(&layout) */
    int32_t n_blocks;        /* blocks per region, > 0 */
    uint64_t block_bytes;    /* equals kvt_layout_block_bytes(&layout) */
    const uint8_t *addr;     /* the receiver's packed worker address (checked) */
    size_t addr_len;
    uint64_t sysv_mds;       /* the address's memory-domain indexes with a sysv transport */
    int32_t n_rkeys;         /* 1 .. n_regions (1 when KVT_DESC_ALLOCATED) */
    size_t *rkey_off;        /* [n_rkeys] offset of each packed rkey in the buffer */
    size_t *rkey_len;        /* [n_rkeys] its length (checked) */
    const uint8_t *buf;      /* the parsed buffer */
    int32_t n_regions;       /* 2 * n_layers, index 2 * layer + kv */
    size_t regions_off;      /* offset of the region table (12 bytes per region) */
    const uint8_t *device;   /* the device export (KVT_DESC_DEVICE), else NULL */
    size_t device_len;       /* 1 .. KVT_DESC_MAX_DEVICE */
} kvt__desc;

/* Parses and checks a descriptor: every length, count and offset against the buffer, the
 * layout against itself (fingerprint, block bytes, bounds), the region table (rkey indexes in
 * range, every rkey used, regions inside the address space and disjoint), the packed rkeys and
 * the worker address against UCX's formats (kvt__ucx_rkey_check, kvt__ucx_addr_check), and no
 * trailing bytes. With a secret (len > 0) the descriptor must be signed and its MAC must verify
 * before anything after the header is read; without one, a signed descriptor is refused too.
 * Never calls UCX. Returns 0 (out filled; kvt__desc_free it), PD_EFORMAT (malformed: err says
 * which field) or PD_EPERM (unsigned, signed without a secret here, or the MAC does not verify:
 * err names the likely configuration cause), or PD_ENOMEM. out is zeroed on failure. */
int kvt__desc_parse(const void *buf, size_t len, const kvt__secret *secret, kvt__desc *out,
                    char *err);
/* Releases what kvt__desc_parse allocated. NULL or a zeroed desc is a no-op. */
void kvt__desc_free(kvt__desc *d);
/* The base address and rkey index of region r (0 <= r < n_regions) of a parsed descriptor. */
void kvt__desc_region(const kvt__desc *d, int32_t r, uint64_t *base, int32_t *rkey);

/* ---------------------------------------------------------------- UCX blob formats */

/* Checks a packed remote key as ucp_rkey_pack writes it in UCX 1.13 - 1.16 (the same in both;
 * see ucp_rkey_pack_memh in src/ucp/core/ucp_rkey.c): u64 md_map | u8 memory type | for each
 * set bit of md_map: u8 size | size bytes of the transport's key. ucp_rkey_pack never appends
 * the optional system-device part, so the components must end exactly at len. The memory type
 * must be host, or CUDA when cuda is true. ucp_ep_rkey_unpack takes no length: this is what
 * makes it read only inside the blob. Returns 0 or PD_EFORMAT. */
int kvt__ucx_rkey_check(const uint8_t *p, size_t len, bool cuda, char *err);
/* Checks a packed worker address as ucp_worker_query(UCP_WORKER_ATTR_FIELD_ADDRESS) writes it
 * in UCX 1.13 - 1.16 (src/ucp/wireup/address.c, non-unified mode, address format v1 -- the
 * default -- or v2): header, worker uuid (required), optional client id and debug name, then
 * devices (md byte, length byte with flags, optional path count and system device, device
 * address) each with its transports (name checksum, interface attributes, length byte with
 * flags, interface address), walking exactly to len. Endpoint addresses (never in a worker
 * address), a path count of 0 (a division by zero in UCX), non-finite performance values and
 * an unknown header version (an assertion abort in UCX) are refused. UCX_UNIFIED_MODE=y packs
 * no lengths and is not supported: such an address is refused like any other unknown format.
 * ucp_ep_create takes no length either. sysv_mds (may be NULL) gets the bits of the memory
 * domains that carry a sysv transport. Returns 0 or PD_EFORMAT. */
int kvt__ucx_addr_check(const uint8_t *p, size_t len, uint64_t *sysv_mds, char *err);
/* Writes into out (room for len bytes) the packed rkey p without its sysv components whose
 * segment id is_valid(id, arg) rejects, and returns the new length (the key must have passed
 * kvt__ucx_rkey_check). sysv_mds: the memory domains that are sysv (kvt__ucx_addr_check).
 * Why: UCX 1.13-1.16 attaches a sysv key's segment in ucp_ep_rkey_unpack, and when that fails
 * its error path releases keys it never unpacked and crashes (ucp_rkey_destroy); a segment
 * that does not exist here is useless anyway (another host's, or forged). */
size_t kvt__ucx_rkey_filter_sysv(const uint8_t *p, size_t len, uint64_t sysv_mds,
                                 bool (*is_valid)(uint32_t shmid, void *arg), void *arg,
                                 uint8_t *out);

#endif
