/*
 * checkpoint.h - Hugging Face safetensors checkpoints, memory-mapped, and the weight views
 * the forward pass consumes.
 *
 * A model directory holds either one model.safetensors or shards listed by
 * model.safetensors.index.json. ckpt_open() reads the index (or the single header) and every
 * shard's header, validates each tensor's dtype, shape and byte range against its file, and
 * maps the shards read-only. Tensor data is never copied here: CkptTensor.data points into
 * the mapping.
 *
 * Linear weights are resolved per tensor from what is present (ckpt_linear):
 *   X.weight (bf16/f16/f32)                               -> CKPT_LINEAR_{BF16,F16,F32}
 *   X.weight (u8 [out,in/2]) + X.weight_scale (e4m3 [out,in/16]) + X.weight_scale_2 (f32)
 *                                                         -> CKPT_LINEAR_NVFP4 (ModelOpt)
 *   X.weight_packed + X.weight_scale + X.weight_global_scale (divides)
 *                                                         -> CKPT_LINEAR_NVFP4 (compressed-tensors)
 *   X.weight (f8_e4m3) + X.weight_scale[_inv]             -> CKPT_LINEAR_FP8
 * X.input_scale is ignored (W4A16). A NVFP4 weight is W[r,c] = e2m1(q) * e4m3(scale[r,c/16]) *
 * global_scale, with element 2j in the low nibble of byte j (kernels/nvfp4_format.h).
 *
 * Ownership: Ckpt owns its mappings and tensor table; every pointer it hands out (names,
 *            data, CkptLinear arrays) stays valid until ckpt_close().
 * Threads:   after ckpt_open() returns, lookups are read-only and safe from any thread.
 * Errors:    ERR_IO (open/mmap), ERR_FORMAT (bad header, truncated file, misshapen
 *            tensor), ERR_NOTFOUND (missing tensor); messages name the tensor and the file.
 */
#ifndef ENGINE_MODEL_CHECKPOINT_H
#define ENGINE_MODEL_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { CKPT_MAX_DIMS = 4 };

typedef enum CkptDtype {
    CKPT_DTYPE_F32,
    CKPT_DTYPE_F16,
    CKPT_DTYPE_BF16,
    CKPT_DTYPE_F8_E4M3,
    CKPT_DTYPE_U8,
    CKPT_DTYPE_I8,
    CKPT_DTYPE_I32,
    CKPT_DTYPE_I64,
    CKPT_DTYPE_F64,
    CKPT_DTYPE_BOOL,
} CkptDtype;

typedef struct CkptTensor {
    const char *name;  // owned by the Ckpt
    CkptDtype dtype;
    int n_dims;  // 0 for a scalar
    int64_t shape[CKPT_MAX_DIMS];
    const void *data;  // into the shard's mapping; little-endian, row-major
    size_t n_bytes;
    int shard;  // index into the Ckpt's shard list
} CkptTensor;

typedef struct CkptShard CkptShard;

typedef struct Ckpt {
    char *dir;  // owned copy of the model directory
    CkptShard *shards;
    int n_shards;
    CkptTensor *tensors;  // sorted by name for ckpt_find()
    int n_tensors;
    size_t n_bytes_mapped;
} Ckpt;

typedef enum CkptLinearFormat {
    CKPT_LINEAR_F32,
    CKPT_LINEAR_F16,
    CKPT_LINEAR_BF16,
    CKPT_LINEAR_FP8,    // e4m3 codes; scale per tensor or per 128x128 block
    CKPT_LINEAR_NVFP4,  // e2m1 codes, e4m3 group scales, f32 global scale
} CkptLinearFormat;

// One linear layer's weight, W: [rows = out features, cols = in features], in the stored
// format. Pointers borrow from the Ckpt.
typedef struct CkptLinear {
    CkptLinearFormat format;
    int rows;
    int cols;
    const void *data;      // F32/F16/BF16: [rows, cols]; FP8: u8 [rows, cols];
                           // NVFP4: u8 [rows, cols / 2], low nibble first
    const uint8_t *scale;  // NVFP4: e4m3 [rows, cols / 16]; FP8 block: f32 via scale_f32
    const float *scale_f32;  // FP8 block scales [ceil(rows/128), ceil(cols/128)] or NULL
    float global_scale;      // NVFP4: multiply (ModelOpt) or 1/weight_global_scale (CT);
                             // FP8 per-tensor scale; 1 otherwise
    const char *name;        // the tensor's base name (owned by the Ckpt)
} CkptLinear;

