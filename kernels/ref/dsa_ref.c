/*
 * dsa_ref.c - DSA indexer references: exact key decode, double dot products, and top-k by a
 * full sort (score descending; among equal scores the later position first: the tie rule),
 * then positions re-sorted ascending.
 */
#include "kernels/ref/dsa_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ref/kern_ref.h"
#include "kernels/rope_format.h"

enum { DIM = 128, ROPE = 64, BLOCK = 128, PAGE_BYTES = 128 * 128 + 128 * 4 };

void dsa_key_read_ref(float *out, const uint8_t *cache, int blk, int row)
{
    const uint8_t *page = cache + (size_t) blk * PAGE_BYTES;
    float s;
    memcpy(&s, page + BLOCK * DIM + 4 * row, sizeof s);
    for (int d = 0; d < DIM; d++) out[d] = kern_e4m3_to_f32(page[row * DIM + d]) * s;
}

void dsa_key_store_ref(float *want, const float *k, const float *ln_w, const float *ln_b,
                          float eps, float theta, const int32_t *pos, int n_tok)
{
    for (int t = 0; t < n_tok; t++) {
        const float *x = k + (size_t) t * DIM;
        double mean = 0.0, var = 0.0, y[DIM];
        for (int d = 0; d < DIM; d++) mean += x[d];
        mean /= DIM;
        for (int d = 0; d < DIM; d++) var += (x[d] - mean) * (x[d] - mean);
        const double inv = 1.0 / sqrt(var / DIM + eps);
        for (int d = 0; d < DIM; d++) y[d] = (x[d] - mean) * inv * ln_w[d] + ln_b[d];
        double r[ROPE];  // kernels/rope.h's RoPE on [0, ROPE): interleaved in, halves out
        for (int i = 0; i < ROPE / 2; i++) {
            const double a = (double) ((float) pos[t] * rope_inv_freq(i, ROPE, theta));
            r[i] = y[2 * i] * cos(a) - y[2 * i + 1] * sin(a);
            r[ROPE / 2 + i] = y[2 * i + 1] * cos(a) + y[2 * i] * sin(a);
        }
        for (int d = 0; d < ROPE; d++) y[d] = r[d];
        for (int d = 0; d < DIM; d++) want[(size_t) t * DIM + d] = (float) y[d];
    }
}

void dsa_scores_ref(float *scores, float *scores_abs, int stride, const float *q, const float *w,
                    float w_scale, float sm_scale, const DsaCache *cache,
                    const int32_t *block_table, int max_blocks, const int32_t *seq,
                    const int32_t *kv_len, int n_tok, int n_heads)
{
    const int dim = cache->dim;
    for (int t = 0; t < n_tok; t++) {
        for (int p = 0; p < kv_len[t]; p++) {
            const int blk = block_table[(size_t) seq[t] * max_blocks + p / cache->block];
            const uint8_t *page = cache->pages + (size_t) blk * cache->page_bytes;
            const int row = p % cache->block;
            const double ks = dsa_key_scale(cache, page, row);
            double sum = 0.0, sum_abs = 0.0;
            for (int h = 0; h < n_heads; h++) {
                const float *qh = q + ((size_t) t * n_heads + h) * dim;
                double dot = 0.0, dot_abs = 0.0;
                for (int d = 0; d < dim; d++) {
                    const double kd = dsa_key_raw(cache, page, row, d) * ks;
                    dot += (double) qh[d] * kd;
                    dot_abs += fabs((double) qh[d] * kd);
                }
                const double wh = (double) w[(size_t) t * n_heads + h] * w_scale;
                sum += wh * fmax(dot * sm_scale, 0.0);
                sum_abs += fabs(wh) * dot_abs * sm_scale;
            }
            scores[(size_t) t * stride + p] = (float) sum;
            if (scores_abs) scores_abs[(size_t) t * stride + p] = (float) sum_abs;
        }
    }
}

typedef struct ScorePos {
    float score;
    int32_t pos;
} ScorePos;

static int by_score_desc(const void *a, const void *b)
{
    const ScorePos *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->pos > y->pos ? -1 : x->pos < y->pos;
}

static int by_int_asc(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *) a, y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

void dsa_topk_ref(int32_t *idx, int32_t *n_sel, const float *scores, int stride,
                  const int32_t *kv_len, int n_tok, int k)
{
    for (int t = 0; t < n_tok; t++) {
        const int len = kv_len[t];
        ScorePos *sp = malloc(sizeof(ScorePos) * (len > 0 ? len : 1));
        for (int p = 0; p < len; p++) sp[p] = (ScorePos){scores[(size_t) t * stride + p], p};
        qsort(sp, (size_t) len, sizeof *sp, by_score_desc);
        const int n = len < k ? len : k;
        for (int i = 0; i < n; i++) idx[(size_t) t * k + i] = sp[i].pos;
        qsort(idx + (size_t) t * k, (size_t) n, sizeof(int32_t), by_int_asc);
        n_sel[t] = n;
        free(sp);
    }
}
