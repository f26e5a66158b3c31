/*
 * tuned_pack.c - kv_b_proj into the tuned MLA kernels' packs (tuned_pack.h).
 */
#include "engine/backend/tuned_pack.h"

#include <stdlib.h>
#include <string.h>

#include "engine/shared/err.h"
#include "kernels/nvfp4_format.h"

Err backend_mla_pack_kv_b(const CkptLinear *kv_b, const BackendMla *p, uint16_t *uk, uint16_t *uv)
{
    if (!backend_mla_shape_tuned(p) || kv_b->cols != p->kv_lora
        || kv_b->rows != p->n_heads * (p->qk_nope + p->v_dim)) {
        LOG_ERROR("%s: [%d, %d] is not a kv_b_proj the tuned MLA kernels take",
                  kv_b->name ? kv_b->name : "kv_b_proj", kv_b->rows, kv_b->cols);
        return ERR_INVAL;
    }
    const size_t H = (size_t) p->n_heads, L = (size_t) p->kv_lora, D = (size_t) p->qk_nope,
                 V = (size_t) p->v_dim, Vp = (size_t) backend_mla_v_rows(p), LP = MLA_KV_LORA,
                 DP = MLA_QK_NOPE;
    float *row = malloc(L * sizeof *row);
    if (!row) return ERR_NOMEM;
    memset(uk, 0, backend_mla_uk_elems(p) * sizeof *uk);
    memset(uv, 0, backend_mla_uv_elems(p) * sizeof *uv);
    for (size_t h = 0; h < H; h++)
        for (size_t r = 0; r < D + V; r++) {
            ckpt_linear_row(kv_b, (int) (h * (D + V) + r), row);
            for (size_t c = 0; c < L; c++) {
                const uint16_t b = nvfp4_float_to_bf16(row[c]);
                if (r < D)
                    uk[(h * LP + c) * DP + r] = b;  // transposed: [h][c][r]
                else
                    uv[(h * Vp + (r - D)) * LP + c] = b;
            }
        }
    free(row);
    return ERR_OK;
}
