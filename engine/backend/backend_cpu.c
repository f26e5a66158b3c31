/*
 * backend_cpu.c - the reference backend: plain C11, fp32 data, threads from a pool.
 *
 * Weights stay in their stored format; a matmul task owns a range of output rows and
 * decodes one row at a time into per-thread scratch (bf16/f16 widen; NVFP4 builds each
 * 16-weight group's 16 possible values from lookup tables of the E2M1 codes and E4M3
 * scales, then indexes it by nibble), then takes the dot product with every token of the
 * batch, so prefill decodes each weight once per call. Dots accumulate in fp32 with 8
 * independent partial sums; reductions that decide something (norm variance, softmax,
 * router sigmoid and selection, DSA scores) run in double. Ops too small to repay waking
 * the thread pool run on the calling thread (PARALLEL_MIN_WORK).
 *
 * Attention uses MLA's absorbed form: for head h, q_lat = W_uk[h]^T q_nope (W_uk[h] is the
 * first qk_nope rows of head h's block of kv_b_proj), score(s) = (q_lat . latent[s] + q_rope
 * . k_pe[s]) * scale, o_lat = sum_s p(s) latent[s], out = W_uv[h] o_lat. That equals
 * transformers' expanded form (k_nope = W_uk latent, v = W_uv latent) up to rounding, and
 * reads only the cached latents (widened first when the cache stores bf16). One task per
 * (token, head).
 *
 * Every op computes each output element with the same arithmetic whatever the batch size or
 * thread count, so a token decoded alone gets bit-identical results to the same token inside
 * a prefill (the model test checks decode == prefill on that basis).
 */
#include "engine/model/backend.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/thread_pool.h"
#include "engine/model/topk.h"
#include "kernels/mla_format.h"
#include "kernels/moe_router.h"
#include "kernels/nvfp4_format.h"
#include "kernels/rope_format.h"

typedef struct CpuImpl {
    ThreadPool *pool;
    int n_threads;
    void *scratch[THREAD_POOL_MAX_THREADS];  // per-thread scratch, owned
    size_t scratch_bytes[THREAD_POOL_MAX_THREADS];
    double *route_buf;  // moe_router_work_bytes() for route(), owned
    size_t route_cap;   // bytes
    float *moe_buf;  // gathered tokens and expert activations for moe(), owned
    size_t moe_cap;  // floats
    float *round_buf;  // matmul inputs rounded to bf16 (the BF16 recipe), owned
    size_t round_cap;  // floats
    // kv_write's transformed values, matmul_group's up products, MLA's rotated q; owned, kept
    // at its largest size (after a prefill chunk: n x H x qk floats, as much again as q)
    float *tmp_buf;
    size_t tmp_cap;  // floats
    void **bound;      // weights bind_linear stored in bf16 (backend_bind_rounds), owned
    int n_bound, bound_cap;
} CpuImpl;

// ---------------------------------------------------------------------------
// Weight rows

static float e2m1_lut[16];
static float e4m3_lut[256];
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;

static void lut_build(void)
{
    for (int i = 0; i < 16; i++)
        e2m1_lut[i] = nvfp4_e2m1_to_float((uint8_t) i);
    for (int i = 0; i < 256; i++)
        e4m3_lut[i] = nvfp4_e4m3_to_float((uint8_t) i);
}

static float half_to_float(uint16_t h)
{
    const int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float v;
    if (exponent == 0)
        v = ldexpf((float) mantissa, -24);
    else if (exponent == 31)
        v = mantissa ? NAN : INFINITY;
    else
        v = ldexpf((float) (mantissa | 1024), exponent - 25);
    return sign ? -v : v;
}

