/*
 * thread_pool.c - workers parked on a condition variable, woken once per parallel-for.
 *
 * Each thread_pool_run() publishes the job and bumps a generation counter under the mutex,
 * then broadcasts; the workers and the caller claim tasks with an atomic fetch-add until
 * none are left, and the last worker to finish signals the caller. With 2 cores (this
 * machine) the win is on matmul rows and attention heads; a run costs a few futex calls.
 */
#include "engine/shared/thread_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct WorkerArg {
    ThreadPool *pool;
    int thread;
} WorkerArg;

struct ThreadPool {
    int n_threads;
    int n_started;  // workers actually running (n_threads - 1 after a good create)
    pthread_t workers[THREAD_POOL_MAX_THREADS];
    WorkerArg args[THREAD_POOL_MAX_THREADS];

    pthread_mutex_t mutex;
    pthread_cond_t wake;  // workers wait here for a new generation or shutdown
    pthread_cond_t done;  // the caller waits here for n_busy to reach 0
    unsigned long generation;
    int n_busy;  // workers still inside the current generation
    bool is_stopping;

    // The current job, written under the mutex before the generation changes.
    ThreadPoolFn fn;
    void *ctx;
    int n_tasks;
    atomic_int next_task;
};

static void run_tasks(ThreadPool *pool, int thread)
{
    for (;;) {
        const int task = atomic_fetch_add(&pool->next_task, 1);
        if (task >= pool->n_tasks) return;
        pool->fn(pool->ctx, task, thread);
    }
}

static void *worker_main(void *arg)
{
    const WorkerArg *wa = arg;
    ThreadPool *pool = wa->pool;
    unsigned long seen = 0;

    pthread_mutex_lock(&pool->mutex);
    for (;;) {
        while (!pool->is_stopping && pool->generation == seen)
            pthread_cond_wait(&pool->wake, &pool->mutex);
        if (pool->is_stopping) break;
        seen = pool->generation;
        pthread_mutex_unlock(&pool->mutex);

        run_tasks(pool, wa->thread);

        pthread_mutex_lock(&pool->mutex);
        if (--pool->n_busy == 0) pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->mutex);
    return NULL;
}

Err thread_pool_create(int n_threads, ThreadPool **out)
{
    *out = NULL;
    if (n_threads < 1 || n_threads > THREAD_POOL_MAX_THREADS) {
        LOG_ERROR("thread pool size %d is outside 1..%d", n_threads, THREAD_POOL_MAX_THREADS);
        return ERR_INVAL;
    }
    ThreadPool *pool = calloc(1, sizeof *pool);
    if (!pool) return ERR_NOMEM;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    atomic_init(&pool->next_task, 0);

    for (int i = 1; i < n_threads; i++) {
        pool->args[i] = (WorkerArg){pool, i};
        if (pthread_create(&pool->workers[i], NULL, worker_main, &pool->args[i]) != 0) {
            LOG_ERROR("could not start thread %d of %d", i, n_threads);
            thread_pool_destroy(pool);
            return ERR_INVAL;
        }
        pool->n_started = i;
    }
    *out = pool;
    return ERR_OK;
}

void thread_pool_destroy(ThreadPool *pool)
{
    if (!pool) return;
    pthread_mutex_lock(&pool->mutex);
    pool->is_stopping = true;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    for (int i = 1; i <= pool->n_started; i++)
        pthread_join(pool->workers[i], NULL);
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mutex);
    free(pool);
}

int thread_pool_size(const ThreadPool *pool)
{
    return pool ? pool->n_threads : 1;
}

int thread_pool_cores(int most)
{
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > most ? most : (int) n;
}

void thread_pool_run(ThreadPool *pool, int n_tasks, ThreadPoolFn fn, void *ctx)
{
    if (n_tasks <= 0) return;
    if (!pool || pool->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    pthread_mutex_lock(&pool->mutex);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_tasks = n_tasks;
    atomic_store(&pool->next_task, 0);
    pool->n_busy = pool->n_started;
    pool->generation++;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);

    run_tasks(pool, 0);

    pthread_mutex_lock(&pool->mutex);
    while (pool->n_busy > 0)
        pthread_cond_wait(&pool->done, &pool->mutex);
    pthread_mutex_unlock(&pool->mutex);
}
