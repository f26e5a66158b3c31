/*
 * bench_sampler.c - the sampler at a real vocabulary: µs per row before (the oracle of
 * tests/engine/model/sampler_ref.h, the algorithm as it was) and after (engine/model/
 * sampler.c), and the wall time of one decode step's rows sampled as the pipeline's last
 * rank does (engine/pipeline/pp_sample.h: the rows side by side on a thread_pool, a row's
 * softmax weights split over the threads) with 1 thread and with N, for R rows and for one.
 * A program that prints numbers (docs/perf.md), never a timed test.
 *
 * Usage: bench_sampler [--vocab V] [--rows R] [--reps N] [--threads T] [--shape peaked|flat]
 *   V 154,880 (GLM's), R 16 rows, N 5 repetitions (medians over them), T min(cores, 16).
 *   peaked: a language model's shape, a bell (mean -2, sd 2.5) with a few tokens at 15-25;
 *   flat: uniform in [-2, 2], where every candidate is within reach of the maximum (the
 *   sampler's slowest case: nothing can be left out of the ranking).
 * Each draw's token is compared with the oracle's (same seed); a mismatch is reported.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/shared/thread_pool.h"
#include "engine/model/sampler.h"
#include "engine/pipeline/pp_sample.h"
#include "tests/engine/model/sampler_ref.h"

typedef struct Config {
    const char *name;
    float temperature, top_p, min_p;
    int top_k;
} Config;

static const Config configs[] = {
    {"greedy", 0.0f, 1.0f, 0.0f, 0},
    {"temperature 1", 1.0f, 1.0f, 0.0f, 0},
    {"temperature 0.7, top_p 0.95", 0.7f, 0.95f, 0.0f, 0},
    {"temperature 1, top_k 50", 1.0f, 1.0f, 0.0f, 50},
    {"temperature 1, min_p 0.05", 1.0f, 1.0f, 0.05f, 0},
};

enum { N_CONFIGS = sizeof configs / sizeof *configs };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + (double) ts.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b)
{
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t) n, sizeof *v, by_value);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t rnd(uint64_t *r)
{
    *r = *r * 6364136223846793005ull + 1442695040888963407ull;
    return *r >> 11;
}

static float unit(uint64_t *r)
{
    return (float) (rnd(r) >> 29) * 0x1.0p-24f;
}

static void fill(float *l, int V, bool flat, uint64_t *r)
{
    for (int i = 0; i < V; i++)
        l[i] = flat ? 4.0f * unit(r) - 2.0f
                    : 2.5f * 1.732f * (unit(r) + unit(r) + unit(r) + unit(r) - 2.0f) - 2.0f;
    if (!flat)
        for (int k = 0; k < 8; k++)
            l[rnd(r) % (uint64_t) V] = 15.0f + 10.0f * unit(r);
}

// One decode step's sampling on pool as the pipeline's last rank does it (pp_sample_rows):
// n rows, each its own Sampler, copied in from src (untimed). Median ms over reps, after one
// untimed step that warms the pages up.
static double time_step(ThreadPool *pool, Sampler *samplers, float *work, const float *src, int n,
                        int V, int32_t *tokens, int reps, double *t_step)
{
    static PpSampleRow rows[PP_SAMPLE_MAX_ROWS];
    static PpSampleScratch scratch;
    for (int k = 0; k < reps + 1; k++) {
        memcpy(work, src, (size_t) n * (size_t) V * sizeof *work);
        for (int i = 0; i < n; i++)
            rows[i] = (PpSampleRow){.sampler = &samplers[i],
                                    .logits = work + (size_t) i * (size_t) V,
                                    .token = &tokens[i]};
        const double t0 = now_s();
        pp_sample_rows(pool, rows, n, &scratch);
        if (k > 0) t_step[k - 1] = now_s() - t0;
    }
    return median(t_step, reps) * 1e3;
}

int main(int argc, char **argv)
{
    int V = 154880, R = 16, reps = 5, threads = 0;
    bool flat = false;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--vocab") == 0) {
            V = atoi(argv[++i]);
        } else if (i + 1 < argc && strcmp(argv[i], "--rows") == 0) {
            R = atoi(argv[++i]);
        } else if (i + 1 < argc && strcmp(argv[i], "--reps") == 0) {
            reps = atoi(argv[++i]);
        } else if (i + 1 < argc && strcmp(argv[i], "--threads") == 0) {
            threads = atoi(argv[++i]);
        } else if (i + 1 < argc && strcmp(argv[i], "--shape") == 0) {
            flat = strcmp(argv[++i], "flat") == 0;
        } else {
            fprintf(stderr, "usage: bench_sampler [--vocab V] [--rows R] [--reps N] [--threads T] "
                            "[--shape peaked|flat]\n");
            return 2;
        }
    }
    if (threads < 1) {
        const long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n_cpu < 1 ? 1 : n_cpu > 16 ? 16 : (int) n_cpu;
    }
    if (V < 2 || R < 1 || reps < 1 || threads > THREAD_POOL_MAX_THREADS) return 2;

    float *rows = malloc((size_t) R * (size_t) V * sizeof *rows);
    float *work = malloc((size_t) R * (size_t) V * sizeof *work);
    Sampler *samplers = calloc((size_t) R, sizeof *samplers);
    int32_t *tokens = malloc((size_t) R * sizeof *tokens);
    double *t_old = malloc((size_t) R * (size_t) reps * sizeof *t_old);
    double *t_new = malloc((size_t) R * (size_t) reps * sizeof *t_new);
    double *t_step = malloc((size_t) reps * sizeof *t_step);
    ThreadPool *pool1 = NULL, *pool_n = NULL;
    if (!rows || !work || !samplers || !tokens || !t_old || !t_new || !t_step
        || thread_pool_create(1, &pool1) || thread_pool_create(threads, &pool_n)) {
        fprintf(stderr, "bench_sampler: out of memory\n");
        return 1;
    }
    uint64_t r = 42;
    for (int i = 0; i < R; i++)
        fill(rows + (size_t) i * (size_t) V, V, flat, &r);
    const size_t row_bytes = (size_t) V * sizeof *rows;

    printf("vocabulary %d, %d rows (%s), %d repetitions, medians\n", V, R, flat ? "flat" : "peaked",
           reps);
    printf("%-30s %12s %12s %9s | %d rows: %11s %11s %11s | 1 row: %8s %8s  (N = %d threads)\n",
           "parameters", "before µs/row", "after µs/row", "speed-up", R, "before 1 thr",
           "after 1 thr", "after N thr", "1 thr", "N thr", threads);
    int n_mismatch = 0;
    for (int c = 0; c < N_CONFIGS; c++) {
        SamplerParams p = sampler_default_params();
        p.temperature = configs[c].temperature;
        p.top_p = configs[c].top_p;
        p.min_p = configs[c].min_p;
        p.top_k = configs[c].top_k;
        double step_old = 0.0;
        // Per row: the oracle and the sampler from the same generator state, one draw each.
        // Both live through the repetitions, as a sequence's sampler does through its steps
        // (the first draws touch the scratch pages and are not timed).
        Sampler s;
        RefSampler o;
        if (sampler_init(&s, V, p)) return 1;
        ref_init(&o, V, p);
        for (int k = -1; k < reps; k++)
            for (int i = 0; i < R; i++) {
                s.rng = o.rng = 0x9e3779b97f4a7c15ull * (uint64_t) (k * R + i + 2);
                // Whichever runs second finds more of the row's cache lines warm (about 25
                // µs at min-p 0.05), so the order alternates.
                int32_t want = 0, got = 0;
                double dt_old = 0.0, dt_new = 0.0;
                for (int which = 0; which < 2; which++) {
                    memcpy(work, rows + (size_t) i * (size_t) V, row_bytes);
                    const double t0 = now_s();
                    if ((which + k + i) % 2 == 0) {
                        want = ref_sample(&o, work, NULL);
                        dt_old = now_s() - t0;
                    } else {
                        got = sampler_sample(&s, work);
                        dt_new = now_s() - t0;
                    }
                }
                n_mismatch += got != want || s.rng != o.rng;
                if (k < 0) continue;
                t_old[k * R + i] = dt_old;
                t_new[k * R + i] = dt_new;
            }
        sampler_free(&s);
        ref_free(&o);
        // The oracle's step is its rows one after another (the loop pp.c had).
        for (int k = 0; k < reps; k++) {
            double sum = 0.0;
            for (int i = 0; i < R; i++)
                sum += t_old[k * R + i];
            t_step[k] = sum;
        }
        step_old = median(t_step, reps);
        const double old_us = median(t_old, R * reps) * 1e6, new_us = median(t_new, R * reps) * 1e6;
        // A step: R samplers, rows copied in (untimed), then one thread_pool_run.
        for (int i = 0; i < R; i++) {
            p.seed = 1000 + (uint64_t) i;
            if (sampler_init(&samplers[i], V, p)) return 1;
        }
        const double step_1 = time_step(pool1, samplers, work, rows, R, V, tokens, reps, t_step);
        const double step_n = time_step(pool_n, samplers, work, rows, R, V, tokens, reps, t_step);
        const double one_1 = time_step(pool1, samplers, work, rows, 1, V, tokens, reps, t_step);
        const double one_n = time_step(pool_n, samplers, work, rows, 1, V, tokens, reps, t_step);
        for (int i = 0; i < R; i++)
            sampler_free(&samplers[i]);
        printf("%-30s %12.1f %12.1f %8.1fx | %8.2f ms %8.2f ms %8.2f ms | %8.3f ms %8.3f ms\n",
               configs[c].name, old_us, new_us, old_us / new_us, step_old * 1e3, step_1, step_n,
               one_1, one_n);
        fflush(stdout);
    }
    printf("tokens or generator states that differ from the oracle: %d\n", n_mismatch);
    thread_pool_destroy(pool1);
    thread_pool_destroy(pool_n);
    free(rows);
    free(work);
    free(samplers);
    free(tokens);
    free(t_old);
    free(t_new);
    free(t_step);
    return n_mismatch ? 1 : 0;
}