static float bf16_to_float(const uint8_t *p)
{
    const uint32_t bits = ((uint32_t) p[0] | (uint32_t) p[1] << 8) << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

// Row r of w as fp32: a pointer into the weight itself (f32) or into buf ([w->cols]).
static const float *linear_row(const CkptLinear *w, int r, float *buf)
{
    const size_t cols = (size_t) w->cols;
    switch (w->format) {
    case CKPT_LINEAR_F32: {
        const float *row = (const float *) w->data + (size_t) r * cols;
        if ((uintptr_t) row % sizeof(float) == 0) return row;
        memcpy(buf, row, cols * sizeof(float));
        return buf;
    }
    case CKPT_LINEAR_BF16: {
        const uint8_t *row = (const uint8_t *) w->data + (size_t) r * cols * 2;
        if ((uintptr_t) row % 2 == 0) {
            // The common case, written so that the compiler vectorizes the widening.
            // Blocks of 8 with a fixed trip count: gcc -O2's cheap cost model vectorizes
            // those, not a loop that needs a runtime-sized epilogue.
            const uint16_t *row16 = (const uint16_t *) (const void *) row;
            size_t c = 0;
            for (; c + 8 <= cols; c += 8) {
                uint32_t bits[8];
                for (int j = 0; j < 8; j++)
                    bits[j] = (uint32_t) row16[c + j] << 16;
                memcpy(buf + c, bits, sizeof bits);
            }
            for (; c < cols; c++)
                buf[c] = bf16_to_float(row + 2 * c);
        } else {
            for (size_t c = 0; c < cols; c++)
                buf[c] = bf16_to_float(row + 2 * c);
        }
        return buf;
    }
    case CKPT_LINEAR_F16: {
        const uint8_t *row = (const uint8_t *) w->data + (size_t) r * cols * 2;
        for (size_t c = 0; c < cols; c++)
            buf[c] = half_to_float((uint16_t) (row[2 * c] | row[2 * c + 1] << 8));
        return buf;
    }
    case CKPT_LINEAR_NVFP4: {
        const uint8_t *q = (const uint8_t *) w->data + (size_t) r * (cols / 2);
        const uint8_t *scale = w->scale + (size_t) r * (cols / NVFP4_GROUP);
        const float global = w->global_scale;
        for (size_t g = 0; g < cols / NVFP4_GROUP; g++) {
            // The group's 16 possible values. e2m1 * e4m3 is exact in fp32, so the one
            // rounding is the global scale's, as in the float64 reference cast to fp32.
            const float s = e4m3_lut[scale[g]];
            float value[16];
            for (int k = 0; k < 16; k++)
                value[k] = e2m1_lut[k] * s * global;
            float *out = buf + g * NVFP4_GROUP;
            const uint8_t *qg = q + g * (NVFP4_GROUP / 2);
            for (int j = 0; j < NVFP4_GROUP / 2; j++) {
                out[2 * j] = value[qg[j] & 15];
                out[2 * j + 1] = value[qg[j] >> 4];
            }
        }
        return buf;
    }
    case CKPT_LINEAR_FP8:
        ckpt_linear_row(w, r, buf);
        return buf;
    }
    ASSERT(!"unknown linear format");
    return buf;
}

static float dot_f32(const float *a, const float *b, int n)
{
    float s[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            s[j] += a[i + j] * b[i + j];
    float tail = 0.0f;
    for (; i < n; i++)
        tail += a[i] * b[i];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])) + tail;
}

// ---------------------------------------------------------------------------
// Scratch

static void *thread_scratch(CpuImpl *impl, int thread)
{
    return impl->scratch[thread];
}

// Make every thread's scratch at least `bytes`. Running out of memory here is fatal: ops
// cannot fail, and the sizes are bounded by the model and the cache set up at startup.
static void ensure_scratch(CpuImpl *impl, size_t bytes)
{
    for (int t = 0; t < impl->n_threads; t++) {
        if (impl->scratch_bytes[t] >= bytes) continue;
        // Grow geometrically: attention scratch follows the context length, and a decode
        // loop should not reallocate at every token.
        const size_t grown =
            bytes < 2 * impl->scratch_bytes[t] ? 2 * impl->scratch_bytes[t] : bytes;
        free(impl->scratch[t]);
        impl->scratch[t] = malloc(grown);
        if (!impl->scratch[t]) log_fatal(__FILE__, __LINE__, "out of memory (%zu bytes)", grown);
        impl->scratch_bytes[t] = grown;
    }
}

// Below this many multiply-adds per op, waking the pool costs more than it saves: a decode
// step on the "default" preset is ~100 ops, most of them this small, and 2 threads were no
// faster than 1 until small ops stayed on the calling thread.
enum { PARALLEL_MIN_WORK = 1 << 18 };

