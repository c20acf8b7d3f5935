/* log.h -- Leveled logging to stderr with a timestamp; the level comes from
 * PDSERVE_LOG_LEVEL (error, warn, info, debug) or pd_log_set_level(). */
#ifndef PD_LOG_H
#define PD_LOG_H

typedef enum { PD_LOG_ERROR = 0, PD_LOG_WARN, PD_LOG_INFO, PD_LOG_DEBUG } pd_log_level;

void pd_log_set_level(pd_log_level level);
pd_log_level pd_log_get_level(void);
/* Parses "error|warn|info|debug"; returns 0 or -1 for an unknown name. */
int pd_log_parse_level(const char *s, pd_log_level *out);
void pd_log(pd_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define PD_LOGE(...) pd_log(PD_LOG_ERROR, __VA_ARGS__)
#define PD_LOGW(...) pd_log(PD_LOG_WARN, __VA_ARGS__)
#define PD_LOGI(...) pd_log(PD_LOG_INFO, __VA_ARGS__)
#define PD_LOGD(...) pd_log(PD_LOG_DEBUG, __VA_ARGS__)

#endif
