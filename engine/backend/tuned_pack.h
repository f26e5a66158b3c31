/*
 * tuned_pack.h - host-side repacks of weights for the CUDA backend's tuned kernels, at the
 * kernels' widths, with zeros where a model is narrower (backend.h backend_*_tuned: zero
 * padding changes no sum). Plain C, so the CPU-only tests run them through the kernels'
 * references (tests/kernels/test_kv_layout.c).
 *
 * - kv_b_proj for kernels/mla.h's absorbed attention: W_UK^T bf16 [Hp, MLA_KV_LORA,
 *   MLA_QK_NOPE] (q_lat = W_UK^T q_nope per head) and W_UV bf16 [Hp, Vp, MLA_KV_LORA]
 *   (out = W_UV o_lat), Hp = backend_mla_heads(n_heads), Vp = backend_mla_v_rows. Values are
 *   rounded to bf16, nearest even: exact for a bf16 checkpoint, the recipe's rounding for
 *   others. Uploaded at bind_kv_b.
 *
 * Ownership: the caller's buffers. Threads: pure. Errors: ERR_NOMEM (a row buffer), ERR_INVAL
 * when the shape is not backend_mla_shape_tuned or kv_b does not match it.
 */
#ifndef ENGINE_BACKEND_TUNED_PACK_H
#define ENGINE_BACKEND_TUNED_PACK_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// W_UV's rows per head: v_dim in 8s (cuBLASLt's fp32 output rows of 16 bytes).
static inline int backend_mla_v_rows(const BackendMla *p)
{
    return (p->v_dim + 7) / 8 * 8;
}

// Elements (bf16) of the two packs.
static inline size_t backend_mla_uk_elems(const BackendMla *p)
{
    return (size_t) backend_mla_heads(p->n_heads) * MLA_KV_LORA * MLA_QK_NOPE;
}
static inline size_t backend_mla_uv_elems(const BackendMla *p)
{
    return (size_t) backend_mla_heads(p->n_heads) * (size_t) backend_mla_v_rows(p) * MLA_KV_LORA;
}

// Fill uk [backend_mla_uk_elems] and uv [backend_mla_uv_elems] (host memory) from kv_b, a host
// CkptLinear [n_heads * (qk_nope + v_dim), kv_lora].
Err backend_mla_pack_kv_b(const CkptLinear *kv_b, const BackendMla *p, uint16_t *uk, uint16_t *uv);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_BACKEND_TUNED_PACK_H
