/*
 * moe_ref.c - the router and the experts written out plainly, following transformers 5.17
 * models/glm_moe_dsa/modeling_glm_moe_dsa.py (GlmMoeDsaTopkRouter / route_tokens_to_experts).
 * The router is kernels/moe_router.h, the one the CPU and CUDA backends run, in moe.h's
 * order (descending choice) and with norm_topk_prob, as kernels/moe.cu computes it. The
 * experts' references read weights of either format (NVFP4 or bf16) through ref_weight(), and
 * run on every core (engine/shared/thread_pool.h): each output's sum alone, in one order.
 */
#include "kernels/ref/moe_ref.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "kernels/moe_router.h"
#include "kernels/ref/kern_ref.h"
#include "kernels/ref/nvfp4_ref.h"
#include "engine/shared/thread_pool.h"

void moe_route_ref(int32_t *idx, float *w, double *choice, const float *logits,
                   const float *bias, int n_tok, int n_experts, int k, int n_group,
                   int topk_group, float scale)
{
    void *work = malloc(moe_router_work_bytes(n_experts, n_group));
    for (int t = 0; t < n_tok; t++)
        moe_router_token(idx + (size_t) t * k, w + (size_t) t * k,
                         choice ? choice + (size_t) t * n_experts : NULL,
                         logits + (size_t) t * n_experts, bias, n_experts, k, n_group,
                         topk_group, true, scale, false, work);
    free(work);
}

// One stacked expert matrix [E, rows, cols] in either format, as the references read it:
// NVFP4 (q codes [E, rows, cols/2], s scales [E, rows, cols/16], g global scales [E, n_g], one
// per rows / n_g consecutive rows: w13's gate and up) or bf16 (w [E, rows, cols]).
typedef struct RefExperts {
    const uint8_t *q, *s;
    const float *g;
    int n_g;
    const uint16_t *w;  // bf16, or NULL for NVFP4
    int rows, cols;
} RefExperts;

// Expert e's W[r, c], exact.
static double ref_weight(const RefExperts *m, int e, int r, int c)
{
    const size_t per = (size_t) m->rows * m->cols;
    if (m->w) return kern_bf16_to_f32(m->w[e * per + (size_t) r * m->cols + c]);
    return nvfp4_weight_ref(m->q + e * per / 2, m->s + e * per / 16,
                            m->g[e * m->n_g + r / (m->rows / m->n_g)], m->cols, r, c);
}

// The references run on a thread pool of every core (up to THREAD_POOL_MAX_THREADS), one task
// per block of REF_ROWS outputs: each output's sum is computed alone, in the same order, so the
// results do not depend on the threads.
enum { REF_ROWS = 32 };

