/*
 * pp_comm.c - TCP control plane, heartbeats and TCP data ring for the pipeline (pp_comm.h),
 * plus the NCCL data plane when built with CUDA.
 *
 * Control frames are 16 bytes: magic, kind, argument. The heartbeat thread polls the
 * control sockets every 50 ms, sends a heartbeat every PP_COMM_HEARTBEAT_MS and declares a
 * peer failed after PP_COMM_TIMEOUT_MS of silence or on a closed connection. On failure it
 * shuts the data sockets down (waking a main thread blocked in send/recv, which then
 * returns ERR_IO) and arms a watchdog that ends the process PP_COMM_GRACE_MS later if the
 * main thread has not: a rank must never outlive its pipeline, and a main thread deep in a
 * long computation cannot be interrupted any other way. The watchdog's _exit() is the one
 * deliberate exception to "no exit outside main": collective faults are fatal by design (a
 * failed collective poisons its communicator), and the supervisor restarts the engine while
 * the job queue re-delivers its jobs.
 */
#define _DEFAULT_SOURCE  // gethostname, NI_MAXHOST
#include "engine/pipeline/pp_comm.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifdef GLMSPARK_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#include "engine/shared/clock.h"

enum {
    CTRL_MAGIC = 0x47504354,  // "GPCT"
    HELLO_MAGIC = 0x47504848,
    CTRL_HEARTBEAT = 1,
    CTRL_BYE = 2,
    CTRL_ABORT = 3,  // arg: the failed rank
};

// What the heartbeat thread and the owner share.
struct PpCommFlags {
    atomic_bool failed;      // a peer failed (or we were told so)
    atomic_bool closing;     // orderly shutdown under way: closed connections are expected
    atomic_bool bye;         // rank > 0: rank 0 said goodbye
    atomic_int failed_rank;  // the rank that failed, -1 before
};

typedef struct CtrlFrame {
    uint32_t magic, kind;
    uint64_t arg;
} CtrlFrame;

typedef struct Hello {
    uint32_t magic;
    int32_t rank, world, data_port, pid;
    uint64_t config_hash;
    char host[64];
} Hello;

typedef struct Welcome {
    int32_t status;  // 0 ok, else the handshake was refused
    int32_t ports[PP_MAX_WORLD];
    char addrs[PP_MAX_WORLD][64];  // data address of every rank
    char hosts[PP_MAX_WORLD][64];
    int32_t pids[PP_MAX_WORLD];
    unsigned char nccl_id[PP_NCCL_ID_BYTES];
} Welcome;

static double now_ms(void)
{
    return clock_now_s() * 1e3;
}

static void sleep_ms(int ms)
{
    const struct timespec ts = {ms / 1000, (long) (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// ---------------------------------------------------------------------------
// Sockets

static Err write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        const ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return ERR_IO;
        p += k;
        n -= (size_t) k;
    }
    return ERR_OK;
}

static Err read_all(int fd, void *buf, size_t n)
{
    char *p = buf;
    while (n > 0) {
        const ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return ERR_IO;
        p += k;
        n -= (size_t) k;
    }
    return ERR_OK;
}

// Wait up to timeout_ms for fd to become readable; false on timeout or error.
static bool wait_readable(int fd, int timeout_ms)
{
    struct pollfd p = {fd, POLLIN, 0};
    int r;
    do {
        r = poll(&p, 1, timeout_ms);
    } while (r < 0 && errno == EINTR);
    return r > 0;
}

static void tune(int fd)
{
    const int one = 1, buf = 4 << 20;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

int pp_comm_listen(const char *addr, int port, int *port_out)
{
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t) port)};
    if (!addr || inet_pton(AF_INET, addr, &sa.sin_addr) != 1) sa.sin_addr.s_addr = INADDR_ANY;
    socklen_t len = sizeof sa;
    if (bind(fd, (struct sockaddr *) &sa, sizeof sa) || listen(fd, PP_MAX_WORLD)
        || getsockname(fd, (struct sockaddr *) &sa, &len)) {
        const int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    *port_out = ntohs(sa.sin_port);
    return fd;
}

