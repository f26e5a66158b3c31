/*
 * mla.cu - MLA decode: cache append, query split/rotation, split-KV absorbed attention and the
 * split merge.
 *
 * Attention decomposition: grid (n_split, H / 16, n_tok); a CTA of 256 threads owns 16 heads
 * of one token and one contiguous range of its positions, so each cache tile is read from
 * memory once per 16 heads (4 times per token for H = 64, the extra reads hitting L2). Per
 * tile of 16 positions the CTA
 *   1. gathers the 16 cache rows through the page table, dequantizes them to fp32 in shared
 *      memory (rows padded to 580 floats so that 16 lanes' 16-byte reads cover all banks;
 *      consecutive threads write consecutive 16-byte pieces, so the fill is conflict-free);
 *   2. thread (head hl = tid/16, position tk = tid%16) computes one 576-long score; a
 *      half-warp shuffle gives the tile max and sum of each head (online softmax, fp32);
 *   3. thread (hl, tk) owns 32 of its head's 512 output values (columns tk*4 + 64j) and adds
 *      p * c_kv for the 16 positions, taking each p from its half-warp by shuffle.
 * Shared memory: q 16 x 576 fp32 + tile 16 x 580 fp32 = 74 KB (fits GB10's 99 KB).
 * This is the CUDA-core baseline: at 32K context it is bound by shared-memory bandwidth, not
 * by the cache bytes (H200, 2026-11-30); tensor-core (mma.sync) tiles are the next step.
 *
 * Merge: one CTA per (head, token) rescales the n_split partial outputs by exp(m_s - M); the
 * (m_s, l_s) pairs are reduced by one warp, then the partial outputs are read with all splits'
 * loads independent (the first version walked the splits one dependent load after another;
 * with this merge and the 16-byte query loads, attention at 1K context with 64 splits went from
 * 41 to 29 us per layer on H200, 2026-11-30).
 */
#include "kernels/mla.h"

#include "engine/shared/cuda_check.h"
#include "kernels/common.cuh"

enum {
    HB = MLA_HEADS_PER_CTA,
    TILE = 16,
    KS_STRIDE = MLA_LK + 4,
    DEC_THREADS = 256,
    BF16_TOKEN_BYTES = MLA_LK * 2,
};

// ---------------------------------------------------------------------------
// Cache append and query split kernels

template <int CT>
static __global__ void mla_append_kernel(uint8_t *__restrict__ cache, const float *__restrict__ ckv,
                                         int ckv_stride, const float *__restrict__ norm_w,
                                         float eps, float theta, const int32_t *__restrict__ pos,
                                         const int32_t *__restrict__ seq,
                                         const int32_t *__restrict__ block_table, int max_blocks)
{
    __shared__ float red[4];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const float *x = ckv + (size_t) t * ckv_stride;
    const int p = pos[t];
    const int blk = block_table[(size_t) seq[t] * max_blocks + p / MLA_BLOCK];
    const size_t tb = CT == MLA_CACHE_FP8 ? MLA_FP8_TOKEN_BYTES : BF16_TOKEN_BYTES;
    uint8_t *dst = cache + ((size_t) blk * MLA_BLOCK + p % MLA_BLOCK) * tb;

    float v[4];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        v[j] = x[tid * 4 + j];
        ss = fmaf(v[j], v[j], ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    const float inv = rsqrtf((red[0] + red[1] + red[2] + red[3]) / MLA_KV_LORA + eps);
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = v[j] * inv * norm_w[tid * 4 + j];

    if (CT == MLA_CACHE_FP8) {
        // One warp covers one 128-value scale chunk.
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
        amax = warp_max(amax);
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        uint32_t packed = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) packed |= (uint32_t) f32_to_e4m3_bits(v[j] / scale) << (8 * j);
        *(uint32_t *) (dst + tid * 4) = packed;
        if (lane == 0) *(float *) (dst + MLA_KV_LORA + warp * 4) = scale;
    } else {
        uint16_t *d = (uint16_t *) dst;
#pragma unroll
        for (int j = 0; j < 4; j++) d[tid * 4 + j] = f32_to_bf16_bits(v[j]);
    }

    if (tid < MLA_ROPE / 2) {
        const int i = tid;
        const double inv_freq = pow((double) theta, -2.0 * i / MLA_ROPE);
        double s, c;
        sincos((double) p * inv_freq, &s, &c);
        const float x0 = x[MLA_KV_LORA + 2 * i], x1 = x[MLA_KV_LORA + 2 * i + 1];
        const float y0 = x0 * (float) c - x1 * (float) s, y1 = x1 * (float) c + x0 * (float) s;
        uint16_t *kpe = (uint16_t *) (dst + (CT == MLA_CACHE_FP8 ? MLA_KV_LORA + 16 : MLA_KV_LORA * 2));
        kpe[2 * i] = f32_to_bf16_bits(y0);
        kpe[2 * i + 1] = f32_to_bf16_bits(y1);
    }
}