// thread_pool_run(), or a plain loop on the calling thread when `work` is small.
static void run_tasks(CpuImpl *impl, int n_tasks, ThreadPoolFn fn, void *ctx, double work)
{
    if (work < PARALLEL_MIN_WORK) {
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    thread_pool_run(impl->pool, n_tasks, fn, ctx);
}

// ---------------------------------------------------------------------------
// Matmul and embedding

typedef struct MatmulJob {
    CpuImpl *impl;
    float *y;
    const CkptLinear *w;
    const float *x;
    int n;
    int rows_per_task;
    bool acc;  // y += instead of y =
} MatmulJob;

static void matmul_task(void *ctx, int task, int thread)
{
    const MatmulJob *job = ctx;
    const CkptLinear *w = job->w;
    float *buf = thread_scratch(job->impl, thread);
    const int r0 = task * job->rows_per_task;
    const int r1 = r0 + job->rows_per_task < w->rows ? r0 + job->rows_per_task : w->rows;
    for (int r = r0; r < r1; r++) {
        const float *row = linear_row(w, r, buf);
        for (int t = 0; t < job->n; t++) {
            const float d = dot_f32(row, job->x + (size_t) t * w->cols, w->cols);
            float *yo = job->y + (size_t) t * w->rows + r;
            *yo = job->acc ? *yo + d : d;
        }
    }
}

static void matmul_run(Backend *be, float *y, const CkptLinear *w, const float *x, int n, bool acc)
{
    CpuImpl *impl = be->impl;
    ASSERT(w->rows > 0 && w->cols > 0 && n >= 0);
    if (n == 0) return;
    ensure_scratch(impl, (size_t) w->cols * sizeof(float));
    // About 8 tasks per thread, at least 4 rows each, to even out the tail.
    int rows_per_task = w->rows / (8 * impl->n_threads);
    if (rows_per_task < 4) rows_per_task = 4;
    MatmulJob job = {impl, y, w, x, n, rows_per_task, acc};
    run_tasks(impl, (w->rows + rows_per_task - 1) / rows_per_task, matmul_task, &job,
              (double) w->rows * w->cols * n);
}

static void cpu_matmul(Backend *be, float *y, const CkptLinear *w, const float *x, int n)
{
    matmul_run(be, y, w, x, n, false);
}

// impl->tmp_buf with room for n floats.
static float *tmp_floats(CpuImpl *impl, size_t n)
{
    if (impl->tmp_cap < n) {
        free(impl->tmp_buf);
        impl->tmp_buf = malloc(n * sizeof(float));
        if (!impl->tmp_buf) log_fatal(__FILE__, __LINE__, "out of memory (%zu floats)", n);
        impl->tmp_cap = n;
    }
    return impl->tmp_buf;
}

// The matmul and matmul_add ops: under the BF16 recipe a tuned weight's input is rounded to
// bf16 first.
static void matmul_op(Backend *be, float *y, const CkptLinear *w, const float *x, int n, bool acc)
{
    CpuImpl *impl = be->impl;
    if (be->precision != BACKEND_PRECISION_BF16 || !backend_matmul_tuned(w) || n == 0) {
        matmul_run(be, y, w, x, n, acc);
        return;
    }
    const size_t need = (size_t) n * (size_t) w->cols;
    if (impl->round_cap < need) {
        free(impl->round_buf);
        impl->round_buf = malloc(need * sizeof(float));
        if (!impl->round_buf) log_fatal(__FILE__, __LINE__, "out of memory (%zu floats)", need);
        impl->round_cap = need;
    }
    for (size_t i = 0; i < need; i++)
        impl->round_buf[i] = nvfp4_round_bf16(x[i]);
    matmul_run(be, y, w, impl->round_buf, n, acc);
}

static void cpu_matmul_op(Backend *be, float *y, const CkptLinear *w, const float *x, int n)
{
    matmul_op(be, y, w, x, n, false);
}

static void cpu_matmul_rows(Backend *be, float *y, const CkptLinear *w, const float *x, int n)
{
    for (int t = 0; t < n; t++)
        matmul_op(be, y + (size_t) t * w->rows, w, x + (size_t) t * w->cols, 1, false);
}

static void cpu_matmul_add(Backend *be, float *y, const CkptLinear *w, const float *x, int n)
{
    matmul_op(be, y, w, x, n, true);
}

static void cpu_embed(Backend *be, float *y, const CkptLinear *table, const int *ids, int n)
{
    CpuImpl *impl = be->impl;
    ensure_scratch(impl, (size_t) table->cols * sizeof(float));
    float *buf = thread_scratch(impl, 0);
    for (int t = 0; t < n; t++) {
        ASSERT(ids[t] >= 0 && ids[t] < table->rows);
        const float *row = linear_row(table, ids[t], buf);
        memmove(y + (size_t) t * table->cols, row, (size_t) table->cols * sizeof(float));
    }
}

// ---------------------------------------------------------------------------
// Elementwise and norms

static void cpu_rmsnorm(Backend *be, float *y, const float *x, const float *w, int n, int dim,
                        int stride, float eps)
{
    (void) be;
    for (int t = 0; t < n; t++) {
        const float *xt = x + (size_t) t * stride;
        float *yt = y + (size_t) t * stride;
        double ss = 0.0;
        for (int i = 0; i < dim; i++)
            ss += (double) xt[i] * xt[i];
        const double inv = 1.0 / sqrt(ss / dim + eps);
        for (int i = 0; i < dim; i++)
            yt[i] = (float) (w[i] * (xt[i] * inv));
    }
}

static void cpu_layernorm(Backend *be, float *y, const float *x, const float *w, const float *b,
                          int n, int dim, float eps)
{
    (void) be;
    for (int t = 0; t < n; t++) {
        const float *xt = x + (size_t) t * dim;
        float *yt = y + (size_t) t * dim;
        double mean = 0.0, var = 0.0;
        for (int i = 0; i < dim; i++)
            mean += xt[i];
        mean /= dim;
        for (int i = 0; i < dim; i++)
            var += (xt[i] - mean) * (xt[i] - mean);
        const double inv = 1.0 / sqrt(var / dim + eps);
        for (int i = 0; i < dim; i++)
            yt[i] = (float) ((xt[i] - mean) * inv * w[i] + b[i]);
    }
}

static void cpu_rope(Backend *be, float *x, int n, int n_heads, int stride, int head_stride,
                     int offset, int rope_dim, const int *pos, float theta)
{
    CpuImpl *impl = be->impl;
    const int half = rope_dim / 2;
    ASSERT(rope_dim % 2 == 0);
    ensure_scratch(impl, (size_t) 3 * rope_dim * sizeof(float));
    float *cs = thread_scratch(impl, 0);  // cos [half], sin [half], tmp [rope_dim]
    float *sn = cs + half, *tmp = cs + 2 * half;
    for (int t = 0; t < n; t++) {
        for (int i = 0; i < half; i++) {
            // transformers: inv_freq = 1 / base^(arange(0, d, 2) / d) and the angle, both
            // in fp32 (autocast disabled); cos/sin of that fp32 angle. kernels/rope_format.h's
            // inv_freq, which the GPU's RoPE takes from the host too.
            rope_cos_sin(pos[t], rope_inv_freq(i, rope_dim, theta), &cs[i], &sn[i]);
        }
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (size_t) t * stride + (size_t) h * head_stride + offset;
            for (int i = 0; i < half; i++)
                rope_rotate(v[2 * i], v[2 * i + 1], cs[i], sn[i], &tmp[i], &tmp[half + i]);
            memcpy(v, tmp, (size_t) rope_dim * sizeof(float));
        }
    }
}

