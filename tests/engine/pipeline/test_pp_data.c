/*
 * test_pp_data.c - pp_comm's activation data plane without GPUs: two ranks as two threads
 * of this process, over loopback.
 *
 *   - GLMSPARK_PP_DATA=tcp makes rank 0 offer no NCCL id;
 *   - without an offer, pp_comm_data_start keeps the TCP ring and pp_comm_send_act/recv_act
 *     move 100 KB patterns around it intact (0 -> 1 and 1 -> 0);
 *   - an offered id travels in the handshake (rank 1 sees rank 0's bytes), and a CPU rank
 *     refuses it with ERR_INVAL (on every build, with or without NCCL);
 *   - device-memory transfers without the NCCL plane are refused with ERR_INVAL.
 */
#define _DEFAULT_SOURCE  // setenv
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "engine/pipeline/pp_comm.h"
#include "engine/shared/err.h"
#include "tests/check.h"
#include "tests/engine/pipeline/pp_test_util.h"

enum { N_BYTES = 100 * 1000 };

typedef struct Rank {
    int rank;
    char master[32];
    const unsigned char *offer;  // rank 0: the id passed to pp_comm_init, or NULL
    Err init_err, start_err, io_err;
    bool uses_nccl;
    unsigned char got_id[PP_NCCL_ID_BYTES];
    bool intact;  // the pattern received equals the one sent
    Err dev_err;
} Rank;

static void fill(unsigned char *p, size_t n, int seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char) (i * 167 + (size_t) seed * 31 + 5);
}

static void *rank_main(void *arg)
{
    Rank *r = arg;
    PpComm c;
    r->init_err = pp_comm_init(&c, r->rank, 2, r->master, 42, r->offer);
    if (r->init_err) return NULL;
    memcpy(r->got_id, c.nccl_id, PP_NCCL_ID_BYTES);
    r->start_err = pp_comm_data_start(&c, false);
    r->uses_nccl = pp_comm_uses_nccl(&c);
    unsigned char *buf = malloc(N_BYTES), *want = malloc(N_BYTES);
    if (!r->start_err && buf && want) {
        // 0 -> 1 with pattern 1, then 1 -> 0 with pattern 2 (the ring's two links).
        const int seed_in = r->rank == 0 ? 2 : 1, seed_out = r->rank == 0 ? 1 : 2;
        fill(want, N_BYTES, seed_in);
        fill(buf, N_BYTES, seed_out);
        if (r->rank == 0) {
            r->io_err = pp_comm_send_act(&c, buf, N_BYTES);
            memset(buf, 0xEE, N_BYTES);
            if (!r->io_err) r->io_err = pp_comm_recv_act(&c, buf, N_BYTES);
        } else {
            unsigned char *out = malloc(N_BYTES);
            if (!out) r->io_err = ERR_NOMEM;
            if (out) memcpy(out, buf, N_BYTES);
            memset(buf, 0xEE, N_BYTES);
            if (!r->io_err) r->io_err = pp_comm_recv_act(&c, buf, N_BYTES);
            if (!r->io_err) r->io_err = pp_comm_send_act(&c, out, N_BYTES);
            free(out);
        }
        r->intact = !r->io_err && memcmp(buf, want, N_BYTES) == 0;
        r->dev_err = pp_comm_send_dev(&c, buf, 16);
    }
    // An orderly end even after a refused start: a rank that just closed its sockets would
    // look like a failed peer to the other thread, whose watchdog ends the process.
    pp_comm_finish(&c);
    free(buf);
    free(want);
    pp_comm_free(&c);
    return NULL;
}

// Run ranks 0 and 1 (threads) through rank_main; offer goes to rank 0.
static void run_pair(Rank r[2], const unsigned char *offer)
{
    const int port = pp_test_free_port();
    CHECK(port > 0);
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        memset(&r[i], 0, sizeof r[i]);
        r[i].rank = i;
        r[i].offer = i == 0 ? offer : NULL;
        snprintf(r[i].master, sizeof r[i].master, "127.0.0.1:%d", port);
    }
    for (int i = 0; i < 2; i++)
        CHECK(pthread_create(&th[i], NULL, rank_main, &r[i]) == 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
}

static void test_tcp_forced(void)
{
    unsigned char id[PP_NCCL_ID_BYTES];
    memset(id, 0x33, sizeof id);
    setenv("GLMSPARK_PP_DATA", "tcp", 1);
    CHECK(!pp_comm_nccl_offer(id));
    CHECK(id[0] == 0x33 && id[PP_NCCL_ID_BYTES - 1] == 0x33);  // untouched
    unsetenv("GLMSPARK_PP_DATA");
}

static void test_tcp_ring(void)
{
    Rank r[2];
    run_pair(r, NULL);
    for (int i = 0; i < 2; i++) {
        CHECK(r[i].init_err == ERR_OK);
        CHECK(r[i].start_err == ERR_OK);
        CHECK(!r[i].uses_nccl);
        CHECK(r[i].io_err == ERR_OK);
        CHECK(r[i].intact);
        CHECK(r[i].dev_err == ERR_INVAL);
    }
}

static void test_offer_refused_by_cpu_ranks(void)
{
    unsigned char id[PP_NCCL_ID_BYTES];
    for (int i = 0; i < PP_NCCL_ID_BYTES; i++)
        id[i] = (unsigned char) (i * 7 + 1);
    Rank r[2];
    run_pair(r, id);
    for (int i = 0; i < 2; i++) {
        CHECK(r[i].init_err == ERR_OK);
        CHECK(memcmp(r[i].got_id, id, sizeof id) == 0);  // carried by the handshake
        CHECK(r[i].start_err == ERR_INVAL);
        CHECK(!r[i].uses_nccl);
    }
}

int main(void)
{
    test_tcp_forced();
    test_tcp_ring();
    test_offer_refused_by_cpu_ranks();
    return check_exit();
}