static __global__ void mla_q_split_kernel(uint16_t *__restrict__ q_nope, float *__restrict__ q_pe,
                                          const float *__restrict__ q,
                                          const int32_t *__restrict__ pos, int n_heads, float theta)
{
    const int t = blockIdx.y, h = blockIdx.x, tid = threadIdx.x;  // 256 threads
    const float *qh = q + ((size_t) t * n_heads + h) * 256;
    if (tid < 192) {
        q_nope[((size_t) t * n_heads + h) * 192 + tid] = f32_to_bf16_bits(qh[tid]);
    } else if (!pos) {  // q_pe already rotated
        q_pe[((size_t) t * n_heads + h) * MLA_ROPE + tid - 192] = qh[tid];
    } else if (tid < 192 + MLA_ROPE / 2) {
        const int i = tid - 192;
        const double inv_freq = pow((double) theta, -2.0 * i / MLA_ROPE);
        double s, c;
        sincos((double) pos[t] * inv_freq, &s, &c);
        const float x0 = qh[192 + 2 * i], x1 = qh[192 + 2 * i + 1];
        float *o = q_pe + ((size_t) t * n_heads + h) * MLA_ROPE;
        o[2 * i] = x0 * (float) c - x1 * (float) s;
        o[2 * i + 1] = x1 * (float) c + x0 * (float) s;
    }
}

// ---------------------------------------------------------------------------
// Attention kernels