static void cpu_silu_mul(Backend *be, float *y, const float *gate, const float *up, int n_elems)
{
    (void) be;
    for (int i = 0; i < n_elems; i++) {
        const float g = gate[i];
        y[i] = (float) ((double) g / (1.0 + exp(-(double) g)) * up[i]);
    }
}

// The products one after the other (a row's sums do not depend on the other products); a
// SwiGLU pair's up product into tmp_buf, then silu_mul.
static void cpu_matmul_group(Backend *be, const BackendProduct *p, int n_p, const float *x, int n)
{
    CpuImpl *impl = be->impl;
    ASSERT(n_p >= 1 && n_p <= BACKEND_MAX_GROUP);
    for (int i = 0; i < n_p; i++) {
        ASSERT(p[i].w->cols == p[0].w->cols);
        matmul_op(be, p[i].y, p[i].w, x, n, false);
        if (!p[i].up) continue;
        ASSERT(p[i].up->rows == p[i].w->rows && p[i].up->cols == p[i].w->cols);
        const size_t need = (size_t) n * (size_t) p[i].w->rows;
        float *u = tmp_floats(impl, need);
        matmul_op(be, u, p[i].up, x, n, false);
        cpu_silu_mul(be, p[i].y, p[i].y, u, (int) need);
    }
}

// ---------------------------------------------------------------------------
// MoE routing (GlmMoeDsaTopkRouter)

// The router itself is kernels/moe_router.h, shared with the CUDA backend and the kernels'
// reference; this op owns only its work buffer.
static void cpu_route(Backend *be, int *idx, float *wts, const float *logits, const float *bias,
                      int n, const BackendRoute *p)
{
    CpuImpl *impl = be->impl;
    const int E = p->n_experts, K = p->top_k, G = p->n_group;
    ASSERT(E > 0 && K > 0 && K <= E && G > 0 && E % G == 0 && p->topk_group > 0
           && p->topk_group <= G);
    const size_t need = moe_router_work_bytes(E, G);
    if (impl->route_cap < need) {
        free(impl->route_buf);
        impl->route_buf = malloc(need);
        if (!impl->route_buf) log_fatal(__FILE__, __LINE__, "out of memory");
        impl->route_cap = need;
    }
    for (int t = 0; t < n; t++) {
        const int n_chosen = moe_router_token(
            idx + (size_t) t * K, wts + (size_t) t * K, NULL, logits + (size_t) t * E, bias, E,
            K, G, p->topk_group, p->norm_topk_prob, p->routed_scaling_factor, true,
            impl->route_buf);
        ASSERT(n_chosen == K);
    }
}

// ---------------------------------------------------------------------------
// DSA indexer top-k

// The best top_k positions by score come from engine/model/topk.h with the tie rule of DSA
// (engine/model/README.md): among equal scores the later, more recent position wins, where
// torch.topk leaves ties unspecified; the GPU kernels follow the same rule.

// Sort v[0..n) ascending in place (heapsort: no allocation, unlike qsort).
static void sort_ints(int *v, int n)
{
    for (int start = n / 2 - 1, end = n;;) {
        int i;
        if (start >= 0) {
            i = start--;
        } else {
            if (--end <= 0) return;
            const int t = v[0];
            v[0] = v[end];
            v[end] = t;
            i = 0;
        }
        for (;;) {  // sift down in a max-heap of v[0..end)
            const int l = 2 * i + 1, r = l + 1;
            int m = i;
            if (l < end && v[l] > v[m]) m = l;
            if (r < end && v[r] > v[m]) m = r;
            if (m == i) break;
            const int t = v[i];
            v[i] = v[m];
            v[m] = t;
            i = m;
        }
    }
}

typedef struct DsaJob {
    CpuImpl *impl;
    int *sel;
    int *n_sel;
    const float *q;
    const float *w;
    const KvCache *kv;
    const BackendSeqs *s;
    int layer;
    const BackendDsa *p;
    bool is_recipe;  // bf16 recipe on a backend_dsa_tuned layer: kernels/dsa.cu's fp32 scores
    bool tc;         // backend_dsa_tc: q rounded to bf16 first
} DsaJob;

