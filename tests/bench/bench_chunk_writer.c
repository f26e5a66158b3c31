/*
 * bench_chunk_writer.c - a stand-in engine for the chunk-latency benchmark.
 *
 *   bench_chunk_writer N_JOBS N_ROUNDS INTERVAL_MS [--batch]   (database from $GLMSPARK_DB)
 *
 * Claims N_JOBS queued jobs through engine/serve/jobq (the real engine's code path), then for
 * N_ROUNDS rounds appends one chunk to every job and sleeps INTERVAL_MS. Each chunk's text
 * is "t=<microseconds since the epoch>" taken before its commit starts, so a client
 * reading the stream through nginx measures commit-to-client latency on the same clock
 * (the commit's own time included). Finally finishes every job.
 *   default   one jobq_append (one commit) per chunk, one job after another: the
 *             one-sequence engine;
 *   --batch   one jobq_append_batch (one commit) per round for every job's chunk, the last
 *             round finishing them in the same commit: the continuous-batching engine,
 *             whose decode step writes every running sequence's chunk at once.
 * Prints one line to stderr: the commits' count and their duration percentiles (the
 * writer's side of the latency); exits non-zero on any failure.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/serve/jobq.h"

static long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long) ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static int cmp_ll(const void *a, const void *b)
{
    const long long x = *(const long long *) a, y = *(const long long *) b;
    return (x > y) - (x < y);
}

// "N commits, commit ms p50 .. p99 .. max .." of durations d[0..n) in microseconds.
static void print_commit_times(long long *d, int n, bool is_batch)
{
    if (n == 0) return;
    qsort(d, (size_t) n, sizeof *d, cmp_ll);
    fprintf(stderr, "bench_chunk_writer: %d %s commits, commit ms p50 %.2f p99 %.2f max %.2f\n", n,
            is_batch ? "batched" : "single-chunk", (double) d[n / 2] / 1e3,
            (double) d[(int) ((long long) n * 99 / 100)] / 1e3, (double) d[n - 1] / 1e3);
}

// One round of the batched engine: every job's chunk in one commit (finishing on the last).
static bool append_round_batch(JobQueue *q, JobqJob *jobs, int n_jobs, bool is_last)
{
    enum { TEXT_LEN = 32 };
    static const int32_t tok = 1;
    JobqAppend *items = calloc((size_t) n_jobs, sizeof *items);
    JobqChunk *chunks = calloc((size_t) n_jobs, sizeof *chunks);
    char *texts = malloc((size_t) n_jobs * TEXT_LEN);
    bool ok = false;
    if (!items || !chunks || !texts) goto done;
    const long long t = now_us();
    for (int i = 0; i < n_jobs; i++) {
        char *text = texts + (size_t) i * TEXT_LEN;
        snprintf(text, TEXT_LEN, "t=%lld", t);
        chunks[i] = (JobqChunk){JOBQ_CHUNK_CONTENT, text, &tok, 1, NULL};
        items[i] = (JobqAppend){.job = &jobs[i], .chunks = &chunks[i], .n_chunks = 1,
                                .finish_reason = is_last ? "stop" : NULL};
    }
    if (jobq_append_batch(q, items, n_jobs)) goto done;
    ok = true;
    for (int i = 0; i < n_jobs; i++) ok &= items[i].result == ERR_OK;
done:
    free(items);
    free(chunks);
    free(texts);
    return ok;
}

int main(int argc, char **argv)
{
    const bool is_batch = argc == 5 && !strcmp(argv[4], "--batch");
    if ((argc != 4 && !is_batch) || !getenv("GLMSPARK_DB")) {
        fprintf(stderr, "usage: GLMSPARK_DB=... bench_chunk_writer N_JOBS N_ROUNDS INTERVAL_MS"
                        " [--batch]\n");
        return 2;
    }
    const int n_jobs = atoi(argv[1]), n_rounds = atoi(argv[2]), interval_ms = atoi(argv[3]);
    JobqOptions o = {.conninfo = getenv("GLMSPARK_DB"), .engine_name = "bench", .model = "bench",
                     .lease_s = 600};
    JobQueue *q = NULL;
    if (n_jobs < 1 || n_jobs > 1000 || n_rounds < 1 || jobq_create(&o, &q)) return 1;
    JobqJob *jobs = calloc((size_t) n_jobs, sizeof *jobs);
    long long *commit_us = malloc((size_t) n_rounds * (size_t) n_jobs * sizeof *commit_us);
    int rc = 1, n_commits = 0;
    if (!jobs || !commit_us) goto done;
    for (int i = 0; i < n_jobs; i++) {
        for (int tries = 0; jobq_claim(q, &jobs[i]) != ERR_OK; tries++) {
            if (tries > 500) {
                fprintf(stderr, "bench_chunk_writer: only %d jobs to claim\n", i);
                goto done;
            }
            jobq_wait(q, 20);
        }
    }
    for (int r = 0; r < n_rounds; r++) {
        if (is_batch) {
            const long long t0 = now_us();
            if (!append_round_batch(q, jobs, n_jobs, r + 1 == n_rounds)) goto done;
            commit_us[n_commits++] = now_us() - t0;
        }
        for (int i = 0; !is_batch && i < n_jobs; i++) {
            char text[32];
            const long long t0 = now_us();
            snprintf(text, sizeof text, "t=%lld", t0);
            const int32_t tok = 1;
            JobqChunk ch = {JOBQ_CHUNK_CONTENT, text, &tok, 1, NULL};
            if (jobq_append(q, &jobs[i], &ch, 1, NULL)) goto done;
            commit_us[n_commits++] = now_us() - t0;
        }
        struct timespec ts = {interval_ms / 1000, (long) (interval_ms % 1000) * 1000000L};
        if (r + 1 < n_rounds) nanosleep(&ts, NULL);
    }
    for (int i = 0; !is_batch && i < n_jobs; i++)
        if (jobq_finish(q, &jobs[i], "stop")) goto done;
    print_commit_times(commit_us, n_commits, is_batch);
    rc = 0;
done:
    for (int i = 0; jobs && i < n_jobs; i++) jobq_job_free(&jobs[i]);
    free(jobs);
    free(commit_us);
    jobq_destroy(q);
    return rc;
}
