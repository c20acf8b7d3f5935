/* svc_process.c -- The process's own figures that Prometheus clients export as process_*
 * (CPU time, memory, descriptors, start time), read from /proc/self and getrlimit at each
 * scrape of every service's /metrics (svc_process_stats_read in svc_metrics.h). */
#include "svc/svc_metrics.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/error.h"

/* Reads the whole of a small /proc file into buf (NUL-terminated). Returns its length, or
 * -1 when it cannot be read. */
static long read_small(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t len = fread(buf, 1, n - 1, f);
    fclose(f);
    buf[len] = 0;
    return (long)len;
}

/* The boot time (Unix seconds) from /proc/stat's btime line, or -1. */
static double boot_time(void)
{
    static char buf[16384]; /* only the first lines matter; btime comes after the CPUs' */
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return -1;
    double bt = -1;
    while (fgets(buf, sizeof buf, f))
        if (!strncmp(buf, "btime ", 6)) {
            bt = strtod(buf + 6, NULL);
            break;
        }
    fclose(f);
    return bt;
}

/* Open descriptors: the entries of /proc/self/fd, less the one that lists them. */
static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1;
}

int svc_process_stats_read(svc_process_stats *out, char *err)
{
    memset(out, 0, sizeof *out);
    char buf[4096];
    if (read_small("/proc/self/stat", buf, sizeof buf) < 0)
        return pd_errf(err, PD_EIO, "cannot read /proc/self/stat");
    /* "pid (comm) state ppid ...": comm may hold spaces and parentheses, so the fields are
     * counted from the last ')'; field 3 (state) is the first after it. */
    const char *p = strrchr(buf, ')');
    if (!p) return pd_errf(err, PD_EIO, "/proc/self/stat: no ')' after the command name");
    p++;
    double f[24]; /* fields 3..26 of proc(5) at f[field - 3] (state reads as 0) */
    int got = 0;
    for (; got < 24; got++) {
        while (*p == ' ') p++;
        if (!*p) break;
        char *end;
        f[got] = strtod(p, &end);
        if (end == p) { /* state: a letter */
            f[got] = 0;
            while (*end && *end != ' ') end++;
        }
        p = end;
    }
    if (got < 22) return pd_errf(err, PD_EIO, "/proc/self/stat: %d fields after the name", got);
    double tick = (double)sysconf(_SC_CLK_TCK), page = (double)sysconf(_SC_PAGESIZE);
    if (tick <= 0) tick = 100;
    if (page <= 0) page = 4096;
    out->cpu_seconds = (f[14 - 3] + f[15 - 3]) / tick;  /* utime + stime */
    out->virtual_bytes = f[23 - 3];                      /* vsize, bytes */
    out->resident_bytes = f[24 - 3] * page;              /* rss, pages */
    double bt = boot_time();
    out->start_time_seconds = bt >= 0 ? bt + f[22 - 3] / tick : 0; /* starttime, ticks */
    out->open_fds = count_fds();
    struct rlimit rl;
    out->max_fds = getrlimit(RLIMIT_NOFILE, &rl) == 0 ? (double)rl.rlim_cur : -1;
    if (bt < 0 || out->open_fds < 0 || out->max_fds < 0)
        return pd_errf(err, PD_EIO, "cannot read %s", bt < 0 ? "/proc/stat's btime"
                       : out->open_fds < 0 ? "/proc/self/fd" : "RLIMIT_NOFILE");
    return 0;
}
