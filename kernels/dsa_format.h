/*
 * dsa_format.h - where the DSA indexer's keys are stored (DsaCache) and the score of one key
 * in the order kernels/dsa.cu computes it, in plain C for the host and the device.
 *
 * Key pages: the key of position p of a sequence lives in page b = block_table[seq, p /
 * block] at pages + b * page_bytes, row p % block, key_bytes apart; a row holds dim values as
 * E4M3 codes (their fp32 scale, one per key, in the page's scale array at offset scales), bf16
 * or fp32 (no scale: 1). The engine's KV cache (engine/model/kv_cache.h kv_dsa_cache) is any
 * of the three at its own widths; at GLM-5's (fp8, dim 128, block 128) it is kernels/dsa.h's
 * dsa_cache_fp8.
 *
 * Score of key k (dim raw values kv[i]: the code's value, not yet scaled) for one query token
 * with n_heads rows q[h, 0..dim) and head weights ws[h] (already multiplied by w_scale):
 *   acc_h = fmaf chain over i = 0 .. dim-1 of q[h, i] * kv[i], from 0
 *   score = fmaf chain over h = 0 .. n_heads-1 of ws[h] * fmaxf((acc_h * scale) * sm_scale, 0)
 * all in fp32 (dsa_key_score). The CUDA kernel keeps this order exactly (its heads past
 * n_heads add fmaf(0, 0, score), which changes nothing: score starts at +0), so the CPU
 * backend, following the bf16 recipe (engine/model/backend.h), computes the same bits.
 *
 * Ownership: none. Threads: pure. Errors: none (callers check shapes).
 */
#ifndef KERNELS_DSA_FORMAT_H
#define KERNELS_DSA_FORMAT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/nvfp4_format.h"

#ifdef __CUDACC__
#define DSA_FN static inline __host__ __device__
#else
#define DSA_FN static inline
#endif

enum { DSA_MAX_DIM = 128, DSA_MAX_HEADS = 32 };  // what kernels/dsa.cu's dsa_scores takes

typedef enum DsaKeyFormat { DSA_KEY_FP8 = 0, DSA_KEY_BF16 = 1, DSA_KEY_F32 = 2 } DsaKeyFormat;

typedef struct DsaCache {
    const uint8_t *pages;  // page 0 (device memory for the kernels)
    int format;            // DsaKeyFormat
    int dim;               // values per key
    int block;             // positions per page
    int key_bytes;         // bytes from one row to the next (a multiple of 16 for the kernels)
    int scales;            // DSA_KEY_FP8: offset of the page's fp32 scale array
    size_t page_bytes;     // bytes from one page to the next
} DsaCache;

// Whether kernels/dsa.cu's dsa_scores takes this cache with n_heads heads: dim a multiple of
// 16 up to DSA_MAX_DIM, n_heads up to DSA_MAX_HEADS, rows, pages and the first page 16-byte
// aligned (fp8 scales 4-byte aligned).
DSA_FN int dsa_scores_supported(const DsaCache *c, int n_heads)
{
    const int value_bytes = c->format == DSA_KEY_FP8 ? 1 : c->format == DSA_KEY_BF16 ? 2 : 4;
    return n_heads > 0 && n_heads <= DSA_MAX_HEADS && c->dim > 0 && c->dim % 16 == 0
           && c->dim <= DSA_MAX_DIM && c->block > 0 && c->key_bytes % 16 == 0
           && c->key_bytes >= c->dim * value_bytes && c->page_bytes % 16 == 0
           && (uintptr_t) c->pages % 16 == 0 && (c->format != DSA_KEY_FP8 || c->scales % 4 == 0);
}

// Whether kernels/dsa.cu's dsa_scores_tc takes it: dsa_scores' shapes with fp8 or bf16 keys
// (values the tensor cores take exactly).
DSA_FN int dsa_scores_tc_supported(const DsaCache *c, int n_heads)
{
    return dsa_scores_supported(c, n_heads) && c->format != DSA_KEY_F32;
}

// Raw value i of row `row` of the page at page, and (through *scale) the key's scale.
DSA_FN float dsa_key_raw(const DsaCache *c, const uint8_t *page, int row, int i)
{
    const uint8_t *k = page + (size_t) row * (size_t) c->key_bytes;
    if (c->format == DSA_KEY_FP8) return nvfp4_e4m3_to_float(k[i]);
    if (c->format == DSA_KEY_BF16) {
        const uint32_t bits = ((uint32_t) k[2 * i] | (uint32_t) k[2 * i + 1] << 8) << 16;
        return nvfp4_bits_to_float(bits);
    }
    float f;
    memcpy(&f, k + (size_t) 4 * i, sizeof f);
    return f;
}

DSA_FN float dsa_key_scale(const DsaCache *c, const uint8_t *page, int row)
{
    if (c->format != DSA_KEY_FP8) return 1.0f;
    float s;
    memcpy(&s, page + c->scales + (size_t) 4 * row, sizeof s);
    return s;
}

// The score of one key (file comment): q [n_heads, dim], ws [n_heads], kv [dim] raw values.
DSA_FN float dsa_key_score(const float *q, const float *ws, int n_heads, int dim, const float *kv,
                           float scale, float sm_scale)
{
    float score = 0.0f;
    for (int h = 0; h < n_heads; h++) {
        const float *qh = q + (size_t) h * (size_t) dim;
        float acc = 0.0f;
        for (int i = 0; i < dim; i++)
            acc = fmaf(qh[i], kv[i], acc);
        score = fmaf(ws[h], fmaxf(acc * scale * sm_scale, 0.0f), score);
    }
    return score;
}

#endif  // KERNELS_DSA_FORMAT_H
