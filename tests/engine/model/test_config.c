/*
 * test_config.c - config.json / hf_quant_config.json parsing against transformers'
 * GlmMoeDsaConfig semantics (transformers 5.17 configuration_glm_moe_dsa.py).
 *
 * Expected values come from that file: its defaults, its indexer_types rule
 * (full iff max(i - offset + 1, 0) % freq == 0, defaults offset 2 / freq 1), its
 * mlp_layer_types rule (first_k_dense_replace dense layers), and from the GLM-5.2 config
 * published by zai-org (zai-org/GLM-5.2 config.json: 21 full layers {0,1,2,6,10,...,74}).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/model/config.h"
#include "tests/check.h"

static ModelConfig cfg;

static Err parse(const char *json)
{
    return config_parse(&cfg, json, strlen(json), NULL, 0, "test/config.json");
}

static Err parse_q(const char *json, const char *quant)
{
    return config_parse(&cfg, json, strlen(json), quant, strlen(quant), "test/config.json");
}

static bool is_zero(const ModelConfig *c)
{
    const unsigned char *p = (const unsigned char *) c;
    for (size_t i = 0; i < sizeof *c; i++) {
        if (p[i]) return false;
    }
    return true;
}

static void test_defaults(void)
{
    CHECK(parse("{}") == ERR_OK);
    CHECK(cfg.vocab_size == 154880 && cfg.hidden_size == 6144 && cfg.n_layers == 78);
    CHECK(cfg.n_mtp_layers == 0);
    CHECK(cfg.n_heads == 64 && cfg.q_lora_rank == 2048 && cfg.kv_lora_rank == 512);
    CHECK(cfg.qk_nope_head_dim == 192 && cfg.qk_rope_head_dim == 64 && cfg.v_head_dim == 256);
    CHECK(config_qk_head_dim(&cfg) == 256);
    CHECK_NEAR(cfg.rope_theta, 10000.0, 0);
    CHECK(cfg.rope_interleave && cfg.indexer_rope_interleave);
    CHECK_NEAR(cfg.rms_norm_eps, 1e-5, 1e-12);
    CHECK_NEAR(cfg.attn_norm_eps, 1e-6, 1e-13);
    CHECK(cfg.max_position_embeddings == 202752);
    CHECK(cfg.index_n_heads == 32 && cfg.index_head_dim == 128 && cfg.index_topk == 2048);
    CHECK(cfg.intermediate_size == 12288 && cfg.moe_intermediate_size == 2048);
    CHECK(cfg.n_routed_experts == 256 && cfg.n_shared_experts == 1);
    CHECK(cfg.n_experts_per_tok == 8 && cfg.n_group == 1 && cfg.topk_group == 1);
    CHECK(cfg.norm_topk_prob);
    CHECK_NEAR(cfg.routed_scaling_factor, 2.5, 0);
    CHECK(!cfg.tie_word_embeddings);
    CHECK(cfg.n_eos_ids == 1 && cfg.eos_ids[0] == 1);  // transformers' default eos_token_id
    CHECK(cfg.pad_id == -1);
    CHECK(cfg.quant == CONFIG_QUANT_NONE);
    // Default indexer rule (freq 1): every layer full. Default first_k_dense_replace = 3.
    int n_full = 0, n_dense = 0;
    for (int i = 0; i < 78; i++) {
        n_full += cfg.indexer[i] == CONFIG_INDEXER_FULL;
        n_dense += cfg.mlp[i] == CONFIG_MLP_DENSE;
    }
    CHECK(n_full == 78);
    CHECK(n_dense == 3 && cfg.mlp[2] == CONFIG_MLP_DENSE && cfg.mlp[3] == CONFIG_MLP_MOE);
}

// GLM-5.2 as published (rope_parameters spelling, freq/offset rule, no indexer_types) with
// the 469B's REAP count.
static const char *glm52 =
    "{\"architectures\": [\"GlmMoeDsaForCausalLM\"], \"model_type\": \"glm_moe_dsa\","
    " \"eos_token_id\": [154820, 154827, 154829], \"pad_token_id\": 154820,"
    " \"first_k_dense_replace\": 3, \"hidden_size\": 6144, \"index_head_dim\": 128,"
    " \"index_n_heads\": 32, \"index_skip_topk_offset\": 3, \"index_topk\": 2048,"
    " \"index_topk_freq\": 4, \"index_topk_pattern\": null, \"kv_lora_rank\": 512,"
    " \"max_position_embeddings\": 1048576, \"moe_intermediate_size\": 2048,"
    " \"n_group\": 1, \"n_routed_experts\": 156, \"n_shared_experts\": 1,"
    " \"norm_topk_prob\": true, \"num_attention_heads\": 64, \"num_experts_per_tok\": 8,"
    " \"num_hidden_layers\": 78, \"num_nextn_predict_layers\": 1, \"q_lora_rank\": 2048,"
    " \"qk_nope_head_dim\": 192, \"qk_rope_head_dim\": 64, \"v_head_dim\": 256,"
    " \"rms_norm_eps\": 1e-05, \"rope_interleave\": true,"
    " \"rope_parameters\": {\"rope_theta\": 8000000, \"rope_type\": \"default\"},"
    " \"routed_scaling_factor\": 2.5, \"tie_word_embeddings\": false, \"topk_group\": 1,"
    " \"vocab_size\": 154880, \"head_dim\": 192, \"scoring_func\": \"sigmoid\"}";

static void test_glm52(void)
{
    CHECK(parse(glm52) == ERR_OK);
    CHECK(!strcmp(cfg.architecture, "GlmMoeDsaForCausalLM"));
    CHECK(!strcmp(cfg.model_type, "glm_moe_dsa"));
    CHECK(cfg.n_routed_experts == 156);
    CHECK_NEAR(cfg.rope_theta, 8e6, 0);
    CHECK(cfg.max_position_embeddings == 1048576);
    CHECK(cfg.n_mtp_layers == 1);
    CHECK(cfg.n_eos_ids == 3 && cfg.eos_ids[0] == 154820 && cfg.eos_ids[2] == 154829);
    CHECK(cfg.pad_id == 154820);
    int n_full = 0;
    for (int i = 0; i < 78; i++) {
        const bool want = i < 3 || (i - 2) % 4 == 0;
        CHECK((cfg.indexer[i] == CONFIG_INDEXER_FULL) == want);
        CHECK(cfg.indexer[i] != CONFIG_INDEXER_NONE);
        n_full += want;
    }
    CHECK(n_full == 21);
    CHECK(cfg.indexer[78] == CONFIG_INDEXER_FULL && cfg.mlp[78] == CONFIG_MLP_MOE);
    CHECK(cfg.mlp[0] == CONFIG_MLP_DENSE && cfg.mlp[2] == CONFIG_MLP_DENSE);
    CHECK(cfg.mlp[3] == CONFIG_MLP_MOE && cfg.mlp[77] == CONFIG_MLP_MOE);
}

static void test_spellings(void)
{
    // Top-level rope_theta (GLM-5 and older configs).
    CHECK(parse("{\"rope_theta\": 1000000}") == ERR_OK);
    CHECK_NEAR(cfg.rope_theta, 1e6, 0);
    // Legacy rope_scaling dict.
    CHECK(parse("{\"rope_scaling\": {\"rope_theta\": 500000, \"type\": \"default\"}}") == ERR_OK);
    CHECK_NEAR(cfg.rope_theta, 5e5, 0);
    // Explicit lists override the rules.
    CHECK(parse("{\"num_hidden_layers\": 4, \"indexer_types\": [\"full\", \"shared\", \"full\","
                " \"shared\"], \"mlp_layer_types\": [\"dense\", \"sparse\", \"dense\", \"sparse\"],"
                " \"index_topk_freq\": 1}")
          == ERR_OK);
    CHECK(cfg.indexer[0] == CONFIG_INDEXER_FULL && cfg.indexer[1] == CONFIG_INDEXER_SHARED);
    CHECK(cfg.indexer[2] == CONFIG_INDEXER_FULL && cfg.indexer[3] == CONFIG_INDEXER_SHARED);
    CHECK(cfg.mlp[0] == CONFIG_MLP_DENSE && cfg.mlp[1] == CONFIG_MLP_MOE);
    CHECK(cfg.mlp[2] == CONFIG_MLP_DENSE && cfg.mlp[3] == CONFIG_MLP_MOE);
    // index_topk_pattern, string form.
    CHECK(parse("{\"num_hidden_layers\": 4, \"index_topk_pattern\": \"FSSF\"}") == ERR_OK);
    CHECK(cfg.indexer[1] == CONFIG_INDEXER_SHARED && cfg.indexer[3] == CONFIG_INDEXER_FULL);
    // Rule with offset 1, freq 2: max(i, 0) % 2 == 0.
    CHECK(parse("{\"num_hidden_layers\": 5, \"index_topk_freq\": 2,"
                " \"index_skip_topk_offset\": 1}")
          == ERR_OK);
    CHECK(cfg.indexer[0] == CONFIG_INDEXER_FULL && cfg.indexer[1] == CONFIG_INDEXER_SHARED);
    CHECK(cfg.indexer[4] == CONFIG_INDEXER_FULL);
    // index_topk <= 0: no DSA anywhere.
    CHECK(parse("{\"num_hidden_layers\": 2, \"index_topk\": 0, \"num_nextn_predict_layers\": 1}")
          == ERR_OK);
    CHECK(cfg.indexer[0] == CONFIG_INDEXER_NONE && cfg.indexer[2] == CONFIG_INDEXER_NONE);
    // first_k_dense_replace beyond the layer count: all dense.
    CHECK(parse("{\"num_hidden_layers\": 2, \"first_k_dense_replace\": 9}") == ERR_OK);
    CHECK(cfg.mlp[0] == CONFIG_MLP_DENSE && cfg.mlp[1] == CONFIG_MLP_DENSE);
    // eos as a single int; q_lora_rank null; the num_experts alias; pad null.
    CHECK(parse("{\"eos_token_id\": 7, \"q_lora_rank\": null, \"num_experts\": 12,"
                " \"pad_token_id\": null}")
          == ERR_OK);
    CHECK(cfg.n_eos_ids == 1 && cfg.eos_ids[0] == 7);
    CHECK(cfg.q_lora_rank == 0 && cfg.n_routed_experts == 12 && cfg.pad_id == -1);
    // Integral doubles are accepted for integer fields.
    CHECK(parse("{\"hidden_size\": 128.0}") == ERR_OK && cfg.hidden_size == 128);
}

static void expect_fail(const char *json, Err want)
{
    memset(&cfg, 0x5a, sizeof cfg);
    const Err err = parse(json);
    CHECK(err == want);
    CHECK(is_zero(&cfg));  // failure leaves zero
    if (err != want) fprintf(stderr, "  input: %s\n", json);
}

static void test_errors(void)
{
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    expect_fail("", ERR_FORMAT);
    expect_fail("{", ERR_FORMAT);
    expect_fail("[]", ERR_FORMAT);
    expect_fail("{} {}", ERR_FORMAT);
    expect_fail("{\"hidden_size\": \"64\"}", ERR_FORMAT);
    expect_fail("{\"hidden_size\": 64.5}", ERR_FORMAT);
    expect_fail("{\"hidden_size\": 0}", ERR_INVAL);
    expect_fail("{\"hidden_size\": -64}", ERR_INVAL);
    expect_fail("{\"hidden_size\": 1e300}", ERR_FORMAT);
    expect_fail("{\"vocab_size\": 99999999999}", ERR_INVAL);
    expect_fail("{\"num_hidden_layers\": 300}", ERR_INVAL);
    expect_fail("{\"num_hidden_layers\": 250, \"num_nextn_predict_layers\": 10}", ERR_INVAL);
    expect_fail("{\"vocab_size\": 4000000, \"hidden_size\": 131072}", ERR_INVAL);  // overflow
    expect_fail("{\"num_attention_heads\": 1024, \"qk_nope_head_dim\": 4096,"
                " \"v_head_dim\": 4096, \"qk_rope_head_dim\": 4096}",
                ERR_INVAL);
    expect_fail("{\"qk_rope_head_dim\": 63}", ERR_INVAL);
    expect_fail("{\"rms_norm_eps\": \"1e-5\"}", ERR_FORMAT);
    expect_fail("{\"rms_norm_eps\": -1}", ERR_INVAL);
    expect_fail("{\"norm_topk_prob\": 1}", ERR_FORMAT);
    expect_fail("{\"architectures\": \"GlmMoeDsaForCausalLM\"}", ERR_FORMAT);
    expect_fail("{\"architectures\": [3]}", ERR_FORMAT);
    expect_fail("{\"eos_token_id\": \"</s>\"}", ERR_FORMAT);
    expect_fail("{\"eos_token_id\": [1, \"x\"]}", ERR_FORMAT);
    expect_fail("{\"eos_token_id\": 154880}", ERR_INVAL);
    expect_fail("{\"eos_token_id\": [1,2,3,4,5,6,7,8,9]}", ERR_INVAL);
    expect_fail("{\"pad_token_id\": 200000}", ERR_INVAL);
    expect_fail("{\"num_hidden_layers\": 3, \"indexer_types\": [\"full\"]}", ERR_INVAL);
    expect_fail("{\"num_hidden_layers\": 2, \"indexer_types\": [\"full\", \"dense\"]}", ERR_FORMAT);
    expect_fail("{\"num_hidden_layers\": 2, \"indexer_types\": [\"full\", 1]}", ERR_FORMAT);
    expect_fail("{\"num_hidden_layers\": 2, \"indexer_types\": [\"shared\", \"full\"]}", ERR_INVAL);
    expect_fail("{\"num_hidden_layers\": 2, \"indexer_types\": {}}", ERR_FORMAT);
    expect_fail("{\"num_hidden_layers\": 2, \"mlp_layer_types\": [\"dense\"]}", ERR_INVAL);
    expect_fail("{\"num_hidden_layers\": 2, \"mlp_layer_types\": [\"dense\", \"x\"]}", ERR_FORMAT);
    expect_fail("{\"num_experts_per_tok\": 9, \"n_routed_experts\": 8}", ERR_INVAL);
    expect_fail("{\"n_group\": 3}", ERR_INVAL);  // 256 experts do not split in 3 groups
    expect_fail("{\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4}}", ERR_INVAL);
    expect_fail("{\"rope_parameters\": 5}", ERR_FORMAT);
    expect_fail("{\"index_head_dim\": 32}", ERR_INVAL);  // smaller than the rope dims
    expect_fail("{\"quantization_config\": {\"quant_method\": \"awq\"}}", ERR_INVAL);
    expect_fail("{\"quantization_config\": {\"quant_method\": \"modelopt\","
                " \"quant_algo\": \"W4A8_AWQ\"}}",
                ERR_INVAL);
    expect_fail("{\"quantization_config\": []}", ERR_FORMAT);
    expect_fail("{\"hidden_act\": \"gelu\"}", ERR_INVAL);
    expect_fail("{\"scoring_func\": \"softmax\"}", ERR_INVAL);
    expect_fail("{\"attention_bias\": true}", ERR_INVAL);
    expect_fail("{\"mlp_bias\": \"no\"}", ERR_FORMAT);
    log_set_level(LOG_LEVEL_WARN);
    // A NUL inside the given length is not JSON either; but text after `len` is ignored.
    const char text[] = "{\"hidden_size\": 32}garbage";
    CHECK(config_parse(&cfg, text, 19, NULL, 0, "t") == ERR_OK && cfg.hidden_size == 32);
}

static void test_quant(void)
{
    // hf_quant_config.json (ModelOpt), as NVIDIA ships it.
    const char *hf = "{\"producer\": {\"name\": \"modelopt\", \"version\": \"0.37.0\"},"
                     " \"quantization\": {\"quant_algo\": \"NVFP4\", \"kv_cache_quant_algo\":"
                     " \"FP8\", \"group_size\": 16, \"exclude_modules\": [\"lm_head\","
                     " \"model.layers.*.self_attn*\", \"model.layers.78*\"]}}";
    CHECK(parse_q("{}", hf) == ERR_OK);
    CHECK(cfg.quant == CONFIG_QUANT_NVFP4_MODELOPT && cfg.quant_group_size == 16);
    CHECK(cfg.kv_cache_fp8 && cfg.n_excludes == 3);
    CHECK(!strcmp(cfg.excludes[2], "model.layers.78*"));
    // config.json quantization_config, ModelOpt.
    CHECK(parse("{\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\":"
                " \"NVFP4\", \"group_size\": 16, \"ignore\": [\"lm_head\"],"
                " \"kv_cache_scheme\": {\"num_bits\": 8}}}")
          == ERR_OK);
    CHECK(cfg.quant == CONFIG_QUANT_NVFP4_MODELOPT && cfg.kv_cache_fp8 && cfg.n_excludes == 1);
    // compressed-tensors NVFP4, format inside config_groups.
    CHECK(parse("{\"quantization_config\": {\"quant_method\": \"compressed-tensors\","
                " \"config_groups\": {\"group_0\": {\"format\": \"nvfp4-pack-quantized\","
                " \"weights\": {\"num_bits\": 4, \"group_size\": 16}, \"targets\": [\"Linear\"]}},"
                " \"ignore\": [\"lm_head\", \"re:.*mlp.gate$\"]}}")
          == ERR_OK);
    CHECK(cfg.quant == CONFIG_QUANT_NVFP4_CT && cfg.quant_group_size == 16);
    CHECK(!cfg.kv_cache_fp8 && cfg.n_excludes == 2);
    // compressed-tensors, top-level format.
    CHECK(parse("{\"quantization_config\": {\"quant_method\": \"compressed-tensors\","
                " \"format\": \"nvfp4-pack-quantized\"}}")
          == ERR_OK);
    CHECK(cfg.quant == CONFIG_QUANT_NVFP4_CT);
    // FP8 (DeepSeek style block quantization).
    CHECK(parse("{\"quantization_config\": {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\","
                " \"weight_block_size\": [128, 128]}}")
          == ERR_OK);
    CHECK(cfg.quant == CONFIG_QUANT_FP8);
    // hf_quant_config.json wins over quantization_config.
    CHECK(parse_q("{\"quantization_config\": {\"quant_method\": \"fp8\"}}", hf) == ERR_OK);
    CHECK(cfg.quant == CONFIG_QUANT_NVFP4_MODELOPT);
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    CHECK(parse_q("{}", "{\"quantization\": 3}") == ERR_FORMAT);
    CHECK(parse_q("{}", "not json") == ERR_FORMAT);
    CHECK(parse_q("{}", "{\"quantization\": {\"quant_algo\": \"INT4\"}}") == ERR_INVAL);
    log_set_level(LOG_LEVEL_WARN);
}

static void test_load(void)
{
    char dir[256], path[300];
    const char *base = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/glmspark_cfg_XXXXXX", base ? base : "/tmp");
    CHECK(mkdtemp(dir) != NULL);
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    CHECK(config_load(&cfg, dir) == ERR_IO);  // no config.json
    log_set_level(LOG_LEVEL_WARN);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    fputs(glm52, f);
    fclose(f);
    CHECK(config_load(&cfg, dir) == ERR_OK);
    CHECK(cfg.n_routed_experts == 156 && cfg.quant == CONFIG_QUANT_NONE);
    snprintf(path, sizeof path, "%s/hf_quant_config.json", dir);
    f = fopen(path, "w");
    fputs("{\"quantization\": {\"quant_algo\": \"NVFP4\", \"group_size\": 16}}", f);
    fclose(f);
    CHECK(config_load(&cfg, dir) == ERR_OK);
    CHECK(cfg.quant == CONFIG_QUANT_NVFP4_MODELOPT && !cfg.kv_cache_fp8);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    log_set_level(LOG_LEVEL_WARN);
    test_defaults();
    test_glm52();
    test_spellings();
    test_errors();
    test_quant();
    test_load();
    return check_exit();
}