// The listening socket a launcher bound for rank 0 (PP_LISTEN_FD_ENV), when it listens on
// `port`; -1 when there is none. The variable is consumed: what this process starts does not
// inherit it, and the fd becomes close-on-exec.
static int inherited_listener(int port)
{
    const char *e = getenv(PP_LISTEN_FD_ENV);
    if (!e) return -1;
    char v[32];  // a copy: unsetenv may free the environment's string
    snprintf(v, sizeof v, "%s", e);
    unsetenv(PP_LISTEN_FD_ENV);
    char *end;
    errno = 0;
    const long fd = strtol(v, &end, 10);
    const bool is_number = errno == 0 && end != v && *end == 0 && fd >= 0 && fd < INT_MAX;
    if (!is_number) {
        LOG_WARN("ignoring %s=\"%s\": not a file descriptor", PP_LISTEN_FD_ENV, v);
        return -1;
    }
    int listening = 0;
    socklen_t n = sizeof listening;
    struct sockaddr_in sa;
    socklen_t len = sizeof sa;
    if (getsockopt((int) fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) || !listening
        || getsockname((int) fd, (struct sockaddr *) &sa, &len) || sa.sin_family != AF_INET
        || ntohs(sa.sin_port) != port) {
        LOG_WARN("ignoring %s=%ld: not a socket listening on port %d", PP_LISTEN_FD_ENV, fd, port);
        return -1;
    }
    fcntl((int) fd, F_SETFD, FD_CLOEXEC);
    return (int) fd;
}

// Accept one connection within timeout_ms; -1 on timeout or error.
static int accept_within(int lfd, int timeout_ms, char *peer, size_t peer_len)
{
    if (!wait_readable(lfd, timeout_ms)) return -1;
    struct sockaddr_in sa;
    socklen_t len = sizeof sa;
    const int fd = accept(lfd, (struct sockaddr *) &sa, &len);
    if (fd < 0) return -1;
    if (peer) inet_ntop(AF_INET, &sa.sin_addr, peer, (socklen_t) peer_len);
    tune(fd);
    return fd;
}

// Connect to addr:port, retrying until timeout_ms has passed. -1 on failure.
static int connect_retry(const char *addr, int port, int timeout_ms)
{
    const double t_end = now_ms() + timeout_ms;
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    do {
        struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res = NULL;
        if (getaddrinfo(addr, port_s, &hints, &res) == 0) {
            const int fd = socket(AF_INET, SOCK_STREAM, 0);
            if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
                freeaddrinfo(res);
                tune(fd);
                return fd;
            }
            if (fd >= 0) close(fd);
            freeaddrinfo(res);
        }
        sleep_ms(50);
    } while (now_ms() < t_end);
    return -1;
}

bool pp_comm_parse_addr(const char *s, char *addr, size_t addr_len, int *port)
{
    const char *colon = s ? strrchr(s, ':') : NULL;
    if (!colon || colon == s || (size_t) (colon - s) >= addr_len) return false;
    char *end;
    const long p = strtol(colon + 1, &end, 10);
    if (*end || end == colon + 1 || p < 1 || p > 65535) return false;
    memcpy(addr, s, (size_t) (colon - s));
    addr[colon - s] = '\0';
    *port = (int) p;
    return true;
}

static void nccl_free(PpComm *c);  // the NCCL data plane's teardown (end of file)

// ---------------------------------------------------------------------------
// Heartbeats and failure

static void *watchdog_main(void *arg)
{
    (void) arg;
    sleep_ms(PP_COMM_GRACE_MS);
    fprintf(stderr, "pipeline: still running %d ms after a rank failure; exiting\n",
            PP_COMM_GRACE_MS);
    _exit(1);
}

// Record the failure of `rank` (once), wake the main thread and arm the watchdog.
static void fail(PpComm *c, int rank, const char *why)
{
    bool expected = false;
    if (!atomic_compare_exchange_strong(&c->flags->failed, &expected, true)) return;
    atomic_store(&c->flags->failed_rank, rank);
    LOG_ERROR("pipeline rank %d (%s) failed: %s; stopping rank %d", rank, c->hosts[rank], why,
              c->rank);
    if (c->rank == 0) {
        const CtrlFrame f = {CTRL_MAGIC, CTRL_ABORT, (uint64_t) rank};
        for (int r = 1; r < c->world; r++)
            if (r != rank && c->ctrl_fd[r] >= 0) (void) write_all(c->ctrl_fd[r], &f, sizeof f);
    }
    if (c->next_fd >= 0) shutdown(c->next_fd, SHUT_RDWR);
    if (c->prev_fd >= 0) shutdown(c->prev_fd, SHUT_RDWR);
    pthread_t wd;
    if (pthread_create(&wd, NULL, watchdog_main, NULL) == 0) pthread_detach(wd);
}

