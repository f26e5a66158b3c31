/*
 * mla_ref.c - MLA references: decode the cache bytes, normalize/rotate exactly, and attend with
 * a two-pass softmax in double.
 */
#include "kernels/ref/mla_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ref/kern_ref.h"
#include "kernels/ref/norm_ref.h"

enum { LORA = 512, ROPE = 64, LK = 576, BLOCK = 128, FP8_BYTES = 656, BF16_BYTES = 1152 };

void mla_cache_read_ref(float *out, const uint8_t *cache, int type, int blk, int row)
{
    const size_t tb = type == 0 ? FP8_BYTES : BF16_BYTES;
    const uint8_t *p = cache + ((size_t) blk * BLOCK + row) * tb;
    if (type == 0) {
        float scales[4];
        memcpy(scales, p + LORA, sizeof scales);
        for (int c = 0; c < LORA; c++) out[c] = kern_e4m3_to_f32(p[c]) * scales[c / 128];
        for (int c = 0; c < ROPE; c++) {
            uint16_t b;
            memcpy(&b, p + LORA + 16 + 2 * c, 2);
            out[LORA + c] = kern_bf16_to_f32(b);
        }
    } else {
        for (int c = 0; c < LK; c++) {
            uint16_t b;
            memcpy(&b, p + 2 * c, 2);
            out[c] = kern_bf16_to_f32(b);
        }
    }
}

void mla_latent_store_ref(float *want, const float *ckv, int ckv_stride, const float *norm_w,
                          float eps, float theta, const int32_t *pos, int n_tok)
{
    for (int t = 0; t < n_tok; t++) {
        const float *x = ckv + (size_t) t * ckv_stride;
        float *o = want + (size_t) t * LK;
        double ss = 0.0;
        for (int c = 0; c < LORA; c++) ss += (double) x[c] * x[c];
        const double inv = 1.0 / sqrt(ss / LORA + eps);
        for (int c = 0; c < LORA; c++) o[c] = (float) (x[c] * inv * norm_w[c]);
        for (int c = 0; c < ROPE; c++)
            o[LORA + c] = x[LORA + c];
        rope_glm_ref(o + LORA, pos + t, 1, 1, ROPE, ROPE, 0, ROPE, theta);
    }
}

void mla_decode_ref(float *out, float *out_abs, float *score_abs, const float *q_lat,
                    const float *q_pe, const uint8_t *cache, int type, const int32_t *block_table,
                    int max_blocks, const int32_t *seq, const int32_t *kv_len,
                    const int32_t *indices, int idx_stride, int n_tok, int n_heads,
                    float sm_scale)
{
    for (int t = 0; t < n_tok; t++) {
        const int len = kv_len[t];
        float *kv = malloc(sizeof(float) * LK * (len > 0 ? len : 1));
        double *sc = malloc(sizeof(double) * (len > 0 ? len : 1));
        for (int i = 0; i < len; i++) {
            const int p = indices ? indices[(size_t) t * idx_stride + i] : i;
            const int blk = block_table[(size_t) seq[t] * max_blocks + p / BLOCK];
            mla_cache_read_ref(kv + (size_t) i * LK, cache, type, blk, p % BLOCK);
        }
        for (int h = 0; h < n_heads; h++) {
            const float *ql = q_lat + ((size_t) t * n_heads + h) * LORA;
            const float *qp = q_pe + ((size_t) t * n_heads + h) * ROPE;
            double m = -INFINITY, smax = 0.0;
            for (int i = 0; i < len; i++) {
                const float *k = kv + (size_t) i * LK;
                double s = 0.0, sa = 0.0;
                for (int c = 0; c < LORA; c++) {
                    s += (double) ql[c] * k[c];
                    sa += fabs((double) ql[c] * k[c]);
                }
                for (int c = 0; c < ROPE; c++) {
                    s += (double) qp[c] * k[LORA + c];
                    sa += fabs((double) qp[c] * k[LORA + c]);
                }
                sc[i] = s * sm_scale;
                if (sc[i] > m) m = sc[i];
                if (sa * sm_scale > smax) smax = sa * sm_scale;
            }
            double l = 0.0;
            for (int i = 0; i < len; i++) l += exp(sc[i] - m);
            for (int c = 0; c < LORA; c++) {
                double acc = 0.0, acc_abs = 0.0;
                for (int i = 0; i < len; i++) {
                    const double p = exp(sc[i] - m) / l;
                    acc += p * kv[(size_t) i * LK + c];
                    acc_abs += p * fabs(kv[(size_t) i * LK + c]);
                }
                const size_t o = ((size_t) t * n_heads + h) * LORA + c;
                out[o] = len > 0 ? (float) acc : 0.0f;
                if (out_abs) out_abs[o] = (float) acc_abs;
            }
            if (score_abs) score_abs[(size_t) t * n_heads + h] = (float) smax;
        }
        free(kv);
        free(sc);
    }
}
