/*
 * kv.cu - kv.h's cache write.
 */
#include "kernels/kv.h"

#include "engine/shared/cuda_check.h"
#include "engine/shared/err.h"

enum { KV_THREADS = 256 };

static __device__ __forceinline__ size_t kv_block(const int32_t *tables, int stride,
                                                  const int32_t *seq_of, const KvEntryLayout &lo,
                                                  int t, int p)
{
    return (size_t) tables[(size_t) seq_of[t] * stride + p / lo.block_size];
}

// kv_fp8_group_store over a warp's lanes.
static __device__ void kv_fp8_group_store_warp(unsigned char *codes, unsigned char *scale_at,
                                               const float *src, int n, int lane)
{
    float amax = 0.0f;
    for (int i = lane; i < n; i += 32)
        amax = fmaxf(amax, fabsf(src[i]));
    for (int o = 16; o > 0; o >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int i = lane; i < n; i += 32)
        codes[i] = nvfp4_float_to_e4m3(src[i] / scale);
    if (lane == 0) memcpy(scale_at, &scale, sizeof scale);
}

static __global__ void __launch_bounds__(KV_THREADS)
    kv_write_kernel(KvPages pg, const int32_t *__restrict__ tables, int stride,
                    const int32_t *__restrict__ seq_of, const int32_t *__restrict__ pos,
                    int offset, const float *__restrict__ src, int width)
{
    const KvEntryLayout &lo = pg.lo;
    const int t = blockIdx.x, p = pos[t], row = p % lo.block_size;
    const size_t b = kv_block(tables, stride, seq_of, lo, t, p);
    unsigned char *e = pg.mla + (b * (size_t) lo.block_size + (size_t) row) * (size_t) lo.bytes;
    unsigned char *page = pg.keys ? pg.keys + b * (size_t) lo.key_page : NULL;
    const float *st = src + (size_t) t * width;
    if (lo.dtype != KV_DTYPE_FP8) {
        for (int i = threadIdx.x; i < width; i += blockDim.x)
            kv_store_part(&lo, e, page, row, offset, st, width, i);
        return;
    }
    // The parts of kv_store_part's fp8 branch, in its order: latent groups, k_pe, index key.
    const int lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    const int pe0 = lo.kv_lora, idx0 = lo.kv_lora + lo.rope_dim, end = offset + width;
    const int groups = (lo.kv_lora + KV_FP8_GROUP - 1) / KV_FP8_GROUP;
    for (int part = threadIdx.x / 32; part < groups + 2; part += n_warps) {
        if (part < groups) {
            if (offset >= pe0) continue;
            const int g0 = part * KV_FP8_GROUP;
            const int n = lo.kv_lora - g0 < KV_FP8_GROUP ? lo.kv_lora - g0 : KV_FP8_GROUP;
            kv_fp8_group_store_warp(e + g0, e + lo.lat_scale + 4 * part, st + g0 - offset, n, lane);
        } else if (part == groups) {
            for (int i = (offset > pe0 ? offset : pe0) + lane; i < end && i < idx0; i += 32)
                kv_bf16_store(e + lo.pe + 2 * (i - pe0), st[i - offset]);
        } else if (end > idx0) {
            kv_fp8_group_store_warp(page + (size_t) row * lo.key_bytes,
                                    page + lo.key_scales + 4 * row, st + idx0 - offset,
                                    lo.index_dim, lane);
        }
    }
}

void kv_write(const KvPages *pg, const int32_t *tables, int stride, const int32_t *seq_of,
              const int32_t *pos, int offset, const float *src, int width, int n_tok,
              cudaStream_t stream)
{
    ASSERT(pg && pg->mla && kv_write_ok(&pg->lo, offset, width) && stride >= 1 && n_tok >= 0);
    ASSERT(pg->keys || offset + width <= pg->lo.kv_lora + pg->lo.rope_dim);
    if (n_tok == 0 || width == 0) return;
    kv_write_kernel<<<(unsigned) n_tok, KV_THREADS, 0, stream>>>(*pg, tables, stride, seq_of, pos,
                                                                offset, src, width);
    CUDA_CHECK(cudaGetLastError());
}