static void dsa_task(void *ctx, int t, int thread)
{
    const DsaJob *job = ctx;
    const BackendDsa *p = job->p;
    const int visible = job->s->pos[t] + 1;
    const KvSeq *seq = job->s->seqs[job->s->seq_of[t]];
    int *sel = job->sel + (size_t) t * p->top_k;
    if (visible <= p->top_k) {
        for (int s = 0; s < visible; s++)
            sel[s] = s;
        job->n_sel[t] = visible;
        return;
    }
    TopkEntry *heap = thread_scratch(job->impl, thread);  // the best top_k so far, worst on top
    float *entry_buf = (float *) (heap + p->top_k);       // a widened cache entry
    int n_heap = 0;
    const float *qt = job->q + (size_t) t * p->n_heads * p->head_dim;
    const float *wt = job->w + (size_t) t * p->n_heads;
    if (job->is_recipe) {
        // The bf16 recipe: fp32 scores bit for bit as kernels/dsa.cu computes them.
        const DsaCache c = kv_dsa_cache(job->kv, job->kv->pool, job->layer);
        float w_scale, sm_scale, ws[DSA_MAX_HEADS];
        backend_dsa_scales(p, &w_scale, &sm_scale);
        for (int h = 0; h < p->n_heads; h++)
            ws[h] = wt[h] * w_scale;
        float q_round[DSA_MAX_HEADS * DSA_MAX_DIM];
        if (job->tc) {
            for (int i = 0; i < p->n_heads * c.dim; i++)
                q_round[i] = nvfp4_round_bf16(qt[i]);
            qt = q_round;
        }
        for (int s = 0; s < visible; s++) {
            const uint8_t *page = (const uint8_t *) job->kv->pool
                                  + kv_key_page_offset(job->kv, seq, job->layer, s);
            const int row = s % c.block;
            for (int i = 0; i < c.dim; i++)
                entry_buf[i] = dsa_key_raw(&c, page, row, i);
            const float score = dsa_key_score(qt, ws, p->n_heads, c.dim, entry_buf,
                                              dsa_key_scale(&c, page, row), sm_scale);
            topk_offer(heap, &n_heap, p->top_k, (TopkEntry){score, s}, TOPK_TIE_HIGHER_ID);
        }
    } else {
        const double head_scale = 1.0 / sqrt((double) p->n_heads);
        const double dot_scale = 1.0 / sqrt((double) p->head_dim);
        for (int s = 0; s < visible; s++) {
            const float *k = kv_read_key(job->kv, seq, job->layer, s, entry_buf);
            double total = 0.0;
            for (int h = 0; h < p->n_heads; h++) {
                const float *qh = qt + (size_t) h * p->head_dim;
                double d = 0.0;
                for (int i = 0; i < p->head_dim; i++)
                    d += (double) qh[i] * k[i];
                d *= dot_scale;
                if (d > 0.0) total += (double) wt[h] * head_scale * d;
            }
            topk_offer(heap, &n_heap, p->top_k, (TopkEntry){total, s}, TOPK_TIE_HIGHER_ID);
        }
    }
    for (int k = 0; k < p->top_k; k++)
        sel[k] = heap[k].id;
    sort_ints(sel, p->top_k);
    job->n_sel[t] = p->top_k;
}

static void cpu_dsa_topk(Backend *be, int *sel, int *n_sel, const float *q, const float *w,
                         const KvCache *kv, const BackendSeqs *s, int layer, const BackendDsa *p)
{
    const int n = s->n;
    CpuImpl *impl = be->impl;
    ASSERT(kv->params.has_index[layer] && kv->params.index_dim == p->head_dim && p->top_k > 0);
    ensure_scratch(impl,
                   (size_t) p->top_k * sizeof(TopkEntry)
                             + (size_t) kv_entry_values(kv, layer) * sizeof(float));
    DsaJob job = {impl, sel, n_sel, q, w, kv, s, layer, p,
                  be->precision == BACKEND_PRECISION_BF16 && backend_dsa_tuned(p, kv, layer),
                  backend_dsa_tc(be, p, kv, layer)};
    double work = 0.0;
    for (int t = 0; t < n; t++)
        work += (double) (s->pos[t] + 1) * p->n_heads * p->head_dim;
    run_tasks(impl, n, dsa_task, &job, work);
}

// ---------------------------------------------------------------------------
// MLA attention (absorbed form)

typedef struct MlaJob {
    CpuImpl *impl;
    float *out;
    const float *q;
    const CkptLinear *kv_b;
    const KvCache *kv;
    const BackendSeqs *s;
    int layer;
    const int *sel;
    const int *n_sel;
    int sel_stride;
    const BackendMla *p;
    bool bf16;  // BACKEND_PRECISION_BF16 on a tuned shape (backend.h)
    bool tc;    // backend_mla_tc: q and the probabilities (times the fp8 scale) in bf16 too
} MlaJob;

// Row r of kv_b as fp32, rounded to bf16 under the BF16 recipe.
static const float *kv_b_row(const CkptLinear *kv_b, int r, float *buf, bool bf16)
{
    const float *row = linear_row(kv_b, r, buf);
    if (!bf16) return row;
    for (int c = 0; c < kv_b->cols; c++)
        buf[c] = nvfp4_round_bf16(row[c]);
    return buf;
}

