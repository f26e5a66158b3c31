/*
 * kv.h - the write into the engine's paged KV cache: one launch stores the values of every
 * token of a step (prefill chunks and decode tokens of any sequences) into its own entry,
 * exactly as kernels/kv_format.h's kv_store_part stores them on the host (the CPU backend),
 * so both backends hold the same bytes for the same values (f32, bf16, fp8 with fp32 group
 * scales; engine/model/kv_cache.h describes the pages).
 *
 * Ownership: borrowed pointers. Threads: thread-safe launchers. Errors: ASSERT on bad shapes;
 * CUDA failures fatal. The launcher never allocates and never synchronizes; positions,
 * sequences and block tables are read on the device, so it can be captured in a CUDA graph.
 */
#ifndef KERNELS_KV_H
#define KERNELS_KV_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/kv_format.h"

#ifdef __cplusplus
extern "C" {
#endif

// One layer of a cache: token t at position pos[t] of table row seq_of[t] lives in block b =
// tables[seq_of[t] * stride + pos[t] / lo.block_size], its entry at mla + (b * block_size +
// pos % block_size) * lo.bytes and its index key in row pos % block_size of the key page at
// keys + b * lo.key_page.
typedef struct KvPages {
    unsigned char *mla;   // the layer's MLA pages
    unsigned char *keys;  // its key pages (NULL without an indexer key)
    KvEntryLayout lo;
} KvPages;

enum { KV_IN_MAX = 1024 };  // the widest write kv_write transforms (in != NULL)

// Values offset .. offset + width of the entries of n_tok tokens from src fp32 [n_tok, width]
// (kv_write_ok(&pg->lo, offset, width) holds), transformed by in first (kv_format.h KvIn; its
// norm exactly as kernels/norm.h's kernels compute it, kernels/norm_dev.cuh, on src's rows as
// the write reads them; its RoPE as kernels/rope.h's): a block per token; f32
// and bf16 a thread per value, fp8 a warp per scaled part (a latent group, k_pe, the index key)
// with the amax split over its lanes (a maximum does not depend on the order of comparisons:
// the same scale and codes as kv_fp8_group_store). src is not written.
void kv_write(const KvPages *pg, const int32_t *tables, int stride, const int32_t *seq_of,
              const int32_t *pos, int offset, const float *src, int width, int n_tok,
              const KvIn *in, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_KV_H