static void *heartbeat_main(void *arg)
{
    PpComm *c = arg;
    double last_rx[PP_MAX_WORLD], last_tx = 0;
    for (int r = 0; r < c->world; r++)
        last_rx[r] = now_ms();
    while (!atomic_load(&c->flags->failed)) {
        const bool closing = atomic_load(&c->flags->closing);
        struct pollfd p[PP_MAX_WORLD];
        int peer[PP_MAX_WORLD], n = 0;
        for (int r = 0; r < c->world; r++)
            if (c->ctrl_fd[r] >= 0) {
                p[n] = (struct pollfd){c->ctrl_fd[r], POLLIN, 0};
                peer[n++] = r;
            }
        if (n == 0) break;
        const int k = poll(p, (nfds_t) n, 50);
        if (k < 0 && errno != EINTR) break;
        const double t = now_ms();
        for (int i = 0; i < n && k > 0; i++) {
            if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            CtrlFrame f;
            const int r = peer[i];
            if (read_all(p[i].fd, &f, sizeof f) || f.magic != CTRL_MAGIC) {
                if (atomic_load(&c->flags->closing) || atomic_load(&c->flags->bye)) {
                    c->ctrl_fd[r] = -1;  // expected at the end; closed by pp_comm_free
                    close(p[i].fd);
                    continue;
                }
                fail(c, r, "its control connection closed");
                break;
            }
            last_rx[r] = t;
            if (f.kind == CTRL_BYE) atomic_store(&c->flags->bye, true);
            if (f.kind == CTRL_ABORT && f.arg < (uint64_t) c->world)
                fail(c, (int) f.arg, "reported by rank 0");
        }
        if (atomic_load(&c->flags->failed)) break;
        if (!closing)
            for (int i = 0; i < n; i++)
                if (t - last_rx[peer[i]] > PP_COMM_TIMEOUT_MS) {
                    char why[64];
                    snprintf(why, sizeof why, "no heartbeat for %.1f s",
                             (t - last_rx[peer[i]]) / 1e3);
                    fail(c, peer[i], why);
                    break;
                }
        if (t - last_tx >= PP_COMM_HEARTBEAT_MS) {
            const CtrlFrame f = {CTRL_MAGIC, CTRL_HEARTBEAT, 0};
            for (int i = 0; i < n; i++)
                (void) write_all(p[i].fd, &f, sizeof f);
            last_tx = t;
        }
        if (closing && atomic_load(&c->flags->bye)) break;
    }
    return NULL;
}

// ---------------------------------------------------------------------------
// Handshake

static void comm_reset(PpComm *c)
{
    memset(c, 0, sizeof *c);
    for (int r = 0; r < PP_MAX_WORLD; r++)
        c->ctrl_fd[r] = -1;
    c->next_fd = c->prev_fd = -1;
}