// Open the checkpoint in model_dir: read and validate every shard header and map the shards.
// On failure *ck is zeroed and the reason (file, tensor) has been logged.
Err ckpt_open(Ckpt *ck, const char *model_dir);

// Unmap and free everything; safe on a zeroed Ckpt; zeroes *ck.
void ckpt_close(Ckpt *ck);

// The tensor called name, or NULL.
const CkptTensor *ckpt_find(const Ckpt *ck, const char *name);

// Path of the shard that holds t (owned by the Ckpt).
const char *ckpt_shard_path(const Ckpt *ck, const CkptTensor *t);

// Look up tensor `name`, check its shape equals shape[0..n_dims) (any dtype in
// allowed_dtypes mask, a bit per CkptDtype), and return it. Errors name tensor and file.
Err ckpt_get(const Ckpt *ck, const char *name, int n_dims, const int64_t *shape,
             unsigned allowed_dtypes, const CkptTensor **out);

// Resolve the linear weight with base name `base` (e.g. "model.layers.3.mlp.experts.7.up_proj")
// of logical shape [rows, cols], deciding the format from the tensors present.
Err ckpt_linear(const Ckpt *ck, const char *base, int rows, int cols, CkptLinear *out);

// Parse one safetensors header (the 8-byte length prefix and the JSON that follows) held in
// buf[0..len), for a file of file_size bytes. Used by ckpt_open and the fuzz target; on
// success *n_tensors_out tensors are described (names point into an allocation returned in
// *names_out, which the caller frees with free()). Never crashes on any bytes.
Err ckpt_parse_header(const uint8_t *buf, size_t len, uint64_t file_size, const char *origin,
                      CkptTensor **tensors_out, int *n_tensors_out, char **names_out);

// Element size of dtype in bytes.
size_t ckpt_dtype_size(CkptDtype dtype);

// Name as safetensors spells it ("BF16", "F8_E4M3", ...).
const char *ckpt_dtype_name(CkptDtype dtype);

// Dequantize row r of w into out (float [w->cols]).
void ckpt_linear_row(const CkptLinear *w, int r, float *out);

// ---------------------------------------------------------------------------
// Additions for pipeline-parallel loading, progress and inspection.

// Bit of dtype in ckpt_get()'s allowed_dtypes mask.
#define CKPT_DTYPE_BIT(dtype) (1u << (unsigned) (dtype))
#define CKPT_DTYPE_ANY        0xffffffffu

// Keep-predicate for ckpt_open_filtered(): true for tensor names this process needs.
typedef bool (*CkptFilter)(const char *name, void *user);

// As ckpt_open(), but only tensors for which keep(name, user) is true are entered, and only
// shards that hold at least one of them are read and mapped (decided from the index, so a
// pipeline rank never touches the other ranks' shards). keep == NULL keeps everything.
Err ckpt_open_filtered(Ckpt *ck, const char *model_dir, CkptFilter keep, void *user);

// Drop t's bytes from this process and from the page cache (madvise + posix_fadvise
// DONTNEED) once they have been consumed (copied to the GPU, repacked). t->data stays valid:
// a later read faults the pages back in from the file. Best effort; never fails.
void ckpt_release(const Ckpt *ck, const CkptTensor *t);

typedef struct CkptTouchStats {
    uint64_t n_bytes;   // tensor bytes read
    double seconds;     // wall time
    double gb_per_s;    // n_bytes / seconds / 1e9
    uint64_t checksum;  // sum of the 64-bit little-endian words read (defeats dead-code removal)
} CkptTouchStats;

// Read every byte of every tensor once (faulting the mappings in), logging progress (bytes,
// GB/s, ETA) at info level. stats may be NULL. Always succeeds on an opened Ckpt.
void ckpt_touch(const Ckpt *ck, CkptTouchStats *stats);

// "BF16", "NVFP4", ... for messages and `inspect`. Static storage.
const char *ckpt_linear_format_name(CkptLinearFormat format);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_MODEL_CHECKPOINT_H
