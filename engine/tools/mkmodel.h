/*
 * mkmodel.h - write a small random GlmMoeDsa checkpoint in exactly the on-disk format of the
 * real NVFP4 ones (config.json, hf_quant_config.json, sharded safetensors with an index,
 * generation_config.json, optionally a tokenizer.json with GLM's special tokens).
 *
 * Routed experts are quantized with ModelOpt's NVFP4 recipe from random bf16 weights;
 * everything else is BF16 (e_score_correction_bias and the indexer's weights_proj F32), as
 * in the published GLM-5.2 NVFP4 checkpoints. The MTP layer, when the preset has one, keeps
 * BF16 experts as NVIDIA's export does. Output is a pure function of (preset, seed,
 * tokenizer): every tensor is drawn from a generator seeded by the seed and the tensor's
 * name, so mkmodel_reference() can reproduce any weight without reading the files.
 *
 * Ownership: nothing outlives a call; out_dir and its missing parents are created.
 * Threads:   reentrant.
 * Errors:    ERR_INVAL (unknown preset, bad tokenizer.json), ERR_IO (cannot write), logged
 *            with the path.
 */
#ifndef ENGINE_TOOLS_MKMODEL_H
#define ENGINE_TOOLS_MKMODEL_H

#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct MkmodelOptions {
    const char *out_dir;
    const char *preset;  // "tiny", "default" or "small"; NULL means "default"
    uint64_t seed;
    const char *tokenizer;  // tokenizer.json to copy and extend, or NULL
} MkmodelOptions;

// Write the checkpoint described by opt into opt->out_dir (files are overwritten).
Err mkmodel_write(const MkmodelOptions *opt);

// The preset names, NULL-terminated. Static storage.
const char *const *mkmodel_presets(void);

// The exact float values (bf16-representable) mkmodel drew for the linear weight `base`
// (e.g. "model.layers.3.mlp.experts.1.up_proj") of shape [rows, cols] under seed, before
// any quantization: out is float [rows, cols].
void mkmodel_reference(uint64_t seed, const char *base, int rows, int cols, float *out);

// Quantize w (float [rows, cols], cols % 16 == 0) with ModelOpt's NVFP4 recipe:
// scale_2 = amax / (6 * 448); scale[r, g] = e4m3(block_amax / (6 * scale_2)) (zero blocks
// 1.0); codes = E2M1 round-to-nearest-even of w / (scale * scale_2), element 2j in the low
// nibble. codes: u8 [rows, cols / 2]; scale: e4m3 [rows, cols / 16].
void mkmodel_quantize_nvfp4(const float *w, int rows, int cols, uint8_t *codes, uint8_t *scale,
                            float *scale_2);

// Round x to the nearest E4M3 ("fn") code, ties to even, saturating at 448.
uint8_t mkmodel_float_to_e4m3(float x);

struct json_object;

// Append to added (a json-c array, tokenizer.json's "added_tokens") the entry of special
// token content with id: not single_word, lstrip, rstrip or normalized; special.
void mkmodel_add_special_token(struct json_object *added, int id, const char *content);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_TOOLS_MKMODEL_H