Err pp_comm_init(PpComm *c, int rank, int world, const char *master, uint64_t config_hash,
                 const unsigned char *nccl_id)
{
    comm_reset(c);
    ASSERT(world >= 1 && world <= PP_MAX_WORLD && rank >= 0 && rank < world);
    if (!(c->flags = malloc(sizeof *c->flags))) return ERR_NOMEM;
    atomic_init(&c->flags->failed, false);
    atomic_init(&c->flags->closing, false);
    atomic_init(&c->flags->bye, false);
    atomic_init(&c->flags->failed_rank, -1);
    c->rank = rank;
    c->world = world;
    char addr[64];
    int port = 0, lfd = -1, dfd = -1, data_port = 0;
    Welcome *wel = calloc(1, sizeof *wel);
    Err err = ERR_IO;
    if (!wel) return ERR_NOMEM;
    char host[64] = "?";
    gethostname(host, sizeof host - 1);
    snprintf(c->hosts[rank], sizeof c->hosts[rank], "%s", host);
    c->pids[rank] = (int) getpid();
    if (!pp_comm_parse_addr(master, addr, sizeof addr, &port)) {
        LOG_ERROR("pipeline master address \"%s\" is not ADDR:PORT", master ? master : "");
        err = ERR_INVAL;
        goto done;
    }
    // Every rank's data listener; rank 0's is the master port's neighbour-free ephemeral port.
    if ((dfd = pp_comm_listen(NULL, 0, &data_port)) < 0) {
        LOG_ERROR("rank %d could not listen for pipeline data: %s", rank, strerror(errno));
        goto done;
    }

    if (rank == 0) {
        if ((lfd = inherited_listener(port)) < 0 && (lfd = pp_comm_listen(addr, port, &port)) < 0) {
            LOG_ERROR("rank 0 could not listen on %s: %s", master, strerror(errno));
            goto done;
        }
        Hello hellos[PP_MAX_WORLD];
        memset(hellos, 0, sizeof hellos);
        int n_joined = 0;
        const double t_end = now_ms() + PP_COMM_CONNECT_MS;
        while (n_joined < world - 1) {
            char peer[64] = "";
            const int fd = accept_within(lfd, (int) (t_end - now_ms()), peer, sizeof peer);
            if (fd < 0) {
                LOG_ERROR("rank 0: only %d of %d ranks joined within %d s", n_joined + 1, world,
                          PP_COMM_CONNECT_MS / 1000);
                goto done;
            }
            Hello h;
            if (!wait_readable(fd, 5000) || read_all(fd, &h, sizeof h) || h.magic != HELLO_MAGIC) {
                LOG_WARN("rank 0: ignoring a connection from %s that is not a rank", peer);
                close(fd);
                continue;
            }
            h.host[sizeof h.host - 1] = '\0';
            const char *why = h.world != world                ? "world size differs"
                              : h.rank < 1 || h.rank >= world ? "rank out of range"
                              : c->ctrl_fd[h.rank] >= 0       ? "rank joined twice"
                              : h.config_hash != config_hash  ? "model config or layer "
                                                                "split differs"
                                                              : NULL;
            if (why) {
                LOG_ERROR("rank 0: refusing rank %d (%s, %s): %s", h.rank, h.host, peer, why);
                const int32_t refuse = 1;
                (void) write_all(fd, &refuse, sizeof refuse);
                close(fd);
                err = ERR_INVAL;
                goto done;
            }
            c->ctrl_fd[h.rank] = fd;
            hellos[h.rank] = h;
            snprintf(wel->addrs[h.rank], sizeof wel->addrs[h.rank], "%s", peer);
            wel->ports[h.rank] = h.data_port;
            snprintf(c->hosts[h.rank], sizeof c->hosts[h.rank], "%s", h.host);
            c->pids[h.rank] = h.pid;
            n_joined++;
        }
        snprintf(wel->addrs[0], sizeof wel->addrs[0], "%s",
                 strcmp(addr, "0.0.0.0") == 0 ? "127.0.0.1" : addr);
        wel->ports[0] = data_port;
        for (int r = 0; r < world; r++) {
            snprintf(wel->hosts[r], sizeof wel->hosts[r], "%s", c->hosts[r]);
            wel->pids[r] = c->pids[r];
        }
        if (nccl_id) memcpy(wel->nccl_id, nccl_id, PP_NCCL_ID_BYTES);
        for (int r = 1; r < world; r++)
            if (write_all(c->ctrl_fd[r], wel, sizeof *wel)) {
                LOG_ERROR("rank 0: could not send the handshake to rank %d (%s)", r, c->hosts[r]);
                goto done;
            }
    } else {
        const int fd = connect_retry(addr, port, PP_COMM_CONNECT_MS);
        if (fd < 0) {
            LOG_ERROR("rank %d could not reach rank 0 at %s within %d s", rank, master,
                      PP_COMM_CONNECT_MS / 1000);
            goto done;
        }
        c->ctrl_fd[0] = fd;
        Hello h = {HELLO_MAGIC, rank, world, data_port, (int32_t) getpid(), config_hash, {0}};
        snprintf(h.host, sizeof h.host, "%s", host);
        if (write_all(fd, &h, sizeof h) || !wait_readable(fd, PP_COMM_CONNECT_MS)
            || read_all(fd, wel, sizeof(int32_t))) {
            LOG_ERROR("rank %d: no handshake answer from rank 0 at %s", rank, master);
            goto done;
        }
        if (wel->status != 0) {
            LOG_ERROR("rank %d: rank 0 refused the handshake (its log says why)", rank);
            err = ERR_INVAL;
            goto done;
        }
        if (read_all(fd, (char *) wel + sizeof(int32_t), sizeof *wel - sizeof(int32_t))) {
            LOG_ERROR("rank %d: truncated handshake from rank 0", rank);
            goto done;
        }
        for (int r = 0; r < world; r++) {
            memcpy(c->hosts[r], wel->hosts[r], sizeof c->hosts[r]);
            c->pids[r] = wel->pids[r];
        }
        memcpy(c->nccl_id, wel->nccl_id, PP_NCCL_ID_BYTES);
    }
    if (nccl_id && rank == 0) memcpy(c->nccl_id, nccl_id, PP_NCCL_ID_BYTES);

    if (world > 1) {
        // Data ring: connect to the successor, accept the predecessor. Connects complete
        // against the listen backlog, so the order cannot deadlock.
        const int next = (rank + 1) % world;
        if ((c->next_fd = connect_retry(wel->addrs[next], wel->ports[next], 10000)) < 0) {
            LOG_ERROR("rank %d could not connect to rank %d (%s) at %s:%d", rank, next,
                      c->hosts[next], wel->addrs[next], wel->ports[next]);
            goto done;
        }
        const int32_t me = rank;
        if (write_all(c->next_fd, &me, sizeof me)) goto done;
        const int prev = (rank - 1 + world) % world;
        if ((c->prev_fd = accept_within(dfd, 10000, NULL, 0)) < 0) {
            LOG_ERROR("rank %d: rank %d (%s) did not connect its data link", rank, prev,
                      c->hosts[prev]);
            goto done;
        }
        int32_t who = -1;
        if (read_all(c->prev_fd, &who, sizeof who) || who != prev) {
            LOG_ERROR("rank %d: unexpected data link (from rank %d, expected %d)", rank, who, prev);
            goto done;
        }
        pthread_t th;
        if (pthread_create(&th, NULL, heartbeat_main, c) != 0) {
            LOG_ERROR("rank %d could not start the heartbeat thread", rank);
            goto done;
        }
        c->thread = (unsigned long) th;
        c->has_thread = true;
    }
    err = ERR_OK;

done:
    if (lfd >= 0) close(lfd);
    if (dfd >= 0) close(dfd);
    free(wel);
    if (err) pp_comm_free(c);
    return err;
}