static void mla_task(void *ctx, int task, int thread)
{
    const MlaJob *job = ctx;
    const BackendMla *p = job->p;
    const int H = p->n_heads, L = p->kv_lora;
    const int t = task / H, h = task % H;
    const int qk = p->qk_nope + p->qk_rope;
    const int visible = job->s->pos[t] + 1;
    const KvSeq *seq = job->s->seqs[job->s->seq_of[t]];
    const int n_keys = job->sel ? job->n_sel[t] : visible;
    const int *keys = job->sel ? job->sel + (size_t) t * job->sel_stride : NULL;

    // Scratch: q_lat, o_lat (double [L]); probabilities (double [visible]); row (float [L]);
    // a widened cache entry (float [kv_entry_values]).
    double *q_lat = thread_scratch(job->impl, thread);
    double *o_lat = q_lat + L;
    double *prob = o_lat + L;
    float *row_buf = (float *) (prob + visible);
    float *entry_buf = row_buf + L;

    const float *qt = job->q + ((size_t) t * H + h) * qk;
    const int row0 = h * (p->qk_nope + p->v_dim);
    const bool bf16 = job->bf16;

    // q_lat = W_uk[h]^T q_nope
    for (int c = 0; c < L; c++)
        q_lat[c] = 0.0;
    for (int i = 0; i < p->qk_nope; i++) {
        const float *w = kv_b_row(job->kv_b, row0 + i, row_buf, bf16);
        const double qi = bf16 ? nvfp4_round_bf16(qt[i]) : qt[i];
        for (int c = 0; c < L; c++)
            q_lat[c] += qi * w[c];
    }
    if (job->tc)  // mla_decode_tc rounds its fp32 q_lat and q_pe to bf16
        for (int c = 0; c < L; c++)
            q_lat[c] = nvfp4_round_bf16((float) q_lat[c]);

    // mla_decode_tc's probabilities are 2^(x - M) with x in log2 units and M an integer
    // (kernels/mla_format.h); the plain recipe's are exp(score - max).
    const double x_scale = job->tc ? (double) mla_log2_scale(p->scale) : p->scale;
    double max_score = -INFINITY;
    for (int j = 0; j < n_keys; j++) {
        const int s = keys ? keys[j] : j;
        DASSERT(s >= 0 && s < visible);
        const float *e = kv_read_entry(job->kv, seq, job->layer, s, entry_buf);
        double d = 0.0;
        for (int c = 0; c < L; c++)
            d += q_lat[c] * e[c];
        for (int i = 0; i < p->qk_rope; i++) {
            const float qp = qt[p->qk_nope + i];
            d += (double) (job->tc ? nvfp4_round_bf16(qp) : qp) * e[L + i];
        }
        prob[j] = d * x_scale;
        if (prob[j] > max_score) max_score = prob[j];
    }
    if (job->tc) max_score = ceil(max_score);
    double sum = 0.0;
    for (int j = 0; j < n_keys; j++) {
        prob[j] = job->tc ? exp2(prob[j] - max_score) : exp(prob[j] - max_score);
        sum += prob[j];
    }
    for (int c = 0; c < L; c++)
        o_lat[c] = 0.0;
    if (job->tc) {
        // mla_decode_tc: each probability times the scale of the latent's 128-value group
        // (1 for a bf16 cache) rounded to bf16, times the stored value (E4M3 code or bf16),
        // the sum divided by the probabilities' at the end.
        const KvEntryLayout *lo = &job->kv->entry[job->layer];
        for (int j = 0; j < n_keys; j++) {
            const int s = keys ? keys[j] : j;
            const unsigned char *e = kv_entry_bytes(job->kv, seq, job->layer, s);
            const bool fp8 = lo->dtype == KV_DTYPE_FP8;
            for (int c0 = 0; c0 < L; c0 += KV_FP8_GROUP) {
                const float sc = fp8 ? kv_f32_load(e + lo->lat_scale + 4 * (c0 / KV_FP8_GROUP)) : 1.0f;
                const double pw = nvfp4_round_bf16((float) prob[j] * sc);
                for (int c = c0; c < c0 + KV_FP8_GROUP && c < L; c++)
                    o_lat[c] += pw * (fp8 ? nvfp4_e4m3_to_float(e[c]) : kv_entry_value(lo, e, c));
            }
        }
        for (int c = 0; c < L; c++)
            o_lat[c] /= sum;
    } else {
        for (int j = 0; j < n_keys; j++) {
            const int s = keys ? keys[j] : j;
            const float *e = kv_read_entry(job->kv, seq, job->layer, s, entry_buf);
            const double pj = prob[j] / sum;
            for (int c = 0; c < L; c++)
                o_lat[c] += pj * e[c];
        }
    }
    if (bf16)
        for (int c = 0; c < L; c++)
            o_lat[c] = nvfp4_round_bf16((float) o_lat[c]);

    // out = W_uv[h] o_lat
    float *ot = job->out + ((size_t) t * H + h) * p->v_dim;
    for (int j = 0; j < p->v_dim; j++) {
        const float *w = kv_b_row(job->kv_b, row0 + p->qk_nope + j, row_buf, bf16);
        double d = 0.0;
        for (int c = 0; c < L; c++)
            d += w[c] * o_lat[c];
        ot[j] = (float) d;
    }
}

