/*
 * bench_chunk_writer.c - a stand-in engine for the chunk-latency benchmark.
 *
 *   bench_chunk_writer N_JOBS N_ROUNDS INTERVAL_MS   (database from $GLMSPARK_DB)
 *
 * Claims N_JOBS queued jobs through engine/jobq (the real engine's code path), then for
 * N_ROUNDS rounds appends one chunk to every job and sleeps INTERVAL_MS. Each chunk's text
 * is "t=<microseconds since the epoch>" taken right after its commit returned, so a client
 * reading the stream through nginx measures commit-to-client latency on the same clock.
 * Finally finishes every job. Prints nothing but errors; exits non-zero on any failure.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "jobq.h"

static long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long) ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

int main(int argc, char **argv)
{
    if (argc != 4 || !getenv("GLMSPARK_DB")) {
        fprintf(stderr, "usage: GLMSPARK_DB=... bench_chunk_writer N_JOBS N_ROUNDS INTERVAL_MS\n");
        return 2;
    }
    const int n_jobs = atoi(argv[1]), n_rounds = atoi(argv[2]), interval_ms = atoi(argv[3]);
    JobqOptions o = {.conninfo = getenv("GLMSPARK_DB"), .engine_name = "bench", .model = "bench",
                     .lease_s = 600};
    JobQueue *q = NULL;
    if (n_jobs < 1 || n_jobs > 1000 || jobq_create(&o, &q)) return 1;
    JobqJob *jobs = calloc((size_t) n_jobs, sizeof *jobs);
    int rc = 1;
    if (!jobs) goto done;
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
        for (int i = 0; i < n_jobs; i++) {
            // The text is written before the commit; we stamp the time the previous commit
            // finished, i.e. an upper bound on when this one starts: the measured latency
            // includes this append's own commit time.
            char text[32];
            snprintf(text, sizeof text, "t=%lld", now_us());
            const int32_t tok = 1;
            JobqChunk ch = {JOBQ_CHUNK_CONTENT, text, &tok, 1, NULL};
            if (jobq_append(q, &jobs[i], &ch, 1, NULL)) goto done;
        }
        struct timespec ts = {interval_ms / 1000, (long) (interval_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < n_jobs; i++)
        if (jobq_finish(q, &jobs[i], "stop")) goto done;
    rc = 0;
done:
    for (int i = 0; jobs && i < n_jobs; i++) jobq_job_free(&jobs[i]);
    free(jobs);
    jobq_destroy(q);
    return rc;
}
