/* kvt_harness.c -- Control-channel framing, block patterns, the event loop and leftover checks
 * shared by pdserve-kvt-bench and the kvtransfer tests (see kvt_harness.h). */
#include "kvtransfer/kvt_harness.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n > 0) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL); /* a dead peer is an error, not SIGPIPE */
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    char *c = p;
    while (n > 0) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

int kvh_send(int fd, uint32_t type, const void *payload, size_t len)
{
    uint32_t hdr[2] = {type, (uint32_t)len};
    if (write_all(fd, hdr, sizeof hdr) < 0) return -1;
    return len ? write_all(fd, payload, len) : 0;
}

int kvh_recv(int fd, uint32_t *type, void **payload, size_t *len, int timeout_ms)
{
    *payload = NULL;
    *len = 0;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int r;
    do r = poll(&pfd, 1, timeout_ms);
    while (r < 0 && errno == EINTR);
    if (r == 0) return -2;
    if (r < 0) return -1;
    uint32_t hdr[2];
    if (read_all(fd, hdr, sizeof hdr) < 0) return -1;
    *type = hdr[0];
    if (hdr[1]) {
        *payload = malloc(hdr[1]);
        if (!*payload || read_all(fd, *payload, hdr[1]) < 0) {
            free(*payload);
            *payload = NULL;
            return -1;
        }
    }
    *len = hdr[1];
    return 0;
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t block_key(uint64_t seed, int32_t layer, int kv, int32_t block)
{
    return mix(seed ^ ((uint64_t)(uint32_t)layer << 40) ^ ((uint64_t)kv << 39) ^
               (uint64_t)(uint32_t)block);
}

void kvh_fill(void *dst, size_t bytes, uint64_t seed, int32_t layer, int kv, int32_t block)
{
    uint64_t k = block_key(seed, layer, kv, block);
    uint64_t *w = dst;
    size_t nw = bytes / 8;
    for (size_t i = 0; i < nw; i++) w[i] = k + i * 0x100000001b3ull;
    for (size_t i = nw * 8; i < bytes; i++) ((uint8_t *)dst)[i] = (uint8_t)(k >> (i % 8));
}

long kvh_check(const void *src, size_t bytes, uint64_t seed, int32_t layer, int kv, int32_t block)
{
    uint64_t k = block_key(seed, layer, kv, block);
    const uint64_t *w = src;
    size_t nw = bytes / 8;
    for (size_t i = 0; i < nw; i++)
        if (w[i] != k + i * 0x100000001b3ull) return (long)(i * 8);
    for (size_t i = nw * 8; i < bytes; i++)
        if (((const uint8_t *)src)[i] != (uint8_t)(k >> (i % 8))) return (long)i;
    return -1;
}

void kvh_fill_pool(kvt_pool *pool, uint64_t seed)
{
    size_t bb = kvt_pool_block_bytes(pool);
    int32_t nb = kvt_pool_n_blocks(pool), nl = kvt_pool_layout(pool)->n_layers;
    for (int32_t l = 0; l < nl; l++)
        for (int kv = 0; kv < 2; kv++) {
            uint8_t *base = kvt_pool_region(pool, l, kv);
            for (int32_t b = 0; b < nb; b++) kvh_fill(base + (size_t)b * bb, bb, seed, l, kv, b);
        }
}

int kvh_loop(kvt_ctx *ctx, int fd, int max_ms)
{
    if (kvt_progress(ctx) > 0) {
        if (fd < 0) return 0;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        return poll(&p, 1, 0) > 0;
    }
    struct pollfd p[2] = {{.fd = kvt_fd(ctx), .events = POLLIN}, {.fd = fd, .events = POLLIN}};
    int to = 0;
    if (kvt_arm(ctx) == 0) {
        to = kvt_timeout_ms(ctx);
        if (to < 0 || to > max_ms) to = max_ms;
    }
    int r = poll(p, fd >= 0 ? 2 : 1, to);
    kvt_progress(ctx);
    return r > 0 && fd >= 0 && (p[1].revents & (POLLIN | POLLHUP | POLLERR));
}

double kvh_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

char *kvh_devshm_list(void)
{
    DIR *d = opendir("/dev/shm");
    size_t cap = 256, len = 0;
    char *out = calloc(1, cap);
    if (!d || !out) {
        if (d) closedir(d);
        return out;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        size_t n = strlen(e->d_name);
        if (len + n + 2 > cap) {
            while (len + n + 2 > cap) cap *= 2;
            char *q = realloc(out, cap);
            if (!q) break;
            out = q;
        }
        memcpy(out + len, e->d_name, n);
        len += n;
        out[len++] = '\n';
        out[len] = 0;
    }
    closedir(d);
    return out;
}

/* Whether a live process maps or holds open /dev/shm/name (then it is someone's segment in use,
 * e.g. of a test running beside this one, not a leftover). */
static bool devshm_in_use(const char *name)
{
    char want[300];
    snprintf(want, sizeof want, "/dev/shm/%s", name);
    DIR *proc = opendir("/proc");
    if (!proc) return false;
    bool used = false;
    struct dirent *e;
    while (!used && (e = readdir(proc))) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        char path[300], line[1024];
        snprintf(path, sizeof path, "/proc/%s/maps", e->d_name);
        FILE *f = fopen(path, "r");
        while (f && !used && fgets(line, sizeof line, f)) used = strstr(line, want) != NULL;
        if (f) fclose(f);
        snprintf(path, sizeof path, "/proc/%s/fd", e->d_name);
        DIR *fds = opendir(path);
        struct dirent *fe;
        while (fds && !used && (fe = readdir(fds))) {
            char link[600], target[300];
            snprintf(link, sizeof link, "%s/%s", path, fe->d_name);
            ssize_t n = readlink(link, target, sizeof target - 1);
            if (n > 0) {
                target[n] = 0;
                used = strncmp(target, want, strlen(want)) == 0;
            }
        }
        if (fds) closedir(fds);
    }
    closedir(proc);
    return used;
}

