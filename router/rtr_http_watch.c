/* rtr_http_watch.c -- The HTTP server's watcher (see rtr_http_impl.h): one thread that closes
 * connections whose request has not arrived in time, and notices clients that hang up while
 * their request waits for tokens. libmicrohttpd gives neither: its idle timeout restarts at
 * every byte (a client sending a byte a second is never idle), and it does not poll a
 * suspended connection's socket.
 *
 * Connections live in slots allocated up front, one per connection the daemon may hold, so
 * that an epoll event names a slot by index and watch generation, never a pointer that may be
 * gone. A slot is taken in libmicrohttpd's NOTIFY_STARTED and given back in NOTIFY_CLOSED,
 * which libmicrohttpd calls before it closes the socket: while a slot is in use its fd is the
 * connection's, so shutdown() and recv() on it under w->mu touch no other socket.
 *
 * Lock: w->mu is innermost. Callers may hold a request's mutex when they call in; the watcher
 * thread calls p.ref with w->mu held and p.hangup without it. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "router/rtr_http_impl.h"

enum { HC_FREE = 0, HC_RECEIVING, HC_SERVING, HC_CLOSING };

static const uint64_t WAKE_KEY = UINT64_MAX; /* the eventfd's epoll key */

struct hw_conn {
    int fd;                         /* the connection's socket (libmicrohttpd's) */
    int state;                      /* HC_* */
    int64_t deadline_ms;            /* HC_RECEIVING: shut down at this time (monotonic ms);
                                       0 = never */
    void *obj;                      /* watched for a hang-up (a request); NULL = not watched */
    bool armed;                     /* obj's socket is in the epoll set */
    uint32_t wgen;                  /* bumped at every watch and unwatch: epoll events carry it */
    int next_free;                  /* free list; -1 = end */
};

struct hwatch {
    hw_params p;
    pthread_mutex_t mu;             /* guards conns, free_head */
    hw_conn *conns;                 /* [p.max_conns] */
    int free_head;
    int ep, wake;                   /* epoll set (watched sockets, wake), eventfd of stop */
    pthread_t thread;
    bool started;
    atomic_int stop;
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* True when the peer closed or reset the socket; data still to read (a pipelined request)
 * does not count. */
static bool peer_gone(int fd)
{
    char b;
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return false;
    if (n == 0) return true;
    return !(errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
}

/* The watched object of an event's slot, with a reference taken, when its client is gone;
 * NULL for a stale event (the watch ended or was renewed) or a peer still there. */
static void *event_obj(hwatch *w, uint64_t key)
{
    const uint32_t idx = (uint32_t)key, gen = (uint32_t)(key >> 32);
    void *obj = NULL;
    if (idx >= (uint32_t)w->p.max_conns) return NULL;
    pthread_mutex_lock(&w->mu);
    hw_conn *c = &w->conns[idx];
    if (c->obj && c->wgen == gen && peer_gone(c->fd)) {
        obj = c->obj;
        w->p.ref(obj); /* (the watch stays, disarmed: EPOLLONESHOT; the owner unwatches) */
    }
    pthread_mutex_unlock(&w->mu);
    return obj;
}

/* Shuts down the sockets of connections past their request deadline; libmicrohttpd then
 * reads the end of the stream and closes them. */
static void reap(hwatch *w, int64_t now)
{
    int n = 0;
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->p.max_conns; i++) {
        hw_conn *c = &w->conns[i];
        if (c->state != HC_RECEIVING || !c->deadline_ms || now < c->deadline_ms) continue;
        shutdown(c->fd, SHUT_RDWR);
        c->state = HC_CLOSING;
        n++;
    }
    pthread_mutex_unlock(&w->mu);
    if (n) {
        pd_metric_add(w->p.m_timeouts, n);
        PD_LOGD("http: closed %d connection(s) that sent no complete request in time", n);
    }
}

static void *watch_main(void *arg)
{
    hwatch *w = arg;
    struct epoll_event ev[64];
    /* The deadlines are looked at every tenth of the request timeout (50 ms - 1 s). */
    int64_t period = w->p.request_timeout_ms / 10, next_scan = 0;
    if (period < 50) period = 50;
    if (period > 1000) period = 1000;
    while (!atomic_load(&w->stop)) {
        int64_t now = now_ms();
        int timeout = -1;
        if (w->p.request_timeout_ms > 0) timeout = next_scan > now ? (int)(next_scan - now) : 0;
        int n = epoll_wait(w->ep, ev, 64, timeout);
        for (int i = 0; i < n; i++) {
            if (ev[i].data.u64 == WAKE_KEY) continue;
            void *obj = event_obj(w, ev[i].data.u64);
            if (obj) w->p.hangup(obj);
        }
        now = now_ms();
        if (w->p.request_timeout_ms > 0 && now >= next_scan) {
            reap(w, now);
            next_scan = now + period;
        }
    }
    return NULL;
}

int hw_create(const hw_params *p, hwatch **out, char *err)
{
    *out = NULL;
    if (p->max_conns < 1 || p->request_timeout_ms < 0 || p->idle_timeout_ms < 0 || !p->ref ||
        !p->hangup)
        return pd_errf(err, PD_EINVAL, "http watcher: bad parameters");
    hwatch *w = calloc(1, sizeof *w);
    if (!w) return pd_errf(err, PD_ENOMEM, "out of memory");
    int rc;
    w->p = *p;
    w->ep = w->wake = -1;
    pthread_mutex_init(&w->mu, NULL);
    atomic_init(&w->stop, 0);
    w->conns = calloc((size_t)p->max_conns, sizeof *w->conns);
    if (!w->conns) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < p->max_conns; i++) {
        w->conns[i].fd = -1;
        w->conns[i].next_free = i + 1 < p->max_conns ? i + 1 : -1;
    }
    w->free_head = 0;
    w->ep = epoll_create1(EPOLL_CLOEXEC);
    w->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = WAKE_KEY};
    if (w->ep < 0 || w->wake < 0 || epoll_ctl(w->ep, EPOLL_CTL_ADD, w->wake, &ev) < 0) {
        rc = pd_errf(err, PD_EIO, "http watcher: epoll: %s", strerror(errno));
        goto fail;
    }
    if (pthread_create(&w->thread, NULL, watch_main, w) != 0) {
        rc = pd_errf(err, PD_EIO, "http watcher: cannot start its thread");
        goto fail;
    }
    w->started = true;
    *out = w;
    return 0;
