/*
 * pp_comm.h - the pipeline's transport: a TCP control plane run by rank 0 (handshake,
 * heartbeats, orderly shutdown, failure broadcast) and a TCP data ring (rank r sends to
 * r + 1, the last rank back to rank 0) for the CPU backend; NCCL send/recv for GPU ranks
 * behind GLMSPARK_HAVE_NCCL.
 *
 * Handshake: every rank > 0 connects to rank 0 (--master ADDR:PORT, retrying while rank 0
 * starts) and sends its rank, world size, a hash of the model config and layer split, the
 * port of its data listener and its host name. Rank 0 refuses a mismatch (naming the rank
 * and what differs), then sends every rank the table of data addresses and the NCCL unique
 * id (zeros on CPU). Each rank then connects to its successor's data listener and accepts
 * its predecessor.
 *
 * Failures: a heartbeat thread in every process sends a heartbeat each
 * PP_COMM_HEARTBEAT_MS on the control connection(s) and watches what it receives. Rank 0
 * declares a rank failed when its connection closes or stays silent for
 * PP_COMM_TIMEOUT_MS, logs "rank R (HOST) failed: ...", tells the other ranks (ABORT) and
 * shuts the data sockets down, so a main thread blocked in send/recv returns ERR_IO at
 * once. A rank > 0 does the same when rank 0 goes silent or away. A process whose main
 * thread is stuck in computation is killed by the watchdog PP_COMM_GRACE_MS after the
 * failure (_exit(1)): the launcher restarts ranks, and no rank may outlive its pipeline.
 *
 * Ownership: PpComm owns its sockets and its heartbeat thread (pp_comm_init/pp_comm_free).
 * Threads:   send/recv from one thread (the owner); the heartbeat thread is internal;
 *            pp_comm_failed() may be called from any thread.
 * Errors:    ERR_IO for connect/accept/send/recv failures and for a failed peer (logged
 *            once, naming the rank and host); ERR_INVAL for a handshake mismatch.
 */
#ifndef ENGINE_PP_COMM_H
#define ENGINE_PP_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#ifdef GLMSPARK_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum {
    PP_MAX_WORLD = 16,
    PP_COMM_HEARTBEAT_MS = 250,
    PP_COMM_TIMEOUT_MS = 3000,
    PP_COMM_GRACE_MS = 4000,
    PP_COMM_CONNECT_MS = 60000,  // how long ranks wait for each other at start
    PP_NCCL_ID_BYTES = 128,
};

typedef struct PpComm {
    int rank, world;
    int ctrl_fd[PP_MAX_WORLD];     // rank 0: [r] for r > 0; rank > 0: [0]; -1 when closed
    int next_fd;                   // data to rank (rank + 1) % world
    int prev_fd;                   // data from rank (rank - 1 + world) % world
    char hosts[PP_MAX_WORLD][64];  // host name of every rank (for messages)
    unsigned char nccl_id[PP_NCCL_ID_BYTES];  // from rank 0 (zeros on CPU)
    struct PpCommFlags *flags;  // private (pp_comm.c): atomics shared with the heartbeat thread
    bool has_thread;
    unsigned long thread;  // pthread_t, kept opaque so the header stays plain C
} PpComm;

// Connect rank `rank` of `world` through the master at "ADDR:PORT" (rank 0 listens there).
// config_hash must be equal on every rank (model config + layer split). nccl_id: rank 0's
// NCCL unique id to distribute (PP_NCCL_ID_BYTES, or NULL on CPU); every rank finds it in
// c->nccl_id afterwards. On failure every socket is closed and *c is left with fds -1.
Err pp_comm_init(PpComm *c, int rank, int world, const char *master, uint64_t config_hash,
                 const unsigned char *nccl_id);

// Send n bytes to the next rank / receive n bytes from the previous one. ERR_IO (logged)
// when the connection fails or a peer has failed.
Err pp_comm_send(PpComm *c, const void *buf, size_t n);
Err pp_comm_recv(PpComm *c, void *buf, size_t n);

// Orderly end. Rank 0: tell every rank goodbye (call after the last result came back).
// Rank > 0: wait (up to PP_COMM_TIMEOUT_MS) for rank 0's goodbye. Then stop heartbeats.
void pp_comm_finish(PpComm *c);

// True once a peer failure has been detected.
bool pp_comm_failed(const PpComm *c);

// Stop the heartbeat thread and close every socket; safe on a zeroed/closed PpComm.
void pp_comm_free(PpComm *c);

// Split "ADDR:PORT" into addr (size addr_len) and port; false when malformed.
bool pp_comm_parse_addr(const char *s, char *addr, size_t addr_len, int *port);

#ifdef GLMSPARK_HAVE_NCCL
// ---------------------------------------------------------------------------
// NCCL data plane for GPU ranks (compiled with the CUDA backend). NCCL_CHECK logs, aborts
// the communicator so that peers fail fast instead of hanging, and aborts the process.

void pp_nccl_fatal(ncclComm_t comm, ncclResult_t r, const char *what, const char *file, int line);
#define NCCL_CHECK(comm, call)                                                               \
    do {                                                                                     \
        const ncclResult_t nccl_r_ = (call);                                                 \
        if (nccl_r_ != ncclSuccess) pp_nccl_fatal(comm, nccl_r_, #call, __FILE__, __LINE__); \
    } while (0)

// Rank 0 creates the unique id (passed to pp_comm_init, which distributes it); every rank
// then joins the communicator with the id found in c->nccl_id.
void pp_nccl_make_id(unsigned char id[PP_NCCL_ID_BYTES]);
ncclComm_t pp_nccl_init(const PpComm *c, int device);
// Activations to the next / from the previous rank on stream; checks async errors while
// waiting so a dead peer ends in ncclCommAbort, never an endless hang.
void pp_nccl_send(ncclComm_t comm, const PpComm *c, const void *d_buf, size_t n,
                  cudaStream_t stream);
void pp_nccl_recv(ncclComm_t comm, const PpComm *c, void *d_buf, size_t n, cudaStream_t stream);
#endif

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_PP_COMM_H