// ---------------------------------------------------------------------------
// Data and shutdown

static Err report_io(PpComm *c, const char *what, int peer)
{
    if (atomic_load(&c->flags->failed)) return ERR_IO;  // logged by the heartbeat thread
    // The socket broke before the heartbeat noticed: that peer is gone.
    char why[96];
    snprintf(why, sizeof why, "its data link broke during %s", what);
    fail(c, peer, why);
    return ERR_IO;
}

Err pp_comm_send(PpComm *c, const void *buf, size_t n)
{
    if (atomic_load(&c->flags->failed)) return ERR_IO;
    if (write_all(c->next_fd, buf, n)) return report_io(c, "send", (c->rank + 1) % c->world);
    return ERR_OK;
}

Err pp_comm_recv(PpComm *c, void *buf, size_t n)
{
    if (atomic_load(&c->flags->failed)) return ERR_IO;
    if (read_all(c->prev_fd, buf, n))
        return report_io(c, "receive", (c->rank - 1 + c->world) % c->world);
    return ERR_OK;
}

void pp_comm_finish(PpComm *c)
{
    if (c->world <= 1 || !c->flags || atomic_load(&c->flags->failed)) return;
    if (c->rank == 0) {
        atomic_store(&c->flags->closing, true);
        const CtrlFrame f = {CTRL_MAGIC, CTRL_BYE, 0};
        for (int r = 1; r < c->world; r++)
            if (c->ctrl_fd[r] >= 0) (void) write_all(c->ctrl_fd[r], &f, sizeof f);
        atomic_store(&c->flags->bye, true);
        return;
    }
    const double t_end = now_ms() + PP_COMM_TIMEOUT_MS;
    while (!atomic_load(&c->flags->bye) && !atomic_load(&c->flags->failed) && now_ms() < t_end)
        sleep_ms(5);
    atomic_store(&c->flags->closing, true);
}

bool pp_comm_failed(const PpComm *c)
{
    return c->flags && atomic_load(&c->flags->failed);
}

void pp_comm_free(PpComm *c)
{
    if (!c) return;
    nccl_free(c);
    if (c->has_thread) {
        atomic_store(&c->flags->closing, true);
        atomic_store(&c->flags->bye, true);
        pthread_join((pthread_t) c->thread, NULL);
        c->has_thread = false;
    }
    for (int r = 0; r < PP_MAX_WORLD; r++)
        if (c->ctrl_fd[r] >= 0) close(c->ctrl_fd[r]);
    if (c->next_fd >= 0) close(c->next_fd);
    if (c->prev_fd >= 0) close(c->prev_fd);
    free(c->flags);
    comm_reset(c);
}

