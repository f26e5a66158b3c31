/*
 * thread_pool.h - a fixed set of worker threads that run one parallel-for at a time.
 *
 * The CPU backend splits a matmul's rows, an attention's (token, head) pairs or a MoE
 * layer's experts into tasks and calls thread_pool_run(), which hands task indices
 * 0..n_tasks-1 to the workers and to the calling thread, and returns when every task has
 * finished. Tasks are claimed from an atomic counter, so uneven tasks balance themselves.
 * A pool of size 1 has no workers: everything runs on the caller, in task order.
 *
 * Ownership: thread_pool_create() allocates the pool and starts n_threads - 1 workers;
 *            thread_pool_destroy() joins them and frees everything.
 * Threads:   thread_pool_run() must not be called concurrently or from inside a task; the
 *            task function runs on several threads at once and must only write disjoint data.
 * Errors:    thread_pool_create() returns ERR_NOMEM or ERR_INVAL (thread creation failed).
 */
#ifndef ENGINE_SHARED_THREAD_POOL_H
#define ENGINE_SHARED_THREAD_POOL_H

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { THREAD_POOL_MAX_THREADS = 64 };

typedef struct ThreadPool ThreadPool;

// One task: `task` in [0, n_tasks), `thread` in [0, thread_pool_size()) identifies the
// running thread (for per-thread scratch).
typedef void (*ThreadPoolFn)(void *ctx, int task, int thread);

// Start a pool of n_threads threads in all (the caller counts as one; 1..64).
// On success *out owns the pool; on failure *out is NULL.
Err thread_pool_create(int n_threads, ThreadPool **out);

// Stop and join the workers, free the pool. NULL is allowed.
void thread_pool_destroy(ThreadPool *pool);

// Threads in the pool, the caller included.
int thread_pool_size(const ThreadPool *pool);

// The machine's online cores, in [1, most]: the size a pool of every core takes.
int thread_pool_cores(int most);

// Run fn(ctx, task, thread) for every task in [0, n_tasks) and return when all are done.
void thread_pool_run(ThreadPool *pool, int n_tasks, ThreadPoolFn fn, void *ctx);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_THREAD_POOL_H
