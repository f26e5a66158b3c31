/*
 * test_attention.c - the CPU backend's MLA attention, DSA top-k and matmul against direct
 * double-precision references, on small random data.
 *
 * MLA: the backend uses the absorbed form over cached latents; the reference expands
 * k_nope = W_uk latent and v = W_uv latent per head and position, as transformers does, and
 * takes the softmax in double. Both read the same fp32 inputs and reduce in double, so the
 * only real difference is the final rounding to fp32: we allow 4 fp32 ulps of the largest
 * |v| that the output averages over. Incremental vs full: each query's arithmetic does not
 * depend on the batch, so one-at-a-time results must equal batched ones bit for bit.
 *
 * Both run on an fp32 and on a bf16 cache (values read back through kv_read()).
 *
 * DSA: the reference ranks every visible key by sum_h w_h Hi^-0.5 relu(q_h . k Di^-0.5)
 * in double and keeps the top k (random data: no ties).
 *
 * Matmul: dot products evaluated in fp32 are within (cols + 8) * FLT_EPSILON * sum |terms|
 * of the exact value (the forward error bound of a sum of cols products, with slack for the
 * 8 partial sums), whatever the format decoded.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/shared/err.h"
#include "kernels/nvfp4_format.h"
#include "tests/check.h"

static float frand(void)
{
    return 2.0f * (float) rand() / (float) RAND_MAX - 1.0f;
}

// ---------------------------------------------------------------------------
// MLA

typedef struct Mla {
    BackendMla p;
    int T;        // positions cached
    float *kv_b;  // [H * (nope + v), L]
    float *q;     // [T, H, nope + rope]
    KvCache kv;
    KvSeq seq;
    KvSeq *seqs[1];  // {&seq}
    int *zeros;      // [T] every token's sequence index
    int *lens;       // [T] pos + 1 of the tokens of the last one_seq()
} Mla;

// The ops' view of n tokens of m's one sequence at positions pos.
static BackendSeqs one_seq(Mla *m, const int *pos, int n)
{
    m->seqs[0] = &m->seq;
    for (int t = 0; t < n; t++)
        m->lens[t] = pos[t] + 1;
    return (BackendSeqs){m->seqs, 1, pos, m->zeros, m->lens, n};
}

static KvDtype kv_dtype;  // the cache storage under test

static void mla_setup(Mla *m, int H, int nope, int rope, int v, int L, int T, int index_dim)
{
    memset(m, 0, sizeof *m);
    m->p = (BackendMla){H, nope, rope, v, L, (float) (1.0 / sqrt(nope + rope)), 0.0f};
    m->T = T;
    const size_t rows = (size_t) H * (nope + v);
    m->kv_b = malloc(rows * L * sizeof(float));
    m->q = malloc((size_t) T * H * (nope + rope) * sizeof(float));
    m->zeros = calloc((size_t) T, sizeof *m->zeros);
    m->lens = calloc((size_t) T, sizeof *m->lens);
    ASSERT(m->kv_b && m->q && m->zeros && m->lens);
    for (size_t i = 0; i < rows * L; i++)
        m->kv_b[i] = frand() * 0.3f;
    for (size_t i = 0; i < (size_t) T * H * (nope + rope); i++)
        m->q[i] = frand();
    KvCacheParams kp = {.n_layers = 2,
                        .block_size = 4,
                        .n_blocks = (T + 3) / 4,
                        .kv_lora = L,
                        .rope_dim = rope,
                        .index_dim = index_dim};
    kp.has_index[1] = index_dim > 0;
    kp.dtype = kv_dtype;
    ASSERT(kv_init(&m->kv, &kp) == ERR_OK);
    ASSERT(kv_seq_reserve(&m->kv, &m->seq, T) == ERR_OK);
    float e[1024];
    for (int l = 0; l < 2; l++)
        for (int t = 0; t < T; t++) {
            ASSERT((size_t) kv_entry_values(&m->kv, l) <= 1024);
            for (size_t i = 0; i < (size_t) kv_entry_values(&m->kv, l); i++)
                e[i] = frand();
            kv_store(&m->kv, &m->seq, l, t, 0, e, (int) (size_t) kv_entry_values(&m->kv, l));
        }
}

static void mla_teardown(Mla *m)
{
    kv_seq_free(&m->kv, &m->seq);
    kv_free(&m->kv);
    free(m->kv_b);
    free(m->q);
    free(m->zeros);
    free(m->lens);
}

// Expanded-form reference for query t (position t) over keys[0..n_keys) of layer 0.
static void mla_ref(const Mla *m, int t, const int *keys, int n_keys, double *out, double *vmax)
{
    const BackendMla *p = &m->p;
    const int qk = p->qk_nope + p->qk_rope, L = p->kv_lora;
    double *score = malloc((size_t) n_keys * sizeof *score);
    float *tmp = malloc((size_t) kv_entry_values(&m->kv, 0) * sizeof *tmp);
    ASSERT(score && tmp);
    for (int h = 0; h < p->n_heads; h++) {
        const float *qh = m->q + ((size_t) t * p->n_heads + h) * qk;
        const float *W = m->kv_b + (size_t) h * (p->qk_nope + p->v_dim) * L;
        double mx = -INFINITY;
        for (int j = 0; j < n_keys; j++) {
            const float *e = kv_read(&m->kv, &m->seq, 0, keys[j], tmp);
            double s = 0.0;
            for (int i = 0; i < p->qk_nope; i++) {
                double k = 0.0;
                for (int c = 0; c < L; c++)
                    k += (double) W[(size_t) i * L + c] * e[c];
                s += qh[i] * k;
            }
            for (int r = 0; r < p->qk_rope; r++)
                s += (double) qh[p->qk_nope + r] * e[L + r];
            score[j] = s * p->scale;
            if (score[j] > mx) mx = score[j];
        }
        double sum = 0.0;
        for (int j = 0; j < n_keys; j++)
            sum += score[j] = exp(score[j] - mx);
        vmax[h] = 0.0;
        for (int d = 0; d < p->v_dim; d++) {
            double o = 0.0;
            for (int j = 0; j < n_keys; j++) {
                const float *e = kv_read(&m->kv, &m->seq, 0, keys[j], tmp);
                double v = 0.0;
                for (int c = 0; c < L; c++)
                    v += (double) W[(size_t) (p->qk_nope + d) * L + c] * e[c];
                if (fabs(v) > vmax[h]) vmax[h] = fabs(v);
                o += score[j] / sum * v;
            }
            out[(size_t) h * p->v_dim + d] = o;
        }
    }
    free(score);
    free(tmp);
}

static void test_mla(Backend *be, int H, int nope, int rope, int v, int L, int T, int top_k)
{
    Mla m;
    mla_setup(&m, H, nope, rope, v, L, T, 0);
    const CkptLinear kv_b = {CKPT_LINEAR_F32, H * (nope + v), L, m.kv_b, NULL, NULL, 1.0f, "kv_b"};
    int *pos = malloc((size_t) T * sizeof *pos);
    int *sel = malloc((size_t) T * top_k * sizeof *sel);
    int *n_sel = malloc((size_t) T * sizeof *n_sel);
    float *full = malloc((size_t) T * H * v * sizeof *full);
    float *one = malloc((size_t) H * v * sizeof *one);
    double *ref = malloc((size_t) H * v * sizeof *ref);
    double *vmax = malloc((size_t) H * sizeof *vmax);
    int *keys = malloc((size_t) T * sizeof *keys);
    ASSERT(pos && sel && n_sel && full && one && ref && vmax && keys);

    // A selection per query: every other visible position, but never more than top_k.
    for (int t = 0; t < T; t++) {
        pos[t] = t;
        int k = 0;
        for (int s = t; s >= 0 && k < top_k; s -= 2)
            sel[(size_t) t * top_k + k++] = s;
        n_sel[t] = k;
        // ascending, as dsa_topk writes them
        for (int i = 0; i < k / 2; i++) {
            int *r = sel + (size_t) t * top_k;
            const int tmp = r[i];
            r[i] = r[k - 1 - i];
            r[k - 1 - i] = tmp;
        }
    }

    for (int pass = 0; pass < 2; pass++) {
        const int *use_sel = pass ? sel : NULL;
        const BackendSeqs all = one_seq(&m, pos, T);
        be->mla_attention(be, full, m.q, &kv_b, &m.kv, &all, 0, use_sel, n_sel, top_k, &m.p);
        int same = 1;
        for (int t = 0; t < T; t++) {
            int n_keys = 0;
            if (use_sel)
                for (int k = 0; k < n_sel[t]; k++)
                    keys[n_keys++] = sel[(size_t) t * top_k + k];
            else
                for (int s = 0; s <= t; s++)
                    keys[n_keys++] = s;
            mla_ref(&m, t, keys, n_keys, ref, vmax);
            for (int h = 0; h < H; h++)
                for (int d = 0; d < v; d++)
                    CHECK_NEAR(full[((size_t) t * H + h) * v + d], ref[(size_t) h * v + d],
                               4.0 * FLT_EPSILON * vmax[h]);
            // the same query alone (decode) equals its row of the batch (prefill)
            const BackendSeqs alone = one_seq(&m, pos + t, 1);
            be->mla_attention(be, one, m.q + (size_t) t * H * (nope + rope), &kv_b, &m.kv, &alone,
                              0, use_sel ? sel + (size_t) t * top_k : NULL, n_sel + t, top_k, &m.p);
            same &= memcmp(one, full + (size_t) t * H * v, (size_t) H * v * sizeof *one) == 0;
        }
        CHECK(same);
        // rope_theta > 0: the op rotates q's rope part itself, bit for bit the rope op on a
        // copy followed by the attention of rotated q (q itself untouched).
        if (rope > 0) {
            const size_t nq = (size_t) T * H * (nope + rope);
            float *qr = malloc(nq * sizeof *qr), *q0 = malloc(nq * sizeof *q0);
            float *fused = malloc((size_t) T * H * v * sizeof *fused);
            ASSERT(qr && q0 && fused);
            memcpy(qr, m.q, nq * sizeof *qr);
            memcpy(q0, m.q, nq * sizeof *q0);
            be->rope(be, qr, T, H, H * (nope + rope), nope + rope, nope, rope, pos, 5000.0f);
            BackendMla pr = m.p;
            pr.rope_theta = 5000.0f;
            const BackendSeqs again = one_seq(&m, pos, T);
            be->mla_attention(be, full, qr, &kv_b, &m.kv, &again, 0, use_sel, n_sel, top_k, &m.p);
            be->mla_attention(be, fused, m.q, &kv_b, &m.kv, &again, 0, use_sel, n_sel, top_k, &pr);
            CHECK(memcmp(fused, full, (size_t) T * H * v * sizeof *full) == 0);
            CHECK(memcmp(m.q, q0, nq * sizeof *q0) == 0);
            free(qr);
            free(q0);
            free(fused);
        }
    }
    free(pos);
    free(sel);
    free(n_sel);
    free(full);
    free(one);
    free(ref);
    free(vmax);
    free(keys);
    mla_teardown(&m);
}

// ---------------------------------------------------------------------------
// DSA top-k

// Under the bf16 recipe (be->precision) the scores are fp32 in kernels/dsa.cu's order (with
// Backend.dsa_tc, of q rounded to bf16: the double ranking rounds it too): a key
// whose double score is within the fp32 rounding bounds, (Di + Hi + 2) eps sum|terms|, of its
// own and of the key it changes places with (at most the largest bound), from the top_k-th
// may fall on either side of it; every other key must be where the double ranking puts it.
static void test_dsa(Backend *be, int Hi, int Di, int top_k, int T)
{
    const bool recipe = be->precision == BACKEND_PRECISION_BF16;
    Mla m;
    mla_setup(&m, 1, 2, 2, 2, 4, T, Di);
    const int key_off = 4 + 2;
    float *q = malloc((size_t) T * Hi * Di * sizeof *q);
    float *w = malloc((size_t) T * Hi * sizeof *w);
    int *pos = malloc((size_t) T * sizeof *pos);
    int *sel = malloc((size_t) T * top_k * sizeof *sel);
    int *n_sel = malloc((size_t) T * sizeof *n_sel);
    double *score = malloc((size_t) T * sizeof *score);
    ASSERT(q && w && pos && sel && n_sel && score);
    for (int i = 0; i < T * Hi * Di; i++)
        q[i] = frand();
    for (int i = 0; i < T * Hi; i++)
        w[i] = frand();
    for (int t = 0; t < T; t++)
        pos[t] = t;
    const BackendDsa p = {Hi, Di, top_k};
    const BackendSeqs all = one_seq(&m, pos, T);
    // Index dims outside 16s are stored padded to them in a bf16 or fp8 cache (kv_cache.h).
    const bool tunable = Di % 16 == 0 || kv_dtype != KV_DTYPE_F32;
    if (recipe) CHECK(backend_dsa_tuned(&p, &m.kv, 1) == tunable);
    // Backend.dsa_tc (fp8 or bf16 keys): the ranking is that of q rounded to bf16.
    const bool tc = backend_dsa_tc(be, &p, &m.kv, 1);
    CHECK(tc == (be->dsa_tc && recipe && tunable && kv_dtype != KV_DTYPE_F32));
    double *bound = malloc((size_t) T * sizeof *bound);
    ASSERT(bound);

    // All weights zero: every score ties at 0 and the latest positions win (the tie rule).
    memset(w, 0, (size_t) T * Hi * sizeof *w);
    be->dsa_topk(be, sel, n_sel, q, w, &m.kv, &all, 1, &p);
    int latest = 1;
    for (int t = 0; t < T; t++)
        for (int k = 0; k < n_sel[t]; k++)
            latest &= sel[(size_t) t * top_k + k] == t + 1 - n_sel[t] + k;
    CHECK(latest);
    for (int i = 0; i < T * Hi; i++)
        w[i] = frand();
    be->dsa_topk(be, sel, n_sel, q, w, &m.kv, &all, 1, &p);

    for (int t = 0; t < T; t++) {
        const int visible = t + 1;
        CHECK(n_sel[t] == (visible < top_k ? visible : top_k));
        for (int s = 0; s < visible; s++) {
            float tmp[256];
            const float *k = kv_read(&m.kv, &m.seq, 1, s, tmp) + key_off;
            double total = 0.0, total_abs = 0.0;
            for (int h = 0; h < Hi; h++) {
                double d = 0.0, d_abs = 0.0;
                for (int i = 0; i < Di; i++) {
                    const float qi = q[((size_t) t * Hi + h) * Di + i];
                    const double qv = tc ? nvfp4_round_bf16(qi) : qi;
                    d += qv * k[i];
                    d_abs += fabs(qv * k[i]);
                }
                d /= sqrt((double) Di);
                total += w[(size_t) t * Hi + h] / sqrt((double) Hi) * (d > 0 ? d : 0);
                total_abs += fabs(w[(size_t) t * Hi + h]) / sqrt((double) Hi) * d_abs / sqrt((double) Di);
            }
            score[s] = total;
            bound[s] = recipe ? (Di + Hi + 2) * (double) FLT_EPSILON * total_abs : 0.0;
        }
        // the top_k-th key by the double ranking (the threshold of the fp32 slack), and the
        // largest bound of any key (the one a wrongly selected key pushed out may be any)
        double bound_max = 0.0;
        for (int s = 0; s < visible; s++)
            bound_max = bound[s] > bound_max ? bound[s] : bound_max;
        int kth = 0;
        for (int s = 0; s < visible; s++) {
            int rank = 0;
            for (int o = 0; o < visible; o++)
                rank += score[o] > score[s] || (score[o] == score[s] && o > s);
            if (rank == (visible < top_k ? visible : top_k) - 1) kth = s;
        }
        // position s is selected iff fewer than top_k visible keys score higher
        int n_expected = 0, ok = 1;
        for (int s = 0; s < visible; s++) {
            int rank = 0;
            for (int o = 0; o < visible; o++)
                rank += score[o] > score[s] || (score[o] == score[s] && o > s);
            const int want = rank < top_k;
            n_expected += want;
            int got = 0;
            for (int k = 0; k < n_sel[t]; k++)
                got |= sel[(size_t) t * top_k + k] == s;
            ok &= got == want || (recipe && fabs(score[s] - score[kth]) <= bound[s] + bound_max);
        }
        CHECK(ok);
        CHECK(n_expected == n_sel[t]);
        for (int k = 1; k < n_sel[t]; k++)
            CHECK(sel[(size_t) t * top_k + k] > sel[(size_t) t * top_k + k - 1]);
    }
    free(q);
    free(w);
    free(pos);
    free(sel);
    free(n_sel);
    free(score);
    free(bound);
    mla_teardown(&m);
}

// ---------------------------------------------------------------------------
// Matmul over every stored format

static double bf16_value(const uint8_t *p)
{
    const uint32_t bits = ((uint32_t) p[0] | (uint32_t) p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static double f16_value(const uint8_t *p)
{
    const unsigned h = (unsigned) p[0] | (unsigned) p[1] << 8;
    const int e = (h >> 10) & 31, mant = h & 1023;
    const double v = e ? ldexp(1.0 + mant / 1024.0, e - 15) : ldexp(mant / 1024.0, -14);
    return (h >> 15) ? -v : v;
}

static double weight_at(const CkptLinear *w, int r, int c)
{
    const uint8_t *b = w->data;
    switch (w->format) {
    case CKPT_LINEAR_F32: {
        float f;
        memcpy(&f, b + ((size_t) r * w->cols + c) * 4, sizeof f);
        return f;
    }
    case CKPT_LINEAR_BF16:
        return bf16_value(b + ((size_t) r * w->cols + c) * 2);
    case CKPT_LINEAR_F16:
        return f16_value(b + ((size_t) r * w->cols + c) * 2);
    case CKPT_LINEAR_NVFP4: {
        const uint8_t byte = b[(size_t) r * (w->cols / 2) + c / 2];
        const uint8_t code = c % 2 == 0 ? byte & 15 : byte >> 4;
        return (double) nvfp4_e2m1_to_float(code)
               * nvfp4_e4m3_to_float(w->scale[(size_t) r * (w->cols / 16) + c / 16])
               * w->global_scale;
    }
    default:
        ASSERT(!"format not tested");
        return 0.0;
    }
}

static void test_matmul(Backend *be, CkptLinearFormat format, int rows, int cols, int n)
{
    const size_t n_w = (size_t) rows * cols;
    const size_t bytes = format == CKPT_LINEAR_F32     ? n_w * 4
                         : format == CKPT_LINEAR_NVFP4 ? n_w / 2
                                                       : n_w * 2;
    uint8_t *data = malloc(bytes + 1);
    uint8_t *scale = malloc(n_w / 16 + 1);
    float *x = malloc((size_t) n * cols * sizeof *x);
    float *y = malloc((size_t) n * rows * sizeof *y);
    ASSERT(data && scale && x && y);
    for (size_t i = 0; i < bytes; i++)
        data[i] = (uint8_t) rand();
    if (format == CKPT_LINEAR_BF16 || format == CKPT_LINEAR_F16)
        for (size_t i = 1; i < bytes; i += 2)  // keep exponents moderate (no inf/nan)
            data[i] = (uint8_t) ((data[i] & 0x80) | (format == CKPT_LINEAR_BF16 ? 0x3c : 0x34)
                                 | (data[i] & 3));
    if (format == CKPT_LINEAR_F32)
        for (size_t i = 0; i < n_w; i++) {
            const float f = frand();
            memcpy(data + 4 * i, &f, 4);
        }
    for (size_t i = 0; i < n_w / 16; i++)
        scale[i] = (uint8_t) ((3 + rand() % 8) << 3 | rand() % 8);  // 2^-4 .. 2^4, no NaN
    for (int i = 0; i < n * cols; i++)
        x[i] = frand();
    const CkptLinear w = {format, rows,  cols, data, format == CKPT_LINEAR_NVFP4 ? scale : NULL,
                          NULL,   0.01f, "w"};
    be->matmul(be, y, &w, x, n);
    for (int t = 0; t < n; t++)
        for (int r = 0; r < rows; r++) {
            double sum = 0.0, sum_abs = 0.0;
            for (int c = 0; c < cols; c++) {
                const double term = weight_at(&w, r, c) * x[(size_t) t * cols + c];
                sum += term;
                sum_abs += fabs(term);
            }
            CHECK_NEAR(y[(size_t) t * rows + r], sum, (cols + 8) * FLT_EPSILON * sum_abs);
        }
    // matmul_add: the same sums added to y, bit for bit y + matmul's result.
    float *acc = malloc((size_t) n * rows * sizeof *acc);
    ASSERT(acc);
    for (int i = 0; i < n * rows; i++)
        acc[i] = frand();
    float *want = malloc((size_t) n * rows * sizeof *want);
    ASSERT(want);
    for (int i = 0; i < n * rows; i++)
        want[i] = acc[i] + y[i];
    be->matmul_add(be, acc, &w, x, n);
    CHECK(memcmp(acc, want, (size_t) n * rows * sizeof *acc) == 0);
    // matmul_group: each product bit for bit its own matmul's, a SwiGLU pair silu_mul's of
    // the two products.
    const size_t ny = (size_t) n * rows;
    float *g1 = malloc(ny * sizeof *g1), *g2 = malloc(ny * sizeof *g2), *g3 = malloc(ny * sizeof *g3);
    float *sw = malloc(ny * sizeof *sw);
    ASSERT(g1 && g2 && g3 && sw);
    const BackendProduct pr[3] = {{g1, &w, NULL}, {g2, &w, NULL}, {g3, &w, &w}};
    be->matmul_group(be, pr, 3, x, n);
    be->silu_mul(be, sw, y, y, (int) ny);
    CHECK(memcmp(g1, y, ny * sizeof *y) == 0);
    CHECK(memcmp(g2, y, ny * sizeof *y) == 0);
    CHECK(memcmp(g3, sw, ny * sizeof *y) == 0);
    // norm_matmul_group: h bit for bit the rmsnorm op's, each product matmul_group's of h.
    {
        const size_t nx = (size_t) n * cols;
        float *nw = malloc((size_t) cols * sizeof *nw), *h = malloc(nx * sizeof *h);
        float *hr = malloc(nx * sizeof *hr), *raw = malloc(nx * sizeof *raw);
        ASSERT(nw && h && hr && raw);
        for (int i = 0; i < cols; i++) nw[i] = 0.5f + frand();
        for (size_t i = 0; i < nx; i++) raw[i] = 4.0f * frand();
        be->rmsnorm(be, hr, raw, nw, n, cols, cols, 1e-5f);
        be->matmul(be, y, &w, hr, n);
        be->silu_mul(be, sw, y, y, (int) ny);
        be->norm_matmul_group(be, pr, 3, h, raw, nw, 1e-5f, n);
        CHECK(memcmp(h, hr, nx * sizeof *h) == 0);
        CHECK(memcmp(g1, y, ny * sizeof *y) == 0);
        CHECK(memcmp(g2, y, ny * sizeof *y) == 0);
        CHECK(memcmp(g3, sw, ny * sizeof *y) == 0);
        free(nw), free(h), free(hr), free(raw);
    }
    free(g1);
    free(g2);
    free(g3);
    free(sw);
    free(acc);
    free(want);
    free(data);
    free(scale);
    free(x);
    free(y);
}

// kv_write with a transform (kv_format.h KvIn) stores exactly what the rmsnorm or layernorm
// op and the rope op on a copy, then a plain kv_write, store; src is left as it was. Two
// sequences in one call, the latent and an index key, on kv_dtype's cache.
static void test_kv_in(Backend *be)
{
    enum { TA = 7, TB = 12, T = TA + TB };
    const int L = 40, R = 8, Di = 16;
    KvCacheParams p = {.n_layers = 1,
                       .block_size = 8,
                       .n_blocks = 4,
                       .kv_lora = L,
                       .rope_dim = R,
                       .index_dim = Di,
                       .dtype = kv_dtype};
    p.has_index[0] = true;
    KvCache ka, kb;
    ASSERT(kv_init(&ka, &p) == ERR_OK && kv_init(&kb, &p) == ERR_OK);
    KvSeq sa[2] = {{0}, {0}}, sb[2] = {{0}, {0}};
    for (int i = 0; i < 2; i++)
        ASSERT(kv_seq_reserve(&ka, &sa[i], i ? TB : TA) == ERR_OK
               && kv_seq_reserve(&kb, &sb[i], i ? TB : TA) == ERR_OK);
    int pos[T], seq_of[T], len[T];
    for (int t = 0; t < T; t++) {
        pos[t] = t < TA ? t : t - TA;
        seq_of[t] = t >= TA;
        len[t] = pos[t] + 1;
    }
    KvSeq *qa[2] = {&sa[0], &sa[1]}, *qb[2] = {&sb[0], &sb[1]};
    const BackendSeqs s_a = {qa, 2, pos, seq_of, len, T}, s_b = {qb, 2, pos, seq_of, len, T};
    float lat[T * (40 + 8)], key[T * 16], lat0[T * (40 + 8)], key0[T * 16];
    float nw[40], kw[16], kbias[16];
    for (int i = 0; i < T * (L + R); i++) lat[i] = 3.0f * frand();
    for (int i = 0; i < T * Di; i++) key[i] = 2.0f * frand();
    for (int i = 0; i < L; i++) nw[i] = frand();
    for (int i = 0; i < Di; i++) kw[i] = frand(), kbias[i] = 0.5f * frand();
    memcpy(lat0, lat, sizeof lat);
    memcpy(key0, key, sizeof key);
    const KvIn li = {nw, NULL, L, 1e-6f, L, R, 10000.0f}, ki = {kw, kbias, Di, 1e-6f, 0, R, 10000.0f};
    be->kv_write(be, &ka, &s_a, 0, 0, lat, L + R, &li);
    be->kv_write(be, &ka, &s_a, 0, L + R, key, Di, &ki);
    CHECK(memcmp(lat, lat0, sizeof lat) == 0 && memcmp(key, key0, sizeof key) == 0);
    be->rmsnorm(be, lat0, lat0, nw, T, L, L + R, 1e-6f);
    be->rope(be, lat0, T, 1, L + R, 0, L, R, pos, 10000.0f);
    be->layernorm(be, key0, key0, kw, kbias, T, Di, 1e-6f);
    be->rope(be, key0, T, 1, Di, 0, 0, R, pos, 10000.0f);
    be->kv_write(be, &kb, &s_b, 0, 0, lat0, L + R, NULL);
    be->kv_write(be, &kb, &s_b, 0, L + R, key0, Di, NULL);
    CHECK(memcmp(ka.pool, kb.pool, ka.block_bytes * (size_t) p.n_blocks) == 0);
    for (int i = 0; i < 2; i++) {
        kv_seq_free(&ka, &sa[i]);
        kv_seq_free(&kb, &sb[i]);
    }
    kv_free(&ka);
    kv_free(&kb);
}

int main(void)
{
    srand(5);
    for (int threads = 1; threads <= 2; threads++) {
        Backend *be = NULL;
        ASSERT(backend_cpu_create(threads, &be) == ERR_OK);
        // A bf16 cache: the reference reads the same rounded values (kv_read), so the
        // tolerances stay those of the fp32 cache.
        kv_dtype = KV_DTYPE_BF16;
        test_kv_in(be);
        test_mla(be, 3, 16, 8, 16, 32, 20, 6);
        test_dsa(be, 4, 16, 6, 30);
        // An fp8 cache (E4M3 with group scales): the same; latent 200 spans a whole and a
        // partial scale group.
        kv_dtype = KV_DTYPE_FP8;
        test_kv_in(be);
        test_mla(be, 3, 16, 8, 16, 32, 20, 6);
        test_mla(be, 2, 8, 4, 8, 200, 12, 5);
        test_dsa(be, 4, 16, 6, 30);
        kv_dtype = KV_DTYPE_F32;
        test_kv_in(be);
        test_mla(be, 2, 4, 2, 3, 8, 9, 3);
        test_mla(be, 3, 16, 8, 16, 32, 20, 6);
        test_dsa(be, 2, 8, 4, 15);
        test_dsa(be, 4, 16, 6, 30);
        // big enough to be split over the pool (backend_cpu.c: PARALLEL_MIN_WORK)
        test_mla(be, 4, 16, 8, 16, 64, 40, 12);
        test_dsa(be, 8, 64, 8, 40);
        // one index head: about half the keys score exactly 0 (ReLU), so most rows tie at
        // the top-k boundary and the rule decides
        test_dsa(be, 1, 16, 12, 40);
        const CkptLinearFormat formats[4] = {CKPT_LINEAR_F32, CKPT_LINEAR_BF16, CKPT_LINEAR_F16,
                                             CKPT_LINEAR_NVFP4};
        for (int f = 0; f < 4; f++) {
            test_matmul(be, formats[f], 1, 16, 1);
            test_matmul(be, formats[f], 37, 48, 3);
            test_matmul(be, formats[f], 130, 256, 2);
            test_matmul(be, formats[f], 301, 512, 2);  // split over the pool
        }
        // The bf16 recipe: the indexer's fp32 scores of kernels/dsa.cu (Di in 16s), on each
        // cache type; Di 8 keeps the double scores.
        be->precision = BACKEND_PRECISION_BF16;
        const KvDtype dtypes[3] = {KV_DTYPE_F32, KV_DTYPE_BF16, KV_DTYPE_FP8};
        for (int d = 0; d < 3; d++) {
            kv_dtype = dtypes[d];
            test_dsa(be, 4, 16, 6, 30);
            test_dsa(be, 8, 64, 8, 40);
            test_dsa(be, 1, 16, 12, 40);
            test_dsa(be, 2, 8, 4, 15);
        }
        // The tensor-core variant (Backend.dsa_tc): q rounded to bf16 on fp8 and bf16 keys;
        // f32 keys and Di 8 keep the plain recipe.
        be->dsa_tc = true;
        for (int d = 0; d < 3; d++) {
            kv_dtype = dtypes[d];
            test_dsa(be, 4, 16, 6, 30);
            test_dsa(be, 8, 64, 8, 40);
            test_dsa(be, 2, 8, 4, 15);
        }
        be->dsa_tc = false;
        be->destroy(be);
    }
    return check_exit();
}
