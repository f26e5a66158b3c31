/*
 * test_dsa.c - kernels/dsa.cu (scores, top-k) against kernels/ref/dsa_ref.c, over key pages
 * written by the engine's cache write (kernels/kv.h kv_write).
 *
 * Write: LayerNorm + RoPE + fp8 with a per-key scale (kv_write's KvIn) against
 * dsa_key_store_ref; bound as in test_mla.c (e4m3 rounding 2^-4 relative, subnormal
 * half-step 2^-10 * scale, plus fp32 statistics).
 * Scores: the reference decodes the same cache bytes; fp32 dot products of 128 terms, a
 * 32-term weighted sum: (128 + 32 + 16) * FLT_EPSILON * sum|terms|.
 * Other layouts (test_layouts: fp8, bf16 and fp32 keys of 32 or 128 values in pages of 16 or
 * 128 positions, as the engine's KV cache holds them): the same bound against the reference,
 * and bit for bit against a C loop over dsa_format.h's dsa_key_score (what the CPU backend
 * runs under the bf16 recipe).
 * Tensor-core scores (dsa_scores_tc, test_tc): q rounded to bf16 in the reference, the same
 * bound (the MMA's fp32 accumulation order is its own), over prefill chunks, decode batches and
 * chunks whose CTAs mix sequences; entries past each token's length untouched.
 * Top-k: exact. The reference sorts the GPU's own fp32 scores, so selections must be identical,
 * including ties (a synthetic score row with many equal values checks the tie rule; a 128K row
 * of nearly equal scores and one of 200 distinct values check the long-context path).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/dsa.h"
#include "kernels/kv.h"
#include "kernels/ref/dsa_ref.h"
#include "tests/gpu/gpu_util.h"

static uint64_t rng = 9;

static void check_topk(const char *what, const float *scores, int stride, const int32_t *kv_len,
                       int n_tok, int k)
{
    float *d_scores = gpu_upload(scores, (size_t) n_tok * stride * 4);
    int32_t *d_len = gpu_upload(kv_len, n_tok * 4);
    int32_t *d_idx = gpu_alloc_poisoned((size_t) n_tok * k * 4), *d_n = gpu_alloc_poisoned(n_tok * 4);
    dsa_topk(d_idx, d_n, d_scores, stride, d_len, n_tok, k, 0);
    int32_t *idx = xmalloc((size_t) n_tok * k * 4), *n = xmalloc(n_tok * 4);
    int32_t *idx_ref = xmalloc((size_t) n_tok * k * 4), *n_ref = xmalloc(n_tok * 4);
    gpu_download(idx, d_idx, (size_t) n_tok * k * 4);
    gpu_download(n, d_n, n_tok * 4);
    dsa_topk_ref(idx_ref, n_ref, scores, stride, kv_len, n_tok, k);
    int bad = 0;
    for (int t = 0; t < n_tok; t++) {
        if (n[t] != n_ref[t] || memcmp(idx + (size_t) t * k, idx_ref + (size_t) t * k, (size_t) n_ref[t] * 4)) {
            if (bad < 3) fprintf(stderr, "%s: token %d selection differs (n %d vs %d)\n", what, t, n[t], n_ref[t]);
            bad++;
        }
    }
    printf("%-40s tokens=%d k=%d: %d differ\n", what, n_tok, k, bad);
    CHECK(bad == 0);
    cudaFree(d_scores), cudaFree(d_len), cudaFree(d_idx), cudaFree(d_n);
    free(idx), free(n), free(idx_ref), free(n_ref);
}

static void test_indexer(int n_seq, const int *lens, int n_heads, int k)
{
    const float theta = 8e6f, eps = 1e-6f;
    int max_len = 0, total = 0;
    for (int s = 0; s < n_seq; s++) {
        max_len = lens[s] > max_len ? lens[s] : max_len;
        total += lens[s];
    }
    const int max_blocks = (max_len + DSA_BLOCK - 1) / DSA_BLOCK, n_blocks = n_seq * max_blocks;
    int32_t *table = xmalloc((size_t) n_blocks * 4);
    for (int i = 0; i < n_blocks; i++) table[i] = n_blocks - 1 - i;  // pages in reverse order
    float *kin = xmalloc((size_t) total * DSA_DIM * 4), *ln_w = xmalloc(DSA_DIM * 4), *ln_b = xmalloc(DSA_DIM * 4);
    int32_t *pos = xmalloc(total * 4), *seq = xmalloc(total * 4);
    fill_f32(kin, (size_t) total * DSA_DIM, &rng, -3.0f, 3.0f);
    fill_f32(ln_w, DSA_DIM, &rng, 0.5f, 1.5f);
    fill_f32(ln_b, DSA_DIM, &rng, -0.2f, 0.2f);
    for (int s = 0, i = 0; s < n_seq; s++)
        for (int p = 0; p < lens[s]; p++, i++) pos[i] = p, seq[i] = s;
    const size_t cache_bytes = (size_t) n_blocks * DSA_BLOCK_BYTES;
    uint8_t *d_cache = gpu_alloc_poisoned(cache_bytes);
    float *d_k = gpu_upload(kin, (size_t) total * DSA_DIM * 4);
    float *d_lw = gpu_upload(ln_w, DSA_DIM * 4), *d_lb = gpu_upload(ln_b, DSA_DIM * 4);
    int32_t *d_pos = gpu_upload(pos, total * 4), *d_seq = gpu_upload(seq, total * 4);
    int32_t *d_table = gpu_upload(table, (size_t) n_blocks * 4);
    // The engine's cache write of index keys (kernels/kv.h kv_write: LayerNorm and RoPE on
    // the way, KvIn) into key pages laid out by kv_format.h at GLM-5's widths: dsa.h's fp8
    // pages. The layout has no latent (kv_lora 0): the MLA pages are never written.
    const KvEntryLayout lo = kv_entry_layout(KV_DTYPE_FP8, 0, 0, DSA_DIM, DSA_BLOCK);
    CHECK(lo.key_page == DSA_BLOCK_BYTES && lo.key_bytes == DSA_DIM
          && lo.key_scales == DSA_BLOCK * DSA_DIM);
    uint8_t *d_mla = gpu_alloc_poisoned((size_t) n_blocks * DSA_BLOCK * lo.bytes);
    const KvPages pages = {d_mla, d_cache, lo};
    const KvIn in = {d_lw, d_lb, DSA_DIM, eps, 0, DSA_ROPE, theta};
    kv_write(&pages, d_table, max_blocks, d_seq, d_pos, 0, d_k, DSA_DIM, total, &in, 0);
    uint8_t *h_cache = xmalloc(cache_bytes);
    gpu_download(h_cache, d_cache, cache_bytes);

    float *want = xmalloc((size_t) total * DSA_DIM * 4), *got = xmalloc((size_t) total * DSA_DIM * 4);
    float *tol = xmalloc((size_t) total * DSA_DIM * 4);
    dsa_key_store_ref(want, kin, ln_w, ln_b, eps, theta, pos, total);
    for (int i = 0; i < total; i++) {
        const int blk = table[seq[i] * max_blocks + pos[i] / DSA_BLOCK];
        dsa_key_read_ref(got + (size_t) i * DSA_DIM, h_cache, blk, pos[i] % DSA_BLOCK);
        float amax = 0.0f;
        for (int d = 0; d < DSA_DIM; d++) amax = fmaxf(amax, fabsf(want[(size_t) i * DSA_DIM + d]));
        for (int d = 0; d < DSA_DIM; d++) {
            const float a = fabsf(want[(size_t) i * DSA_DIM + d]);
            tol[(size_t) i * DSA_DIM + d] = ldexpf(a, -4) + ldexpf(amax / 448.0f, -10) * 1.01f
                                            + 300 * FLT_EPSILON * (a + 2.0f);
        }
    }
    compare("kv_write index keys", got, want, tol, 0, (size_t) total * DSA_DIM, 1e-2);

    // One query per sequence.
    const int n_tok = n_seq;
    float *q = xmalloc((size_t) n_tok * n_heads * DSA_DIM * 4), *w = xmalloc((size_t) n_tok * n_heads * 4);
    fill_f32(q, (size_t) n_tok * n_heads * DSA_DIM, &rng, -1.0f, 1.0f);
    fill_f32(w, (size_t) n_tok * n_heads, &rng, -1.0f, 1.0f);
    int32_t *dseq = xmalloc(n_tok * 4), *kv_len = xmalloc(n_tok * 4);
    for (int t = 0; t < n_tok; t++) dseq[t] = t, kv_len[t] = lens[t];
    const int stride = max_len + 5;
    const float w_scale = 1.0f / sqrtf((float) n_heads), sm_scale = 1.0f / sqrtf(128.0f);
    float *s_want = xmalloc((size_t) n_tok * stride * 4), *s_abs = xmalloc((size_t) n_tok * stride * 4);
    float *s_got = xmalloc((size_t) n_tok * stride * 4);
    memset(s_want, 0, (size_t) n_tok * stride * 4);
    memset(s_abs, 0, (size_t) n_tok * stride * 4);
    const DsaCache hc = dsa_cache_fp8(h_cache), dc = dsa_cache_fp8(d_cache);
    dsa_scores_ref(s_want, s_abs, stride, q, w, w_scale, sm_scale, &hc, table, max_blocks,
                   dseq, kv_len, n_tok, n_heads);
    float *d_q = gpu_upload(q, (size_t) n_tok * n_heads * DSA_DIM * 4);
    float *d_w = gpu_upload(w, (size_t) n_tok * n_heads * 4);
    int32_t *d_dseq = gpu_upload(dseq, n_tok * 4), *d_len = gpu_upload(kv_len, n_tok * 4);
    float *d_s = gpu_alloc_poisoned((size_t) n_tok * stride * 4);
    dsa_scores(d_s, stride, d_q, d_w, w_scale, sm_scale, &dc, d_table, max_blocks, d_dseq, d_len,
               max_len, n_tok, n_heads, 0);
    gpu_download(s_got, d_s, (size_t) n_tok * stride * 4);
    // Compare only the written entries (p < kv_len); pack them.
    size_t n_cmp = 0;
    float *g2 = xmalloc((size_t) total * 4), *w2 = xmalloc((size_t) total * 4), *t2 = xmalloc((size_t) total * 4);
    for (int t = 0; t < n_tok; t++)
        for (int p = 0; p < kv_len[t]; p++, n_cmp++) {
            const size_t o = (size_t) t * stride + p;
            g2[n_cmp] = s_got[o];
            w2[n_cmp] = s_want[o];
            t2[n_cmp] = (128 + 32 + 16) * FLT_EPSILON * s_abs[o];
        }
    char name[96];
    snprintf(name, sizeof name, "dsa scores heads=%d len0=%d", n_heads, lens[0]);
    compare(name, g2, w2, t2, 0, n_cmp, 1e-10);
    // Unwritten tail entries of the GPU buffer are NaN poison: give top-k finite ones to ignore.
    snprintf(name, sizeof name, "dsa topk len0=%d", lens[0]);
    check_topk(name, s_got, stride, kv_len, n_tok, k);

    cudaFree(d_cache), cudaFree(d_mla), cudaFree(d_k), cudaFree(d_lw), cudaFree(d_lb), cudaFree(d_pos);
    cudaFree(d_seq);
    cudaFree(d_table), cudaFree(d_q), cudaFree(d_w), cudaFree(d_dseq), cudaFree(d_len), cudaFree(d_s);
    free(table), free(kin), free(ln_w), free(ln_b), free(pos), free(seq), free(h_cache), free(want);
    free(got), free(tol), free(q), free(w), free(dseq), free(kv_len), free(s_want), free(s_abs);
    free(s_got), free(g2), free(w2), free(t2);
}

// Random key pages of one layout (n_pages pages, rows key_bytes apart, fp8 scales after the
// rows), one query token per sequence over kv_len keys; scores vs the reference (bound as
// above) and vs dsa_key_score (equal), then top-k vs the reference on the GPU's scores.
// Random key pages of layout c (its pages field unused): values in [-2, 2) (fp8 codes of 100x
// that, with scales in [0.001, 0.03)), then codes 0x7f and 0xff (+-480 on both sides, not NaN)
// in rows 1 and 2 of an fp8 cache's first page.
static void fill_pages(uint8_t *h, const DsaCache *cp, int n_pages)
{
    const DsaCache c = *cp;
    const DsaKeyFormat format = (DsaKeyFormat) c.format;
    const int dim = c.dim, block = c.block;
    const size_t bytes = (size_t) n_pages * c.page_bytes;
    memset(h, 0, bytes);
    for (int pg = 0; pg < n_pages; pg++) {
        uint8_t *page = h + (size_t) pg * c.page_bytes;
        for (int r = 0; r < block; r++) {
            uint8_t *row = page + (size_t) r * c.key_bytes;
            for (int i = 0; i < dim; i++) {
                const float v = kern_rand_uniform(&rng, -2.0f, 2.0f);
                if (format == DSA_KEY_FP8) {
                    row[i] = nvfp4_float_to_e4m3(v * 100.0f);
                } else if (format == DSA_KEY_BF16) {
                    const uint16_t b = kern_f32_to_bf16(v);
                    row[2 * i] = (uint8_t) (b & 0xff);
                    row[2 * i + 1] = (uint8_t) (b >> 8);
                } else {
                    memcpy(row + 4 * i, &v, 4);
                }
            }
            if (format == DSA_KEY_FP8) {
                const float sc = kern_rand_uniform(&rng, 0.001f, 0.03f);
                memcpy(page + c.scales + 4 * r, &sc, 4);
            }
        }
    }
    if (format == DSA_KEY_FP8) {
        h[(size_t) 1 * c.key_bytes + 3] = 0x7f;
        h[(size_t) 2 * c.key_bytes + 5] = 0xff;
    }
}

// A DsaCache layout of fp8, bf16 or fp32 keys of dim values in pages of block rows (pages unset).
static DsaCache layout(DsaKeyFormat format, int dim, int block)
{
    const int value_bytes = format == DSA_KEY_FP8 ? 1 : format == DSA_KEY_BF16 ? 2 : 4;
    DsaCache c = {NULL, format, dim, block, dim * value_bytes, block * dim * value_bytes, 0};
    c.page_bytes = (size_t) c.scales + (format == DSA_KEY_FP8 ? (size_t) block * 4 : 0);
    c.page_bytes = (c.page_bytes + 15) / 16 * 16;
    return c;
}

static void test_layout(DsaKeyFormat format, int dim, int block, int n_heads, int k)
{
    enum { N_SEQ = 3 };
    const int kv_len[N_SEQ] = {1, 3 * block + 5, 2000};
    const int max_len = 2000, max_blocks = (max_len + block - 1) / block;
    const int n_pages = N_SEQ * max_blocks;
    const DsaCache c = layout(format, dim, block);
    const size_t bytes = (size_t) n_pages * c.page_bytes;
    uint8_t *h = xmalloc(bytes);
    fill_pages(h, &c, n_pages);
    int32_t *table = xmalloc((size_t) n_pages * 4), seq[N_SEQ];
    for (int i = 0; i < n_pages; i++) table[i] = (int32_t) ((i * 7 + 3) % n_pages);  // a permutation
    for (int t = 0; t < N_SEQ; t++) seq[t] = t;
    const int stride = max_len + 3;
    float *q = xmalloc((size_t) N_SEQ * n_heads * dim * 4), *w = xmalloc((size_t) N_SEQ * n_heads * 4);
    fill_f32(q, (size_t) N_SEQ * n_heads * dim, &rng, -1.0f, 1.0f);
    fill_f32(w, (size_t) N_SEQ * n_heads, &rng, -1.0f, 1.0f);
    const float w_scale = 1.0f / sqrtf((float) n_heads), sm_scale = 1.0f / sqrtf((float) dim);
    float *s_want = xmalloc((size_t) N_SEQ * stride * 4), *s_abs = xmalloc((size_t) N_SEQ * stride * 4);
    float *s_got = xmalloc((size_t) N_SEQ * stride * 4);
    DsaCache hc = c;
    hc.pages = h;
    dsa_scores_ref(s_want, s_abs, stride, q, w, w_scale, sm_scale, &hc, table, max_blocks, seq,
                   kv_len, N_SEQ, n_heads);
    DsaCache dc = c;
    dc.pages = gpu_upload(h, bytes);
    CHECK(dsa_scores_supported(&dc, n_heads));
    float *d_q = gpu_upload(q, (size_t) N_SEQ * n_heads * dim * 4);
    float *d_w = gpu_upload(w, (size_t) N_SEQ * n_heads * 4);
    int32_t *d_table = gpu_upload(table, (size_t) n_pages * 4), *d_seq = gpu_upload(seq, sizeof seq);
    int32_t *d_len = gpu_upload(kv_len, sizeof kv_len);
    float *d_s = gpu_alloc_poisoned((size_t) N_SEQ * stride * 4);
    dsa_scores(d_s, stride, d_q, d_w, w_scale, sm_scale, &dc, d_table, max_blocks, d_seq, d_len,
               max_len, N_SEQ, n_heads, 0);
    gpu_download(s_got, d_s, (size_t) N_SEQ * stride * 4);
    const char *fmt_name[3] = {"fp8", "bf16", "f32"};
    int total = 0, not_equal = 0;
    for (int t = 0; t < N_SEQ; t++) total += kv_len[t];
    float *g2 = xmalloc((size_t) total * 4), *w2 = xmalloc((size_t) total * 4), *t2 = xmalloc((size_t) total * 4);
    float kv[DSA_DIM], ws[DSA_MAX_HEADS];
    for (int t = 0, n = 0; t < N_SEQ; t++) {
        for (int hd = 0; hd < n_heads; hd++) ws[hd] = w[(size_t) t * n_heads + hd] * w_scale;
        for (int p = 0; p < kv_len[t]; p++, n++) {
            const size_t o = (size_t) t * stride + p;
            g2[n] = s_got[o];
            w2[n] = s_want[o];
            t2[n] = (float) (dim + 32 + 16) * FLT_EPSILON * s_abs[o];
            const uint8_t *page = h + (size_t) table[t * max_blocks + p / block] * c.page_bytes;
            for (int i = 0; i < dim; i++) kv[i] = dsa_key_raw(&hc, page, p % block, i);
            const float sc = dsa_key_score(q + (size_t) t * n_heads * dim, ws, n_heads, dim, kv,
                                           dsa_key_scale(&hc, page, p % block), sm_scale);
            not_equal += memcmp(&sc, &s_got[o], 4) != 0;
        }
    }
    char name[96];
    snprintf(name, sizeof name, "dsa scores %s dim=%d block=%d heads=%d", fmt_name[format], dim,
             block, n_heads);
    compare(name, g2, w2, t2, 0, (size_t) total, 1e-10);
    printf("%-40s %d of %d scores differ from dsa_key_score's bits\n", name, not_equal, total);
    CHECK(not_equal == 0);
    snprintf(name, sizeof name, "dsa topk %s dim=%d block=%d", fmt_name[format], dim, block);
    check_topk(name, s_got, stride, kv_len, N_SEQ, k);
    cudaFree((void *) dc.pages), cudaFree(d_q), cudaFree(d_w), cudaFree(d_table), cudaFree(d_seq);
    cudaFree(d_len), cudaFree(d_s);
    free(h), free(table), free(q), free(w), free(s_want), free(s_abs), free(s_got), free(g2);
    free(w2), free(t2);
}

// dsa_scores_tc over tokens given as runs {sequence, first position, count} (a prefill chunk's
// tokens share a CTA's key tile; a decode batch's and a chunk's edges put several sequences in
// one CTA): scores against the reference on q rounded to bf16, within the fp32 bound above
// (the tensor cores' accumulation order is not the C loop's); entries at p >= kv_len
// untouched; top-k on the GPU's own scores exact.
typedef struct TcRun {
    int seq, first, count;
} TcRun;

// Each count of tiles a CTA in `tiles` (0: the launcher's choice; -1 ends the list) is checked
// against the one reference: a CTA's run of tiles over a chunk (q loaded once) and its rounds of
// sequences in every tile of the run.
static void test_scores_tc(const char *what, DsaKeyFormat format, int dim, int block, int n_heads,
                           int n_seq, const TcRun *runs, int n_runs, int k, const int *tiles)
{
    int n_tok = 0, max_len = 0;
    for (int r = 0; r < n_runs; r++) {
        n_tok += runs[r].count;
        const int end = runs[r].first + runs[r].count;
        max_len = end > max_len ? end : max_len;
    }
    int32_t *seq = xmalloc((size_t) n_tok * 4), *kv_len = xmalloc((size_t) n_tok * 4);
    for (int r = 0, t = 0; r < n_runs; r++)
        for (int i = 0; i < runs[r].count; i++, t++) {
            seq[t] = runs[r].seq;
            kv_len[t] = runs[r].first + i + 1;
        }
    const int max_blocks = (max_len + block - 1) / block, n_pages = n_seq * max_blocks;
    const DsaCache c = layout(format, dim, block);
    const size_t bytes = (size_t) n_pages * c.page_bytes;
    uint8_t *h = xmalloc(bytes);
    fill_pages(h, &c, n_pages);
    int32_t *table = xmalloc((size_t) n_pages * 4);
    for (int i = 0; i < n_pages; i++) table[i] = (int32_t) ((i * 7 + 3) % n_pages);  // a permutation
    const int stride = max_len + 5;
    const size_t nq = (size_t) n_tok * n_heads * dim;
    float *q = xmalloc(nq * 4), *qr = xmalloc(nq * 4), *w = xmalloc((size_t) n_tok * n_heads * 4);
    fill_f32(q, nq, &rng, -1.0f, 1.0f);
    for (size_t i = 0; i < nq; i++) qr[i] = kern_bf16_to_f32(kern_f32_to_bf16(q[i]));
    fill_f32(w, (size_t) n_tok * n_heads, &rng, -1.0f, 1.0f);
    const float w_scale = 1.0f / sqrtf((float) n_heads), sm_scale = 1.0f / sqrtf((float) dim);
    const size_t ns = (size_t) n_tok * stride;
    float *s_want = xmalloc(ns * 4), *s_abs = xmalloc(ns * 4), *s_got = xmalloc(ns * 4);
    DsaCache hc = c;
    hc.pages = h;
    dsa_scores_ref(s_want, s_abs, stride, qr, w, w_scale, sm_scale, &hc, table, max_blocks, seq,
                   kv_len, n_tok, n_heads);
    DsaCache dc = c;
    dc.pages = gpu_upload(h, bytes);
    CHECK(dsa_scores_tc_supported(&dc, n_heads));
    float *d_q = gpu_upload(q, nq * 4), *d_w = gpu_upload(w, (size_t) n_tok * n_heads * 4);
    int32_t *d_table = gpu_upload(table, (size_t) n_pages * 4);
    int32_t *d_seq = gpu_upload(seq, (size_t) n_tok * 4), *d_len = gpu_upload(kv_len, (size_t) n_tok * 4);
    int total = 0;
    for (int t = 0; t < n_tok; t++) total += kv_len[t];
    float *g2 = xmalloc((size_t) total * 4), *w2 = xmalloc((size_t) total * 4), *t2 = xmalloc((size_t) total * 4);
    for (int ti = 0; tiles[ti] >= 0; ti++) {
        float *d_s = gpu_alloc_poisoned(ns * 4);
        dsa_scores_tc(d_s, stride, d_q, d_w, w_scale, sm_scale, &dc, d_table, max_blocks, d_seq, d_len,
                      max_len, n_tok, n_heads, tiles[ti], 0);
        gpu_download(s_got, d_s, ns * 4);
        int untouched = 1;
        for (int t = 0, n = 0; t < n_tok; t++)
            for (int p = 0; p < stride; p++) {
                const size_t o = (size_t) t * stride + p;
                if (p >= kv_len[t]) {
                    uint32_t bits;
                    memcpy(&bits, &s_got[o], 4);
                    untouched &= bits == 0xffffffffu;
                    continue;
                }
                g2[n] = s_got[o];
                w2[n] = s_want[o];
                t2[n++] = (float) (dim + 32 + 16) * FLT_EPSILON * s_abs[o];
            }
        char name[128];
        snprintf(name, sizeof name, "dsa scores tc %s, tiles %d", what, tiles[ti]);
        compare(name, g2, w2, t2, 0, (size_t) total, 1e-10);
        CHECK(untouched);
        snprintf(name, sizeof name, "dsa topk tc %s, tiles %d", what, tiles[ti]);
        check_topk(name, s_got, stride, kv_len, n_tok, k);
        cudaFree(d_s);
    }
    cudaFree((void *) dc.pages), cudaFree(d_q), cudaFree(d_w), cudaFree(d_table), cudaFree(d_seq);
    cudaFree(d_len);
    free(seq), free(kv_len), free(h), free(table), free(q), free(qr), free(w), free(s_want);
    free(s_abs), free(s_got), free(g2), free(w2), free(t2);
}

static void test_tc(void)
{
    // A prefill chunk of 70 tokens at positions 230.. (CTAs of 4 tokens of one sequence,
    // lengths past a 64-position tile and not in 8s); a decode batch of 5 sequences (every CTA
    // mixes them); a chunk's edges (a CTA of sequences 0, 1, 0, 0: a round of tokens that are
    // not adjacent).
    const TcRun prefill[] = {{0, 230, 70}};
    const TcRun decode[] = {{1, 0, 1}, {2, 76, 1}, {0, 299, 1}, {3, 128, 1}, {4, 63, 1}};
    const TcRun edges[] = {{0, 10, 1}, {1, 40, 1}, {0, 100, 2}, {2, 200, 7}};
    // 1 and 3 tiles a CTA (the prefill's 5 tiles as 3 + 2, rounds of sequences in each tile
    // of a run) beside the launcher's choice.
    const int tiles[] = {0, 1, 3, -1};
    const DsaKeyFormat formats[2] = {DSA_KEY_FP8, DSA_KEY_BF16};
    for (int f = 0; f < 2; f++) {
        const char *fn = formats[f] == DSA_KEY_FP8 ? "fp8" : "bf16";
        char what[64];
        snprintf(what, sizeof what, "%s prefill 128x32", fn);
        test_scores_tc(what, formats[f], 128, 128, 32, 1, prefill, 1, 64, tiles);
        snprintf(what, sizeof what, "%s decode 128x32", fn);
        test_scores_tc(what, formats[f], 128, 128, 32, 5, decode, 5, 64, tiles);
        snprintf(what, sizeof what, "%s edges 128x32 block 16", fn);
        test_scores_tc(what, formats[f], 128, 16, 32, 3, edges, 4, 32, tiles);
        snprintf(what, sizeof what, "%s edges 32x5", fn);  // heads past 5 and dims past 32 idle
        test_scores_tc(what, formats[f], 32, 16, 5, 3, edges, 4, 8, tiles);
        snprintf(what, sizeof what, "%s prefill 64x4", fn);
        test_scores_tc(what, formats[f], 64, 128, 4, 1, prefill, 1, 16, tiles);
    }
    // GLM-5's indexer at a longer context: 128 tokens ending at 20,000 (the C reference's
    // ~10 G multiply-adds bound the size), with the launcher's choice of tiles (on 132 SMs 9:
    // 313 tiles in runs of 9, the last of 7), one, and 16 (the most it chooses, prefill's).
    const TcRun chunk[] = {{0, 20000 - 128, 128}};
    const int long_tiles[] = {0, 1, 16, -1};
    test_scores_tc("fp8 128 tokens at 20K", DSA_KEY_FP8, 128, 128, 32, 1, chunk, 1, 2048, long_tiles);
}

static void test_ties(void)
{
    // Scores drawn from 7 values: thousands of ties at the threshold.
    const int n_tok = 3, stride = 10000, k = 2048;
    const int32_t kv_len[3] = {10000, 2049, 5000};
    float *s = xmalloc((size_t) n_tok * stride * 4);
    for (size_t i = 0; i < (size_t) n_tok * stride; i++)
        s[i] = (float) ((int) (kern_rand_u64(&rng) % 7) - 3) * 0.5f;
    s[stride + 5] = -0.0f;  // must tie with +0, as C compares them
    check_topk("dsa topk ties", s, stride, kv_len, n_tok, k);
    free(s);
}

static void test_long(void)
{
    // 128K positions (the bench's long context): continuous scores with a narrow spread (most
    // keys share their top digits) and a row with ties at the threshold.
    const int n_tok = 2, stride = 131072, k = 2048;
    const int32_t kv_len[2] = {131072, 100003};
    float *s = xmalloc((size_t) n_tok * stride * 4);
    for (size_t i = 0; i < (size_t) stride; i++) s[i] = 1.0f + kern_rand_uniform(&rng, 0.0f, 1e-3f);
    for (size_t i = stride; i < (size_t) 2 * stride; i++)
        s[i] = (float) (int) (kern_rand_u64(&rng) % 200) * 0.25f;
    check_topk("dsa topk 128K", s, stride, kv_len, n_tok, k);
    free(s);
}

int main(void)
{
    const int lens_a[] = {1, 100, 129};
    const int lens_b[] = {5000, 40000};
    test_indexer(3, lens_a, 32, 2048);
    test_indexer(3, lens_a, 5, 64);
    test_indexer(2, lens_b, 32, 2048);  // GLM: 32 heads x 128, top-2048
    for (int f = DSA_KEY_FP8; f <= DSA_KEY_F32; f++) {
        test_layout((DsaKeyFormat) f, 128, 128, 32, 256);  // GLM's widths in the engine's pages
        test_layout((DsaKeyFormat) f, 32, 16, 4, 8);       // a small model's
    }
    test_tc();
    test_ties();
    test_long();
    return check_exit();
}