static void cpu_mla_attention(Backend *be, float *out, const float *q, const CkptLinear *kv_b,
                              const KvCache *kv, const BackendSeqs *s, int layer, const int *sel,
                              const int *n_sel, int sel_stride, const BackendMla *p)
{
    const int n = s->n;
    const int *pos = s->pos;
    CpuImpl *impl = be->impl;
    ASSERT(kv_b->cols == p->kv_lora && kv_b->rows == p->n_heads * (p->qk_nope + p->v_dim));
    ASSERT(kv->params.kv_lora == p->kv_lora && kv->params.rope_dim == p->qk_rope);
    if (p->rope_theta > 0.0f && n > 0) {  // the rope op on a copy of q
        const int qk = p->qk_nope + p->qk_rope;
        float *qr = tmp_floats(impl, (size_t) n * p->n_heads * qk);
        memcpy(qr, q, (size_t) n * p->n_heads * qk * sizeof *qr);
        backend_mla_q_rope(be, qr, n, p, pos);
        q = qr;
    }
    int max_visible = 1;
    for (int t = 0; t < n; t++)
        if (pos[t] + 1 > max_visible) max_visible = pos[t] + 1;
    ensure_scratch(impl, ((size_t) 2 * p->kv_lora + max_visible) * sizeof(double)
                             + ((size_t) p->kv_lora + (size_t) kv_entry_values(kv, layer)) * sizeof(float));
    const bool bf16 =
        be->precision == BACKEND_PRECISION_BF16 && backend_mla_tuned(p, &kv->entry[layer]);
    MlaJob job = {impl, out, q, kv_b, kv, s, layer, sel, n_sel, sel_stride, p, bf16,
                  backend_mla_tc(be, p, &kv->entry[layer])};
    double work = 0.0;
    for (int t = 0; t < n; t++)
        work += (double) p->n_heads * p->kv_lora
                * (2.0 * (sel ? n_sel[t] : pos[t] + 1) + p->qk_nope + p->v_dim);
    run_tasks(impl, n * p->n_heads, mla_task, &job, work);
}

// ---------------------------------------------------------------------------
// KV cache writes and routed experts

// With a transform: src copied, then the rmsnorm or layernorm op and the rope op on the copy,
// then stored (the CUDA backend's one launch computes these numbers: kernels/norm_dev.cuh).
static void cpu_kv_write(Backend *be, KvCache *kv, const BackendSeqs *s, int layer, int offset,
                         const float *src, int width, const KvIn *in)
{
    CpuImpl *impl = be->impl;
    const int n = s->n;
    if (in && n > 0) {
        ASSERT(in->norm_dim >= 0 && in->norm_dim <= width && (!in->norm_b || in->norm_dim == width));
        ASSERT(in->rope_dim >= 0 && in->rope_off >= 0 && in->rope_off + in->rope_dim <= width);
        const size_t need = (size_t) n * (size_t) width;
        float *t = tmp_floats(impl, need);
        memcpy(t, src, need * sizeof(float));
        backend_kv_in_ops(be, t, src, n, width, in, s->pos);
        src = t;
    }
    for (int t = 0; t < n; t++)
        kv_store(kv, s->seqs[s->seq_of[t]], layer, s->pos[t], offset, src + (size_t) t * width,
                 width);
}

// Tokens are grouped by expert (as transformers' eager experts loop does), so each expert's
// weights are decoded once per call and run as one matmul over its tokens.
static void cpu_moe(Backend *be, float *out, const float *x, int n, const int *idx,
                    const float *wts, int top_k, const CkptLinear *experts, int n_experts,
                    const float *residual)
{
    CpuImpl *impl = be->impl;
    const int hidden = experts[0].cols, inter = experts[0].rows;
    const size_t need = (size_t) n * (3 * (size_t) hidden + 2 * (size_t) inter + 2);
    if (impl->moe_cap < need) {
        free(impl->moe_buf);
        impl->moe_buf = malloc(need * sizeof(float));
        if (!impl->moe_buf) log_fatal(__FILE__, __LINE__, "out of memory (%zu floats)", need);
        impl->moe_cap = need;
    }
    float *xe = impl->moe_buf;             // [n, hidden] this expert's tokens
    float *ye = xe + (size_t) n * hidden;  // [n, hidden] its output
    float *g = ye + (size_t) n * hidden;   // [n, inter]
    float *u = g + (size_t) n * inter;     // [n, inter]
    float *we = u + (size_t) n * inter;    // [n] routing weights
    int *tok = (int *) (we + n);           // [n] token of each row
    float *sum = (float *) (tok + n);      // [n, hidden] the experts' sum (out may be residual)

    const bool bf16 =
        be->precision == BACKEND_PRECISION_BF16 && backend_moe_tuned(experts, n_experts, top_k);
    memset(sum, 0, (size_t) n * hidden * sizeof(float));
    for (int e = 0; e < n_experts; e++) {
        int cnt = 0;
        for (int t = 0; t < n; t++)
            for (int k = 0; k < top_k; k++)
                if (idx[(size_t) t * top_k + k] == e) {
                    float *row = xe + (size_t) cnt * hidden;
                    memcpy(row, x + (size_t) t * hidden, (size_t) hidden * sizeof(float));
                    if (bf16)
                        for (int c = 0; c < hidden; c++)
                            row[c] = nvfp4_round_bf16(row[c]);
                    we[cnt] = wts[(size_t) t * top_k + k];
                    tok[cnt++] = t;
                }
        if (cnt == 0) continue;
        const CkptLinear *w = experts + 3 * (size_t) e;
        ASSERT(w[0].cols == hidden && w[1].rows == inter && w[2].rows == hidden
               && w[2].cols == inter);
        cpu_matmul(be, g, &w[0], xe, cnt);
        cpu_matmul(be, u, &w[1], xe, cnt);
        cpu_silu_mul(be, g, g, u, cnt * inter);
        if (bf16)
            for (size_t i = 0; i < (size_t) cnt * inter; i++)
                g[i] = nvfp4_round_bf16(g[i]);
        cpu_matmul(be, ye, &w[2], g, cnt);
        for (int i = 0; i < cnt; i++) {
            float *o = sum + (size_t) tok[i] * hidden;
            const float *y = ye + (size_t) i * hidden;
            for (int c = 0; c < hidden; c++)
                o[c] += y[c] * we[i];
        }
    }
    for (size_t i = 0; i < (size_t) n * hidden; i++)
        out[i] = residual ? residual[i] + sum[i] : sum[i];
}

