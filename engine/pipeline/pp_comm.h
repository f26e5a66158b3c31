/*
 * pp_comm.h - the pipeline's transport: a TCP control plane run by rank 0 (handshake,
 * heartbeats, orderly shutdown, failure broadcast) and a TCP data ring (rank r sends to
 * r + 1, the last rank back to rank 0) for the CPU backend and for small messages; GPU
 * ranks send activations with NCCL send/recv instead (builds with GLMSPARK_HAVE_NCCL).
 *
 * Data plane: rank 0 decides. With GPU ranks it offers NCCL (pp_comm_nccl_offer: a fresh
 * unique id, travelling in the handshake) unless GLMSPARK_PP_DATA=tcp; after the handshake
 * every rank joins the communicator (pp_comm_data_start) on its current CUDA device, with
 * one stream of its own. pp_comm_send_act/recv_act then move host buffers through device
 * staging buffers and NCCL (or over the TCP ring when NCCL is off); pp_comm_send_dev/recv_dev
 * move device buffers directly. While a transfer runs the caller polls the stream, NCCL's
 * asynchronous error and the heartbeat state: a dead peer ends in ncclCommAbort and ERR_IO,
 * never in an endless wait; a peer that dies while an NCCL call blocks (the join, a lazy
 * connection) is caught by the heartbeat thread, whose watchdog ends the process.
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
 * Ownership: PpComm owns its sockets, its heartbeat thread and (GPU ranks) the NCCL
 *            communicator, its stream and staging buffers (pp_comm_init/pp_comm_free).
 * Threads:   send/recv from one thread (the owner); the heartbeat thread is internal;
 *            pp_comm_failed() may be called from any thread.
 * Errors:    ERR_IO for connect/accept/send/recv failures and for a failed peer (logged
 *            once, naming the rank and host); ERR_INVAL for a handshake mismatch.
 */
#ifndef ENGINE_PIPELINE_PP_COMM_H
#define ENGINE_PIPELINE_PP_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/shared/err.h"

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
    int pids[PP_MAX_WORLD];        // process id of every rank (status reports)
    unsigned char nccl_id[PP_NCCL_ID_BYTES];  // from rank 0 (zeros on CPU)
    struct PpCommFlags *flags;  // private (pp_comm.c): atomics shared with the heartbeat thread
    struct PpNccl *nccl;        // private (pp_comm.c): the NCCL data plane; NULL: TCP
    bool has_thread;
    unsigned long thread;  // pthread_t, kept opaque so the header stays plain C
} PpComm;

// A listening TCP socket on addr:port (addr NULL or not an IPv4 address: any; port 0: an
// ephemeral port), close-on-exec; *port_out gets the port. -1 (errno set) on failure.
int pp_comm_listen(const char *addr, int port, int *port_out);

// The variable through which a launcher hands rank 0 the master's listening socket, already
// bound (pp_launch_local): its value is the inherited fd. Binding in the launcher and
// inheriting the socket leaves no moment in which another process can take the port.
#define PP_LISTEN_FD_ENV "GLMSPARK_PP_LISTEN_FD"

// Connect rank `rank` of `world` through the master at "ADDR:PORT" (rank 0 listens there,
// on the socket PP_LISTEN_FD_ENV names when it is set and listens on that port).
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

// Stop the heartbeat thread, leave the NCCL communicator (destroyed, or aborted after a
// failure) and close every socket; safe on a zeroed/closed PpComm.
void pp_comm_free(PpComm *c);

// Split "ADDR:PORT" into addr (size addr_len) and port; false when malformed.
bool pp_comm_parse_addr(const char *s, char *addr, size_t addr_len, int *port);

// ---------------------------------------------------------------------------
// Activation data plane (NCCL for GPU ranks)

// Rank 0, before pp_comm_init, when its ranks run on GPUs: true with a fresh NCCL unique id
// in id (pass it to pp_comm_init) when this build has NCCL and GLMSPARK_PP_DATA is not
// "tcp"; false (TCP data plane, id untouched) otherwise. ERR-free: a failing
// ncclGetUniqueId is logged and answers false.
bool pp_comm_nccl_offer(unsigned char id[PP_NCCL_ID_BYTES]);

// Every rank, after pp_comm_init: when rank 0 offered NCCL, join the communicator on the
// calling thread's current CUDA device (gpu says this rank's activations live on a GPU;
// a CPU rank offered NCCL is refused with ERR_INVAL), else keep the TCP ring. ERR_IO when
// NCCL fails or a peer dies while joining (within PP_COMM_CONNECT_MS).
Err pp_comm_data_start(PpComm *c, bool gpu);

// True when activations travel through NCCL.
bool pp_comm_uses_nccl(const PpComm *c);

// Activations in host memory (n bytes) to the next rank / from the previous one: staged
// through device buffers and NCCL when pp_comm_uses_nccl(), else the TCP ring. Errors as
// pp_comm_send/recv.
Err pp_comm_send_act(PpComm *c, const void *buf, size_t n);
Err pp_comm_recv_act(PpComm *c, void *buf, size_t n);

// Device memory (n bytes) straight through NCCL; ERR_INVAL (logged) without NCCL.
Err pp_comm_send_dev(PpComm *c, const void *d_buf, size_t n);
Err pp_comm_recv_dev(PpComm *c, void *d_buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_PIPELINE_PP_COMM_H