// ---------------------------------------------------------------------------
// Activation data plane

bool pp_comm_uses_nccl(const PpComm *c)
{
    return c->nccl != NULL;
}

// True when GLMSPARK_PP_DATA asks for the TCP data plane.
static bool tcp_forced(void)
{
    const char *v = getenv("GLMSPARK_PP_DATA");
    return v && strcmp(v, "tcp") == 0;
}

static bool id_is_zero(const unsigned char *id)
{
    for (int i = 0; i < PP_NCCL_ID_BYTES; i++)
        if (id[i]) return false;
    return true;
}

#ifndef GLMSPARK_HAVE_NCCL

bool pp_comm_nccl_offer(unsigned char id[PP_NCCL_ID_BYTES])
{
    (void) id;
    (void) tcp_forced;
    return false;
}

Err pp_comm_data_start(PpComm *c, bool gpu)
{
    (void) gpu;
    if (id_is_zero(c->nccl_id)) return ERR_OK;
    LOG_ERROR("rank %d: rank 0 offered the NCCL data plane, but this glmspark was built without "
              "NCCL (start every rank from the same build, or set GLMSPARK_PP_DATA=tcp on rank 0)",
              c->rank);
    return ERR_INVAL;
}

Err pp_comm_send_dev(PpComm *c, const void *d_buf, size_t n)
{
    (void) c, (void) d_buf, (void) n;
    LOG_ERROR("pipeline: device-memory transfers need NCCL, which this build lacks");
    return ERR_INVAL;
}

Err pp_comm_recv_dev(PpComm *c, void *d_buf, size_t n)
{
    return pp_comm_send_dev(c, d_buf, n);
}

static void nccl_free(PpComm *c)
{
    (void) c;
}

Err pp_comm_send_act(PpComm *c, const void *buf, size_t n)
{
    return pp_comm_send(c, buf, n);
}

Err pp_comm_recv_act(PpComm *c, void *buf, size_t n)
{
    return pp_comm_recv(c, buf, n);
}

#else   // GLMSPARK_HAVE_NCCL

// One rank's NCCL state: the communicator, its stream and device staging buffers for
// activations that come from host memory.
struct PpNccl {
    ncclComm_t comm;
    cudaStream_t stream;
    void *stage;  // device memory, cap bytes
    size_t cap;
    bool aborted;
};

enum { NCCL_SPIN_US = 2000 };  // poll without sleeping this long, then sleep 20 us per poll

static Err stage_ensure(PpComm *c, size_t n);

// Record an NCCL-side failure: abort the communicator (pending peer operations fail instead
// of hanging), then report through the heartbeat machinery (logged once, watchdog armed).
static Err nccl_fail(PpComm *c, int peer, const char *why)
{
    if (!c->nccl->aborted) {
        ncclCommAbort(c->nccl->comm);
        c->nccl->aborted = true;
    }
    if (!atomic_load(&c->flags->failed)) fail(c, peer, why);
    return ERR_IO;
}

// Wait until the communicator's pending work is enqueued and the stream is idle, polling
// NCCL's asynchronous error and the heartbeat state. peer: the rank blamed on failure.
// timeout_ms < 0: no limit (a peer may compute for long; its heartbeats say it is alive).
static Err nccl_wait(PpComm *c, int peer, const char *what, int timeout_ms)
{
    struct PpNccl *x = c->nccl;
    const double t0 = now_ms();
    char why[160];
    for (;;) {
        if (atomic_load(&c->flags->failed)) return nccl_fail(c, peer, "failed during NCCL");
        ncclResult_t async = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(x->comm, &async);
        if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
            snprintf(why, sizeof why, "NCCL error during %s: %s", what,
                     ncclGetErrorString(r != ncclSuccess ? r : async));
            return nccl_fail(c, peer, why);
        }
        if (async == ncclSuccess) {  // enqueued (or joined): now the stream
            const cudaError_t q = cudaStreamQuery(x->stream);
            if (q == cudaSuccess) return ERR_OK;
            if (q != cudaErrorNotReady) {
                snprintf(why, sizeof why, "CUDA error during %s: %s", what, cudaGetErrorString(q));
                return nccl_fail(c, peer, why);
            }
        }
        const double t = now_ms() - t0;
        if (timeout_ms >= 0 && t > timeout_ms) {
            snprintf(why, sizeof why, "%s did not finish within %d s", what, timeout_ms / 1000);
            return nccl_fail(c, peer, why);
        }
        if (t * 1000 > NCCL_SPIN_US) {
            const struct timespec ts = {0, 20 * 1000};
            nanosleep(&ts, NULL);
        }
    }
}