// ---------------------------------------------------------------------------
// Construction

static void *cpu_alloc(Backend *be, size_t bytes)
{
    (void) be;
    return calloc(1, bytes ? bytes : 1);
}

static void cpu_free_mem(Backend *be, void *p)
{
    (void) be;
    free(p);
}

static void cpu_copy(Backend *be, void *dst, const void *src, size_t bytes)
{
    (void) be;
    if (bytes) memcpy(dst, src, bytes);
}

// Read in place from the checkpoint mapping; under the BF16 recipe a weight stored otherwise
// than in bf16 is stored in bf16 first (backend_bind_rounds), as the CUDA backend stores it.
static Err cpu_bind_linear(Backend *be, CkptLinear *w)
{
    if (!backend_bind_rounds(be, w)) return ERR_OK;
    CpuImpl *impl = be->impl;
    if (impl->n_bound == impl->bound_cap) {
        const int cap = impl->bound_cap ? 2 * impl->bound_cap : 16;
        void **grown = realloc(impl->bound, (size_t) cap * sizeof *grown);
        if (!grown) return ERR_NOMEM;
        impl->bound = grown;
        impl->bound_cap = cap;
    }
    uint16_t *b = malloc((size_t) w->rows * (size_t) w->cols * sizeof *b);
    float *row = malloc((size_t) w->cols * sizeof *row);
    if (!b || !row) {
        free(b);
        free(row);
        return ERR_NOMEM;
    }
    backend_round_linear(w, b, row);
    free(row);
    impl->bound[impl->n_bound++] = b;
    w->data = b;
    w->format = CKPT_LINEAR_BF16;
    w->scale = NULL;
    w->scale_f32 = NULL;
    return ERR_OK;
}

// NVFP4 experts are read in place, as bind_linear; others are bound one by one (under the
// BF16 recipe stored in bf16, as the CUDA backend stacks them).
static Err cpu_bind_experts(Backend *be, CkptLinear *experts, int n_experts)
{
    if (backend_experts_nvfp4(experts, n_experts)) return ERR_OK;
    for (int i = 0; i < 3 * n_experts; i++) {
        const Err err = cpu_bind_linear(be, &experts[i]);
        if (err) return err;
    }
    return ERR_OK;
}

static Err cpu_bind_kv_b(Backend *be, const CkptLinear *kv_b, const BackendMla *p)
{
    (void) be;
    (void) kv_b;  // mla_attention reads kv_b itself
    (void) p;
    return ERR_OK;
}

static void cpu_destroy(Backend *be)
{
    if (!be) return;
    CpuImpl *impl = be->impl;
    if (impl) {
        thread_pool_destroy(impl->pool);
        for (int t = 0; t < THREAD_POOL_MAX_THREADS; t++)
            free(impl->scratch[t]);
        free(impl->route_buf);
        free(impl->moe_buf);
        free(impl->round_buf);
        free(impl->tmp_buf);
        for (int i = 0; i < impl->n_bound; i++)
            free(impl->bound[i]);
        free(impl->bound);
        free(impl);
    }
    free(be);
}

Err backend_cpu_create(int n_threads, Backend **out)
{
    *out = NULL;
    pthread_once(&lut_once, lut_build);
    Backend *be = calloc(1, sizeof *be);
    CpuImpl *impl = calloc(1, sizeof *impl);
    if (!be || !impl) {
        free(be);
        free(impl);
        return ERR_NOMEM;
    }
    be->impl = impl;
    impl->n_threads = n_threads;
    const Err err = thread_pool_create(n_threads, &impl->pool);
    if (err) {
        cpu_destroy(be);
        return err;
    }
    be->name = "cpu";
    be->mla_tc = backend_mla_tc_env();
    be->dsa_tc = backend_dsa_tc_env();
    be->destroy = cpu_destroy;
    be->alloc = cpu_alloc;
    be->free_mem = cpu_free_mem;
    be->upload = cpu_copy;
    be->download = cpu_copy;
    be->bind_linear = cpu_bind_linear;
    be->bind_experts = cpu_bind_experts;
    be->bind_kv_b = cpu_bind_kv_b;
    be->matmul = cpu_matmul_op;
    be->matmul_rows = cpu_matmul_rows;
    be->matmul_group = cpu_matmul_group;
    be->norm_matmul_group = backend_norm_matmul_group_ops;
    be->matmul_add = cpu_matmul_add;
    be->embed = cpu_embed;
    be->rmsnorm = cpu_rmsnorm;
    be->layernorm = cpu_layernorm;
    be->rope = cpu_rope;
    be->silu_mul = cpu_silu_mul;
    be->route = cpu_route;
    be->route_moe = backend_route_moe_ops;
    be->dsa_topk = cpu_dsa_topk;
    be->mla_attention = cpu_mla_attention;
    be->kv_write = cpu_kv_write;
    be->moe = cpu_moe;
    *out = be;
    return ERR_OK;
}
