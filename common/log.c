/* log.c -- stderr logger: one line per call, written with a single fprintf so that
 * lines from different threads do not interleave. */
#include "common/log.h"

#include "common/env.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int g_level = -1; /* -1: not yet read from the environment */

int pd_log_parse_level(const char *s, pd_log_level *out)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++) {
        if (strcmp(s, names[i]) == 0) {
            *out = (pd_log_level)i;
            return 0;
        }
    }
    return -1;
}

pd_log_level pd_log_get_level(void)
{
    if (g_level < 0) {
        pd_log_level l = PD_LOG_INFO;
        if (pd_log_parse_level(pd_env_str("PDSERVE_LOG_LEVEL"), &l) != 0) l = PD_LOG_INFO;
        g_level = (int)l;
    }
    return (pd_log_level)g_level;
}

void pd_log_set_level(pd_log_level level) { g_level = (int)level; }

void pd_log(pd_log_level level, const char *fmt, ...)
{
    if ((int)level > (int)pd_log_get_level()) return;
    static const char tag[] = "EWID";
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %c %s\n", tm.tm_year + 1900,
            tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
            tag[level], msg);
}
