/* fuzz_kv_descriptor.c -- libFuzzer target for the KV pool descriptor that a Prefill RPC
 * carries from the network (KvTarget.kv_descriptor): the strict parser and the UCX address and
 * remote-key checks it runs (kvtransfer/kvt_desc.c), without a secret and with one. Pure code:
 * no UCX call is reached. Seeds: real descriptors exported by kvt_pool_export, and mutants. */
#include <stdint.h>
#include <string.h>

#include "common/error.h"
#include "kvtransfer/kvt_desc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kvt__secret secret; /* a fixed test secret: reaches the MAC check */
    if (!secret.len) {
        secret.len = 32;
        memset(secret.key, 0x6b, secret.len);
    }
    char err[PD_ERR_LEN];
    kvt__desc d;
    if (kvt__desc_parse(data, size, NULL, &d, err) == 0) {
        /* Everything the parser vouches for must be inside the input. */
        for (int32_t i = 0; i < d.n_rkeys; i++)
            if (d.rkey_off[i] + d.rkey_len[i] > size) __builtin_trap();
        for (int32_t r = 0; r < d.n_regions; r++) {
            uint64_t base;
            int32_t k;
            kvt__desc_region(&d, r, &base, &k);
            if (k < 0 || k >= d.n_rkeys) __builtin_trap();
        }
        if (d.addr + d.addr_len > data + size) __builtin_trap();
        kvt__desc_free(&d);
    }
    if (kvt__desc_parse(data, size, &secret, &d, err) == 0) kvt__desc_free(&d);
    /* The blob checks on their own, on the raw input. */
    kvt__ucx_addr_check(data, size, NULL, err);
    kvt__ucx_rkey_check(data, size, size & 1, err);
    return 0;
}
