/* fuzz_config_json.c -- Fuzzes the model config parser (text/model_config.h): the input is
 * config.json text, optionally followed by a NUL byte and generation_config.json text. A config
 * that parses must give the engine sane numbers: finite, non-negative RoPE frequencies and a
 * positive parameter count. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "text/model_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data;
    const char *nul = memchr(text, '\0', size);
    size_t cfg_len = nul ? (size_t)(nul - text) : size;
    char err[PD_ERR_LEN];
    mc_config cfg;
    if (mc_parse_json(text, cfg_len, &cfg, err) < 0) return 0;
    if (nul && mc_parse_generation_json(nul + 1, size - cfg_len - 1, &cfg, err) < 0) return 0;

    if (cfg.n_eos < 0 || cfg.n_eos > MC_MAX_EOS) abort();
    (void)mc_is_eos(&cfg, 0);
    if (mc_param_count(&cfg) <= 0) abort();
    /* The engine allocates head_dim / 2 frequencies; keep the fuzzer's allocation small. */
    if (cfg.head_dim <= 4096) {
        float inv_freq[2048];
        float attn = mc_rope_inv_freq(&cfg, inv_freq);
        if (!isfinite(attn) || !(attn > 0)) abort();
        for (int i = 0; i < cfg.head_dim / 2; i++)
            if (!isfinite(inv_freq[i]) || !(inv_freq[i] >= 0)) abort();
    }
    return 0;
}