template <int CT>
static __global__ void __launch_bounds__(DEC_THREADS)
    mla_decode_kernel(float *__restrict__ ws_o, float *__restrict__ ws_ml,
                      const float *__restrict__ q_lat, const float *__restrict__ q_pe,
                      const uint8_t *__restrict__ cache, const int32_t *__restrict__ block_table,
                      int max_blocks, const int32_t *__restrict__ seq,
                      const int32_t *__restrict__ kv_len, const int32_t *__restrict__ indices,
                      int idx_stride, int n_heads, float sm_scale, int n_split, int vec_q)
{
    extern __shared__ float4 smem4[];
    float *qs = (float *) smem4;   // [HB][MLA_LK]
    float *ks = qs + HB * MLA_LK;  // [TILE][KS_STRIDE]
    __shared__ long long offs[TILE];

    const int split = blockIdx.x, hg = blockIdx.y, t = blockIdx.z;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, hl = tid / TILE, tk = tid % TILE;
    const int h = hg * HB + hl;
    const size_t tb = CT == MLA_CACHE_FP8 ? MLA_FP8_TOKEN_BYTES : BF16_TOKEN_BYTES;

    if (vec_q) {
        // 16 heads x 144 float4: all 9 loads of a thread are in flight before the first store
        // (a scalar loop waited one L2 latency per 256 values; at 1K context with 64 splits the
        // whole CTA is a single tile, so nothing hides that latency).
        enum { Q4 = HB * MLA_LK / 4, Q4_PER = Q4 / DEC_THREADS, ROW4 = MLA_LK / 4 };
        float4 v[Q4_PER];
#pragma unroll
        for (int r = 0; r < Q4_PER; r++) {
            const int i = tid + r * DEC_THREADS, hh = hg * HB + i / ROW4, c4 = i % ROW4;
            v[r] = c4 < MLA_KV_LORA / 4
                       ? __ldg((const float4 *) (q_lat + ((size_t) t * n_heads + hh) * MLA_KV_LORA) + c4)
                       : __ldg((const float4 *) (q_pe + ((size_t) t * n_heads + hh) * MLA_ROPE) + c4 - MLA_KV_LORA / 4);
        }
#pragma unroll
        for (int r = 0; r < Q4_PER; r++) ((float4 *) qs)[tid + r * DEC_THREADS] = v[r];
    } else {
        for (int i = tid; i < HB * MLA_LK; i += DEC_THREADS) {
            const int hh = hg * HB + i / MLA_LK, c = i % MLA_LK;
            qs[i] = c < MLA_KV_LORA ? q_lat[((size_t) t * n_heads + hh) * MLA_KV_LORA + c]
                                    : q_pe[((size_t) t * n_heads + hh) * MLA_ROPE + c - MLA_KV_LORA];
        }
    }

    const int len = kv_len[t];
    const int per = CEIL_DIV(CEIL_DIV(len, n_split), TILE) * TILE;
    const int beg = split * per, end = min(len, beg + per);
    const int s = seq[t];

    float m_run = -INFINITY, l_run = 0.0f;
    float o[32];
#pragma unroll
    for (int j = 0; j < 32; j++) o[j] = 0.0f;

    for (int base = beg; base < end; base += TILE) {
        __syncthreads();  // the previous tile is consumed (and q is in place)
        if (tid < TILE) {
            const int i = base + tid;
            long long off = -1;
            if (i < end) {
                const int p = indices ? indices[(size_t) t * idx_stride + i] : i;
                const int blk = block_table[(size_t) s * max_blocks + p / MLA_BLOCK];
                off = ((long long) blk * MLA_BLOCK + p % MLA_BLOCK) * (long long) tb;
            }
            offs[tid] = off;
        }
        __syncthreads();
        // Consecutive threads fill consecutive 16-byte pieces of a row: coalesced 128-byte
        // loads per warp and conflict-free shared-memory stores.
        if (CT == MLA_CACHE_FP8) {
            for (int it = tid; it < TILE * 160; it += DEC_THREADS) {
                const int tok = it / 160, r = it % 160;
                const long long off = offs[tok];
                if (r < 128) {
                    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (off >= 0) {
                        const uint32_t wd = __ldg((const uint32_t *) (cache + off) + r);
                        const float sc = __ldg((const float *) (cache + off + MLA_KV_LORA) + r / 32);
                        v = make_float4(e4m3_bits_to_f32((uint8_t) wd) * sc,
                                        e4m3_bits_to_f32((uint8_t) (wd >> 8)) * sc,
                                        e4m3_bits_to_f32((uint8_t) (wd >> 16)) * sc,
                                        e4m3_bits_to_f32((uint8_t) (wd >> 24)) * sc);
                    }
                    *(float4 *) (ks + tok * KS_STRIDE + r * 4) = v;
                } else {
                    const int i = r - 128;  // pair of rope values
                    float2 v = make_float2(0.0f, 0.0f);
                    if (off >= 0)
                        v = bf16x2_bits_to_f32(__ldg((const uint32_t *) (cache + off + MLA_KV_LORA + 16) + i));
                    *(float2 *) (ks + tok * KS_STRIDE + MLA_KV_LORA + 2 * i) = v;
                }
            }
        } else {
            for (int it = tid; it < TILE * (MLA_LK / 2); it += DEC_THREADS) {
                const int tok = it / (MLA_LK / 2), i = it % (MLA_LK / 2);
                const long long off = offs[tok];
                float2 v = make_float2(0.0f, 0.0f);
                if (off >= 0) v = bf16x2_bits_to_f32(__ldg((const uint32_t *) (cache + off) + i));
                *(float2 *) (ks + tok * KS_STRIDE + 2 * i) = v;
            }
        }
        __syncthreads();

        const float *qh = qs + hl * MLA_LK;
        const float *kt = ks + tk * KS_STRIDE;
        float sc = 0.0f;
#pragma unroll 8
        for (int c = 0; c < MLA_LK; c += 4) {
            const float4 a = *(const float4 *) (qh + c), b = *(const float4 *) (kt + c);
            sc = fmaf(a.x, b.x, sc);
            sc = fmaf(a.y, b.y, sc);
            sc = fmaf(a.z, b.z, sc);
            sc = fmaf(a.w, b.w, sc);
        }
        const bool valid = offs[tk] >= 0;
        sc = valid ? sc * sm_scale : -INFINITY;
        float mt = sc;
#pragma unroll
        for (int o2 = 8; o2 > 0; o2 >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o2));
        const float m_new = fmaxf(m_run, mt);
        const float p = valid ? expf(sc - m_new) : 0.0f;
        const float alpha = m_run == -INFINITY ? 0.0f : expf(m_run - m_new);
        float ps = p;
#pragma unroll
        for (int o2 = 8; o2 > 0; o2 >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o2);
        l_run = l_run * alpha + ps;
        m_run = m_new;
#pragma unroll
        for (int j = 0; j < 32; j++) o[j] *= alpha;
#pragma unroll 4
        for (int i = 0; i < TILE; i++) {
            const float pi = __shfl_sync(0xffffffffu, p, (lane & 16) | i);
            const float *kr = ks + i * KS_STRIDE + tk * 4;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float4 v = *(const float4 *) (kr + 64 * j);
                o[4 * j] = fmaf(pi, v.x, o[4 * j]);
                o[4 * j + 1] = fmaf(pi, v.y, o[4 * j + 1]);
                o[4 * j + 2] = fmaf(pi, v.z, o[4 * j + 2]);
                o[4 * j + 3] = fmaf(pi, v.w, o[4 * j + 3]);
            }
        }
    }

    const size_t row = ((size_t) t * n_split + split) * n_heads + h;
    float *wo = ws_o + row * MLA_KV_LORA + tk * 4;