int kvh_shm_leftovers(const pid_t *pids, int n_pids, const char *devshm_before)
{
    int found = 0;
    FILE *f = fopen("/proc/sysvipc/shm", "r");
    if (f) {
        char line[512];
        if (!fgets(line, sizeof line, f)) line[0] = 0; /* header */
        while (fgets(line, sizeof line, f)) {
            long key, shmid, size, cpid, lpid, nattch;
            unsigned long perms;
            if (sscanf(line, "%ld %ld %lo %ld %ld %ld %ld", &key, &shmid, &perms, &size, &cpid,
                       &lpid, &nattch) != 7)
                continue;
            for (int i = 0; i < n_pids; i++)
                if (cpid == pids[i]) {
                    fprintf(stderr, "leftover SysV segment %ld (%ld B) of pid %ld\n", shmid, size,
                            cpid);
                    found++;
                }
        }
        fclose(f);
    }
    char *now = kvh_devshm_list();
    if (now) {
        for (char *name = strtok(now, "\n"); name; name = strtok(NULL, "\n")) {
            if (devshm_before) {
                const char *p = devshm_before;
                size_t n = strlen(name);
                bool seen = false;
                while ((p = strstr(p, name))) {
                    if ((p == devshm_before || p[-1] == '\n') && p[n] == '\n') {
                        seen = true;
                        break;
                    }
                    p += n;
                }
                if (seen) continue;
            }
            if (strncmp(name, "ucx", 3) != 0) continue; /* only what UCX creates */
            char path[300];
            snprintf(path, sizeof path, "/dev/shm/%s", name);
            /* Someone else's in use, or a file that was just going away, is not ours. */
            if (devshm_in_use(name)) continue;
            usleep(200000);
            if (access(path, F_OK) != 0 || devshm_in_use(name)) continue;
            fprintf(stderr, "leftover /dev/shm/%s\n", name);
            found++;
        }
        free(now);
    }
    return found;
}

void kvh_permute(int32_t *ids, int32_t n, uint64_t seed)
{
    for (int32_t i = 0; i < n; i++) ids[i] = i;
    uint64_t s = seed | 1;
    for (int32_t i = n - 1; i > 0; i--) {
        s = mix(s);
        int32_t j = (int32_t)(s % (uint64_t)(i + 1));
        int32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
}
