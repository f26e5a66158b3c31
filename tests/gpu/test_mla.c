/*
 * test_mla.c - kernels/mla.cu (query split, split-KV absorbed decode attention) against
 * kernels/ref/mla_ref.c, for the fp8 and the bf16 cache, over pages written by the engine's
 * cache write (kernels/kv.h kv_write with the latent's norm and RoPE), itself checked against
 * mla_latent_store_ref's values read through the MLA cache's layout.
 *
 * Pages are handed out in a shuffled order so that a wrong page-table walk cannot pass. The
 * attention reference reads the same cache bytes the kernel read (downloaded after the append),
 * so the quantization is not part of the attention bound; the write test bounds it separately:
 * e4m3 keeps 3 mantissa bits (2^-4 relative error after rounding) down to its subnormal step
 * (2^-9 * scale, half of it after rounding), bf16 keeps 8 (2^-8).
 *
 * Attention bound: score errors are fp32 dot-product errors, delta = (576 + 16) * FLT_EPSILON *
 * max_p sum|q k| * sm_scale; they change each softmax weight by at most a factor exp(2 delta),
 * so the output moves by <= 2.2 delta * sum_p p |v|; the weighted sum adds (len + 16) *
 * FLT_EPSILON * sum_p p |v|, and the final bf16 rounding 2^-8 |out|.
 *
 * mla_decode_tc (tensor cores, 32 or 64 heads a CTA: mla_decode_tc_heads, each width against the
 * reference and 64 byte for byte 32 at every split): the reference gets q rounded to bf16 as the
 * kernel rounds it, so the bound above holds for its scores; its other rounding, each
 * probability times its chunk scale to bf16 (at most 2^-8 relative), moves the output by at
 * most 2^-8 sum_p p |v| more. Products on the tensor cores are exact (bf16 x bf16 fits fp32);
 * their accumulation is taken to be as good as an fp32 sum (the (576 + 16) and (len + 16)
 * FLT_EPSILON terms, with the slack of the 16). Each tensor-core case runs once more with q 4
 * bytes off 16-byte alignment (the kernel's value-a-load path). mla_q_split runs with decode's
 * few tokens (a block a head) and a prefill chunk's 21 (8 heads a block).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kv.h"
#include "kernels/mla.h"
#include "kernels/ref/mla_ref.h"
#include "kernels/rope_format.h"
#include "tests/gpu/gpu_util.h"

#define CEIL_DIV_HOST(a, b) (((a) + (b) - 1) / (b))

static uint64_t rng = 5;

enum { H_MAX = 64 };

// The bf16 output d_out [nq, 512] of an attention kernel against the reference want (and its
// out_abs, score_abs), under the bound in the file comment plus p_round * sum_p p |v|.
static void check_out(const char *name, const uint16_t *d_out, const float *want,
                      const float *out_abs, const float *score_abs, const int32_t *kv_len,
                      int n_heads, size_t nq, double p_round)
{
    uint16_t *ob = xmalloc(nq * MLA_KV_LORA * 2);
    float *got = xmalloc(nq * MLA_KV_LORA * 4), *tol = xmalloc(nq * MLA_KV_LORA * 4);
    gpu_download(ob, d_out, nq * MLA_KV_LORA * 2);
    for (size_t i = 0; i < nq * MLA_KV_LORA; i++) {
        const size_t th = i / MLA_KV_LORA;
        const int len = kv_len[th / n_heads];
        const double delta = (MLA_LK + 16) * FLT_EPSILON * score_abs[th];
        got[i] = kern_bf16_to_f32(ob[i]);
        tol[i] = (float) (out_abs[i] * (2.2 * delta + (len + 16) * FLT_EPSILON + p_round)
                          + ldexp(fabs(want[i]), -8));
    }
    compare(name, got, want, tol, 0, nq * MLA_KV_LORA, 1e-4);
    free(ob), free(got), free(tol);
}

static void test_mla(MlaCacheType type, int n_seq, const int *lens, int n_heads,
                     const int *splits, int n_splits, int use_indices)
{
    const float theta = 8e6f, eps = 1e-5f, sm_scale = 1.0f / 16.0f;
    int max_len = 0, total = 0;
    for (int s = 0; s < n_seq; s++) {
        max_len = lens[s] > max_len ? lens[s] : max_len;
        total += lens[s];
    }
    const int max_blocks = CEIL_DIV_HOST(max_len, MLA_BLOCK);
    const int n_blocks = n_seq * max_blocks;
    int32_t *table = xmalloc((size_t) n_blocks * 4);
    for (int i = 0; i < n_blocks; i++) table[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {  // shuffle the pages
        const int j = (int) (kern_rand_u64(&rng) % (uint64_t) (i + 1));
        const int32_t tmp = table[i];
        table[i] = table[j];
        table[j] = tmp;
    }
    const size_t tb = mla_cache_token_bytes(type);
    const size_t cache_bytes = (size_t) n_blocks * MLA_BLOCK * tb;

    // Write every position of every sequence in one launch, as the engine writes a layer's
    // latent: kernels/kv.h kv_write over pages laid out by kv_format.h at GLM-5's widths (the
    // MLA cache of this type), normalizing c_kv and rotating k_pe on the way (KvIn).
    const int ckv_stride = MLA_LK;
    float *ckv = xmalloc((size_t) total * ckv_stride * 4), *norm_w = xmalloc(MLA_KV_LORA * 4);
    int32_t *pos = xmalloc(total * 4), *seq = xmalloc(total * 4);
    fill_f32(ckv, (size_t) total * ckv_stride, &rng, -2.0f, 2.0f);
    fill_f32(norm_w, MLA_KV_LORA, &rng, 0.5f, 1.5f);
    for (int s = 0, i = 0; s < n_seq; s++)
        for (int p = 0; p < lens[s]; p++, i++) pos[i] = p, seq[i] = s;
    MlaCache cache = {gpu_alloc_poisoned(cache_bytes), type, n_blocks};
    float *d_ckv = gpu_upload(ckv, (size_t) total * ckv_stride * 4), *d_nw = gpu_upload(norm_w, MLA_KV_LORA * 4);
    int32_t *d_pos = gpu_upload(pos, total * 4), *d_seq = gpu_upload(seq, total * 4);
    int32_t *d_table = gpu_upload(table, (size_t) n_blocks * 4);
    const KvPages pages = {cache.data, NULL,
                           kv_entry_layout(type == MLA_CACHE_FP8 ? KV_DTYPE_FP8 : KV_DTYPE_BF16,
                                           MLA_KV_LORA, MLA_ROPE, 0, MLA_BLOCK)};
    CHECK((size_t) pages.lo.bytes == tb);  // the engine's entry is the MLA cache's token
    const KvIn in = {d_nw, NULL, MLA_KV_LORA, eps, MLA_KV_LORA, MLA_ROPE, theta};
    kv_write(&pages, d_table, max_blocks, d_seq, d_pos, 0, d_ckv, MLA_LK, total, &in, 0);
    uint8_t *h_cache = xmalloc(cache_bytes);
    gpu_download(h_cache, cache.data, cache_bytes);

    float *want = xmalloc((size_t) total * MLA_LK * 4), *got = xmalloc((size_t) total * MLA_LK * 4);
    float *tol = xmalloc((size_t) total * MLA_LK * 4);
    mla_latent_store_ref(want, ckv, ckv_stride, norm_w, eps, theta, pos, total);
    for (int i = 0; i < total; i++) {
        const int blk = table[seq[i] * max_blocks + pos[i] / MLA_BLOCK];
        mla_cache_read_ref(got + (size_t) i * MLA_LK, h_cache, type, blk, pos[i] % MLA_BLOCK);
        for (int c = 0; c < MLA_LK; c++) {
            const size_t o = (size_t) i * MLA_LK + c;
            const float a = fabsf(want[o]);
            if (type == MLA_CACHE_FP8 && c < MLA_KV_LORA) {
                float amax = 0.0f;
                for (int j = c / 128 * 128; j < c / 128 * 128 + 128; j++)
                    amax = fmaxf(amax, fabsf(want[(size_t) i * MLA_LK + j]));
                tol[o] = ldexpf(a, -4) + ldexpf(amax / 448.0f, -10) * 1.01f + 600 * FLT_EPSILON * a;
            } else if (c < MLA_KV_LORA) {
                tol[o] = ldexpf(a, -8) + 600 * FLT_EPSILON * a + 16 * FLT_EPSILON * 4.0f;
            } else {
                // k_pe: the rotation's few ulp of |x0| + |x1| (the same fp32 angles on both
                // sides, kernels/rope_format.h), then bf16 rounding.
                const int pair = (c - MLA_KV_LORA) % (MLA_ROPE / 2);
                const float *xp = ckv + (size_t) i * ckv_stride + MLA_KV_LORA + 2 * pair;
                tol[o] = ldexpf(a, -8) + 16 * FLT_EPSILON * (fabsf(xp[0]) + fabsf(xp[1]));
            }
        }
    }
    char name[96];
    snprintf(name, sizeof name, "kv_write latent %s tokens=%d", type == MLA_CACHE_FP8 ? "fp8" : "bf16", total);
    compare(name, got, want, tol, 0, (size_t) total * MLA_LK, type == MLA_CACHE_FP8 ? 1e-2 : 1e-4);

    // One decode query per sequence.
    const int n_tok = n_seq;
    const size_t nq = (size_t) n_tok * n_heads;
    float *q_lat = xmalloc(nq * MLA_KV_LORA * 4), *q_pe = xmalloc(nq * MLA_ROPE * 4);
    fill_f32(q_lat, nq * MLA_KV_LORA, &rng, -0.5f, 0.5f);
    fill_f32(q_pe, nq * MLA_ROPE, &rng, -1.0f, 1.0f);
    int32_t *dec_seq = xmalloc(n_tok * 4), *kv_len = xmalloc(n_tok * 4);
    const int idx_stride = max_len;
    int32_t *indices = xmalloc((size_t) n_tok * idx_stride * 4);
    for (int t = 0; t < n_tok; t++) {
        dec_seq[t] = t;
        kv_len[t] = lens[t];
        if (use_indices) {  // every other position, in scrambled order
            int n = 0;
            for (int p = lens[t] - 1; p >= 0; p -= 2) indices[(size_t) t * idx_stride + n++] = p;
            kv_len[t] = n;
        }
    }
    float *out_want = xmalloc(nq * MLA_KV_LORA * 4), *out_abs = xmalloc(nq * MLA_KV_LORA * 4);
    float *score_abs = xmalloc(nq * 4);
    float *d_ql = gpu_upload(q_lat, nq * MLA_KV_LORA * 4), *d_qp = gpu_upload(q_pe, nq * MLA_ROPE * 4);
    int32_t *d_dseq = gpu_upload(dec_seq, n_tok * 4), *d_len = gpu_upload(kv_len, n_tok * 4);
    int32_t *d_idx = gpu_upload(indices, (size_t) n_tok * idx_stride * 4);
    // mla_decode against the reference; mla_decode_tc (heads in 32s) against the reference
    // with q rounded to bf16 as the kernel rounds it, the probabilities' rounding in the bound.
    float *ql_r = xmalloc(nq * MLA_KV_LORA * 4), *qp_r = xmalloc(nq * MLA_ROPE * 4);
    for (size_t i = 0; i < nq * MLA_KV_LORA; i++) ql_r[i] = kern_round_bf16(q_lat[i]);
    for (size_t i = 0; i < nq * MLA_ROPE; i++) qp_r[i] = kern_round_bf16(q_pe[i]);
    for (int tc = 0; tc < (n_heads % 32 == 0 ? 2 : 1); tc++) {
        mla_decode_ref(out_want, out_abs, score_abs, tc ? ql_r : q_lat, tc ? qp_r : q_pe, h_cache,
                       type, table, max_blocks, dec_seq, kv_len, use_indices ? indices : NULL,
                       idx_stride, n_tok, n_heads, sm_scale);
        // The tensor-core kernel with 32 heads a CTA and, where n_heads allows, 64 (its
        // prefetching form): both against the reference, and 64's output byte for byte 32's.
        const int n_widths = tc ? (n_heads % 64 == 0 && mla_tc_heads_fit(64) ? 2 : 1) : 1;
        uint16_t *out32 = xmalloc(nq * MLA_KV_LORA * 2), *out64 = xmalloc(nq * MLA_KV_LORA * 2);
        for (int si = 0; si < n_splits; si++)
            for (int wi = 0; wi < n_widths; wi++) {
                const int n_split = splits[si], heads = 32 << wi;
                float *ws_o = gpu_alloc_poisoned((size_t) n_tok * n_split * n_heads * MLA_KV_LORA * 4);
                float *ws_ml = gpu_alloc_poisoned((size_t) n_tok * n_split * n_heads * 2 * 4);
                uint16_t *d_out = gpu_alloc_poisoned(nq * MLA_KV_LORA * 2);
                if (tc)
                    mla_decode_tc_heads(d_out, d_ql, d_qp, &cache, d_table, max_blocks, d_dseq,
                                        d_len, use_indices ? d_idx : NULL, idx_stride, n_tok,
                                        n_heads, sm_scale, n_split, ws_o, ws_ml, heads, 0);
                else
                    mla_decode(d_out, d_ql, d_qp, &cache, d_table, max_blocks, d_dseq, d_len,
                               use_indices ? d_idx : NULL, idx_stride, n_tok, n_heads, sm_scale,
                               n_split, ws_o, ws_ml, 0);
                snprintf(name, sizeof name, "mla %s %s H=%d len0=%d split=%d%s",
                         tc ? (heads == 64 ? "tc64" : "tc") : "decode",
                         type == MLA_CACHE_FP8 ? "fp8" : "bf16", n_heads, lens[0], n_split,
                         use_indices ? " indexed" : "");
                check_out(name, d_out, out_want, out_abs, score_abs, kv_len, n_heads, nq,
                          tc ? 0x1p-8 : 0.0);
                gpu_download(heads == 64 ? out64 : out32, d_out, nq * MLA_KV_LORA * 2);
                if (heads == 64) {
                    size_t differ = 0;
                    for (size_t i = 0; i < nq * MLA_KV_LORA; i++) differ += out64[i] != out32[i];
                    if (differ) printf("  %s: %zu of %zu outputs differ from 32 heads a CTA\n", name, differ, nq * MLA_KV_LORA);
                    CHECK(differ == 0);
                }
                cudaFree(ws_o), cudaFree(ws_ml), cudaFree(d_out);
            }
        free(out32), free(out64);
        for (int wi = 0; tc && wi < n_widths; wi++) {  // q 4 bytes off 16-byte alignment:
            const size_t bl = nq * MLA_KV_LORA * 4, bp = nq * MLA_ROPE * 4;  // value-a-load q
            char *ql_m = gpu_alloc_poisoned(bl + 16), *qp_m = gpu_alloc_poisoned(bp + 16);
            CUDA_CHECK(cudaMemcpy(ql_m + 4, q_lat, bl, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(qp_m + 4, q_pe, bp, cudaMemcpyHostToDevice));
            const int n_split = splits[0], heads = 32 << wi;
            float *ws_o = gpu_alloc_poisoned((size_t) n_tok * n_split * n_heads * MLA_KV_LORA * 4);
            float *ws_ml = gpu_alloc_poisoned((size_t) n_tok * n_split * n_heads * 2 * 4);
            uint16_t *d_out = gpu_alloc_poisoned(nq * MLA_KV_LORA * 2);
            mla_decode_tc_heads(d_out, (const float *) (ql_m + 4), (const float *) (qp_m + 4),
                                &cache, d_table, max_blocks, d_dseq, d_len,
                                use_indices ? d_idx : NULL, idx_stride, n_tok, n_heads, sm_scale,
                                n_split, ws_o, ws_ml, heads, 0);
            snprintf(name, sizeof name, "mla %s %s H=%d len0=%d split=%d%s, q unaligned",
                     heads == 64 ? "tc64" : "tc", type == MLA_CACHE_FP8 ? "fp8" : "bf16",
                     n_heads, lens[0], n_split, use_indices ? " indexed" : "");
            check_out(name, d_out, out_want, out_abs, score_abs, kv_len, n_heads, nq, 0x1p-8);
            cudaFree(ws_o), cudaFree(ws_ml), cudaFree(d_out), cudaFree(ql_m), cudaFree(qp_m);
        }
    }
    free(ql_r), free(qp_r);
    cudaFree(cache.data), cudaFree(d_ckv), cudaFree(d_nw), cudaFree(d_pos), cudaFree(d_seq);
    cudaFree(d_table), cudaFree(d_ql), cudaFree(d_qp), cudaFree(d_dseq), cudaFree(d_len), cudaFree(d_idx);
    free(table), free(ckv), free(norm_w), free(pos), free(seq), free(h_cache), free(want), free(got);
    free(tol), free(q_lat), free(q_pe), free(dec_seq), free(kv_len), free(indices), free(out_want);
    free(out_abs), free(score_abs);
}

// mla_q_split: q_nope rounded to bf16 (exactly), q_pe copied (exactly) or (rope) rotated at
// each token's position exactly as rope_format.h's host arithmetic rotates it (the CPU
// backend's RoPE); with a model narrower than GLM-5 (qk_nope < 192, qk_rope < 64, heads
// padded), zeros everywhere else.
static void test_q_split(int n_tok, int n_heads, int qk_nope, int qk_rope, int heads_pad, int rope)
{
    const int w = qk_nope + qk_rope;
    const float theta = 10000.0f;
    const size_t n = (size_t) n_tok * n_heads * w, m = (size_t) n_tok * heads_pad * 256;
    float *q = xmalloc(n * 4), *want = xmalloc(m * 4);
    fill_f32(q, n, &rng, -2.0f, 2.0f);
    int32_t *pos = xmalloc((size_t) n_tok * 4);
    for (int t = 0; t < n_tok; t++) pos[t] = 7 + 1000 * t;  // large angles too
    float *d_q = gpu_upload(q, n * 4);
    int32_t *d_pos = gpu_upload(pos, (size_t) n_tok * 4);
    uint16_t *d_nope = gpu_alloc_poisoned((size_t) n_tok * heads_pad * 192 * 2);
    float *d_pe = gpu_alloc_poisoned((size_t) n_tok * heads_pad * 64 * 4);
    mla_q_split(d_nope, d_pe, d_q, rope ? d_pos : NULL, theta, n_tok, n_heads, qk_nope, qk_rope,
                heads_pad, 0);
    float *q0 = xmalloc(n * 4);  // the unrotated values, for the rotation's bound
    memcpy(q0, q, n * 4);
    if (rope) {  // the reference: q's rope parts rotated on the host
        RopeFreqs f;
        rope_freqs(&f, qk_rope, theta);
        for (int t = 0; t < n_tok; t++)
            for (int h = 0; h < n_heads; h++) {
                float *pe = q + ((size_t) t * n_heads + h) * w + qk_nope, rot[64];
                for (int i = 0; i < qk_rope / 2; i++) {
                    float cs, sn;
                    rope_cos_sin(pos[t], f.inv[i], &cs, &sn);
                    rope_rotate(pe[2 * i], pe[2 * i + 1], cs, sn, &rot[i], &rot[qk_rope / 2 + i]);
                }
                memcpy(pe, rot, (size_t) qk_rope * 4);
            }
    }
    uint16_t *nope = xmalloc((size_t) n_tok * heads_pad * 192 * 2);
    float *pe = xmalloc((size_t) n_tok * heads_pad * 64 * 4);
    gpu_download(nope, d_nope, (size_t) n_tok * heads_pad * 192 * 2);
    gpu_download(pe, d_pe, (size_t) n_tok * heads_pad * 64 * 4);
    float *got = xmalloc(m * 4), *tol = xmalloc(m * 4);
    for (int t = 0; t < n_tok; t++)
        for (int h = 0; h < heads_pad; h++) {
            const size_t th = (size_t) t * heads_pad + h;
            const float *qh = h < n_heads ? q + ((size_t) t * n_heads + h) * w : NULL;
            for (int c = 0; c < 256; c++) {
                const size_t o = th * 256 + c;
                got[o] = c < 192 ? kern_bf16_to_f32(nope[th * 192 + c]) : pe[th * 64 + c - 192];
                want[o] = !qh                       ? 0.0f
                          : c < qk_nope             ? kern_round_bf16(qh[c])
                          : c < 192                 ? 0.0f
                          : c - 192 < qk_rope       ? qh[qk_nope + c - 192]
                                                    : 0.0f;
                tol[o] = 0.0f;
                if (rope && qh && c >= 192 && c - 192 < qk_rope) {
                    // The device's double cos and sin may differ from the host's in the last
                    // bit: a few fp32 ulps of the pair's magnitude.
                    const int i = (c - 192) % (qk_rope / 2);
                    const float *p0 = q0 + ((size_t) t * n_heads + h) * w + qk_nope + 2 * i;
                    tol[o] = 4 * FLT_EPSILON * (fabsf(p0[0]) + fabsf(p0[1]));
                }
            }
        }
    compare(rope ? "mla q_split + rope" : "mla q_split", got, want, tol, 0, m, 1e-12);
    cudaFree(d_q), cudaFree(d_pos), cudaFree(d_nope), cudaFree(d_pe);
    free(q), free(q0), free(pos), free(want), free(nope), free(pe), free(got), free(tol);
}

int main(void)
{
    const int one[] = {1}, few[] = {1, 3, 16}, glm[] = {1, 4, 13, 64};
    const int lens_a[] = {1, 17, 129};
    const int lens_b[] = {1000, 4100};
    const int lens_c[] = {300};
    for (int rope = 0; rope < 2; rope++) {
        test_q_split(3, 64, 192, 64, 64, rope);
        test_q_split(5, 3, 33, 4, 32, rope);  // a sweep model's widths, zero-padded
        test_q_split(2, 16, 24, 8, 16, rope);
        test_q_split(21, 64, 192, 64, 64, rope);  // a prefill chunk's: 8 heads a block
    }
    test_mla(MLA_CACHE_FP8, 3, lens_a, 16, few, 3, 0);
    test_mla(MLA_CACHE_FP8, 3, lens_a, 32, few, 3, 1);   // the tensor-core kernel, fp8, short
    test_mla(MLA_CACHE_BF16, 3, lens_a, 32, few, 3, 0);
    test_mla(MLA_CACHE_FP8, 2, lens_b, 64, glm, 4, 0);   // GLM: 64 heads, 1K and 4K context
    test_mla(MLA_CACHE_FP8, 2, lens_b, 64, few, 2, 1);   // DSA-selected positions
    test_mla(MLA_CACHE_BF16, 1, lens_c, 64, one, 1, 1);
    // Prefill's form (64 heads a CTA, each walking many tiles with the next one's loads in
    // flight): a long range per CTA, ends off the 32-position tile, empty splits (len 1 at 13).
    const int lens_d[] = {2081, 1, 700, 33};
    test_mla(MLA_CACHE_FP8, 4, lens_d, 64, glm, 3, 1);
    test_mla(MLA_CACHE_BF16, 4, lens_d, 64, few, 2, 0);
    return check_exit();
}
