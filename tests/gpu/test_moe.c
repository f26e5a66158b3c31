/*
 * test_moe.c - kernels/moe.cu (fused router, NVFP4 expert gate/up + SwiGLU, expert down +
 * weighted sum + residual) against kernels/ref/moe_ref.c.
 *
 * Router: moe.h promises moe_router_token()'s results bit for bit, so experts and weights
 * must be identical, with exact ties among logits, with and without norm_topk_prob, in both
 * output orders. Shapes: GLM's 156 experts top-8 (one group), 256 experts with 8 groups
 * keeping 4 (DeepSeek), one-expert groups, a 1-expert edge case, the largest E and K, and
 * groups that are all kept (the rank kernel, as with one group).
 *
 * Experts: the 8-column kernels and the wide tiles of prefill (moe_experts_*_wide, which sum
 * the same products in another order) are each held to the reference's bounds; a prefill
 * chunk's atomic grouping must equal 512-pair calls bit for bit.
 * w13 is checked per output against a bound derived from the fp32 error of the gate
 * and up sums ((hidden + 64) * FLT_EPSILON * sum|terms| each) pushed through SiLU(g) * u, plus
 * the bf16 rounding. w2 is checked with the GPU's own bf16 activations as the reference input,
 * so its bound is the fp32 one: (k * inter + 64) * FLT_EPSILON * sum|terms| (+ residual).
 *
 * Experts stored in bf16 (moe_experts_bf16_w13 / _w2, CUDA cores) against moe_w13_bf16_ref /
 * moe_w2_bf16_ref with the same bounds, the sums' factor taken from the kernels' order (moe.h):
 * a term passes through at most 8 ceil(K / 256) fp32 additions in its lane's chain and 5 in
 * the butterfly, each off by at most 2^-24 of the running sum, so a sum is within
 * (8 ceil(K / 256) + 5) 2^-24 sum|terms| (+2 for the reference's own float roundings); w2
 * adds the weight's multiply, moe_combine's k additions and the host's residual add. Then,
 * exactly: the host repeats that order (warp_order_dot), and act must equal its rounding of
 * SiLU(g) * u (or, where the device's expf, within 2 ulp of the host's, can move it, one of
 * the two roundings within 4 ulp) and y must equal it bit for bit; that also pins a pair's
 * outputs to its row alone, whichever grouping (one block, or a prefill chunk's atomics) put
 * it in whichever column.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/moe.h"
#include "kernels/moe_router.h"
#include "kernels/ref/moe_ref.h"
#include "tests/gpu/gpu_util.h"

static uint64_t rng = 11;

// Whether two device buffers of n bytes hold the same bits.
static bool same_bits(const void *d_a, const void *d_b, size_t n)
{
    uint8_t *a = xmalloc(n), *b = xmalloc(n);
    gpu_download(a, d_a, n);
    gpu_download(b, d_b, n);
    const bool same = !memcmp(a, b, n);
    free(a), free(b);
    return same;
}

// moe_route_group on device logits and bias (n_tok tokens): idx, w and the work list bit for bit
// moe_route's, then moe_group's (the unwritten slots of both lists keep the same poison).
static void check_route_group(const char *what, const float *d_logits, const float *d_bias,
                              int n_tok, int n_experts, int k, bool norm, bool ascending)
{
    const float scale = 2.5f;
    const size_t np = (size_t) n_tok * k, nw = moe_work_ints((int) np, n_experts);
    int32_t *d_idx = gpu_alloc_poisoned(np * 4), *d_idx2 = gpu_alloc_poisoned(np * 4);
    float *d_w = gpu_alloc_poisoned(np * 4), *d_w2 = gpu_alloc_poisoned(np * 4);
    int32_t *d_work = gpu_alloc_poisoned(nw * 4), *d_work2 = gpu_alloc_poisoned(nw * 4);
    moe_route(d_idx, d_w, d_logits, d_bias, n_tok, n_experts, k, 1, 1, norm, scale, ascending, 0);
    moe_group(d_work, d_idx, n_tok, k, n_experts, 0);
    moe_route_group(d_work2, d_idx2, d_w2, d_logits, d_bias, n_tok, n_experts, k, norm, scale,
                    ascending, 0);
    const bool si = same_bits(d_idx, d_idx2, np * 4), sw = same_bits(d_w, d_w2, np * 4),
               sl = same_bits(d_work, d_work2, nw * 4);
    printf("route_group %s n_tok=%d E=%d k=%d: experts %s, weights %s, work list %s\n", what, n_tok,
           n_experts, k, si ? "equal" : "DIFFER", sw ? "equal" : "DIFFER",
           sl ? "equal" : "DIFFERS");
    CHECK(si && sw && sl);
    cudaFree(d_idx), cudaFree(d_idx2), cudaFree(d_w), cudaFree(d_w2), cudaFree(d_work);
    cudaFree(d_work2);
}

// The GPU router against moe_router_token() (kernels/moe_router.h) token by token: the same
// experts in the same order and the same weight bits. Where moe_route_group takes the shape,
// it too (check_route_group), and again with a NaN logit in one token (route_warp's path).
static void test_route(int n_tok, int n_experts, int k, int n_group, int topk_group, bool norm,
                       bool ascending)
{
    const float scale = 2.5f;
    float *logits = xmalloc((size_t) n_tok * n_experts * 4), *bias = xmalloc(n_experts * 4);
    fill_f32(logits, (size_t) n_tok * n_experts, &rng, -4.0f, 4.0f);
    fill_f32(bias, n_experts, &rng, -0.1f, 0.1f);
    // Exact ties: every third token repeats its first half of experts in its second half (so
    // groups tie too), and the bias is zero.
    for (int t = 1; t < n_tok; t += 3) {
        float *row = logits + (size_t) t * n_experts;
        memcpy(row + n_experts / 2, row, (size_t) (n_experts / 2) * 4);
    }
    if (n_tok > 2) memset(bias, 0, (size_t) n_experts * 4);
    int32_t *idx_ref = xmalloc((size_t) n_tok * k * 4), *idx = xmalloc((size_t) n_tok * k * 4);
    float *w_ref = xmalloc((size_t) n_tok * k * 4), *w = xmalloc((size_t) n_tok * k * 4);
    void *work = xmalloc(moe_router_work_bytes(n_experts, n_group));
    for (int t = 0; t < n_tok; t++)
        moe_router_token(idx_ref + (size_t) t * k, w_ref + (size_t) t * k, NULL,
                         logits + (size_t) t * n_experts, bias, n_experts, k, n_group, topk_group,
                         norm, scale, ascending, work);
    float *d_logits = gpu_upload(logits, (size_t) n_tok * n_experts * 4);
    float *d_bias = gpu_upload(bias, n_experts * 4);
    int32_t *d_idx = gpu_alloc_poisoned((size_t) n_tok * k * 4);
    float *d_w = gpu_alloc_poisoned((size_t) n_tok * k * 4);
    moe_route(d_idx, d_w, d_logits, d_bias, n_tok, n_experts, k, n_group, topk_group, norm, scale,
              ascending, 0);
    gpu_download(idx, d_idx, (size_t) n_tok * k * 4);
    gpu_download(w, d_w, (size_t) n_tok * k * 4);

    int bad = 0;
    for (int t = 0; t < n_tok; t++)
        if (memcmp(idx + (size_t) t * k, idx_ref + (size_t) t * k, (size_t) k * 4)
            || memcmp(w + (size_t) t * k, w_ref + (size_t) t * k, (size_t) k * 4)) {
            if (bad++ < 5) fprintf(stderr, "route token %d differs from moe_router_token\n", t);
        }
    printf("route n_tok=%d E=%d k=%d groups=%d/%d norm=%d ascending=%d: %d/%d tokens differ\n",
           n_tok, n_experts, k, topk_group, n_group, norm, ascending, bad, n_tok);
    CHECK(bad == 0);
    if (moe_route_group_ok(n_tok, n_experts, k, n_group, topk_group)) {
        check_route_group("", d_logits, d_bias, n_tok, n_experts, k, norm, ascending);
        logits[(size_t) (n_tok - 1) * n_experts + n_experts / 3] = NAN;
        float *d_nan = gpu_upload(logits, (size_t) n_tok * n_experts * 4);
        check_route_group("NaN", d_nan, d_bias, n_tok, n_experts, k, norm, ascending);
        cudaFree(d_nan);
    }
    cudaFree(d_logits), cudaFree(d_bias), cudaFree(d_idx), cudaFree(d_w);
    free(logits), free(bias), free(idx_ref), free(idx), free(w_ref), free(w), free(work);
}


// The host side of one expert test: the checkpoint's layout and the routing.
typedef struct ExpertCase {
    const uint8_t *q13, *s13, *q2, *s2;
    const float *g13, *g2, *w, *res;
    const int32_t *idx;
    int n_tok, k, hidden, inter;
} ExpertCase;

// moe_w13_ref's results for one input and each output's bound (the header's).
typedef struct W13Ref {
    float *want, *tol;
} W13Ref;

// The bounds of r->want (na outputs) from the reference's gate g and up u, whose fp32 sums may
// be off by rel * their sum |terms| ga, ua: pushed through SiLU(g) * u (|SiLU'| < 1.1), plus the
// bf16 rounding and the fp32 epilogue.
static void w13_bounds(W13Ref *r, const float *g, const float *u, const float *ga, const float *ua,
                       size_t na, double rel)
{
    for (size_t i = 0; i < na; i++) {
        const double eg = rel * ga[i], eu = rel * ua[i];
        const double sg = g[i] / (1.0 + exp(-(double) g[i]));
        r->tol[i] = (float) (1.1 * eg * (fabs(u[i]) + eu) + fabs(sg) * eu
                             + ldexp(fabs(r->want[i]), -8) + 16 * FLT_EPSILON * fabs(r->want[i]));
    }
}

static W13Ref w13_ref(const ExpertCase *c, const uint16_t *x)
{
    const size_t na = (size_t) c->n_tok * c->k * c->inter;
    W13Ref r = {xmalloc(na * 4), xmalloc(na * 4)};
    float *g = xmalloc(na * 4), *u = xmalloc(na * 4), *ga = xmalloc(na * 4), *ua = xmalloc(na * 4);
    moe_w13_ref(r.want, g, u, ga, ua, c->q13, c->s13, c->g13, x, c->idx, c->n_tok, c->k,
                c->hidden, c->inter);
    w13_bounds(&r, g, u, ga, ua, na, (c->hidden + 64) * FLT_EPSILON);
    free(g), free(u), free(ga), free(ua);
    return r;
}

// d_act (bf16 [n_pairs, inter]) against a w13_ref; act_b receives the downloaded activations.
static void check_w13(const char *name, const ExpertCase *c, const W13Ref *r,
                      const uint16_t *d_act, uint16_t *act_b)
{
    const size_t na = (size_t) c->n_tok * c->k * c->inter;
    float *got = xmalloc(na * 4);
    gpu_download(act_b, d_act, na * 2);
    for (size_t i = 0; i < na; i++) got[i] = kern_bf16_to_f32(act_b[i]);
    compare(name, got, r->want, r->tol, 0, na, 1e-4);
    free(got);
}

// d_out (fp32 [no]) against a w2 reference out_want plus the residual res, each within rel *
// (its sum |terms| out_abs + |res|); out_want is modified.
static void check_out(const char *name, float *out_want, const float *out_abs, const float *res,
                      const float *d_out, size_t no, double rel)
{
    float *out_got = xmalloc(no * 4), *tol2 = xmalloc(no * 4);
    gpu_download(out_got, d_out, no * 4);
    for (size_t i = 0; i < no; i++) {
        out_want[i] += res[i];
        tol2[i] = (float) (rel * (out_abs[i] + fabsf(res[i])));
    }
    compare(name, out_got, out_want, tol2, 0, no, 1e-10);
    free(out_got), free(tol2);
}

// d_out (fp32 [n_tok, hidden]: w2, the weighted sum and the residual, from act_b) against
// moe_w2_ref plus the residual, within the fp32 bound of the header.
static void check_w2(const char *name, const ExpertCase *c, const uint16_t *act_b,
                     const float *d_out)
{
    const size_t no = (size_t) c->n_tok * c->hidden;
    float *out_want = xmalloc(no * 4), *out_abs = xmalloc(no * 4);
    moe_w2_ref(out_want, out_abs, c->q2, c->s2, c->g2, act_b, c->idx, c->w, c->n_tok, c->k,
               c->hidden, c->inter);
    check_out(name, out_want, out_abs, c->res, d_out, no,
              ((size_t) c->k * c->inter + 64) * FLT_EPSILON);
    free(out_want), free(out_abs);
}

// Routing for the expert tests: k distinct experts a token (as the router guarantees) and
// weights in [0.05, 0.5).
static void random_routing(int32_t *idx, float *w, int n_tok, int k, int n_experts)
{
    for (int t = 0; t < n_tok; t++) {
        for (int j = 0; j < k; j++) {
            int e, dup;
            do {
                e = (int) (kern_rand_u64(&rng) % (uint64_t) n_experts);
                dup = 0;
                for (int i = 0; i < j; i++)
                    dup |= idx[t * k + i] == e;
            } while (dup);
            idx[t * k + j] = e;
            w[t * k + j] = kern_rand_uniform(&rng, 0.05f, 0.5f);
        }
    }
}

static void test_experts(int n_experts, int hidden, int inter, int n_tok, int k)
{
    const size_t n13 = (size_t) n_experts * 2 * inter * hidden, n2 = (size_t) n_experts * hidden * inter;
    uint8_t *q13 = xmalloc(n13 / 2), *s13 = xmalloc(n13 / 16), *q2 = xmalloc(n2 / 2), *s2 = xmalloc(n2 / 16);
    float *g13 = xmalloc(n_experts * 2 * 4), *g2 = xmalloc(n_experts * 4);
    fill_bytes(q13, n13 / 2, &rng);
    fill_bytes(q2, n2 / 2, &rng);
    for (size_t i = 0; i < n13 / 16; i++) s13[i] = random_e4m3_scale(&rng);
    for (size_t i = 0; i < n2 / 16; i++) s2[i] = random_e4m3_scale(&rng);
    fill_f32(g13, n_experts * 2, &rng, 0.001f, 0.004f);
    fill_f32(g2, n_experts, &rng, 0.001f, 0.004f);
    const int n_pairs = n_tok * k;
    uint16_t *x = xmalloc((size_t) n_tok * hidden * 2);
    fill_bf16(x, (size_t) n_tok * hidden, &rng, -1.0f, 1.0f);
    int32_t *idx = xmalloc(n_pairs * 4);
    float *w = xmalloc(n_pairs * 4), *res = xmalloc((size_t) n_tok * hidden * 4);
    random_routing(idx, w, n_tok, k, n_experts);
    fill_f32(res, (size_t) n_tok * hidden, &rng, -1.0f, 1.0f);

    // The checkpoint's layout uploaded, packed per expert as the backend does.
    uint8_t *d_q13 = gpu_upload(q13, n13 / 2), *d_s13 = gpu_upload(s13, n13 / 16);
    uint8_t *d_q2 = gpu_upload(q2, n2 / 2), *d_s2 = gpu_upload(s2, n2 / 16);
    MoeExperts ex = {gpu_alloc_poisoned(n13 / 2), gpu_alloc_poisoned(n13 / 16),
                     gpu_upload(g13, n_experts * 8), gpu_alloc_poisoned(n2 / 2),
                     gpu_alloc_poisoned(n2 / 16), gpu_upload(g2, n_experts * 4), n_experts, hidden,
                     inter};
    const size_t e13 = (size_t) 2 * inter * hidden, e2 = (size_t) hidden * inter;
    for (int e = 0; e < n_experts; e++) {
        moe_pack_w13((uint8_t *) ex.q13 + e * e13 / 2, (uint8_t *) ex.s13 + e * e13 / 16,
                     d_q13 + e * e13 / 2, d_s13 + e * e13 / 16, inter, hidden, 0);
        moe_pack_w2((uint8_t *) ex.q2 + e * e2 / 2, (uint8_t *) ex.s2 + e * e2 / 16,
                    d_q2 + e * e2 / 2, d_s2 + e * e2 / 16, hidden, inter, 0);
    }
    float *xf = xmalloc((size_t) n_tok * hidden * 4);  // the bf16 inputs, exactly, in fp32
    for (size_t i = 0; i < (size_t) n_tok * hidden; i++) xf[i] = kern_bf16_to_f32(x[i]);
    float *d_x = gpu_upload(xf, (size_t) n_tok * hidden * 4);
    int32_t *d_idx = gpu_upload(idx, n_pairs * 4);
    float *d_w = gpu_upload(w, n_pairs * 4);
    float *d_res = gpu_upload(res, (size_t) n_tok * hidden * 4);
    int32_t *d_work = gpu_alloc_poisoned(moe_work_ints(n_pairs, n_experts) * 4);
    uint16_t *d_act = gpu_alloc_poisoned((size_t) n_pairs * inter * 2);
    float *d_y = gpu_alloc_poisoned((size_t) n_pairs * hidden * 4);
    float *d_out = gpu_alloc_poisoned((size_t) n_tok * hidden * 4);
    moe_group(d_work, d_idx, n_tok, k, n_experts, 0);
    moe_experts_w13(d_act, &ex, d_x, d_work, n_tok, k, 0);
    moe_experts_w2(d_y, &ex, d_act, d_work, d_w, n_tok, k, 0);
    moe_combine(d_out, d_y, d_res, n_tok, k, hidden, 0);
    const ExpertCase ec = {q13, s13, q2, s2, g13, g2, w, res, idx, n_tok, k, hidden, inter};
    const size_t na = (size_t) n_pairs * inter;
    uint16_t *act_b = xmalloc(na * 2);
    char name[128];
    W13Ref ref = w13_ref(&ec, x);  // once: both kernels are held to it
    {
        // Prefill's wide tiles (moe.h): the 8-column kernels' products summed in another order,
        // held to the same bounds; w2 from the 8-column kernel's activations, so that one w2
        // reference serves both.
        int32_t *d_wwork = gpu_alloc_poisoned(moe_wide_work_ints(&ex, n_tok, k) * 4);
        uint16_t *d_act3 = gpu_alloc_poisoned(na * 2);
        float *d_y3 = gpu_alloc_poisoned((size_t) n_pairs * hidden * 4);
        float *d_out3 = gpu_alloc_poisoned((size_t) n_tok * hidden * 4);
        moe_group_wide(d_wwork, d_idx, n_tok, k, n_experts, 0);
        moe_experts_w13_wide(d_act3, &ex, d_x, d_wwork, n_tok, k, 0);
        snprintf(name, sizeof name, "moe wide w13 E=%d %dx%d tok=%d k=%d", n_experts, hidden,
                 inter, n_tok, k);
        check_w13(name, &ec, &ref, d_act3, act_b);
        gpu_download(act_b, d_act, na * 2);  // the 8-column activations (checked below)
        moe_experts_w2_wide(d_y3, &ex, d_act, d_wwork, d_w, n_tok, k, 0);
        moe_combine(d_out3, d_y3, d_res, n_tok, k, hidden, 0);
        snprintf(name, sizeof name, "moe wide w2 E=%d %dx%d tok=%d k=%d", n_experts, hidden,
                 inter, n_tok, k);
        check_w2(name, &ec, act_b, d_out3);
        if ((double) n_pairs * hidden * inter <= 0x1p28) {
            // fp32 inputs that are not bf16 values (rounded on the way in), a zero row and a
            // row of larger magnitudes: the row staging rounds and scales them as the
            // reference reads their bf16 roundings (small shapes: the reference is the cost).
            float *xr = xmalloc((size_t) n_tok * hidden * 4);
            uint16_t *xr_b = xmalloc((size_t) n_tok * hidden * 2);
            for (size_t i = 0; i < (size_t) n_tok * hidden; i++) {
                const size_t t = i / (size_t) hidden;
                xr[i] = t == 0 ? 0.0f : xf[i] * (1.0f + 0x1p-12f * (float) ((int) (i % 7) - 3));
                if (n_tok > 1 && t == (size_t) n_tok - 1) xr[i] *= 64.0f;
                xr_b[i] = kern_f32_to_bf16(xr[i]);
            }
            float *d_xr = gpu_upload(xr, (size_t) n_tok * hidden * 4);
            moe_experts_w13_wide(d_act3, &ex, d_xr, d_wwork, n_tok, k, 0);
            W13Ref ref_r = w13_ref(&ec, xr_b);
            snprintf(name, sizeof name, "moe wide w13 rounded fp32 inputs E=%d %dx%d tok=%d k=%d",
                     n_experts, hidden, inter, n_tok, k);
            check_w13(name, &ec, &ref_r, d_act3, act_b);
            free(ref_r.want), free(ref_r.tol), free(xr), free(xr_b);
            cudaFree(d_xr);
        }
        cudaFree(d_wwork), cudaFree(d_act3), cudaFree(d_y3), cudaFree(d_out3);
    }
    if (n_pairs > MOE_MAX_PAIRS) {
        // A prefill chunk's grouping (atomics, three launches) against decode-sized calls of
        // moe_group's one-block grouping over the same tokens: equal bit for bit (moe.h).
        uint16_t *d_act2 = gpu_alloc_poisoned((size_t) n_pairs * inter * 2);
        float *d_y2 = gpu_alloc_poisoned((size_t) n_pairs * hidden * 4);
        float *d_out2 = gpu_alloc_poisoned((size_t) n_tok * hidden * 4);
        const int per = MOE_MAX_PAIRS / k;
        for (int t0 = 0; t0 < n_tok; t0 += per) {
            const int nc = n_tok - t0 < per ? n_tok - t0 : per;
            const size_t p0 = (size_t) t0 * k;
            moe_group(d_work, d_idx + p0, nc, k, n_experts, 0);
            moe_experts_w13(d_act2 + p0 * inter, &ex, d_x + (size_t) t0 * hidden, d_work, nc, k, 0);
            moe_experts_w2(d_y2 + p0 * hidden, &ex, d_act2 + p0 * inter, d_work, d_w + p0, nc, k, 0);
            moe_combine(d_out2 + (size_t) t0 * hidden, d_y2 + p0 * hidden,
                        d_res + (size_t) t0 * hidden, nc, k, hidden, 0);
        }
        const bool same = same_bits(d_act, d_act2, (size_t) n_pairs * inter * 2)
                          && same_bits(d_out, d_out2, (size_t) n_tok * hidden * 4);
        printf("moe E=%d tok=%d k=%d: chunk grouping = %d-pair calls bit for bit: %s\n", n_experts,
               n_tok, k, MOE_MAX_PAIRS, same ? "yes" : "NO");
        CHECK(same);
        cudaFree(d_act2), cudaFree(d_y2), cudaFree(d_out2);
    }

    if (n_tok <= MOE_COMBINE_FUSED_MAX_TOK && n_pairs <= MOE_MAX_PAIRS) {
        // down and the combine in one launch: y and out bit for bit the two launches', the
        // residual in place (out = residual, as the backend calls it), twice on the same
        // counters (the last block leaves them zero), then without a residual.
        const size_t nc = moe_combine_counters(hidden), no = (size_t) n_tok * hidden;
        int32_t *d_cnt = gpu_alloc_poisoned(nc * 4);
        CHECK(cudaMemset(d_cnt, 0, nc * 4) == cudaSuccess);
        float *d_y4 = gpu_alloc_poisoned((size_t) n_pairs * hidden * 4);
        float *d_o4 = gpu_alloc_poisoned(no * 4), *d_o5 = gpu_alloc_poisoned(no * 4);
        float *d_plain = gpu_alloc_poisoned(no * 4);
        bool same = true;
        for (int rep = 0; rep < 2; rep++) {
            CHECK(cudaMemcpy(d_o4, d_res, no * 4, cudaMemcpyDeviceToDevice) == cudaSuccess);
            moe_experts_w2_combine(d_o4, d_y4, d_o4, d_cnt, &ex, d_act, d_work, d_w, n_tok, k, 0);
            same = same && same_bits(d_o4, d_out, no * 4)
                   && same_bits(d_y4, d_y, (size_t) n_pairs * hidden * 4);
        }
        moe_experts_w2_combine(d_o5, d_y4, NULL, d_cnt, &ex, d_act, d_work, d_w, n_tok, k, 0);
        moe_combine(d_plain, d_y, NULL, n_tok, k, hidden, 0);
        same = same && same_bits(d_o5, d_plain, no * 4);
        int32_t *cnt = xmalloc(nc * 4);
        gpu_download(cnt, d_cnt, nc * 4);
        bool zero = true;
        for (size_t i = 0; i < nc; i++) zero = zero && cnt[i] == 0;
        printf("moe w2+combine E=%d tok=%d k=%d: = w2, combine bit for bit: %s; counters zero "
               "after: %s\n", n_experts, n_tok, k, same ? "yes" : "NO", zero ? "yes" : "NO");
        CHECK(same && zero);
        free(cnt);
        cudaFree(d_cnt), cudaFree(d_y4), cudaFree(d_o4), cudaFree(d_o5), cudaFree(d_plain);
    }

    // The 8-column kernels: w13 + SwiGLU, then w2 + weighted sum + residual from the GPU's
    // activations.
    snprintf(name, sizeof name, "moe w13 E=%d %dx%d tok=%d k=%d", n_experts, hidden, inter, n_tok, k);
    check_w13(name, &ec, &ref, d_act, act_b);
    snprintf(name, sizeof name, "moe w2 E=%d %dx%d tok=%d k=%d", n_experts, hidden, inter, n_tok, k);
    check_w2(name, &ec, act_b, d_out);

    cudaFree((void *) ex.q13), cudaFree((void *) ex.s13), cudaFree((void *) ex.g13);
    cudaFree((void *) ex.q2), cudaFree((void *) ex.s2), cudaFree((void *) ex.g2);
    cudaFree(d_q13), cudaFree(d_s13), cudaFree(d_q2), cudaFree(d_s2), cudaFree(d_work), cudaFree(d_y);
    cudaFree(d_x), cudaFree(d_idx), cudaFree(d_w), cudaFree(d_res), cudaFree(d_act), cudaFree(d_out);
    free(xf);
    free(q13), free(s13), free(q2), free(s2), free(g13), free(g2), free(x), free(idx), free(w);
    free(res), free(act_b), free(ref.want), free(ref.tol);
}

// ---------------------------------------------------------------------------
// Experts stored in bf16

// The bf16 kernels' fp32 dot product of w and x (K bf16 values each) in moe.h's order: lane l's
// chain over the 8-value chunks l, l + 32, ... from 0 (each product is exact in fp32, so the
// kernel's fmaf and this multiply-then-add agree), then warp_sum's butterfly.
static float warp_order_dot(const uint16_t *w, const uint16_t *x, int K)
{
    float lane[32], next[32];
    for (int l = 0; l < 32; l++) {
        float acc = 0.0f;
        for (int c = l; c < K / 8; c += 32)
            for (int i = 8 * c; i < 8 * c + 8; i++)
                acc += kern_bf16_to_f32(w[i]) * kern_bf16_to_f32(x[i]);
        lane[l] = acc;
    }
    for (int o = 16; o > 0; o >>= 1) {
        for (int l = 0; l < 32; l++)
            next[l] = lane[l] + lane[l ^ o];
        memcpy(lane, next, sizeof lane);
    }
    return lane[0];
}

// The epilogue of moe.h (the device's swiglu_bf16) with e standing for expf(-g), as a float.
static float swiglu_host(float g, float u, float e)
{
    return kern_bf16_to_f32(kern_f32_to_bf16(g / (1.0f + e) * u));
}

// act_b (the GPU's, bf16 [n_pairs, inter]) and d_y (fp32 [n_pairs, hidden]) against the host's
// repetition of the kernels' order (the file comment): y bit for bit, act up to expf's ulps.
static void check_bf16_exact(const char *name, const uint16_t *w13, const uint16_t *w2,
                             const uint16_t *x, const int32_t *idx, const float *w,
                             const uint16_t *act_b, const float *d_y, int n_tok, int k, int hidden,
                             int inter)
{
    const size_t n_pairs = (size_t) n_tok * k;
    size_t exact = 0, near = 0, bad_act = 0, bad_y = 0;
    for (size_t p = 0; p < n_pairs; p++) {
        const uint16_t *gate = w13 + (size_t) idx[p] * 2 * inter * hidden;
        const uint16_t *xt = x + p / k * hidden;
        for (int i = 0; i < inter; i++) {
            const float g = warp_order_dot(gate + (size_t) i * hidden, xt, hidden);
            const float u = warp_order_dot(gate + ((size_t) inter + i) * hidden, xt, hidden);
            const float e = expf(-g), got = kern_bf16_to_f32(act_b[p * inter + i]);
            if (act_b[p * inter + i] == kern_f32_to_bf16(g / (1.0f + e) * u)) {
                exact++;
                continue;
            }
            // CUDA's expf is within 2 ulp, glibc's within 1: any e within 4 ulp may be the
            // device's; the result is monotone in e, so its roundings lie between these two.
            float lo = e, hi = e;
            for (int s = 0; s < 4; s++)
                lo = nextafterf(lo, 0.0f), hi = nextafterf(hi, INFINITY);
            const float a = swiglu_host(g, u, lo), b = swiglu_host(g, u, hi);
            if (got >= fminf(a, b) && got <= fmaxf(a, b))
                near++;
            else if (bad_act++ < 5)
                fprintf(stderr, "%s act[%zu, %d]: got %.9g want %.9g\n", name, p, i, got,
                        swiglu_host(g, u, e));
        }
    }
    float *y = xmalloc(n_pairs * hidden * 4);
    gpu_download(y, d_y, n_pairs * hidden * 4);
    for (size_t p = 0; p < n_pairs; p++) {
        const uint16_t *down = w2 + (size_t) idx[p] * hidden * inter;
        for (int r = 0; r < hidden; r++) {
            const float want =
                warp_order_dot(down + (size_t) r * inter, act_b + p * inter, inter) * w[p];
            const float got = y[p * hidden + r];
            if (!(got == want) && bad_y++ < 5)  // NaN fails
                fprintf(stderr, "%s y[%zu, %d]: got %.9g want %.9g\n", name, p, r, got, want);
        }
    }
    printf("%s: act = host order's rounding %zu, within expf's ulps %zu, bad %zu; y bad %zu/%zu\n",
           name, exact, near, bad_act, bad_y, n_pairs * hidden);
    CHECK(bad_act == 0);
    CHECK(bad_y == 0);
    free(y);
}

static void test_experts_bf16(int n_experts, int hidden, int inter, int n_tok, int k)
{
    const size_t n13 = (size_t) n_experts * 2 * inter * hidden;
    const size_t n2 = (size_t) n_experts * hidden * inter, nx = (size_t) n_tok * hidden;
    const int n_pairs = n_tok * k;
    uint16_t *w13 = xmalloc(n13 * 2), *w2 = xmalloc(n2 * 2);
    const float a13 = 3.0f / sqrtf((float) hidden), a2 = 3.0f / sqrtf((float) inter);
    fill_bf16(w13, n13, &rng, -a13, a13);  // gate and up of about unit size for |x| < 1
    fill_bf16(w2, n2, &rng, -a2, a2);
    // fp32 inputs that are not bf16 values (the kernel rounds them as read); the last token's
    // row 64 times larger, into SiLU's tails.
    float *xf = xmalloc(nx * 4);
    uint16_t *x = xmalloc(nx * 2);
    fill_f32(xf, nx, &rng, -1.0f, 1.0f);
    for (size_t i = 0; i < nx; i++) {
        if (n_tok > 1 && i / (size_t) hidden == (size_t) n_tok - 1) xf[i] *= 64.0f;
        x[i] = kern_f32_to_bf16(xf[i]);
    }
    int32_t *idx = xmalloc(n_pairs * 4);
    float *w = xmalloc(n_pairs * 4), *res = xmalloc(nx * 4);
    random_routing(idx, w, n_tok, k, n_experts);
    fill_f32(res, nx, &rng, -1.0f, 1.0f);

    const MoeExpertsBf16 ex = {gpu_upload(w13, n13 * 2), gpu_upload(w2, n2 * 2), n_experts, hidden,
                               inter};
    float *d_x = gpu_upload(xf, nx * 4), *d_w = gpu_upload(w, n_pairs * 4);
    float *d_res = gpu_upload(res, nx * 4);
    int32_t *d_idx = gpu_upload(idx, n_pairs * 4);
    int32_t *d_work = gpu_alloc_poisoned(moe_work_ints(n_pairs, n_experts) * 4);
    uint16_t *d_act = gpu_alloc_poisoned((size_t) n_pairs * inter * 2);
    float *d_y = gpu_alloc_poisoned((size_t) n_pairs * hidden * 4);
    float *d_out = gpu_alloc_poisoned(nx * 4);
    moe_group(d_work, d_idx, n_tok, k, n_experts, 0);
    moe_experts_bf16_w13(d_act, &ex, d_x, d_work, n_tok, k, 0);
    moe_experts_bf16_w2(d_y, &ex, d_act, d_work, d_w, n_tok, k, 0);
    moe_combine(d_out, d_y, d_res, n_tok, k, hidden, 0);

    // w13 against the reference, the sums' factor from the kernel's order (the file comment).
    const size_t na = (size_t) n_pairs * inter;
    W13Ref ref = {xmalloc(na * 4), xmalloc(na * 4)};
    float *g = xmalloc(na * 4), *u = xmalloc(na * 4), *ga = xmalloc(na * 4), *ua = xmalloc(na * 4);
    moe_w13_bf16_ref(ref.want, g, u, ga, ua, w13, x, idx, n_tok, k, hidden, inter);
    w13_bounds(&ref, g, u, ga, ua, na, (8 * ((hidden + 255) / 256) + 5 + 2) * 0x1p-24);
    const ExpertCase ec = {.n_tok = n_tok, .k = k, .hidden = hidden, .inter = inter};
    uint16_t *act_b = xmalloc(na * 2);
    char name[128];
    snprintf(name, sizeof name, "moe bf16 w13 E=%d %dx%d tok=%d k=%d", n_experts, hidden, inter,
             n_tok, k);
    check_w13(name, &ec, &ref, d_act, act_b);

    // w2 + weighted sum + residual from the GPU's activations: the dot's factor, the weight's
    // multiply, moe_combine's k additions, the reference's and the host residual's roundings.
    const size_t no = nx;
    float *out_want = xmalloc(no * 4), *out_abs = xmalloc(no * 4);
    moe_w2_bf16_ref(out_want, out_abs, w2, act_b, idx, w, n_tok, k, hidden, inter);
    snprintf(name, sizeof name, "moe bf16 w2 E=%d %dx%d tok=%d k=%d", n_experts, hidden, inter,
             n_tok, k);
    check_out(name, out_want, out_abs, res, d_out, no,
              (8 * ((inter + 255) / 256) + 5 + 1 + k + 3) * 0x1p-24);

    snprintf(name, sizeof name, "moe bf16 exact E=%d %dx%d tok=%d k=%d", n_experts, hidden, inter,
             n_tok, k);
    check_bf16_exact(name, w13, w2, x, idx, w, act_b, d_y, n_tok, k, hidden, inter);

    cudaFree((void *) ex.w13), cudaFree((void *) ex.w2), cudaFree(d_x), cudaFree(d_w);
    cudaFree(d_res), cudaFree(d_idx), cudaFree(d_work), cudaFree(d_act), cudaFree(d_y);
    cudaFree(d_out);
    free(w13), free(w2), free(xf), free(x), free(idx), free(w), free(res), free(ref.want);
    free(ref.tol), free(g), free(u), free(ga), free(ua), free(act_b), free(out_want), free(out_abs);
}

int main(void)
{
    test_route(1, 1, 1, 1, 1, true, false);
    test_route(37, 156, 8, 1, 1, true, true);    // GLM-5.2-REAP, as the backends ask
    test_route(37, 156, 8, 1, 1, true, false);   // moe.h's order
    test_route(16, 256, 8, 8, 4, true, true);    // DeepSeek-V3 style group limit
    test_route(16, 256, 8, 8, 4, false, false);  // without norm_topk_prob
    test_route(9, 8, 3, 8, 2, true, true);       // one-expert groups
    test_route(5, 33, 3, 1, 1, true, true);
    test_route(7, 512, 16, 1, 1, false, true);  // the largest E and K (by rank)
    test_route(6, 64, 8, 4, 4, true, false);    // groups, all kept: by rank
    // A decode step's shapes for moe_route_group (up to MOE_ROUTE_GROUP_MAX_TOK tokens).
    test_route(1, 156, 8, 1, 1, true, true);
    test_route(2, 156, 8, 1, 1, true, true);
    test_route(8, 156, 8, 1, 1, true, true);
    test_route(2, 512, 16, 1, 1, false, false);
    test_experts(5, 64, 64, 3, 2);
    test_experts(9, 96, 160, 4, 3);
    test_experts(12, 6144, 2048, 2, 8);  // GLM shapes, 12 experts in memory
    test_experts(12, 6144, 2048, 8, 8);  // batch 8: experts shared by several tokens
    test_experts(3, 64, 48, 20, 2);      // more than 8 pairs per expert: several tiles
    test_experts(7, 80, 32, 1, 3);       // K = 80 and 32: chunks of 4 k-steps and a tail
    test_experts(4, 48, 16, 5, 4);       // every expert taken by most tokens
    test_experts(20, 128, 64, 2, 16);    // k > 8: a w2 warp walks two slots
    test_experts(11, 96, 96, 3, 9);
    test_experts(5, 144, 32, 3, 2);      // w2 + combine: two row blocks, the last partial
    test_experts(20, 128, 64, 700, 8);   // a prefill chunk: 5,600 pairs, grouped by atomics
    test_experts(156, 256, 64, 1024, 8);  // the largest chunk at GLM's E and k
    test_experts(3, 1040, 80, 300, 2);    // wide: ~200 pairs an expert (4 tiles); K 1040: staged
                                          // ranges of 512, 512 and a tail-only 16; K 80: a tail
    test_experts(2, 64, 32, 61, 2);       // every token takes both experts: one wide tile of 61
                                          // columns, its last n-tile 5 wide
    test_experts(8, 6144, 2048, 24, 8);   // GLM's widths, every expert 24 pairs: 3 full n-tiles
    test_experts(4, 6144, 512, 130, 2);   // GLM's hidden, ~65 pairs an expert: full wide tiles
    test_experts_bf16(9, 40, 24, 1, 3);   // decode, one token; K = 40, 24: 5 and 3 chunks
    test_experts_bf16(9, 40, 24, 3, 4);
    test_experts_bf16(16, 40, 24, 64, 8);     // 512 pairs (one-block grouping), full tiles
    test_experts_bf16(20, 40, 24, 2, 16);     // the largest k
    test_experts_bf16(7, 8, 8, 5, 3);         // one chunk a row
    test_experts_bf16(5, 1288, 200, 9, 2);    // 161 chunks: two rounds of loads, a lane's tail
    test_experts_bf16(20, 264, 136, 700, 8);  // a prefill chunk, grouped by atomics; partial
                                              // blocks of rows (136 / 16, 264 / 32)
    test_experts_bf16(156, 40, 24, 1024, 8);  // the largest chunk at GLM's E and k
    test_experts_bf16(12, 6144, 2048, 3, 8);  // GLM-5.2's widths
    return check_exit();
}
