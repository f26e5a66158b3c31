/*
 * mtp_test_util.h - shared by the MTP tests (test_mtp.c, test_mtp_pp.c): the chi-square
 * statistic and its p = 1e-4 critical value, and the exact distribution of the second
 * generated token at temperature 1; the source and temporary directories.
 */
#ifndef TESTS_ENGINE_MTP_TEST_UTIL_H
#define TESTS_ENGINE_MTP_TEST_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "tests/check.h"

// The source tree (GLMSPARK_SOURCE_DIR, else ".") into src, checked by the file probe
// (relative to it) existing, and a fresh temporary directory $TMPDIR/<prefix>_XXXXXX into
// tmp. False (with a message) when either fails.
static inline bool mtp_test_dirs(char *src, size_t src_len, const char *probe, char *tmp,
                                 size_t tmp_len, const char *prefix)
{
    const char *dir = getenv("GLMSPARK_SOURCE_DIR");
    snprintf(src, src_len, "%s", dir ? dir : ".");
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", src, probe);
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "\"%s\" not found (set GLMSPARK_SOURCE_DIR)\n", path);
        return false;
    }
    const char *base = getenv("TMPDIR");
    snprintf(tmp, tmp_len, "%s/%s_XXXXXX", base ? base : "/tmp", prefix);
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return false;
    }
    return true;
}

// Upper p = 1e-4 point of chi-square with dof degrees of freedom (Wilson-Hilferty).
static inline double chi2_crit(int dof)
{
    const double z = 3.719, k = dof;
    const double t = 1.0 - 2.0 / (9.0 * k) + z * sqrt(2.0 / (9.0 * k));
    return k * t * t * t;
}

// Chi-square of counts against probabilities (bins with expectation < 5 pooled).
static inline double chi2(const long *count, const double *prob, int V, long n, int *dof)
{
    double stat = 0.0, pool_e = 0.0, pool_o = 0.0;
    int bins = 0;
    *dof = 0;
    for (int i = 0; i < V; i++) {
        const double ex = prob[i] * (double) n;
        if (ex < 5.0) {
            pool_e += ex, pool_o += (double) count[i];
            continue;
        }
        stat += ((double) count[i] - ex) * ((double) count[i] - ex) / ex;
        bins++;
    }
    if (pool_e >= 5.0) {
        stat += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
        bins++;
    } else if (pool_o > 0 && pool_e == 0.0) {
        return INFINITY;  // a token the target never emits
    }
    *dof = bins - 1;
    return stat;
}

// softmax(logits) in double into p [V].
static inline void softmax_row(double *p, const float *lg, int V)
{
    double mx = -INFINITY, sum = 0.0;
    for (int v = 0; v < V; v++)
        mx = lg[v] > mx ? lg[v] : mx;
    for (int v = 0; v < V; v++)
        sum += p[v] = exp(lg[v] - mx);
    for (int v = 0; v < V; v++)
        p[v] /= sum;
}

// marg [V] = sum_y1 p(y1 | prompt) p(. | prompt, y1) at temperature 1 (kv: room for n + 1).
static inline void second_token_marginal(Model *m, KvCache *kv, const int *prompt, int n,
                                         double *marg)
{
    const int V = m->cfg.vocab_size;
    float *lg = malloc((size_t) V * sizeof *lg);
    double *p1 = malloc((size_t) V * sizeof *p1), *p2 = malloc((size_t) V * sizeof *p2);
    ASSERT(lg && p1 && p2);
    KvSeq seq = {0};
    ASSERT(model_forward(m, kv, &seq, prompt, n, lg, false) == ERR_OK);
    softmax_row(p1, lg, V);
    for (int v = 0; v < V; v++)
        marg[v] = 0.0;
    for (int y = 0; y < V; y++) {
        if (p1[y] < 1e-9) continue;
        seq.n_tokens = n;  // roll back to the prompt
        ASSERT(model_forward(m, kv, &seq, &y, 1, lg, false) == ERR_OK);
        softmax_row(p2, lg, V);
        for (int v = 0; v < V; v++)
            marg[v] += p1[y] * p2[v];
    }
    kv_seq_free(kv, &seq);
    free(lg);
    free(p1);
    free(p2);
}

#endif  // TESTS_ENGINE_MTP_TEST_UTIL_H