#pragma unroll
    for (int j = 0; j < 8; j++)
        *(float4 *) (wo + 64 * j) = make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]);
    if (tk == 0) {
        ws_ml[row * 2] = m_run;
        ws_ml[row * 2 + 1] = l_run;
    }
}

static __global__ void mla_merge_kernel(uint16_t *__restrict__ out, const float *__restrict__ ws_o,
                                        const float *__restrict__ ws_ml, int n_heads, int n_split)
{
    __shared__ float wgt[MLA_MAX_SPLIT];
    __shared__ float s_l;
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;  // 128 threads x 4 columns
    const size_t row0 = (size_t) t * n_split * n_heads + h;      // split s: row0 + s * n_heads
    if (tid < WARP_SIZE) {
        // Warp 0: lane l holds splits l and l + 32; the maximum, the weights exp(m_s - M) and
        // the denominator are warp reductions instead of a serial loop of dependent loads.
        float m2[2], l2[2];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int s = tid + WARP_SIZE * j;
            m2[j] = s < n_split ? ws_ml[(row0 + (size_t) s * n_heads) * 2] : -INFINITY;
            l2[j] = s < n_split ? ws_ml[(row0 + (size_t) s * n_heads) * 2 + 1] : 0.0f;
        }
        const float m = warp_max(fmaxf(m2[0], m2[1]));
        float l = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int s = tid + WARP_SIZE * j;
            const float wg = m2[j] == -INFINITY ? 0.0f : expf(m2[j] - m);
            if (s < n_split) wgt[s] = wg;
            l = fmaf(wg, l2[j], l);
        }
        l = warp_sum(l);
        if (tid == 0) s_l = l;
    }
    __syncthreads();
    // The partial outputs of all splits are independent loads: unrolled, several are in flight.
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int s = 0; s < n_split; s++) {
        const float wg = wgt[s];
        const float4 v = *(const float4 *) (ws_o + (row0 + (size_t) s * n_heads) * MLA_KV_LORA + tid * 4);
        acc.x = fmaf(wg, v.x, acc.x);
        acc.y = fmaf(wg, v.y, acc.y);
        acc.z = fmaf(wg, v.z, acc.z);
        acc.w = fmaf(wg, v.w, acc.w);
    }
    const float l = s_l;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    uint16_t *o = out + ((size_t) t * n_heads + h) * MLA_KV_LORA + tid * 4;
    o[0] = f32_to_bf16_bits(acc.x * inv);
    o[1] = f32_to_bf16_bits(acc.y * inv);
    o[2] = f32_to_bf16_bits(acc.z * inv);
    o[3] = f32_to_bf16_bits(acc.w * inv);
}