fail:
    hw_destroy(w);
    return rc;
}

void hw_destroy(hwatch *w)
{
    if (!w) return;
    if (w->started) {
        atomic_store(&w->stop, 1);
        const uint64_t one = 1;
        if (write(w->wake, &one, sizeof one) < 0) PD_LOGW("http watcher: cannot wake its thread");
        pthread_join(w->thread, NULL);
    }
    if (w->ep >= 0) close(w->ep);
    if (w->wake >= 0) close(w->wake);
    pthread_mutex_destroy(&w->mu);
    free(w->conns);
    free(w);
}

hw_conn *hw_conn_open(hwatch *w, int fd)
{
    hw_conn *c = NULL;
    pthread_mutex_lock(&w->mu);
    if (w->free_head >= 0) {
        c = &w->conns[w->free_head];
        w->free_head = c->next_free;
        c->fd = fd;
        c->state = HC_RECEIVING;
        c->deadline_ms = w->p.request_timeout_ms ? now_ms() + w->p.request_timeout_ms : 0;
        c->obj = NULL;
    }
    pthread_mutex_unlock(&w->mu);
    return c;
}

/* Ends the slot's watch; w->mu held. */
static void unwatch_locked(hwatch *w, hw_conn *c)
{
    if (!c->obj) return;
    if (c->armed) epoll_ctl(w->ep, EPOLL_CTL_DEL, c->fd, NULL);
    c->obj = NULL;
    c->armed = false;
    c->wgen++;
}

void hw_conn_close(hwatch *w, hw_conn *c)
{
    if (!c) return;
    pthread_mutex_lock(&w->mu);
    unwatch_locked(w, c);
    c->wgen++;
    c->fd = -1;
    c->state = HC_FREE;
    c->next_free = w->free_head;
    w->free_head = (int)(c - w->conns);
    pthread_mutex_unlock(&w->mu);
}

void hw_conn_serving(hwatch *w, hw_conn *c)
{
    if (!c) return;
    pthread_mutex_lock(&w->mu);
    if (c->state == HC_RECEIVING) c->state = HC_SERVING;
    pthread_mutex_unlock(&w->mu);
}

void hw_conn_waiting(hwatch *w, hw_conn *c)
{
    if (!c) return;
    pthread_mutex_lock(&w->mu);
    if (c->state == HC_SERVING) {
        c->state = HC_RECEIVING;
        c->deadline_ms = w->p.request_timeout_ms
                             ? now_ms() + w->p.idle_timeout_ms + w->p.request_timeout_ms
                             : 0;
    }
    pthread_mutex_unlock(&w->mu);
}

int hw_watch(hwatch *w, hw_conn *c, void *obj)
{
    if (!c) return PD_EINVAL;
    int rc = 0;
    pthread_mutex_lock(&w->mu);
    unwatch_locked(w, c);
    c->wgen++;
    struct epoll_event ev = {.events = EPOLLRDHUP | EPOLLONESHOT,
                             .data.u64 = (uint64_t)(c - w->conns) | (uint64_t)c->wgen << 32};
    c->obj = obj;
    c->armed = epoll_ctl(w->ep, EPOLL_CTL_ADD, c->fd, &ev) == 0;
    if (!c->armed) rc = PD_EIO;
    pthread_mutex_unlock(&w->mu);
    return rc;
}

void hw_unwatch(hwatch *w, hw_conn *c)
{
    if (!c) return;
    pthread_mutex_lock(&w->mu);
    unwatch_locked(w, c);
    pthread_mutex_unlock(&w->mu);
}

void hw_each_watched(hwatch *w, void (*fn)(void *obj))
{
    if (!w) return;
    for (int i = 0; i < w->p.max_conns; i++) {
        pthread_mutex_lock(&w->mu);
        void *obj = w->conns[i].obj;
        if (obj) w->p.ref(obj);
        pthread_mutex_unlock(&w->mu);
        if (obj) fn(obj);
    }
}