bool pp_comm_nccl_offer(unsigned char id[PP_NCCL_ID_BYTES])
{
    if (tcp_forced()) {
        LOG_INFO("pipeline: GLMSPARK_PP_DATA=tcp, activations over TCP");
        return false;
    }
    ncclUniqueId uid;
    _Static_assert(sizeof uid == PP_NCCL_ID_BYTES, "NCCL unique id size");
    const ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) {
        LOG_WARN("pipeline: ncclGetUniqueId failed (%s); activations over TCP",
                 ncclGetErrorString(r));
        return false;
    }
    memcpy(id, &uid, sizeof uid);
    return true;
}

Err pp_comm_data_start(PpComm *c, bool gpu)
{
    if (c->world <= 1 || id_is_zero(c->nccl_id)) return ERR_OK;
    if (!gpu) {
        LOG_ERROR("rank %d: rank 0 offered the NCCL data plane, but this rank runs on the CPU "
                  "(use the same --backend on every rank)",
                  c->rank);
        return ERR_INVAL;
    }
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
        LOG_ERROR("rank %d: no current CUDA device for NCCL", c->rank);
        return ERR_IO;
    }
    if (!(c->nccl = calloc(1, sizeof *c->nccl))) return ERR_NOMEM;
    if (cudaStreamCreateWithFlags(&c->nccl->stream, cudaStreamNonBlocking) != cudaSuccess) {
        LOG_ERROR("rank %d: could not create a CUDA stream for NCCL", c->rank);
        c->nccl->stream = NULL;
        nccl_free(c);
        return ERR_IO;
    }
    ncclUniqueId uid;
    memcpy(&uid, c->nccl_id, sizeof uid);
    // Blocking calls (NCCL's default; NCCL_COMM_BLOCKING=0 makes them non-blocking, which
    // the waits below handle too but which costs tens of microseconds per hop: the enqueue
    // moves to a helper thread). A peer that dies while a blocking call waits on it cannot
    // hang us: the heartbeat thread notices and its watchdog ends the process.
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    const double t0 = now_ms();
    const ncclResult_t r = ncclCommInitRankConfig(&c->nccl->comm, c->world, uid, c->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        LOG_ERROR("rank %d: ncclCommInitRankConfig failed: %s", c->rank, ncclGetErrorString(r));
        c->nccl->comm = NULL;
        nccl_free(c);
        return ERR_IO;
    }
    const int blame = c->rank == 0 ? 1 : 0;
    Err err = nccl_wait(c, blame, "the NCCL join", PP_COMM_CONNECT_MS);
    // One byte around the ring now, in one group (every rank sends and receives at once), so
    // that NCCL's lazy connection setup (~100 ms) happens here and not in the first batch.
    if (!err && !(err = stage_ensure(c, 2))) {
        struct PpNccl *x = c->nccl;
        const int next = (c->rank + 1) % c->world, prev = (c->rank - 1 + c->world) % c->world;
        ncclResult_t g = ncclGroupStart();
        if (g == ncclSuccess) g = ncclSend(x->stage, 1, ncclUint8, next, x->comm, x->stream);
        if (g == ncclSuccess)
            g = ncclRecv((char *) x->stage + 1, 1, ncclUint8, prev, x->comm, x->stream);
        const ncclResult_t g_end = ncclGroupEnd();
        if (g == ncclSuccess) g = g_end;
        if (g != ncclSuccess && g != ncclInProgress) {
            char why[128];
            snprintf(why, sizeof why, "NCCL connection setup failed: %s", ncclGetErrorString(g));
            err = nccl_fail(c, blame, why);
        } else {
            err = nccl_wait(c, blame, "the NCCL connection setup", PP_COMM_CONNECT_MS);
        }
    }
    if (err) {
        nccl_free(c);
        return err;
    }
    LOG_INFO("pipeline rank %d: NCCL data plane on GPU %d (%s), joined in %.0f ms", c->rank, device,
             c->hosts[c->rank], now_ms() - t0);
    return ERR_OK;
}