static void ref_parallel(int n_tasks, ThreadPoolFn fn, void *ctx)
{
    const int n = thread_pool_cores(THREAD_POOL_MAX_THREADS);
    ThreadPool *pool = NULL;
    if (n > 1 && thread_pool_create(n, &pool) != ERR_OK) pool = NULL;
    if (!pool) {  // one thread (or threads could not start): the same tasks in order
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    thread_pool_run(pool, n_tasks, fn, ctx);
    thread_pool_destroy(pool);
}

typedef struct W13Job {
    float *act, *g, *u, *g_abs, *u_abs;
    const RefExperts *m;
    const uint16_t *x;
    const int32_t *idx;
    int k, hidden, inter, blocks;  // blocks of REF_ROWS rows per pair
} W13Job;

static void w13_task(void *ctx, int task, int thread)
{
    (void) thread;
    const W13Job *j = ctx;
    const int p = task / j->blocks, i0 = task % j->blocks * REF_ROWS;
    const int t = p / j->k, e = j->idx[p], hidden = j->hidden, inter = j->inter;
    const uint16_t *xt = j->x + (size_t) t * hidden;
    for (int i = i0; i < inter && i < i0 + REF_ROWS; i++) {
        double gv = 0.0, uv = 0.0, ga = 0.0, ua = 0.0;
        for (int c = 0; c < hidden; c++) {
            const double xv = kern_bf16_to_f32(xt[c]);
            const double tg = ref_weight(j->m, e, i, c) * xv;
            const double tu = ref_weight(j->m, e, inter + i, c) * xv;
            gv += tg;
            uv += tu;
            ga += fabs(tg);
            ua += fabs(tu);
        }
        const size_t o = (size_t) p * inter + i;
        j->act[o] = (float) (gv / (1.0 + exp(-gv)) * uv);
        if (j->g) j->g[o] = (float) gv;
        if (j->u) j->u[o] = (float) uv;
        if (j->g_abs) j->g_abs[o] = (float) ga;
        if (j->u_abs) j->u_abs[o] = (float) ua;
    }
}

static void w13_ref(float *act, float *g, float *u, float *g_abs, float *u_abs, const RefExperts *m,
                    const uint16_t *x, const int32_t *idx, int n_tok, int k, int hidden, int inter)
{
    W13Job j = {act, g, u, g_abs, u_abs, m, x, idx, k, hidden, inter,
                (inter + REF_ROWS - 1) / REF_ROWS};
    ref_parallel(n_tok * k * j.blocks, w13_task, &j);
}

typedef struct W2Job {
    float *out, *out_abs;
    const RefExperts *m;
    const uint16_t *act;
    const int32_t *idx;
    const float *w;
    int k, hidden, inter, blocks;  // blocks of REF_ROWS rows per token
} W2Job;

static void w2_task(void *ctx, int task, int thread)
{
    (void) thread;
    const W2Job *j = ctx;
    const int t = task / j->blocks, r0 = task % j->blocks * REF_ROWS;
    const int k = j->k, hidden = j->hidden, inter = j->inter;
    for (int r = r0; r < hidden && r < r0 + REF_ROWS; r++) {
        double sum = 0.0, sum_abs = 0.0;
        for (int jj = 0; jj < k; jj++) {
            const int p = t * k + jj, e = j->idx[p];
            for (int c = 0; c < inter; c++) {
                const double term = j->w[p] * ref_weight(j->m, e, r, c)
                                    * kern_bf16_to_f32(j->act[(size_t) p * inter + c]);
                sum += term;
                sum_abs += fabs(term);
            }
        }
        j->out[(size_t) t * hidden + r] = (float) sum;
        if (j->out_abs) j->out_abs[(size_t) t * hidden + r] = (float) sum_abs;
    }
}

static void w2_ref(float *out, float *out_abs, const RefExperts *m, const uint16_t *act,
                   const int32_t *idx, const float *w, int n_tok, int k, int hidden, int inter)
{
    W2Job j = {out, out_abs, m, act, idx, w, k, hidden, inter, (hidden + REF_ROWS - 1) / REF_ROWS};
    ref_parallel(n_tok * j.blocks, w2_task, &j);
}

void moe_w13_ref(float *act, float *g, float *u, float *g_abs, float *u_abs, const uint8_t *q13,
                 const uint8_t *s13, const float *g13, const uint16_t *x, const int32_t *idx,
                 int n_tok, int k, int hidden, int inter)
{
    const RefExperts m = {q13, s13, g13, 2, NULL, 2 * inter, hidden};
    w13_ref(act, g, u, g_abs, u_abs, &m, x, idx, n_tok, k, hidden, inter);
}

void moe_w2_ref(float *out, float *out_abs, const uint8_t *q2, const uint8_t *s2, const float *g2,
                const uint16_t *act, const int32_t *idx, const float *w, int n_tok, int k,
                int hidden, int inter)
{
    const RefExperts m = {q2, s2, g2, 1, NULL, hidden, inter};
    w2_ref(out, out_abs, &m, act, idx, w, n_tok, k, hidden, inter);
}

void moe_w13_bf16_ref(float *act, float *g, float *u, float *g_abs, float *u_abs,
                      const uint16_t *w13, const uint16_t *x, const int32_t *idx, int n_tok, int k,
                      int hidden, int inter)
{
    const RefExperts m = {NULL, NULL, NULL, 1, w13, 2 * inter, hidden};
    w13_ref(act, g, u, g_abs, u_abs, &m, x, idx, n_tok, k, hidden, inter);
}

void moe_w2_bf16_ref(float *out, float *out_abs, const uint16_t *w2, const uint16_t *act,
                     const int32_t *idx, const float *w, int n_tok, int k, int hidden, int inter)
{
    const RefExperts m = {NULL, NULL, NULL, 1, w2, hidden, inter};
    w2_ref(out, out_abs, &m, act, idx, w, n_tok, k, hidden, inter);
}
