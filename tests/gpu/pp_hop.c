/*
 * pp_hop.c - the latency of one pipeline activation hop through pp_comm: a ping-pong between
 * two ranks (one per GPU) of the message a decode step hands the next stage, at GLM-5's
 * dimensions (hidden 6144 f32 per row plus the DSA selection state of index_topk 2048, as
 * model_act_bytes() lays it out), for several row counts.
 *
 *   pp_hop --rank R --world 2 --master ADDR:PORT [--device D] [--iters N]
 *
 * Rank 0 offers NCCL unless GLMSPARK_PP_DATA=tcp (pp_comm.h). Two paths are timed:
 *   dev   device buffers straight through NCCL (pp_comm_send_dev/recv_dev; NCCL only)
 *   host  host buffers through pp_comm_send_act/recv_act: staged through device memory
 *         and NCCL, or the TCP ring when NCCL is off; the path the engine uses today
 * Every round trip's payload is checked (rank 1 echoes what it got; rank 0 compares after
 * the last iteration of each size, with a fresh pattern per size). Rank 0 prints one line
 * per (path, rows): median and 10th/90th percentile of half a round trip, in microseconds.
 * Exit status 0 when every transfer arrived intact. Not a ctest: tests/gpu/run_pp.sh runs it
 * on the two-GPU machine.
 */
#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/pipeline/pp_comm.h"

enum { HIDDEN = 6144, TOPK = 2048, WARMUP = 20 };

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

// Bytes of one decode activation message for `rows` rows (model_act_bytes at GLM-5 sizes).
static size_t act_bytes(int rows)
{
    return (size_t) rows * HIDDEN * sizeof(float) + (1 + (size_t) rows * (1 + TOPK)) * 4;
}

// One ping-pong path over `iters` timed round trips; rank 0 fills times[] (us per hop).
static Err pingpong(PpComm *c, bool dev, unsigned char *h_buf, void *d_buf, size_t n, int iters,
                    double *times)
{
    Err err = ERR_OK;
    for (int it = 0; it < WARMUP + iters && !err; it++) {
        const double t0 = now_us();
        if (c->rank == 0) {
            err = dev ? pp_comm_send_dev(c, d_buf, n) : pp_comm_send_act(c, h_buf, n);
            if (!err) err = dev ? pp_comm_recv_dev(c, d_buf, n) : pp_comm_recv_act(c, h_buf, n);
        } else {
            err = dev ? pp_comm_recv_dev(c, d_buf, n) : pp_comm_recv_act(c, h_buf, n);
            if (!err) err = dev ? pp_comm_send_dev(c, d_buf, n) : pp_comm_send_act(c, h_buf, n);
        }
        if (it >= WARMUP) times[it - WARMUP] = (now_us() - t0) / 2;
    }
    return err;
}

int main(int argc, char **argv)
{
    int rank = -1, world = 2, device = -1, iters = 200;
    const char *master = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--rank"))
            rank = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--world"))
            world = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--master"))
            master = argv[i + 1];
        else if (!strcmp(argv[i], "--device"))
            device = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters"))
            iters = atoi(argv[i + 1]);
    }
    if (rank < 0 || world != 2 || !master || iters < 1) {
        fprintf(stderr, "usage: pp_hop --rank R --world 2 --master ADDR:PORT [--device D] "
                        "[--iters N]\n");
        return 2;
    }
    if (cudaSetDevice(device >= 0 ? device : rank) != cudaSuccess) {
        fprintf(stderr, "pp_hop: no CUDA device %d\n", device >= 0 ? device : rank);
        return 1;
    }
    static const int rows[] = {1, 2, 4, 8, 64};
    const int n_rows = (int) (sizeof rows / sizeof rows[0]);
    const size_t max_n = act_bytes(rows[n_rows - 1]);
    unsigned char *h_buf = malloc(max_n), *h_want = malloc(max_n);
    double *times = malloc((size_t) iters * sizeof *times);
    void *d_buf = NULL;
    PpComm c;
    bool joined = false;  // pp_comm_init ran (pp_comm_free needs its closed state)
    int rc = 1;
    if (!h_buf || !h_want || !times || cudaMalloc(&d_buf, max_n) != cudaSuccess) goto done;
    unsigned char id[PP_NCCL_ID_BYTES];
    const bool offer = rank == 0 && pp_comm_nccl_offer(id);
    joined = true;
    if (pp_comm_init(&c, rank, world, master, 0x1234, offer ? id : NULL)
        || pp_comm_data_start(&c, true))
        goto done;
    const char *transport = pp_comm_uses_nccl(&c) ? "nccl" : "tcp";
    if (rank == 0) printf("%-5s %-4s %5s %9s %9s %9s %9s\n", "data", "path", "rows", "bytes",
                          "p10_us", "median_us", "p90_us");
    bool intact = true;
    for (int pass = 0; pass < 2; pass++) {
        const bool dev = pass == 0;
        if (dev && !pp_comm_uses_nccl(&c)) continue;
        for (int r = 0; r < n_rows; r++) {
            const size_t n = act_bytes(rows[r]);
            for (size_t k = 0; k < n; k++)  // a pattern of its own per size and path
                h_want[k] = (unsigned char) (k * 131 + (size_t) r * 17 + (size_t) pass * 101 + 7);
            if (rank == 0) {
                memcpy(h_buf, h_want, n);
                if (cudaMemcpy(d_buf, h_want, n, cudaMemcpyHostToDevice) != cudaSuccess) goto done;
            } else {
                memset(h_buf, 0xEE, n);  // poison: what arrives must overwrite it
                if (cudaMemset(d_buf, 0xEE, n) != cudaSuccess) goto done;
            }
            if (pingpong(&c, dev, h_buf, d_buf, n, iters, times)) goto done;
            if (dev && cudaMemcpy(h_buf, d_buf, n, cudaMemcpyDeviceToHost) != cudaSuccess)
                goto done;
            if (memcmp(h_buf, h_want, n) != 0) {
                fprintf(stderr, "pp_hop rank %d: %s path, %d rows: payload corrupted\n", rank,
                        dev ? "dev" : "host", rows[r]);
                intact = false;
            }
            if (rank == 0) {
                qsort(times, (size_t) iters, sizeof *times, cmp_double);
                printf("%-5s %-4s %5d %9zu %9.1f %9.1f %9.1f\n", transport, dev ? "dev" : "host",
                       rows[r], n, times[iters / 10], times[iters / 2], times[iters * 9 / 10]);
                fflush(stdout);
            }
        }
    }
    pp_comm_finish(&c);
    rc = intact ? 0 : 1;

done:
    if (rc && rank == 0) fprintf(stderr, "pp_hop: failed\n");
    if (joined) pp_comm_free(&c);
    if (d_buf) cudaFree(d_buf);
    free(h_buf);
    free(h_want);
    free(times);
    return rc;
}