// Enqueue one NCCL point-to-point call (send when d_send, else receive into d_recv) with
// rank `peer` and wait for it.
static Err nccl_p2p(PpComm *c, const void *d_send, void *d_recv, size_t n, int peer)
{
    if (atomic_load(&c->flags->failed)) return ERR_IO;
    struct PpNccl *x = c->nccl;
    const ncclResult_t r = d_send ? ncclSend(d_send, n, ncclUint8, peer, x->comm, x->stream)
                                  : ncclRecv(d_recv, n, ncclUint8, peer, x->comm, x->stream);
    if (r != ncclSuccess && r != ncclInProgress) {
        char why[128];
        snprintf(why, sizeof why, "NCCL %s failed: %s", d_send ? "send" : "receive",
                 ncclGetErrorString(r));
        return nccl_fail(c, peer, why);
    }
    return nccl_wait(c, peer, d_send ? "an NCCL send" : "an NCCL receive", -1);
}

// The staging buffer, grown to n bytes. ERR_NOMEM (logged).
static Err stage_ensure(PpComm *c, size_t n)
{
    struct PpNccl *x = c->nccl;
    if (x->cap >= n) return ERR_OK;
    if (x->stage) cudaFree(x->stage);
    x->stage = NULL;
    x->cap = 0;
    if (cudaMalloc(&x->stage, n) != cudaSuccess) {
        x->stage = NULL;
        LOG_ERROR("rank %d: out of device memory for a %zu-byte activation buffer", c->rank, n);
        return ERR_NOMEM;
    }
    x->cap = n;
    return ERR_OK;
}

Err pp_comm_send_dev(PpComm *c, const void *d_buf, size_t n)
{
    if (!c->nccl) {
        LOG_ERROR("pipeline: device-memory transfers need the NCCL data plane");
        return ERR_INVAL;
    }
    return nccl_p2p(c, d_buf, NULL, n, (c->rank + 1) % c->world);
}

Err pp_comm_recv_dev(PpComm *c, void *d_buf, size_t n)
{
    if (!c->nccl) {
        LOG_ERROR("pipeline: device-memory transfers need the NCCL data plane");
        return ERR_INVAL;
    }
    return nccl_p2p(c, NULL, d_buf, n, (c->rank - 1 + c->world) % c->world);
}

// Host-memory variants of send_dev/recv_dev through the staging buffer, on the one stream.
static Err nccl_send_host(PpComm *c, const void *buf, size_t n)
{
    Err err = stage_ensure(c, n);
    if (err) return err;
    if (cudaMemcpyAsync(c->nccl->stage, buf, n, cudaMemcpyHostToDevice, c->nccl->stream)
        != cudaSuccess)
        return nccl_fail(c, c->rank, "cudaMemcpyAsync to the activation buffer failed");
    return pp_comm_send_dev(c, c->nccl->stage, n);
}

static Err nccl_recv_host(PpComm *c, void *buf, size_t n)
{
    Err err = stage_ensure(c, n);
    if (!err) err = pp_comm_recv_dev(c, c->nccl->stage, n);
    if (err) return err;
    if (cudaMemcpy(buf, c->nccl->stage, n, cudaMemcpyDeviceToHost) != cudaSuccess)
        return nccl_fail(c, c->rank, "cudaMemcpy from the activation buffer failed");
    return ERR_OK;
}

Err pp_comm_send_act(PpComm *c, const void *buf, size_t n)
{
    return c->nccl ? nccl_send_host(c, buf, n) : pp_comm_send(c, buf, n);
}

Err pp_comm_recv_act(PpComm *c, void *buf, size_t n)
{
    return c->nccl ? nccl_recv_host(c, buf, n) : pp_comm_recv(c, buf, n);
}

static void nccl_free(PpComm *c)
{
    struct PpNccl *x = c->nccl;
    if (!x) return;
    // Every transfer has completed by now (each is waited for), so nothing is lost by
    // aborting; unlike ncclCommDestroy, whose finalize step may wait on peers, abort is
    // local and bounded, which matters when the other ranks have already exited.
    if (x->comm && !x->aborted) ncclCommAbort(x->comm);
    if (x->stage) cudaFree(x->stage);
    if (x->stream) cudaStreamDestroy(x->stream);
    free(x);
    c->nccl = NULL;
}
#endif  // GLMSPARK_HAVE_NCCL