// ---------------------------------------------------------------------------
// Launchers

size_t mla_cache_token_bytes(MlaCacheType type)
{
    return type == MLA_CACHE_FP8 ? MLA_FP8_TOKEN_BYTES : BF16_TOKEN_BYTES;
}

void mla_cache_append(const MlaCache *cache, const float *ckv, int ckv_stride,
                      const float *norm_w, float eps, float theta, const int32_t *pos,
                      const int32_t *seq, const int32_t *block_table, int max_blocks, int n_tok,
                      cudaStream_t stream)
{
    ASSERT(cache && cache->data && n_tok > 0 && ckv_stride >= MLA_LK && max_blocks > 0);
    if (cache->type == MLA_CACHE_FP8)
        mla_append_kernel<MLA_CACHE_FP8><<<n_tok, 128, 0, stream>>>(
            cache->data, ckv, ckv_stride, norm_w, eps, theta, pos, seq, block_table, max_blocks);
    else
        mla_append_kernel<MLA_CACHE_BF16><<<n_tok, 128, 0, stream>>>(
            cache->data, ckv, ckv_stride, norm_w, eps, theta, pos, seq, block_table, max_blocks);
    CUDA_CHECK(cudaGetLastError());
}

void mla_q_split(uint16_t *q_nope, float *q_pe, const float *q, const int32_t *pos, int n_tok,
                 int n_heads, float theta, cudaStream_t stream)
{
    ASSERT(n_tok > 0 && n_heads > 0 && (!pos || theta > 0.0f));
    mla_q_split_kernel<<<dim3(n_heads, n_tok), 256, 0, stream>>>(q_nope, q_pe, q, pos, n_heads,
                                                                 theta);
    CUDA_CHECK(cudaGetLastError());
}

void mla_decode(uint16_t *out, const float *q_lat, const float *q_pe, const MlaCache *cache,
                const int32_t *block_table, int max_blocks, const int32_t *seq,
                const int32_t *kv_len, const int32_t *indices, int idx_stride, int n_tok,
                int n_heads, float sm_scale, int n_split, float *ws_o, float *ws_ml,
                cudaStream_t stream)
{
    ASSERT(cache && cache->data && n_tok > 0 && n_heads > 0 && n_heads % HB == 0);
    ASSERT(n_split >= 1 && n_split <= MLA_MAX_SPLIT && max_blocks > 0);
    ASSERT(indices == NULL || idx_stride > 0);
    ASSERT((uintptr_t) ws_o % 16 == 0);
    const size_t smem = (size_t) (HB * MLA_LK + TILE * KS_STRIDE) * sizeof(float);
    const dim3 grid(n_split, n_heads / HB, n_tok);
    const int vec_q = ((uintptr_t) q_lat | (uintptr_t) q_pe) % 16 == 0;
    if (cache->type == MLA_CACHE_FP8) {
        CUDA_CHECK(cudaFuncSetAttribute(mla_decode_kernel<MLA_CACHE_FP8>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
        mla_decode_kernel<MLA_CACHE_FP8><<<grid, DEC_THREADS, smem, stream>>>(
            ws_o, ws_ml, q_lat, q_pe, cache->data, block_table, max_blocks, seq, kv_len, indices,
            idx_stride, n_heads, sm_scale, n_split, vec_q);
    } else {
        CUDA_CHECK(cudaFuncSetAttribute(mla_decode_kernel<MLA_CACHE_BF16>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
        mla_decode_kernel<MLA_CACHE_BF16><<<grid, DEC_THREADS, smem, stream>>>(
            ws_o, ws_ml, q_lat, q_pe, cache->data, block_table, max_blocks, seq, kv_len, indices,
            idx_stride, n_heads, sm_scale, n_split, vec_q);
    }
    CUDA_CHECK(cudaGetLastError());
    mla_merge_kernel<<<dim3(n_heads, n_tok), MLA_KV_LORA / 4, 0, stream>>>(out, ws_o, ws_ml,
                                                                         n_heads, n_split);
    CUDA_CHECK(cudaGetLastError());
}
