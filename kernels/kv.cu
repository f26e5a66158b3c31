/*
 * kv.cu - kv.h's cache write.
 */
#include "kernels/kv.h"

#include <string.h>

#include "engine/shared/cuda_check.h"
#include "engine/shared/err.h"
#include "kernels/launch.cuh"
#include "kernels/norm_dev.cuh"
#include "kernels/rope_format.h"

enum { KV_THREADS = NORM_THREADS };  // a transformed write normalizes as norm.cu's blocks do

// The transform of a kv_write, with RoPE's frequencies from the host (rope_format.h).
typedef struct KvInDev {
    KvIn in;
    RopeFreqs f;
    bool vec;  // norm.cu would read src's rows in 16-byte pieces (norm_vec_rows)
} KvInDev;

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

// src's row of token t transformed by in into row (shared memory, KV_IN_MAX floats): the
// norm (all threads: the statistic synchronizes the block), then RoPE, a thread per pair. The
// row, the norm's weights and RoPE's angle are all fetched or computed first, so the block
// waits for memory once rather than once per phase (the same numbers in the same order).
enum { KV_PER_THREAD = KV_IN_MAX / KV_THREADS };  // kv_write launches KV_THREADS a block
static_assert(KV_IN_MAX % KV_THREADS == 0, "a row's values spread evenly over the threads");

static __device__ void kv_transform(float *row, const float *st, int width, const KvInDev &d, int p)
{
    __shared__ double red[NORM_THREADS / WARP_SIZE];
    const KvIn &in = d.in;
    const int tid = threadIdx.x, half = in.rope_dim / 2;
    float xv[KV_PER_THREAD], wv[KV_PER_THREAD], bv[KV_PER_THREAD];
#pragma unroll
    for (int j = 0; j < KV_PER_THREAD; j++) {
        const int i = tid + j * KV_THREADS;
        xv[j] = i < width ? st[i] : 0.0f;
        wv[j] = i < in.norm_dim ? in.norm_w[i] : 0.0f;
        bv[j] = in.norm_b && i < in.norm_dim ? in.norm_b[i] : 0.0f;
    }
    float cs = 0.0f, sn = 0.0f;
    if (tid < half) rope_cos_sin(p, d.f.inv[tid], &cs, &sn);
#pragma unroll
    for (int j = 0; j < KV_PER_THREAD; j++) {
        const int i = tid + j * KV_THREADS;
        if (i < width) row[i] = xv[j];
    }
    __syncthreads();
    if (in.norm_dim > 0) {
        // The statistic over src's row as norm.cu reads it (16-byte pieces when it would).
        if (in.norm_b) {
            double mean;
            const double inv = norm_layer_inv(row, in.norm_dim, d.vec, in.eps, red, &mean);
#pragma unroll
            for (int j = 0; j < KV_PER_THREAD; j++) {
                const int i = tid + j * KV_THREADS;
                if (i < in.norm_dim) row[i] = (float) norm_layer_value(xv[j], mean, inv, wv[j], bv[j]);
            }
        } else {
            const double inv = norm_rms_inv(row, in.norm_dim, d.vec, in.eps, red);
#pragma unroll
            for (int j = 0; j < KV_PER_THREAD; j++) {
                const int i = tid + j * KV_THREADS;
                if (i < in.norm_dim) row[i] = (float) norm_rms_value(xv[j], inv, wv[j]);
            }
        }
        __syncthreads();
    }
    float a = 0.0f, b = 0.0f;
    if (tid < half) {
        a = row[in.rope_off + 2 * tid];
        b = row[in.rope_off + 2 * tid + 1];
    }
    __syncthreads();  // every pair read before any is written (the output is de-interleaved)
    if (tid < half)
        rope_rotate(a, b, cs, sn, &row[in.rope_off + tid], &row[in.rope_off + half + tid]);
    __syncthreads();
}

static __global__ void __launch_bounds__(KV_THREADS)
    kv_write_kernel(KvPages pg, const int32_t *__restrict__ tables, int stride,
                    const int32_t *__restrict__ seq_of, const int32_t *__restrict__ pos,
                    int offset, const float *__restrict__ src, int width, bool has_in,
                    const __grid_constant__ KvInDev in)
{
    KERN_ENTRY();
    __shared__ __align__(16) float row[KV_IN_MAX];
    const KvEntryLayout &lo = pg.lo;
    const int t = blockIdx.x, p = pos[t], row_at = p % lo.block_size;
    const size_t b = kv_block(tables, stride, seq_of, lo, t, p);
    unsigned char *e = pg.mla + (b * (size_t) lo.block_size + (size_t) row_at) * (size_t) lo.bytes;
    unsigned char *page = pg.keys ? pg.keys + b * (size_t) lo.key_page : NULL;
    const float *st = src + (size_t) t * width;
    if (has_in) {
        kv_transform(row, st, width, in, p);
        st = row;
    }
    if (lo.dtype != KV_DTYPE_FP8) {
        for (int i = threadIdx.x; i < width; i += blockDim.x)
            kv_store_part(&lo, e, page, row_at, offset, st, width, i);
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
            kv_fp8_group_store_warp(page + (size_t) row_at * lo.key_bytes,
                                    page + lo.key_scales + 4 * row_at, st + idx0 - offset,
                                    lo.index_dim, lane);
        }
    }
}

void kv_write(const KvPages *pg, const int32_t *tables, int stride, const int32_t *seq_of,
              const int32_t *pos, int offset, const float *src, int width, int n_tok,
              const KvIn *in, cudaStream_t stream)
{
    ASSERT(pg && pg->mla && kv_write_ok(&pg->lo, offset, width) && stride >= 1 && n_tok >= 0);
    ASSERT(pg->keys || offset + width <= pg->lo.kv_lora + pg->lo.rope_dim);
    if (n_tok == 0 || width == 0) return;
    KvInDev d;
    memset(&d, 0, sizeof d);
    if (in) {
        ASSERT(width <= KV_IN_MAX && in->norm_dim >= 0 && in->norm_dim <= width);
        ASSERT(in->norm_dim == 0 || (in->norm_w && in->eps >= 0.0f));
        ASSERT(!in->norm_b || in->norm_dim == width);
        ASSERT(in->rope_dim >= 0 && in->rope_dim % 2 == 0 && in->rope_dim / 2 <= ROPE_MAX_PAIRS
               && in->rope_dim / 2 <= KV_THREADS && in->rope_off >= 0
               && in->rope_off + in->rope_dim <= width);
        d.in = *in;
        if (in->rope_dim > 0) {
            ASSERT(in->theta > 0.0f);
            rope_freqs(&d.f, in->rope_dim, in->theta);
        }
        // norm.cu's choice for these rows: the rmsnorm op reads them width apart, layernorm
        // (the whole write) norm_dim apart, which is then width.
        d.vec = norm_vec_rows(src, in->norm_dim, width);
    }
    kern_launch(kv_write_kernel, (unsigned) n_tok, KV_THREADS, 0, stream, *pg, tables, stride,
                seq_of, pos, offset, src, width, in != NULL, d);
}
