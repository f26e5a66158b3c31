/*
 * backend_ops.c - every op of the CUDA backend (kernels/, the BF16 precision recipe, the only
 * one it runs) against the CPU backend following the recipe (the reference) on fresh random
 * inputs (label gpu; needs a GPU, never run by ops/test).
 *
 * Outputs of the kernels that sum products must agree to a relative L2 error of 1e-3 (the
 * issue's GPU-vs-recipe bound: the two differ by fp32 summation order and the bf16 roundings
 * it flips); norms, RoPE and SwiGLU (fp32 with double statistics on both) to 1e-6; what is
 * exact on both is compared exactly: the embedding lookup, the residual add, the router's
 * experts, the KV cache's bytes, the DSA selections (ties included; with the tensor-core
 * scores, but for keys within the fp32 bound of the threshold). Every weight format is bound
 * as the recipe stores it (bf16) on both, and shapes are odd on purpose (rows not multiples
 * of 8, columns not in 8s, sequences crossing block boundaries). A token's MoE output is bit
 * for bit the same alone (n = 1) as in a batch. Seeded, so a failure reproduces.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/backend_cuda.h"
#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/shared/err.h"
#include "kernels/nvfp4_format.h"
#include "tests/check.h"
#include "tests/golden/rel_l2.h"

static Backend *cpu, *gpu;
static uint64_t rng_state = 0x9e3779b97f4a7c15u;

static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t) (rng_state >> 16);
}

static float frand(void)
{
    return (float) rnd() / 4294967296.0f * 2.0f - 1.0f;
}

static float *rand_floats(size_t n, float scale)
{
    float *v = malloc(n * sizeof *v + 1);
    ASSERT(v);
    for (size_t i = 0; i < n; i++)
        v[i] = frand() * scale;
    return v;
}

// A device copy of host floats / ints on the GPU backend.
static void *dev(const void *host, size_t bytes)
{
    void *d = gpu->alloc(gpu, bytes);
    ASSERT(d);
    gpu->upload(gpu, d, host, bytes);
    return d;
}

static void *down(const void *d, size_t bytes)
{
    void *h = malloc(bytes + 1);
    ASSERT(h);
    gpu->download(gpu, h, d, bytes);
    return h;
}

// Compare the GPU result d (n floats) with the CPU result want; print and check.
static void expect_close(const char *what, const float *d, const float *want, size_t n, double tol)
{
    float *got = down(d, n * sizeof *got);
    const double e = golden_rel_l2(got, want, n);
    printf("%-34s rel L2 %.3g\n", what, e);
    CHECK(e <= tol);
    if (e > tol) fprintf(stderr, "%s: relative L2 error %.3g > %.3g\n", what, e, tol);
    free(got);
}

// A random weight [rows, cols] in format f (host memory; freed with free_linear).
static CkptLinear make_linear(CkptLinearFormat f, int rows, int cols)
{
    CkptLinear w = {.format = f, .rows = rows, .cols = cols, .global_scale = 1.0f};
    const size_t n = (size_t) rows * cols;
    uint8_t *data = NULL;
    switch (f) {
    case CKPT_LINEAR_F32:
        data = (uint8_t *) rand_floats(n, 0.1f);
        break;
    case CKPT_LINEAR_BF16:
    case CKPT_LINEAR_F16:
        data = malloc(n * 2);
        ASSERT(data);
        for (size_t i = 0; i < n; i++) {
            // bf16: sign, exponent near 2^-4; f16: same range, exponent bias 15.
            const uint16_t h = f == CKPT_LINEAR_BF16
                                   ? (uint16_t) ((rnd() & 0x8000u) | (0x3b00u + (rnd() & 0x1ffu)))
                                   : (uint16_t) ((rnd() & 0x8000u) | (0x2c00u + (rnd() & 0x7ffu)));
            memcpy(data + 2 * i, &h, 2);
        }
        break;
    case CKPT_LINEAR_FP8: {
        data = malloc(n);
        ASSERT(data);
        for (size_t i = 0; i < n; i++)
            data[i] = (uint8_t) ((rnd() & 0x80u) | (0x20u + rnd() % 0x30u));
        const size_t nb = (size_t) ((rows + 127) / 128) * ((cols + 127) / 128);
        float *s = malloc(nb * sizeof *s);
        ASSERT(s);
        for (size_t i = 0; i < nb; i++)
            s[i] = 0.01f + 0.01f * (float) (rnd() % 7);
        w.scale_f32 = s;
        break;
    }
    case CKPT_LINEAR_NVFP4: {
        data = malloc(n / 2);
        uint8_t *s = malloc(n / NVFP4_GROUP);
        ASSERT(data && s);
        for (size_t i = 0; i < n / 2; i++)
            data[i] = (uint8_t) rnd();
        for (size_t i = 0; i < n / NVFP4_GROUP; i++)
            s[i] = (uint8_t) (0x28 + rnd() % 0x18);  // e4m3 around 2^-2 .. 2^1
        w.scale = s;
        w.global_scale = 0.0123f;
        break;
    }
    }
    w.data = data;
    return w;
}

static void free_linear(CkptLinear *w)
{
    free((void *) w->data);
    free((void *) w->scale);
    free((void *) w->scale_f32);
}

static const char *format_name(CkptLinearFormat f)
{
    static const char *names[] = {"f32", "f16", "bf16", "fp8", "nvfp4"};
    return names[f];
}

static void test_matmul(void)
{
    const CkptLinearFormat formats[] = {CKPT_LINEAR_F32, CKPT_LINEAR_F16, CKPT_LINEAR_BF16,
                                        CKPT_LINEAR_FP8, CKPT_LINEAR_NVFP4};
    // cols 288: whole 16-byte vectors in every format; 100 (112 for NVFP4, whose groups
    // need cols % 16 == 0): not, except f32 at 100.
    for (int si = 0; si < 10; si++) {
        const int fi = si % 5, rows = si < 5 ? 203 : 37;
        const int cols = si < 5 ? 288 : formats[fi] == CKPT_LINEAR_NVFP4 ? 112 : 100;
        CkptLinear w = make_linear(formats[fi], rows, cols);
        CkptLinear wc = w, wg = w;  // each backend's binding: bf16 under the recipe
        CHECK(cpu->bind_linear(cpu, &wc) == ERR_OK && gpu->bind_linear(gpu, &wg) == ERR_OK);
        CHECK(wc.format == CKPT_LINEAR_BF16 && wg.format == CKPT_LINEAR_BF16);
        const int ns[3] = {1, 7, 20};
        float *x_all = rand_floats((size_t) 20 * cols, 1.0f);  // each n uses its first n rows
        for (int ni = 0; ni < 3; ni++) {
            const int n = ns[ni];
            const float *x = x_all;
            float *want = malloc((size_t) n * rows * sizeof *want);
            cpu->matmul(cpu, want, &wc, x, n);
            float *dx = dev(x, (size_t) n * cols * sizeof *x);
            float *dy = gpu->alloc(gpu, (size_t) n * rows * sizeof(float));
            gpu->matmul(gpu, dy, &wg, dx, n);
            char what[64];
            snprintf(what, sizeof what, "matmul %s %dx%d n=%d", format_name(formats[fi]), rows,
                     cols, n);
            expect_close(what, dy, want, (size_t) n * rows, 1e-3);
            if (n == 1) {  // embed: the bound table's rows, exact (cols 100: the kernel's
                           // value-a-load path; 288 and 112: 16 bytes a load)
                const int ids[3] = {0, rows - 1, 77 % rows};
                float *e_want = malloc(3 * (size_t) cols * sizeof *e_want);
                cpu->embed(cpu, e_want, &wc, ids, 3);
                int *dids = dev(ids, sizeof ids);
                float *de = gpu->alloc(gpu, 3 * (size_t) cols * sizeof(float));
                gpu->embed(gpu, de, &wg, dids, 3);
                snprintf(what, sizeof what, "embed %s cols %d", format_name(formats[fi]), cols);
                expect_close(what, de, e_want, 3 * (size_t) cols, 0.0);
                gpu->free_mem(gpu, dids);
                gpu->free_mem(gpu, de);
                free(e_want);
            }
            gpu->free_mem(gpu, dx);
            gpu->free_mem(gpu, dy);
            free(want);
        }
        free(x_all);
        free_linear(&w);  // the rounded copies are the backends' own
    }
}

static void test_elementwise(void)
{
    const int n = 5, dim = 96, stride = 130;
    float *x = rand_floats((size_t) n * stride, 3.0f);
    float *w = rand_floats(stride, 1.0f), *b = rand_floats(stride, 1.0f);
    float *dx = dev(x, (size_t) n * stride * sizeof *x);
    float *dw = dev(w, stride * sizeof *w), *db = dev(b, stride * sizeof *b);

    float *want = malloc((size_t) n * stride * sizeof *want);
    memcpy(want, x, (size_t) n * stride * sizeof *want);
    cpu->rmsnorm(cpu, want, want, w, n, dim, stride, 1e-5f);
    gpu->rmsnorm(gpu, dx, dx, dw, n, dim, stride, 1e-5f);
    expect_close("rmsnorm in place, strided", dx, want, (size_t) n * stride, 1e-6);
    {  // aligned rows (kv_a's c_kv: 512 of 576): the kernel that holds the row in registers
        const int d2 = 512, s2 = 576;
        float *x2 = rand_floats((size_t) n * s2, 3.0f), *w2 = rand_floats(d2, 1.0f);
        float *dx2 = dev(x2, (size_t) n * s2 * sizeof *x2), *dw2 = dev(w2, d2 * sizeof *w2);
        cpu->rmsnorm(cpu, x2, x2, w2, n, d2, s2, 1e-6f);
        gpu->rmsnorm(gpu, dx2, dx2, dw2, n, d2, s2, 1e-6f);
        expect_close("rmsnorm in place, aligned rows", dx2, x2, (size_t) n * s2, 1e-6);
        gpu->free_mem(gpu, dx2);
        gpu->free_mem(gpu, dw2);
        free(x2);
        free(w2);
    }

    gpu->upload(gpu, dx, x, (size_t) n * stride * sizeof *x);
    memcpy(want, x, (size_t) n * stride * sizeof *want);
    cpu->layernorm(cpu, want, want, w, b, n, dim, 1e-6f);
    gpu->layernorm(gpu, dx, dx, dw, db, n, dim, 1e-6f);
    expect_close("layernorm in place", dx, want, (size_t) n * dim, 1e-6);

    // RoPE on 3 heads of 40 (offset 8, rope 16), then on a single strided row.
    const int pos[5] = {0, 1, 17, 1000, 65000};
    int *dpos = dev(pos, sizeof pos);
    gpu->upload(gpu, dx, x, (size_t) n * stride * sizeof *x);
    memcpy(want, x, (size_t) n * stride * sizeof *want);
    cpu->rope(cpu, want, n, 3, stride, 40, 8, 16, pos, 1e4f);
    gpu->rope(gpu, dx, n, 3, stride, 40, 8, 16, dpos, 1e4f);
    cpu->rope(cpu, want, n, 1, stride, 0, 100, 30, pos, 8e6f);
    gpu->rope(gpu, dx, n, 1, stride, 0, 100, 30, dpos, 8e6f);
    expect_close("rope", dx, want, (size_t) n * stride, 1e-6);

    const int N = n * stride;
    float *u = rand_floats((size_t) N, 2.0f);
    float *du = dev(u, (size_t) N * sizeof *u);
    gpu->upload(gpu, dx, x, (size_t) N * sizeof *x);
    memcpy(want, x, (size_t) N * sizeof *want);
    cpu->silu_mul(cpu, want, want, u, N);
    gpu->silu_mul(gpu, dx, dx, du, N);
    expect_close("silu_mul", dx, want, (size_t) N, 1e-6);

    gpu->free_mem(gpu, dx);
    gpu->free_mem(gpu, dw);
    gpu->free_mem(gpu, db);
    gpu->free_mem(gpu, du);
    gpu->free_mem(gpu, dpos);
    free(x);
    free(w);
    free(b);
    free(u);
    free(want);
}

static void test_route_moe(void)
{
    const BackendRoute cases[2] = {{16, 4, 4, 2, true, 2.5f}, {7, 3, 1, 1, false, 1.0f}};
    for (int ci = 0; ci < 2; ci++) {
        const BackendRoute p = cases[ci];
        const int n = 9, E = p.n_experts, K = p.top_k, hidden = 64, inter = 32;
        float *logits = rand_floats((size_t) n * E, 4.0f), *bias = rand_floats((size_t) E, 0.5f);
        int *idx = malloc((size_t) n * K * sizeof *idx);
        float *wts = malloc((size_t) n * K * sizeof *wts);
        cpu->route(cpu, idx, wts, logits, bias, n, &p);
        float *dl = dev(logits, (size_t) n * E * sizeof(float)),
              *dbias = dev(bias, E * sizeof(float));
        int *didx = gpu->alloc(gpu, (size_t) n * K * sizeof(int));
        float *dwts = gpu->alloc(gpu, (size_t) n * K * sizeof(float));
        gpu->route(gpu, didx, dwts, dl, dbias, n, &p);
        int *gidx = down(didx, (size_t) n * K * sizeof(int));
        CHECK(memcmp(gidx, idx, (size_t) n * K * sizeof(int)) == 0);
        expect_close(ci ? "route (7 experts, 1 group)" : "route (16 experts, 4 groups)", dwts, wts,
                     (size_t) n * K, 1e-6);

        // Routed experts: all NVFP4 (ci 0), then NVFP4 but for one fp8 expert (ci 1): an odd
        // mix, which both backends bind in bf16 (the bf16 experts' kernels).
        CkptLinear *orig = calloc((size_t) 3 * E, sizeof *orig),
                   *ex = calloc((size_t) 3 * E, sizeof *ex),
                   *exg = calloc((size_t) 3 * E, sizeof *exg);
        ASSERT(orig && ex && exg);
        for (int e = 0; e < E; e++) {
            const CkptLinearFormat f = ci && e == 1 ? CKPT_LINEAR_FP8 : CKPT_LINEAR_NVFP4;
            orig[3 * e] = make_linear(f, inter, hidden);
            orig[3 * e + 1] = make_linear(f, inter, hidden);
            orig[3 * e + 2] = make_linear(f, hidden, inter);
        }
        memcpy(ex, orig, (size_t) 3 * E * sizeof *ex);
        memcpy(exg, orig, (size_t) 3 * E * sizeof *exg);
        CHECK(cpu->bind_experts(cpu, ex, E) == ERR_OK && gpu->bind_experts(gpu, exg, E) == ERR_OK);
        CHECK((ex[0].format == CKPT_LINEAR_BF16) == (ci == 1));
        float *x = rand_floats((size_t) n * hidden, 1.0f);
        float *want = malloc((size_t) n * hidden * sizeof *want);
        cpu->moe(cpu, want, x, n, idx, wts, K, ex, E, NULL);
        float *dx = dev(x, (size_t) n * hidden * sizeof *x);
        float *dout = gpu->alloc(gpu, (size_t) n * hidden * sizeof(float));
        gpu->moe(gpu, dout, dx, n, didx, dwts, K, exg, E, NULL);
        expect_close(ci ? "moe (7 experts, top 3, bound in bf16)" : "moe (16 experts, top 4, nvfp4)",
                     dout, want, (size_t) n * hidden, 1e-3);
        // With a residual, in place (the MoE layer's add in its combine): residual + the plain
        // output, bit for bit, on both backends.
        const size_t nh = (size_t) n * hidden;
        float *plain = down(dout, nh * sizeof *plain), *r = rand_floats(nh, 1.0f);
        float *dres = dev(r, nh * sizeof *r), *cres = malloc(nh * sizeof *cres);
        ASSERT(cres);
        memcpy(cres, r, nh * sizeof *r);
        gpu->moe(gpu, dres, dx, n, didx, dwts, K, exg, E, dres);
        cpu->moe(cpu, cres, x, n, idx, wts, K, ex, E, cres);
        float *gres = down(dres, nh * sizeof *gres);
        size_t bad_g = 0, bad_c = 0;
        for (size_t i = 0; i < nh; i++) {
            const float g = r[i] + plain[i], c = r[i] + want[i];
            bad_g += memcmp(&gres[i], &g, sizeof g) != 0;
            bad_c += memcmp(&cres[i], &c, sizeof c) != 0;
        }
        printf("moe with the residual in place: %zu / %zu values differ from residual + moe on "
               "the GPU, %zu on the CPU\n", bad_g, nh, bad_c);
        CHECK(bad_g == 0 && bad_c == 0);
        free(plain), free(r), free(cres), free(gres);
        gpu->free_mem(gpu, dres);
        // route_moe at 1, 5 and 9 tokens (the first two routed and grouped in one launch where
        // the routing has no group limit: ci 1), with the residual in place: experts, weights
        // and the output bit for bit the GPU's route, then moe; and the CPU's route_moe
        // (route, then moe) its route and moe.
        for (int m = 1; m <= n; m += 4) {
            const size_t nk = (size_t) m * K, nm = (size_t) m * hidden;
            float *rr = rand_floats(nm, 1.0f), *cr = malloc(nm * sizeof *cr);
            int *ci2 = malloc(nk * sizeof *ci2);
            float *cw2 = malloc(nk * sizeof *cw2);
            ASSERT(cr && ci2 && cw2);
            float *d1 = dev(rr, nm * sizeof *rr), *d2 = dev(rr, nm * sizeof *rr);
            int *di1 = gpu->alloc(gpu, nk * sizeof(int)), *di2 = gpu->alloc(gpu, nk * sizeof(int));
            float *dw1 = gpu->alloc(gpu, nk * sizeof(float));
            float *dw2 = gpu->alloc(gpu, nk * sizeof(float));
            ASSERT(di1 && di2 && dw1 && dw2);
            gpu->route(gpu, di1, dw1, dl, dbias, m, &p);
            gpu->moe(gpu, d1, dx, m, di1, dw1, K, exg, E, d1);
            gpu->route_moe(gpu, d2, dx, m, di2, dw2, dl, dbias, &p, exg, E, d2);
            int *gi1 = down(di1, nk * sizeof(int)), *gi2 = down(di2, nk * sizeof(int));
            float *gw1 = down(dw1, nk * sizeof(float)), *gw2 = down(dw2, nk * sizeof(float));
            float *go1 = down(d1, nm * sizeof(float)), *go2 = down(d2, nm * sizeof(float));
            const bool same = !memcmp(gi1, gi2, nk * sizeof(int)) && !memcmp(gw1, gw2, nk * 4)
                              && !memcmp(go1, go2, nm * 4);
            memcpy(cr, rr, nm * sizeof *rr);
            cpu->route_moe(cpu, cr, x, m, ci2, cw2, logits, bias, &p, ex, E, cr);
            float *c1 = malloc(nm * sizeof *c1);
            ASSERT(c1);
            memcpy(c1, rr, nm * sizeof *rr);
            cpu->moe(cpu, c1, x, m, idx, wts, K, ex, E, c1);
            const bool same_c = !memcmp(ci2, idx, nk * sizeof(int)) && !memcmp(cw2, wts, nk * 4)
                                && !memcmp(cr, c1, nm * 4);
            printf("route_moe n=%d (%s): GPU %s route, then moe; CPU %s\n", m,
                   ci ? "no group limit" : "group limit", same ? "=" : "DIFFERS from",
                   same_c ? "=" : "DIFFERS");
            CHECK(same && same_c);
            free(rr), free(cr), free(ci2), free(cw2), free(c1);
            free(gi1), free(gi2), free(gw1), free(gw2), free(go1), free(go2);
            gpu->free_mem(gpu, d1), gpu->free_mem(gpu, d2), gpu->free_mem(gpu, di1);
            gpu->free_mem(gpu, di2), gpu->free_mem(gpu, dw1), gpu->free_mem(gpu, dw2);
        }
        // Token 0 alone (the decode kernels): the same bits as in the batch.
        float *batch = down(dout, (size_t) hidden * sizeof *batch);
        gpu->moe(gpu, dout, dx, 1, didx, dwts, K, exg, E, NULL);
        float *alone = down(dout, (size_t) hidden * sizeof *alone);
        CHECK(memcmp(alone, batch, (size_t) hidden * sizeof *alone) == 0);
        printf("moe token 0 alone vs in batch: %s\n",
               memcmp(alone, batch, (size_t) hidden * sizeof *alone) ? "DIFFERENT" : "identical");
        free(batch);
        free(alone);
        for (int i = 0; i < 3 * E; i++)
            free_linear(&orig[i]);
        free(orig);
        free(ex);
        free(exg);
        gpu->free_mem(gpu, dl);
        gpu->free_mem(gpu, dbias);
        gpu->free_mem(gpu, didx);
        gpu->free_mem(gpu, dwts);
        gpu->free_mem(gpu, dx);
        gpu->free_mem(gpu, dout);
        free(gidx);
        free(x);
        free(want);
        free(logits);
        free(bias);
        free(idx);
        free(wts);
    }
}

// Under Backend.dsa_tc the two backends' scores agree to the fp32 rounding of their sums only
// (the tensor cores accumulate in their own order): every key that one selection a [n] holds
// and the other b [n] does not must score, in double on q rounded to bf16 (as both use it),
// within its own bound (Di + Hi + 2) FLT_EPSILON sum|terms| plus the largest one of the
// top_k-th key (tests/engine/backend/test_attention.c's rule).
static bool near_ties_only(const KvCache *kv, const KvSeq *seq, const float *qt, const float *wt,
                           int visible, const int *a, const int *b, int n, const BackendDsa *p)
{
    double *score = malloc((size_t) visible * sizeof *score);
    double *bound = malloc((size_t) visible * sizeof *bound);
    ASSERT(score && bound);
    double bound_max = 0.0;
    for (int s = 0; s < visible; s++) {
        float tmp[DSA_MAX_DIM];
        const float *k = kv_read_key(kv, seq, 1, s, tmp);
        double total = 0.0, total_abs = 0.0;
        for (int h = 0; h < p->n_heads; h++) {
            double d = 0.0, d_abs = 0.0;
            for (int i = 0; i < p->head_dim; i++) {
                const double qv = nvfp4_round_bf16(qt[h * p->head_dim + i]);
                d += qv * k[i];
                d_abs += fabs(qv * k[i]);
            }
            d /= sqrt((double) p->head_dim);
            total += wt[h] / sqrt((double) p->n_heads) * (d > 0 ? d : 0);
            total_abs +=
                fabs(wt[h]) / sqrt((double) p->n_heads) * d_abs / sqrt((double) p->head_dim);
        }
        score[s] = total;
        bound[s] = (p->head_dim + p->n_heads + 2) * (double) FLT_EPSILON * total_abs;
        bound_max = bound[s] > bound_max ? bound[s] : bound_max;
    }
    int kth = 0;  // the n-th best by the double ranking (ties: the later position)
    for (int s = 0; s < visible; s++) {
        int rank = 0;
        for (int o = 0; o < visible; o++)
            rank += score[o] > score[s] || (score[o] == score[s] && o > s);
        if (rank == n - 1) kth = s;
    }
    bool ok = true;
    for (int side = 0; side < 2; side++) {
        const int *x = side ? b : a, *y = side ? a : b;
        for (int i = 0; i < n; i++) {
            bool in_y = false;
            for (int j = 0; j < n; j++)
                in_y |= y[j] == x[i];
            ok &= in_y || fabs(score[x[i]] - score[kth]) <= bound[x[i]] + bound_max;
        }
    }
    free(score);
    free(bound);
    return ok;
}

// The caches of the attention tests: two layers (an index key of Di values on the second),
// blocks of 16 positions, room for two sequences of 45 and 30 tokens.
static KvCacheParams two_layer_cache(KvDtype dtype, int L, int R, int Di)
{
    KvCacheParams p = {.n_layers = 2,
                       .block_size = 16,
                       .n_blocks = 6,
                       .kv_lora = L,
                       .rope_dim = R,
                       .index_dim = Di,
                       .dtype = dtype};
    p.has_index[1] = true;
    return p;
}

// kv_write with its transform (kv_format.h KvIn) as model.c writes a layer: the latent
// RMS-normalized and its k_pe rotated, the index key layer-normalized and its first dims
// rotated, two sequences in one call, on bf16 and fp8 caches. The fused launch stores
// exactly the bytes of the ops one at a time on the GPU (rmsnorm, layernorm and rope on a
// copy, then the plain write: what GLMSPARK_CUDA_FUSE=0 runs), leaves src as it was, and its
// values decode within 1e-6 of the CPU's (norms and RoPE: fp32 with double statistics).
static void test_kv_write_in(KvDtype dtype)
{
    enum { TA = 45, TB = 30, T = TA + TB };
    const int L = 144, R = 16, Di = 32;
    const float theta = 10000.0f, eps = 1e-6f;
    const KvCacheParams p = two_layer_cache(dtype, L, R, Di);
    KvCache kc, kg, ku;
    ASSERT(kv_init(&kc, &p) == ERR_OK && kv_init(&kg, &p) == ERR_OK && kv_init(&ku, &p) == ERR_OK);
    KvSeq sc[2] = {{0}, {0}}, sg[2] = {{0}, {0}}, su[2] = {{0}, {0}};
    for (int i = 0; i < 2; i++)
        ASSERT(kv_seq_reserve(&kc, &sc[i], i ? TB : TA) == ERR_OK
               && kv_seq_reserve(&kg, &sg[i], i ? TB : TA) == ERR_OK
               && kv_seq_reserve(&ku, &su[i], i ? TB : TA) == ERR_OK);
    int pos[T], seq_of[T], len[T];
    for (int t = 0; t < T; t++) {
        pos[t] = t < TA ? t : t - TA;
        seq_of[t] = t >= TA;
        len[t] = pos[t] + 1;
    }
    int *dpos = dev(pos, sizeof pos), *dseq_of = dev(seq_of, sizeof seq_of),
        *dlen = dev(len, sizeof len);
    KvSeq *cseqs[2] = {&sc[0], &sc[1]}, *gseqs[2] = {&sg[0], &sg[1]}, *useqs[2] = {&su[0], &su[1]};
    const BackendSeqs cs = {cseqs, 2, pos, seq_of, len, T}, gs = {gseqs, 2, dpos, dseq_of, dlen, T},
                      us = {useqs, 2, dpos, dseq_of, dlen, T};
    float *lat = rand_floats((size_t) T * (L + R), 3.0f), *key = rand_floats((size_t) T * Di, 2.0f);
    float *nw = rand_floats(L, 1.0f), *kw = rand_floats(Di, 1.0f), *kb = rand_floats(Di, 0.5f);
    float *dlat = dev(lat, (size_t) T * (L + R) * sizeof(float));
    float *dkey = dev(key, (size_t) T * Di * sizeof(float));
    float *dnw = dev(nw, L * sizeof(float)), *dkw = dev(kw, Di * sizeof(float)),
          *dkb = dev(kb, Di * sizeof(float));
    const KvIn lc = {nw, NULL, L, eps, L, R, theta}, lg = {dnw, NULL, L, eps, L, R, theta};
    const KvIn kcin = {kw, kb, Di, eps, 0, R, theta}, kgin = {dkw, dkb, Di, eps, 0, R, theta};
    for (int layer = 0; layer < 2; layer++) {
        cpu->kv_write(cpu, &kc, &cs, layer, 0, lat, L + R, &lc);
        gpu->kv_write(gpu, &kg, &gs, layer, 0, dlat, L + R, &lg);
    }
    cpu->kv_write(cpu, &kc, &cs, 1, L + R, key, Di, &kcin);
    gpu->kv_write(gpu, &kg, &gs, 1, L + R, dkey, Di, &kgin);
    // The ops one at a time on copies.
    float *tl = dev(lat, (size_t) T * (L + R) * sizeof(float)), *tk = dev(key, (size_t) T * Di * sizeof(float));
    gpu->rmsnorm(gpu, tl, tl, dnw, T, L, L + R, eps);
    gpu->rope(gpu, tl, T, 1, L + R, 0, L, R, dpos, theta);
    gpu->layernorm(gpu, tk, tk, dkw, dkb, T, Di, eps);
    gpu->rope(gpu, tk, T, 1, Di, 0, 0, R, dpos, theta);
    for (int layer = 0; layer < 2; layer++) gpu->kv_write(gpu, &ku, &us, layer, 0, tl, L + R, NULL);
    gpu->kv_write(gpu, &ku, &us, 1, L + R, tk, Di, NULL);

    const size_t bytes = kg.block_bytes * (size_t) p.n_blocks;
    unsigned char *got = malloc(bytes), *ops = malloc(bytes);
    ASSERT(got && ops);
    backend_cuda_kv_download(gpu, &kg, got);
    backend_cuda_kv_download(gpu, &ku, ops);
    size_t differ = 0;
    for (size_t i = 0; i < bytes; i++) differ += got[i] != ops[i];
    printf("kv_write+norm+rope (%s) vs ops   %zu bytes differ\n", kv_dtype_name(dtype), differ);
    CHECK(differ == 0);
    float *after = down(dlat, (size_t) T * (L + R) * sizeof(float));
    CHECK(memcmp(after, lat, (size_t) T * (L + R) * sizeof(float)) == 0);  // src untouched
    free(after);
    // Decoded values against the CPU's: the GPU pool read through a copy of its KvCache.
    KvCache kgv = kg;
    kgv.pool = got;
    const int nv = L + R + Di;
    float *want = malloc((size_t) T * nv * sizeof(float)), *have = malloc((size_t) T * nv * sizeof(float));
    ASSERT(want && have);
    for (int t = 0; t < T; t++) {
        kv_read(&kc, cseqs[seq_of[t]], 1, pos[t], want + (size_t) t * nv);
        kv_read(&kgv, gseqs[seq_of[t]], 1, pos[t], have + (size_t) t * nv);
    }
    const double e = golden_rel_l2(have, want, (size_t) T * nv);
    printf("kv_write+norm+rope (%s) vs CPU  rel L2 %.3g\n", kv_dtype_name(dtype), e);
    CHECK(e <= 1e-6);
    free(want), free(have), free(got), free(ops);
    free(lat), free(key), free(nw), free(kw), free(kb);
    gpu->free_mem(gpu, dlat), gpu->free_mem(gpu, dkey), gpu->free_mem(gpu, dnw);
    gpu->free_mem(gpu, dkw), gpu->free_mem(gpu, dkb), gpu->free_mem(gpu, tl), gpu->free_mem(gpu, tk);
    gpu->free_mem(gpu, dpos), gpu->free_mem(gpu, dseq_of), gpu->free_mem(gpu, dlen);
    for (int i = 0; i < 2; i++) {
        kv_seq_free(&kc, &sc[i]);
        kv_seq_free(&kg, &sg[i]);
        kv_seq_free(&ku, &su[i]);
    }
    kv_free(&kc), kv_free(&kg), kv_free(&ku);
}

// kv_write and dsa_topk over two sequences in one call each (45 and 30 tokens, blocks of 16:
// the batched ops of one step), for a bf16 and an fp8 cache, index keys of Di values (20:
// stored padded to 32, q padded to match on the GPU); the two backends use separate caches
// of the same layout, and store the same bytes (kernels/kv_format.h's one store routine;
// latent 144: a whole fp8 scale group and a partial one). MLA: tuned_mla (blocks of 128).
static void test_attention(KvDtype dtype, int Di)
{
    enum { TA = 45, TB = 30, T = TA + TB };
    const int L = 144, R = 16, Hi = 4, topk = 8;
    const KvCacheParams p = two_layer_cache(dtype, L, R, Di);
    KvCache kc, kg;
    ASSERT(kv_init(&kc, &p) == ERR_OK && kv_init(&kg, &p) == ERR_OK);
    KvSeq sc[2] = {{0}, {0}}, sg[2] = {{0}, {0}};
    for (int i = 0; i < 2; i++)
        ASSERT(kv_seq_reserve(&kc, &sc[i], i ? TB : TA) == ERR_OK
               && kv_seq_reserve(&kg, &sg[i], i ? TB : TA) == ERR_OK);
    int pos[T], seq_of[T];
    for (int t = 0; t < T; t++) {
        pos[t] = t < TA ? t : t - TA;
        seq_of[t] = t >= TA;
    }
    int *dpos = dev(pos, sizeof pos), *dseq_of = dev(seq_of, sizeof seq_of);
    KvSeq *cseqs[2] = {&sc[0], &sc[1]}, *gseqs[2] = {&sg[0], &sg[1]};
    int len[T];
    for (int t = 0; t < T; t++)
        len[t] = pos[t] + 1;
    int *dlen = dev(len, sizeof len);
    const BackendSeqs cs = {cseqs, 2, pos, seq_of, len, T}, gs = {gseqs, 2, dpos, dseq_of, dlen, T};
    float *lat = rand_floats((size_t) T * (L + R), 1.0f), *key = rand_floats((size_t) T * Di, 1.0f);
    float *dlat = dev(lat, (size_t) T * (L + R) * sizeof(float));
    float *dkey = dev(key, (size_t) T * Di * sizeof(float));
    for (int layer = 0; layer < 2; layer++) {
        cpu->kv_write(cpu, &kc, &cs, layer, 0, lat, L + R, NULL);
        gpu->kv_write(gpu, &kg, &gs, layer, 0, dlat, L + R, NULL);
    }
    cpu->kv_write(cpu, &kc, &cs, 1, L + R, key, Di, NULL);
    gpu->kv_write(gpu, &kg, &gs, 1, L + R, dkey, Di, NULL);
    {
        const size_t bytes = kg.block_bytes * (size_t) p.n_blocks;
        unsigned char *got = malloc(bytes);
        ASSERT(got);
        backend_cuda_kv_download(gpu, &kg, got);
        // Both caches are fresh and reserved alike, so the sequences hold the same block ids
        // and unused blocks are zero in both: the pools compare whole.
        size_t differ = 0;
        for (int i = 0; i < 2; i++)
            ASSERT(sc[i].n_blocks == sg[i].n_blocks
                   && !memcmp(sc[i].blocks, sg[i].blocks, (size_t) sc[i].n_blocks * sizeof(int)));
        for (size_t i = 0; i < bytes; i++)
            differ += ((const unsigned char *) kc.pool)[i] != got[i];
        printf("kv_write (%s cache)            %zu bytes differ\n", kv_dtype_name(dtype), differ);
        CHECK(differ == 0);
        free(got);
    }

    // DSA over both sequences: positions below top_k see every key, the rest select.
    const BackendDsa dp = {Hi, Di, topk};
    float *q = rand_floats((size_t) T * Hi * Di, 1.0f), *w = rand_floats((size_t) T * Hi, 1.0f);
    float *dq = dev(q, (size_t) T * Hi * Di * sizeof(float)),
          *dw = dev(w, (size_t) T * Hi * sizeof(float));
    int *sel = calloc((size_t) T * topk, sizeof *sel), *n_sel = calloc(T, sizeof *n_sel);
    int *dsel = gpu->alloc(gpu, (size_t) T * topk * sizeof(int));
    int *dn_sel = gpu->alloc(gpu, (size_t) T * sizeof(int));
    // Pass 0 with ties: one live index head (about half the keys score exactly 0) and every
    // weight 0 on even tokens (all keys score 0), so the tie rule (the later position wins)
    // decides at the top-k boundary; pass 1 as drawn.
    for (int pass = 0; pass < 2; pass++) {
        const bool ties = pass == 0;
        float *wp = malloc((size_t) T * Hi * sizeof *wp);
        ASSERT(wp);
        for (int i = 0; i < T * Hi; i++)
            wp[i] = ties && (i % Hi != 0 || (i / Hi) % 2 == 0) ? 0.0f : w[i];
        gpu->upload(gpu, dw, wp, (size_t) T * Hi * sizeof(float));
        cpu->dsa_topk(cpu, sel, n_sel, q, wp, &kc, &cs, 1, &dp);
        gpu->dsa_topk(gpu, dsel, dn_sel, dq, dw, &kg, &gs, 1, &dp);
        int *gsel = down(dsel, (size_t) T * topk * sizeof(int)),
            *gn = down(dn_sel, (size_t) T * sizeof(int));
        const bool tc = backend_dsa_tc(cpu, &dp, &kc, 1);
        CHECK(tc == backend_dsa_tc(gpu, &dp, &kg, 1));
        CHECK(tc == cpu->dsa_tc);
        int sel_bad = 0, near_ties = 0;
        for (int t = 0; t < T; t++) {
            int bad = gn[t] != n_sel[t];
            for (int k = 0; k < n_sel[t] && k < topk; k++)
                bad += gsel[(size_t) t * topk + k] != sel[(size_t) t * topk + k];
            if (bad && tc && gn[t] == n_sel[t]
                && near_ties_only(&kc, &sc[seq_of[t]], q + (size_t) t * Hi * Di,
                                  wp + (size_t) t * Hi, pos[t] + 1, gsel + (size_t) t * topk,
                                  sel + (size_t) t * topk, n_sel[t], &dp)) {
                near_ties++;
                bad = 0;
            }
            sel_bad += bad;
        }
        printf("dsa_topk (%s cache%s%s, dim %d)        %d differences, %d tokens "
               "differ within the fp32 bound\n",
               kv_dtype_name(dtype), ties ? ", ties" : "", tc ? ", dsa_tc" : "", Di, sel_bad,
               near_ties);
        CHECK(sel_bad == 0);
        free(gsel);
        free(gn);
        free(wp);
    }
    gpu->free_mem(gpu, dpos);
    gpu->free_mem(gpu, dseq_of);
    gpu->free_mem(gpu, dlen);
    gpu->free_mem(gpu, dlat);
    gpu->free_mem(gpu, dkey);
    gpu->free_mem(gpu, dq);
    gpu->free_mem(gpu, dw);
    gpu->free_mem(gpu, dsel);
    gpu->free_mem(gpu, dn_sel);
    free(lat);
    free(key);
    free(q);
    free(w);
    free(sel);
    free(n_sel);
    for (int i = 0; i < 2; i++) {
        kv_seq_free(&kc, &sc[i]);
        kv_seq_free(&kg, &sg[i]);
    }
    kv_free(&kc);
    kv_free(&kg);
}

// The tuned kernels under the BF16 recipe (backend.h), both backends following it: routed
// NVFP4 experts stacked by bind_experts, and MLA at GLM-5's latent and head widths over fp8
// and bf16 caches of 128-position blocks (two sequences, one crossing a block boundary;
// dense, and over a selection). Bound: 1e-3 relative L2 (the GPU-vs-recipe bound;
// the two differ by fp32 summation order and the bf16 roundings that it flips).
static void tuned_mla(BackendMla mp);

// matmul (or matmul_rows) of n random tokens on both backends, weights wc (CPU) and wg (GPU,
// bound), within the recipe's 1e-3.
static void matmul_vs_cpu(const char *label, const CkptLinear *wc, const CkptLinear *wg, int n,
                          bool rows)
{
    float *x = rand_floats((size_t) n * wc->cols, 1.0f);
    float *want = malloc((size_t) n * wc->rows * sizeof *want);
    ASSERT(want);
    cpu->matmul(cpu, want, wc, x, n);
    float *dx = dev(x, (size_t) n * wc->cols * sizeof *x);
    float *dy = gpu->alloc(gpu, (size_t) n * wc->rows * sizeof(float));
    (rows ? gpu->matmul_rows : gpu->matmul)(gpu, dy, wg, dx, n);
    char what[96];
    snprintf(what, sizeof what, "%s n=%d", label, n);
    expect_close(what, dy, want, (size_t) n * wc->rows, 1e-3);
    free(x), free(want);
    gpu->free_mem(gpu, dx), gpu->free_mem(gpu, dy);
}

static void test_tuned(void)
{
    cpu->precision = gpu->precision = BACKEND_PRECISION_BF16;
    {
        // bf16 weights: 1 token (CUDA cores), 5 (tensor cores: 2,304 rows fill the chip
        // twice), 40 (cuBLASLt), and 3 from a misaligned input (rounded into a copy first);
        // then 156 rows (the router's experts: rows in 4s) at 40 tokens through cuBLASLt.
        for (int shape = 0; shape < 2; shape++) {
            const int rows = shape ? 156 : 2304, cols = 520;
            CkptLinear w = make_linear(CKPT_LINEAR_BF16, rows, cols), wg = w;
            CHECK(gpu->bind_linear(gpu, &wg) == ERR_OK);
            const int ns[4] = {1, 5, 40, 3};
            for (int i = shape ? 2 : 0; i < (shape ? 3 : 4); i++) {
                const int n = ns[i], off = i == 3 ? 1 : 0;
                float *x = rand_floats((size_t) n * cols + 1, 1.0f);
                float *want = malloc((size_t) n * rows * sizeof *want);
                cpu->matmul(cpu, want, &w, x + off, n);
                float *dx = dev(x, ((size_t) n * cols + 1) * sizeof *x);
                float *dy = gpu->alloc(gpu, (size_t) n * rows * sizeof(float));
                gpu->matmul(gpu, dy, &wg, dx + off, n);
                char what[64];
                snprintf(what, sizeof what, "matmul tuned bf16 %d rows n=%d%s", rows, n,
                         off ? " (misaligned x)" : "");
                expect_close(what, dy, want, (size_t) n * rows, 1e-3);
                free(x), free(want);
                gpu->free_mem(gpu, dx), gpu->free_mem(gpu, dy);
            }
            free_linear(&w);
        }
        // matmul_rows on a weight whose rows take the tensor-core GEMV (2,304 rows: the lm_head's
        // kernel) at 1, 5, 16 and 40 rows: within the recipe of the CPU, and each row bit for
        // bit matmul_rows on that row alone (logits that do not depend on the batch).
        {
            const int rows = 2304, cols = 520;
            CkptLinear w = make_linear(CKPT_LINEAR_BF16, rows, cols), wg = w;
            CHECK(gpu->bind_linear(gpu, &wg) == ERR_OK);
            const int ns[4] = {1, 5, 16, 40};
            for (int i = 0; i < 4; i++) {
                const int n = ns[i];
                matmul_vs_cpu("matmul_rows tuned bf16 2304 rows", &w, &wg, n, true);
                float *x = rand_floats((size_t) n * cols, 1.0f);
                float *dx = dev(x, (size_t) n * cols * sizeof *x);
                float *dy = gpu->alloc(gpu, (size_t) n * rows * sizeof(float));
                float *d1 = gpu->alloc(gpu, (size_t) rows * sizeof(float));
                gpu->matmul_rows(gpu, dy, &wg, dx, n);
                float *all = down(dy, (size_t) n * rows * sizeof(float));
                int bad = 0;
                for (int t = 0; t < n; t++) {
                    gpu->matmul_rows(gpu, d1, &wg, dx + (size_t) t * cols, 1);
                    float *one = down(d1, (size_t) rows * sizeof(float));
                    bad += memcmp(one, all + (size_t) t * rows, (size_t) rows * sizeof(float)) != 0;
                    free(one);
                }
                printf("matmul_rows 2304 rows n=%d: %d of %d rows differ from one-row calls\n", n,
                       bad, n);
                CHECK(bad == 0);
                free(x), free(all);
                gpu->free_mem(gpu, dx), gpu->free_mem(gpu, dy), gpu->free_mem(gpu, d1);
            }
            free_linear(&w);
        }
        // A bf16 weight whose columns are not in 8s (a sweep model's o_proj, 5 heads x 5): the
        // GPU's zero-padded copy, x padded to match, on the tuned GEMV, the tensor cores and
        // cuBLASLt (1, 5, 40 tokens), and matmul_rows (the head over a batch's rows); then an
        // f32 weight (GLM-5.2's weights_proj: 32 index heads), which both backends store in
        // bf16 when bound under the recipe and the GPU runs on the tuned GEMV.
        CkptLinear odd = make_linear(CKPT_LINEAR_BF16, 64, 25), oddg = odd;
        CHECK(gpu->bind_linear(gpu, &oddg) == ERR_OK);
        CkptLinear wf = make_linear(CKPT_LINEAR_F32, 32, 520), wfc = wf, wfg = wf;
        CHECK(cpu->bind_linear(cpu, &wfc) == ERR_OK && gpu->bind_linear(gpu, &wfg) == ERR_OK);
        CHECK(wfc.format == CKPT_LINEAR_BF16 && wfg.format == CKPT_LINEAR_BF16);
        // An f32 weight with 25 columns: rounded, then padded like a bf16 one.
        CkptLinear wo = make_linear(CKPT_LINEAR_F32, 32, 25), woc = wo, wog = wo;
        CHECK(cpu->bind_linear(cpu, &woc) == ERR_OK && gpu->bind_linear(gpu, &wog) == ERR_OK);
        const int ns[3] = {1, 5, 40};
        for (int i = 0; i < 3; i++) {
            matmul_vs_cpu("matmul tuned bf16 25 columns (padded)", &odd, &oddg, ns[i], false);
            matmul_vs_cpu("matmul_rows tuned bf16 25 columns", &odd, &oddg, ns[i], true);
            matmul_vs_cpu("matmul f32 weight bound as bf16", &wfc, &wfg, ns[i], false);
            matmul_vs_cpu("matmul f32 weight, 25 columns, bound as bf16", &woc, &wog, ns[i], false);
        }
        free_linear(&odd);
        free_linear(&wf);
        free_linear(&wo);
    }
    {
        // n 5: 8-column tiles, where token 0 and the last token alone must equal themselves
        // in the batch bit for bit; n 1030: one launch on the wide tiles (8,240 pairs over 24
        // experts: past the 8-column tiles' 8,192); n 4100: a 4,096-token wide launch, then 4
        // tokens on the 8-column tiles. The wide tiles sum in another order than the 8-column
        // ones (moe.h), so those two are held to the CPU reference alone.
        // Then a sweep model's narrow widths (hidden 48, intermediate 16: the kernels take
        // multiples of 16, as NVFP4 stores them), n 5 and 40. Shapes 2 and 3: the same with
        // experts stored in bf16 (kernels/moe.h's bf16 kernels: 8-column tiles only; n 1030
        // takes two launches of at most 8,192 pairs, n 4100 five).
        for (int shape = 0; shape < 4; shape++) {
            const bool bf16 = shape >= 2;
            const bool narrow = shape % 2 == 1;
            const BackendRoute rp = narrow ? (BackendRoute){6, 3, 1, 1, true, 1.0f}
                                           : (BackendRoute){24, 8, 1, 1, true, 2.5f};
            const int E = rp.n_experts, K = rp.top_k, hidden = narrow ? 48 : 256,
                      inter = narrow ? 16 : 128;
            CkptLinear *ex = calloc((size_t) 3 * E, sizeof *ex),
                       *exg = calloc((size_t) 3 * E, sizeof *exg);
            ASSERT(ex && exg);
            for (int i = 0; i < 3 * E; i++) {
                ex[i] = make_linear(bf16 ? CKPT_LINEAR_BF16 : CKPT_LINEAR_NVFP4,
                                    i % 3 == 2 ? hidden : inter, i % 3 == 2 ? inter : hidden);
                exg[i] = ex[i];
            }
            CHECK(cpu->bind_experts(cpu, ex, E) == ERR_OK
                  && gpu->bind_experts(gpu, exg, E) == ERR_OK);
            static const int ns[2][3] = {{5, 1030, 4100}, {5, 40, 0}};
            for (size_t c = 0; c < 3 && ns[narrow][c]; c++) {
                const int n = ns[narrow][c];
                float *logits = rand_floats((size_t) n * E, 4.0f);
                int *idx = malloc((size_t) n * K * sizeof *idx);
                float *wts = malloc((size_t) n * K * sizeof *wts);
                ASSERT(idx && wts);
                cpu->route(cpu, idx, wts, logits, NULL, n, &rp);
                float *x = rand_floats((size_t) n * hidden, 1.0f);
                float *want = malloc((size_t) n * hidden * sizeof *want);
                cpu->moe(cpu, want, x, n, idx, wts, K, ex, E, NULL);
                float *dx = dev(x, (size_t) n * hidden * sizeof *x);
                int *didx = dev(idx, (size_t) n * K * sizeof *idx);
                float *dwts = dev(wts, (size_t) n * K * sizeof *wts);
                float *dout = gpu->alloc(gpu, (size_t) n * hidden * sizeof(float));
                gpu->moe(gpu, dout, dx, n, didx, dwts, K, exg, E, NULL);
                char what[80];
                snprintf(what, sizeof what, "moe tuned (%s experts, hidden %d) n=%d",
                         bf16 ? "bf16" : "nvfp4", hidden, n);
                expect_close(what, dout, want, (size_t) n * hidden, 1e-3);
                float *batch = down(dout, (size_t) n * hidden * sizeof *batch);
                if (n > 1000) {  // several launches: each chunk's residual rows, out apart
                    const size_t nh = (size_t) n * hidden;
                    float *r = rand_floats(nh, 1.0f), *dr = dev(r, nh * sizeof *r);
                    gpu->moe(gpu, dout, dx, n, didx, dwts, K, exg, E, dr);
                    float *got = down(dout, nh * sizeof *got);
                    size_t bad = 0;
                    for (size_t i = 0; i < nh; i++) {
                        const float w = r[i] + batch[i];
                        bad += memcmp(&got[i], &w, sizeof w) != 0;
                    }
                    printf("moe tuned n=%d with a residual apart: %zu of %zu values differ from "
                           "residual + moe\n", n, bad, nh);
                    CHECK(bad == 0);
                    free(r), free(got);
                    gpu->free_mem(gpu, dr);
                }
                const int ends[2] = {0, n - 1};
                for (int j = 0; j < (n == 5 ? 2 : 0); j++) {  // n 5: 8-column tiles alone
                    const int t = ends[j];
                    gpu->moe(gpu, dout, dx + (size_t) t * hidden, 1, didx + (size_t) t * K,
                             dwts + (size_t) t * K, K, exg, E, NULL);
                    float *alone = down(dout, (size_t) hidden * sizeof *alone);
                    const bool same =
                        memcmp(alone, batch + (size_t) t * hidden, (size_t) hidden * sizeof *alone)
                        == 0;
                    printf("moe tuned n=%d token %d alone vs in batch: %s\n", n, t,
                           same ? "identical" : "DIFFERENT");
                    CHECK(same);
                    free(alone);
                }
                free(logits), free(idx), free(wts), free(x), free(want), free(batch);
                gpu->free_mem(gpu, dx), gpu->free_mem(gpu, didx), gpu->free_mem(gpu, dwts);
                gpu->free_mem(gpu, dout);
            }
            for (int i = 0; i < 3 * E; i++)
                free_linear(&ex[i]);  // the CPU reads NVFP4 and bf16 experts in place
            free(ex), free(exg);
        }
    }
    tuned_mla((BackendMla){32, 192, 64, 128, 512, 1.0f / 16.0f, 0.0f});
    // A sweep model's widths: 3 heads (run as 32), q_nope 24, rope 8, v 5 (W_UV rows padded to
    // 8), latent 40, all zero-padded to the kernels' (kv_cache.h, mla_tuned).
    tuned_mla((BackendMla){3, 24, 8, 5, 40, 0.17f, 0.0f});
}

// MLA through the tuned kernels (test_tuned) at the widths of mp: two sequences of 300 and 40
// tokens in one call (two of mla_tuned's 256-token chunks), dense and sparse, both kernels,
// fp8 and bf16 caches; then q's RoPE inside the attention (rope_theta).
static void tuned_mla(const BackendMla mp)
{
    enum { TA = 300, TB = 40, T = TA + TB, KSEL = 48 };  // past a 256-token chunk of mla_tuned
    const int L = mp.kv_lora, R = mp.qk_rope, H = mp.n_heads, nope = mp.qk_nope, vd = mp.v_dim;
    CkptLinear kv_b = make_linear(CKPT_LINEAR_BF16, H * (nope + vd), L), kv_bg = kv_b;
    CHECK(cpu->bind_kv_b(cpu, &kv_b, &mp) == ERR_OK && gpu->bind_kv_b(gpu, &kv_bg, &mp) == ERR_OK);
    CHECK(gpu->bind_linear(gpu, &kv_bg) == ERR_OK);
    int pos[T], seq_of[T], len[T], *sel = malloc((size_t) T * KSEL * sizeof *sel), n_sel[T];
    ASSERT(sel);
    for (int t = 0; t < T; t++) {
        pos[t] = t < TA ? t : t - TA;
        seq_of[t] = t >= TA;
        len[t] = pos[t] + 1;
        // A selection: every third position from the newest down, ascending.
        n_sel[t] = 0;
        for (int p = pos[t] % 3; p <= pos[t] && n_sel[t] < KSEL; p += 3)
            sel[(size_t) t * KSEL + n_sel[t]++] = p;
    }
    int *dpos = dev(pos, sizeof pos), *dseq_of = dev(seq_of, sizeof seq_of),
        *dlen = dev(len, sizeof len);
    int *dsel = dev(sel, (size_t) T * KSEL * sizeof *sel), *dn_sel = dev(n_sel, sizeof n_sel);
    float *lat = rand_floats((size_t) T * (L + R), 1.0f),
          *qa = rand_floats((size_t) T * H * (nope + R), 1.0f);
    float *dlat = dev(lat, (size_t) T * (L + R) * sizeof(float));
    float *dqa = dev(qa, (size_t) T * H * (nope + R) * sizeof(float));
    float *want = malloc((size_t) T * H * vd * sizeof *want);
    float *dout = gpu->alloc(gpu, (size_t) T * H * vd * sizeof(float));
    const KvDtype dtypes[2] = {KV_DTYPE_FP8, KV_DTYPE_BF16};
    for (int di = 0; di < 2; di++) {
        const KvCacheParams p = {.n_layers = 1,
                                 .block_size = 128,
                                 .n_blocks = 4,
                                 .kv_lora = L,
                                 .rope_dim = R,
                                 .dtype = dtypes[di]};
        KvCache kc, kg;
        ASSERT(kv_init(&kc, &p) == ERR_OK && kv_init(&kg, &p) == ERR_OK);
        CHECK(backend_mla_tuned(&mp, &kc.entry[0]));
        KvSeq sc[2] = {{0}, {0}}, sg[2] = {{0}, {0}};
        for (int i = 0; i < 2; i++)
            ASSERT(kv_seq_reserve(&kc, &sc[i], i ? TB : TA) == ERR_OK
                   && kv_seq_reserve(&kg, &sg[i], i ? TB : TA) == ERR_OK);
        KvSeq *cseqs[2] = {&sc[0], &sc[1]}, *gseqs[2] = {&sg[0], &sg[1]};
        const BackendSeqs cs = {cseqs, 2, pos, seq_of, len, T},
                          gs = {gseqs, 2, dpos, dseq_of, dlen, T};
        cpu->kv_write(cpu, &kc, &cs, 0, 0, lat, L + R, NULL);
        gpu->kv_write(gpu, &kg, &gs, 0, 0, dlat, L + R, NULL);
        // Both MLA kernels: mla_decode (fp32) and, with Backend.mla_tc, mla_decode_tc (tensor
        // cores; q and the probabilities in bf16, as the CPU then rounds them too).
        for (int tc = 0; tc < 2; tc++)
            for (int sparse = 0; sparse < 2; sparse++) {
                cpu->mla_tc = gpu->mla_tc = tc;
                cpu->mla_attention(cpu, want, qa, &kv_b, &kc, &cs, 0, sparse ? sel : NULL,
                                   sparse ? n_sel : NULL, KSEL, &mp);
                gpu->mla_attention(gpu, dout, dqa, &kv_bg, &kg, &gs, 0, sparse ? dsel : NULL,
                                   sparse ? dn_sel : NULL, KSEL, &mp);
                cpu->mla_tc = gpu->mla_tc = false;
                char what[64];
                snprintf(what, sizeof what, "mla tuned%s %s (%s cache, %d heads, latent %d)",
                         tc ? " tc" : "", sparse ? "sparse" : "dense", kv_dtype_name(dtypes[di]), H,
                         L);
                expect_close(what, dout, want, (size_t) T * H * vd, 1e-3);
            }
        // q's RoPE in the attention (rope_theta: the query split rotates it) against the CPU
        // doing the same, and bit for bit the GPU's rope op on q followed by the attention.
        {
            BackendMla mr = mp;
            mr.rope_theta = 10000.0f;
            const size_t nq = (size_t) T * H * (nope + R), no = (size_t) T * H * vd;
            float *dqr = dev(qa, nq * sizeof(float)), *dref = gpu->alloc(gpu, no * sizeof(float));
            ASSERT(dref);
            cpu->mla_tc = gpu->mla_tc = true;
            cpu->mla_attention(cpu, want, qa, &kv_b, &kc, &cs, 0, sel, n_sel, KSEL, &mr);
            gpu->mla_attention(gpu, dout, dqa, &kv_bg, &kg, &gs, 0, dsel, dn_sel, KSEL, &mr);
            gpu->rope(gpu, dqr, T, H, H * (nope + R), nope + R, nope, R, dpos, mr.rope_theta);
            gpu->mla_attention(gpu, dref, dqr, &kv_bg, &kg, &gs, 0, dsel, dn_sel, KSEL, &mp);
            cpu->mla_tc = gpu->mla_tc = false;
            char what[80];
            snprintf(what, sizeof what, "mla tuned tc sparse, q rotated inside (%s cache)",
                     kv_dtype_name(dtypes[di]));
            expect_close(what, dout, want, no, 1e-3);
            float *got = down(dout, no * sizeof(float)), *ref = down(dref, no * sizeof(float));
            float *qb = down(dqa, nq * sizeof(float));
            const bool same = memcmp(got, ref, no * sizeof(float)) == 0;
            if (!same) fprintf(stderr, "%s: not bit for bit rope, then attention\n", what);
            CHECK(same);
            CHECK(memcmp(qb, qa, nq * sizeof(float)) == 0);  // q untouched
            free(got), free(ref), free(qb);
            gpu->free_mem(gpu, dqr), gpu->free_mem(gpu, dref);
        }
        for (int i = 0; i < 2; i++) {
            kv_seq_free(&kc, &sc[i]);
            kv_seq_free(&kg, &sg[i]);
        }
        kv_free(&kc);
        kv_free(&kg);
    }
    free_linear(&kv_b);
    free(sel), free(lat), free(qa), free(want);
    gpu->free_mem(gpu, dpos), gpu->free_mem(gpu, dseq_of), gpu->free_mem(gpu, dlen);
    gpu->free_mem(gpu, dsel), gpu->free_mem(gpu, dn_sel), gpu->free_mem(gpu, dlat);
    gpu->free_mem(gpu, dqa), gpu->free_mem(gpu, dout);
}

// matmul_add (y += w x, the residual adds) against the CPU backend's: the tuned GEMV (the add
// in its store; CUDA cores at 1 token, tensor cores at 5) and cuBLASLt (then an add) at 40.
static void test_matmul_add(void)
{
    const int rows = 2304, cols = 520;
    CkptLinear w = make_linear(CKPT_LINEAR_BF16, rows, cols), wg = w;
    CHECK(gpu->bind_linear(gpu, &wg) == ERR_OK);
    {
        const int ns[3] = {1, 5, 40};
        for (int i = 0; i < 3; i++) {
            const int n = ns[i];
            float *x = rand_floats((size_t) n * cols, 1.0f);
            float *y = rand_floats((size_t) n * rows, 1.0f);
            float *dx = dev(x, (size_t) n * cols * sizeof *x);
            float *dy = dev(y, (size_t) n * rows * sizeof *y);
            cpu->matmul_add(cpu, y, &w, x, n);
            gpu->matmul_add(gpu, dy, &wg, dx, n);
            char what[64];
            snprintf(what, sizeof what, "matmul_add n=%d", n);
            expect_close(what, dy, y, (size_t) n * rows, 1e-3);  // as matmul
            free(x), free(y);
            gpu->free_mem(gpu, dx), gpu->free_mem(gpu, dy);
        }
    }
    free_linear(&w);
}

// Four bf16 weights of rows[i] x cols on the host (w, freed with free_linear) and bound on the
// GPU (wg): matmul_group's and norm_matmul_group's products.
static void group_weights(CkptLinear w[4], CkptLinear wg[4], const int rows[4], int cols)
{
    for (int i = 0; i < 4; i++) {
        w[i] = make_linear(CKPT_LINEAR_BF16, rows[i], cols);
        wg[i] = w[i];
        CHECK(gpu->bind_linear(gpu, &wg[i]) == ERR_OK);
    }
}

// matmul_group: four products of one input as a layer's q_a, kv_a and the indexer's wk and
// weights_proj, at small widths and odd rows, then a plain product and a SwiGLU pair as the
// router and the shared expert; each output bit for bit the GPU's own ops (matmul of its
// weight: the grouped GEMV runs the split-K kernel's sums; for the pair matmul, matmul,
// silu_mul) and within 1e-3 of the CPU's, at 1, 3 and 16 tokens (one launch) and 40
// (cuBLASLt: one product at a time).
static void test_matmul_group(void)
{
    const int cols = 264, rows[4] = {200, 72, 72, 1};
    CkptLinear w[4], wg[4];
    group_weights(w, wg, rows, cols);
    const int ns[4] = {1, 3, 16, 40};
    for (int k = 0; k < 4; k++) {
        const int n = ns[k];
        float *x = rand_floats((size_t) n * cols, 1.0f);
        float *dx = dev(x, (size_t) n * cols * sizeof *x);
        BackendProduct pc[4], pg[4];
        float *alone[4];
        for (int i = 0; i < 4; i++) {
            const size_t ny = (size_t) n * rows[i];
            pc[i] = (BackendProduct){malloc(ny * sizeof(float)), &w[i], NULL};
            pg[i] = (BackendProduct){gpu->alloc(gpu, ny * sizeof(float)), &wg[i], NULL};
            alone[i] = gpu->alloc(gpu, ny * sizeof(float));
            ASSERT(pc[i].y && pg[i].y && alone[i]);
            gpu->matmul(gpu, alone[i], &wg[i], dx, n);
        }
        cpu->matmul_group(cpu, pc, 4, x, n);
        gpu->matmul_group(gpu, pg, 4, dx, n);
        for (int i = 0; i < 4; i++) {
            const size_t ny = (size_t) n * rows[i];
            char what[64];
            snprintf(what, sizeof what, "matmul_group %d rows n=%d", rows[i], n);
            expect_close(what, pg[i].y, pc[i].y, ny, 1e-3);  // as matmul
            float *got = down(pg[i].y, ny * sizeof(float)), *want = down(alone[i], ny * sizeof(float));
            const bool same = memcmp(got, want, ny * sizeof(float)) == 0;
            if (!same) fprintf(stderr, "%s: not bit for bit the weight's own matmul\n", what);
            CHECK(same);
            free(got), free(want), free(pc[i].y);
            gpu->free_mem(gpu, pg[i].y), gpu->free_mem(gpu, alone[i]);
        }
        // A SwiGLU pair beside a plain product (the router and the shared expert): the pair's
        // output bit for bit silu_mul of the GPU's two matmuls.
        {
            const size_t n0 = (size_t) n * rows[0], n1 = (size_t) n * rows[1];
            float *c0 = malloc(n0 * sizeof(float)), *c1 = malloc(n1 * sizeof(float));
            float *d0 = gpu->alloc(gpu, n0 * sizeof(float)), *d1 = gpu->alloc(gpu, n1 * sizeof(float));
            float *dg = gpu->alloc(gpu, n1 * sizeof(float)), *du = gpu->alloc(gpu, n1 * sizeof(float));
            ASSERT(c0 && c1 && d0 && d1 && dg && du);
            const BackendProduct qc[2] = {{c0, &w[0], NULL}, {c1, &w[1], &w[2]}};
            const BackendProduct qg[2] = {{d0, &wg[0], NULL}, {d1, &wg[1], &wg[2]}};
            cpu->matmul_group(cpu, qc, 2, x, n);
            gpu->matmul_group(gpu, qg, 2, dx, n);
            gpu->matmul(gpu, dg, &wg[1], dx, n);
            gpu->matmul(gpu, du, &wg[2], dx, n);
            gpu->silu_mul(gpu, dg, dg, du, (int) n1);
            char what[64];
            snprintf(what, sizeof what, "matmul_group swiglu %d rows n=%d", rows[1], n);
            expect_close(what, d1, c1, n1, 1e-3);
            float *got = down(d1, n1 * sizeof(float)), *want = down(dg, n1 * sizeof(float));
            const bool same = memcmp(got, want, n1 * sizeof(float)) == 0;
            if (!same) fprintf(stderr, "%s: not bit for bit matmul, matmul, silu_mul\n", what);
            CHECK(same);
            free(got), free(want), free(c0), free(c1);
            gpu->free_mem(gpu, d0), gpu->free_mem(gpu, d1), gpu->free_mem(gpu, dg);
            gpu->free_mem(gpu, du);
        }
        free(x);
        gpu->free_mem(gpu, dx);
    }
    for (int i = 0; i < 4; i++) free_linear(&w[i]);
}

// norm_matmul_group: a layer's norm with the products of its output (the attention's four, the
// router and the shared expert's pair) at 1 and 2 tokens (the fused launch), 3 and 40 (the two
// ops): h and every product bit for bit the GPU's rmsnorm, then matmul_group; within 1e-3 of
// the CPU's (the norm in double on both, the products as matmul).
static void test_norm_matmul_group(void)
{
    const int cols = 264, rows[4] = {200, 72, 72, 1};
    CkptLinear w[4], wg[4];
    group_weights(w, wg, rows, cols);
    float *nw = rand_floats((size_t) cols, 1.0f);
    float *dnw = dev(nw, (size_t) cols * sizeof *nw);
    const int ns[4] = {1, 2, 3, 40};
    for (int k = 0; k < 4; k++) {
        const int n = ns[k];
        const size_t nx = (size_t) n * cols;
        float *x = rand_floats(nx, 3.0f);
        float *dx = dev(x, nx * sizeof *x);
        for (int pair = 0; pair < 2; pair++) {
            // pair 0: four plain products; pair 1: a plain product and a SwiGLU pair.
            const int np = pair ? 2 : 4;
            BackendProduct pc[4], pg[4], pr[4];
            for (int i = 0; i < np; i++) {
                const CkptLinear *up = pair && i == 1 ? &w[2] : NULL, *upg = up ? &wg[2] : NULL;
                const size_t ny = (size_t) n * rows[i];
                pc[i] = (BackendProduct){malloc(ny * sizeof(float)), &w[i], up};
                pg[i] = (BackendProduct){gpu->alloc(gpu, ny * sizeof(float)), &wg[i], upg};
                pr[i] = (BackendProduct){gpu->alloc(gpu, ny * sizeof(float)), &wg[i], upg};
                ASSERT(pc[i].y && pg[i].y && pr[i].y);
            }
            float *hc = malloc(nx * sizeof(float));
            float *hg = gpu->alloc(gpu, nx * sizeof(float));
            float *hr = gpu->alloc(gpu, nx * sizeof(float));
            ASSERT(hc && hg && hr);
            cpu->norm_matmul_group(cpu, pc, np, hc, x, nw, 1e-6f, n);
            gpu->norm_matmul_group(gpu, pg, np, hg, dx, dnw, 1e-6f, n);
            gpu->rmsnorm(gpu, hr, dx, dnw, n, cols, cols, 1e-6f);
            gpu->matmul_group(gpu, pr, np, hr, n);
            char what[80];
            snprintf(what, sizeof what, "norm_matmul_group%s h n=%d", pair ? " swiglu" : "", n);
            expect_close(what, hg, hc, nx, 1e-6);
            float *got = down(hg, nx * sizeof(float)), *want = down(hr, nx * sizeof(float));
            bool same = memcmp(got, want, nx * sizeof(float)) == 0;
            if (!same) fprintf(stderr, "%s: not bit for bit the rmsnorm op's\n", what);
            CHECK(same);
            free(got), free(want);
            for (int i = 0; i < np; i++) {
                const size_t ny = (size_t) n * rows[i];
                snprintf(what, sizeof what, "norm_matmul_group%s %d rows n=%d",
                         pr[i].up ? " swiglu" : "", rows[i], n);
                expect_close(what, pg[i].y, pc[i].y, ny, 1e-3);
                got = down(pg[i].y, ny * sizeof(float)), want = down(pr[i].y, ny * sizeof(float));
                same = memcmp(got, want, ny * sizeof(float)) == 0;
                if (!same)
                    fprintf(stderr, "%s: not bit for bit rmsnorm, then matmul_group\n", what);
                CHECK(same);
                free(got), free(want), free(pc[i].y);
                gpu->free_mem(gpu, pg[i].y), gpu->free_mem(gpu, pr[i].y);
            }
            free(hc);
            gpu->free_mem(gpu, hg), gpu->free_mem(gpu, hr);
        }
        free(x);
        gpu->free_mem(gpu, dx);
    }
    free(nw);
    gpu->free_mem(gpu, dnw);
    for (int i = 0; i < 4; i++) free_linear(&w[i]);
}

int main(void)
{
    ASSERT(backend_cpu_create(2, &cpu) == ERR_OK);
    if (backend_cuda_create(0, &gpu) != ERR_OK) {
        fprintf(stderr, "no CUDA device\n");
        return 1;
    }
    cpu->precision = BACKEND_PRECISION_BF16;  // the CPU follows the GPU's recipe
    CHECK(gpu->precision == BACKEND_PRECISION_BF16 && gpu->kernels);
    test_matmul();
    test_matmul_add();
    test_matmul_group();
    test_norm_matmul_group();
    test_elementwise();
    test_route_moe();
    // DSA through kernels/dsa.cu (fp32 scores the CPU reproduces bit for bit, so the
    // selections are equal, ties included), on each cache type the GPU takes.
    cpu->dsa_tc = gpu->dsa_tc = false;
    test_attention(KV_DTYPE_BF16, 32);
    test_attention(KV_DTYPE_FP8, 32);
    test_kv_write_in(KV_DTYPE_FP8);
    test_kv_write_in(KV_DTYPE_BF16);
    test_attention(KV_DTYPE_FP8, 20);
    // The tensor-core scores (Backend.dsa_tc): selections equal but for keys within the fp32
    // bound of the threshold.
    cpu->dsa_tc = gpu->dsa_tc = true;
    test_attention(KV_DTYPE_BF16, 32);
    test_attention(KV_DTYPE_FP8, 32);
    // Index keys narrower than 16s (a sweep model's 20): stored and read zero-padded to 32.
    test_attention(KV_DTYPE_BF16, 20);
    test_attention(KV_DTYPE_FP8, 20);
    // The top-k in passes of a few rows (1,000 bytes of scores over a capacity of about 48
    // positions): the same selections as the CPU, ties included.
    printf("DSA top-k in passes of at most 1000 bytes of scores:\n");
    backend_cuda_limit_dsa_scores(gpu, 1000);
    test_attention(KV_DTYPE_FP8, 32);
    cpu->dsa_tc = gpu->dsa_tc = false;
    test_attention(KV_DTYPE_BF16, 32);
    backend_cuda_limit_dsa_scores(gpu, (size_t) 256 << 20);
    test_tuned();
    gpu->destroy(gpu);
    cpu->destroy(cpu);
    return check_exit();
}
