/*
 * mla_pack.h - a layer's kv_b_proj repacked for kernels/mla.h's absorbed attention, at the
 * kernels' widths: W_UK^T bf16 [Hp, MLA_KV_LORA, MLA_QK_NOPE] (q_lat = W_UK^T q_nope per head)
 * and W_UV bf16 [Hp, Vp, MLA_KV_LORA] (out = W_UV o_lat), Hp = backend_mla_heads(n_heads),
 * Vp = backend_mla_v_rows. Where the model is narrower (latent, q_nope, heads, v_dim) the packs
 * hold zeros, so the padded products equal the model's (backend.h backend_mla_shape_tuned).
 * Values are rounded to bf16, nearest even: exact for a bf16 checkpoint, the recipe's rounding
 * for others. The CUDA backend uploads them at bind_kv_b; tests/kernels/test_kv_layout.c
 * runs them through the kernels' reference.
 *
 * Ownership: the caller's buffers. Threads: pure. Errors: ERR_NOMEM (a row buffer), ERR_INVAL
 * when the shape is not backend_mla_shape_tuned or kv_b does not match it.
 */
#ifndef ENGINE_BACKEND_MLA_PACK_H
#define ENGINE_BACKEND_MLA_PACK_H

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
#endif  // ENGINE_BACKEND_MLA_PACK_H
