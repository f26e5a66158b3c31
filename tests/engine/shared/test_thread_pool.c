/*
 * test_thread_pool.c - thread_pool.c: every task of every run executes exactly once, on a
 * valid thread index, for pool sizes 1..4 and task counts around the pool size; runs
 * complete before thread_pool_run() returns (the counts are read right after).
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "engine/shared/thread_pool.h"
#include "engine/shared/err.h"
#include "tests/check.h"

enum { MAX_TASKS = 1000 };

typedef struct Counts {
    atomic_int hits[MAX_TASKS];
    atomic_int bad_thread;
    int n_threads;
} Counts;

static void count_task(void *ctx, int task, int thread)
{
    Counts *c = ctx;
    atomic_fetch_add(&c->hits[task], 1);
    if (thread < 0 || thread >= c->n_threads) atomic_fetch_add(&c->bad_thread, 1);
}

int main(void)
{
    static Counts c;
    const int task_counts[] = {0, 1, 2, 3, 7, 64, MAX_TASKS};
    for (int n_threads = 1; n_threads <= 4; n_threads++) {
        ThreadPool *pool = NULL;
        CHECK(thread_pool_create(n_threads, &pool) == ERR_OK);
        CHECK(thread_pool_size(pool) == n_threads);
        for (size_t k = 0; k < sizeof task_counts / sizeof task_counts[0]; k++)
            for (int rep = 0; rep < 50; rep++) {
                const int n = task_counts[k];
                for (int i = 0; i < MAX_TASKS; i++)
                    atomic_store(&c.hits[i], 0);
                atomic_store(&c.bad_thread, 0);
                c.n_threads = n_threads;
                thread_pool_run(pool, n, count_task, &c);
                int ok = 1;
                for (int i = 0; i < MAX_TASKS; i++)
                    ok &= atomic_load(&c.hits[i]) == (i < n ? 1 : 0);
                CHECK(ok);
                CHECK(atomic_load(&c.bad_thread) == 0);
            }
        thread_pool_destroy(pool);
    }
    ThreadPool *pool = (ThreadPool *) 1;
    CHECK(thread_pool_create(0, &pool) == ERR_INVAL && pool == NULL);
    CHECK(thread_pool_create(THREAD_POOL_MAX_THREADS + 1, &pool) == ERR_INVAL);
    thread_pool_destroy(NULL);
    return check_exit();
}
