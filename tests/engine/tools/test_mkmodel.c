/*
 * test_mkmodel.c - mkmodel round trip: write the tiny preset, read it back through
 * config_load and ckpt_open, and compare every weight with the values mkmodel drew.
 *
 * NVFP4 error bound. For one 16-element block with effective scale s = e4m3(q) * scale_2,
 * each element x = w / s is rounded to the nearest E2M1 value. The E2M1 grid
 * {0, .5, 1, 1.5, 2, 3, 4, 6} has spacing 0.5 on [0, 2], 1 on [2, 4] and 2 on [4, 6], so
 * the rounding error is at most half a spacing: 0.25 s for |x| <= 2, 0.5 s for |x| <= 4,
 * 1 s for |x| <= 6. Because q was rounded to E4M3 (3 mantissa bits, relative error up to
 * 2^-4), |x| can exceed 6 by up to 6 / (1 - 2^-4) - 6 = 0.4; it then saturates to 6, an
 * error of |x| - 6 (< 1 s). The test bounds each element by that formula (plus 1e-6
 * relative for float arithmetic) and the aggregate NMSE by sum(bound^2) / sum(w^2).
 */
#include <dirent.h>
#include <json-c/json.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/cli/cli.h"
#include "engine/model/checkpoint.h"
#include "engine/model/config.h"
#include "engine/tools/mkmodel.h"
#include "kernels/nvfp4_format.h"
#include "tests/check.h"

static char tmp_root[256];

static double e2m1_bound(double x_abs)
{
    if (x_abs <= 2.0) return 0.25;
    if (x_abs <= 4.0) return 0.5;
    if (x_abs <= 6.0) return 1.0;
    return x_abs - 6.0;
}

typedef struct Errs {
    double sum_err2, sum_bound2, sum_w2, max_ratio;
    long n_over;
} Errs;

// Compare the dequantized weight `base` [rows, cols] with mkmodel's originals.
static void compare_linear(const Ckpt *ck, uint64_t seed, const char *base, int rows, int cols,
                           CkptLinearFormat want_format, Errs *e)
{
    CkptLinear w;
    const Err err = ckpt_linear(ck, base, rows, cols, &w);
    CHECK(err == ERR_OK);
    if (err) return;
    CHECK(w.format == want_format);
    float *ref = malloc((size_t) rows * (size_t) cols * sizeof *ref);
    float *row = malloc((size_t) cols * sizeof *row);
    mkmodel_reference(seed, base, rows, cols, ref);
    for (int r = 0; r < rows; r++) {
        ckpt_linear_row(&w, r, row);
        for (int c = 0; c < cols; c++) {
            const double want = ref[(size_t) r * (size_t) cols + (size_t) c];
            const double diff = fabs(row[c] - want);
            double bound = 0.0;
            if (w.format == CKPT_LINEAR_NVFP4) {
                const double s = nvfp4_e4m3_to_float(
                                     w.scale[(size_t) r * (size_t) (cols / 16) + (size_t) (c / 16)])
                                 * w.global_scale;
                bound = s * e2m1_bound(fabs(want) / s) + 1e-6 * fabs(want);
            }
            if (diff > bound) e->n_over++;
            if (bound > 0) e->max_ratio = fmax(e->max_ratio, diff / bound);
            e->sum_err2 += diff * diff;
            e->sum_bound2 += bound * bound;
            e->sum_w2 += want * want;
        }
    }
    free(ref);
    free(row);
}

static bool keep_layer3(const char *name, void *user)
{
    (void) user;
    return strncmp(name, "model.layers.3.", 15) == 0;
}

static void test_round_trip(void)
{
    char dir[300];
    snprintf(dir, sizeof dir, "%s/tiny", tmp_root);
    const uint64_t seed = 1234;
    MkmodelOptions opt = {.out_dir = dir, .preset = "tiny", .seed = seed};
    CHECK(mkmodel_write(&opt) == ERR_OK);

    ModelConfig *cfg = malloc(sizeof *cfg);
    CHECK(config_load(cfg, dir) == ERR_OK);
    CHECK(!strcmp(cfg->architecture, "GlmMoeDsaForCausalLM"));
    CHECK(cfg->hidden_size == 64 && cfg->vocab_size == 512 && cfg->n_layers == 4);
    CHECK(cfg->n_mtp_layers == 1 && cfg->index_topk == 8);
    CHECK(cfg->n_routed_experts == 8 && cfg->n_experts_per_tok == 2);
    CHECK(cfg->mlp[0] == CONFIG_MLP_DENSE && cfg->mlp[1] == CONFIG_MLP_MOE);
    CHECK(cfg->indexer[0] == CONFIG_INDEXER_FULL && cfg->indexer[1] == CONFIG_INDEXER_SHARED);
    CHECK(cfg->indexer[2] == CONFIG_INDEXER_FULL && cfg->indexer[4] == CONFIG_INDEXER_FULL);
    CHECK(cfg->quant == CONFIG_QUANT_NVFP4_MODELOPT && cfg->quant_group_size == 16);
    CHECK(cfg->n_excludes >= 5);
    // Without a tokenizer the specials are the last 17 ids; <|endoftext|> is the last.
    CHECK(cfg->n_eos_ids == 3 && cfg->eos_ids[0] == 511 && cfg->pad_id == 511);

    Ckpt ck;
    CHECK(ckpt_open(&ck, dir) == ERR_OK);
    CHECK(ck.n_shards >= 2);
    size_t total = 0;
    for (int i = 0; i < ck.n_tensors; i++) {
        total += ck.tensors[i].n_bytes;
        // Aligned, as safetensors' writer guarantees by sorting on dtype.
        CHECK((uintptr_t) ck.tensors[i].data % ckpt_dtype_size(ck.tensors[i].dtype) == 0);
    }
    CHECK(total < 2u << 20);

    const int H = cfg->hidden_size, MI = cfg->moe_intermediate_size;
    Errs fp4 = {0}, bf = {0};
    char base[160];
    for (int l = 1; l < cfg->n_layers + cfg->n_mtp_layers; l++) {
        // Experts are NVFP4 in decoder layers and BF16 in the MTP layer (NVIDIA's export).
        const CkptLinearFormat f = l < cfg->n_layers ? CKPT_LINEAR_NVFP4 : CKPT_LINEAR_BF16;
        for (int e = 0; e < cfg->n_routed_experts; e++) {
            snprintf(base, sizeof base, "model.layers.%d.mlp.experts.%d.gate_proj", l, e);
            compare_linear(&ck, seed, base, MI, H, f, f == CKPT_LINEAR_NVFP4 ? &fp4 : &bf);
            snprintf(base, sizeof base, "model.layers.%d.mlp.experts.%d.down_proj", l, e);
            compare_linear(&ck, seed, base, H, MI, f, f == CKPT_LINEAR_NVFP4 ? &fp4 : &bf);
        }
        snprintf(base, sizeof base, "model.layers.%d.mlp.shared_experts.up_proj", l);
        compare_linear(&ck, seed, base, MI, H, CKPT_LINEAR_BF16, &bf);
    }
    snprintf(base, sizeof base, "model.layers.0.self_attn.q_b_proj");
    compare_linear(&ck, seed, base, cfg->n_heads * config_qk_head_dim(cfg), cfg->q_lora_rank,
                   CKPT_LINEAR_BF16, &bf);
    compare_linear(&ck, seed, "model.layers.0.self_attn.indexer.weights_proj", cfg->index_n_heads,
                   H, CKPT_LINEAR_F32, &bf);
    compare_linear(&ck, seed, "lm_head", cfg->vocab_size, H, CKPT_LINEAR_BF16, &bf);
    compare_linear(&ck, seed, "model.layers.4.eh_proj", H, 2 * H, CKPT_LINEAR_BF16, &bf);
    CHECK(fp4.n_over == 0);
    CHECK(fp4.sum_err2 <= fp4.sum_bound2);
    CHECK(fp4.sum_err2 > 0);  // it really was quantized
    printf("nvfp4 round trip: NMSE %.3g (bound %.3g), max error / bound %.3f\n",
           fp4.sum_err2 / fp4.sum_w2, fp4.sum_bound2 / fp4.sum_w2, fp4.max_ratio);
    CHECK(bf.sum_err2 == 0.0 && bf.n_over == 0);  // BF16 and F32 tensors are exact

    // The router bias is F32, the indexer LayerNorm has a bias, the MTP layer its norms.
    const CkptTensor *t = ckpt_find(&ck, "model.layers.1.mlp.gate.e_score_correction_bias");
    CHECK(t && t->dtype == CKPT_DTYPE_F32 && t->n_dims == 1 && t->shape[0] == 8);
    CHECK(ckpt_find(&ck, "model.layers.0.self_attn.indexer.k_norm.bias") != NULL);
    CHECK(ckpt_find(&ck, "model.layers.1.self_attn.indexer.wk.weight") == NULL);  // shared
    CHECK(ckpt_find(&ck, "model.layers.4.shared_head.norm.weight") != NULL);
    t = ckpt_find(&ck, "model.layers.2.mlp.experts.0.up_proj.weight_scale_2");
    CHECK(t && t->n_dims == 0 && t->dtype == CKPT_DTYPE_F32);
    CHECK(ckpt_find(&ck, "model.layers.2.mlp.experts.0.up_proj.input_scale") != NULL);
    int n_layer3 = 0;
    for (int i = 0; i < ck.n_tensors; i++) {
        n_layer3 += keep_layer3(ck.tensors[i].name, NULL);
    }
    ckpt_close(&ck);

    // A pipeline rank that owns layer 3 maps one shard: mkmodel never splits a layer.
    CHECK(ckpt_open_filtered(&ck, dir, keep_layer3, NULL) == ERR_OK);
    CHECK(ck.n_shards == 1 && ck.n_tensors == n_layer3 && n_layer3 > 0);
    ckpt_close(&ck);

    // inspect accepts it; a damaged copy makes it exit 1.
    char *argv[] = {"inspect", "--model", dir, NULL};
    CHECK(cli_inspect(3, argv) == 0);
    char *bad_argv[] = {"inspect", "--model", tmp_root, NULL};
    CHECK(cli_inspect(3, bad_argv) == 1);
    free(cfg);
}

static int files_equal(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb;
    while (same) {
        const int ca = fgetc(fa), cb = fgetc(fb);
        if (ca != cb) same = 0;
        if (ca == EOF || cb == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

// Whether the two-shard checkpoints in directories a and b have byte-identical files.
static bool checkpoints_equal(const char *a, const char *b)
{
    const char *files[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "config.json", "model.safetensors.index.json"};
    char pa[400], pb[400];
    bool same = true;
    for (int i = 0; i < 4; i++) {
        snprintf(pa, sizeof pa, "%s/%s", a, files[i]);
        snprintf(pb, sizeof pb, "%s/%s", b, files[i]);
        same = same && files_equal(pa, pb);
    }
    return same;
}

static void test_determinism(void)
{
    char a[300], b[300], c[300], pa[400], pc[400];
    snprintf(a, sizeof a, "%s/det_a", tmp_root);
    snprintf(b, sizeof b, "%s/det_b", tmp_root);
    snprintf(c, sizeof c, "%s/det/nested/c", tmp_root);  // parents are created
    MkmodelOptions opt = {.out_dir = a, .preset = "tiny", .seed = 5};
    CHECK(mkmodel_write(&opt) == ERR_OK);
    opt.out_dir = b;
    CHECK(mkmodel_write(&opt) == ERR_OK);
    opt.out_dir = c, opt.seed = 6;
    CHECK(mkmodel_write(&opt) == ERR_OK);
    CHECK(checkpoints_equal(a, b));
    snprintf(pa, sizeof pa, "%s/model-00001-of-00002.safetensors", a);
    snprintf(pc, sizeof pc, "%s/model-00001-of-00002.safetensors", c);
    CHECK(!files_equal(pa, pc));
    opt.preset = "nonsense";
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    CHECK(mkmodel_write(&opt) == ERR_INVAL);
    log_set_level(LOG_LEVEL_WARN);
}

// --spill: with out_dir's room set to the first shard's size, the second shard goes to the
// spill directory behind a symbolic link, the files read the same as an unspilled run's and
// the checkpoint opens; a run without a spill directory that does not fit is refused before
// any shard exists; a later run that fits replaces the link with the file.
static void test_spill(void)
{
    char a[300], b[300], sp[300], p1[400], p2[400], t2[400];
    snprintf(a, sizeof a, "%s/spill_a", tmp_root);
    snprintf(b, sizeof b, "%s/spill_b", tmp_root);
    snprintf(sp, sizeof sp, "%s/spill_dir", tmp_root);
    MkmodelOptions opt = {.out_dir = a, .preset = "tiny", .seed = 5};
    CHECK(mkmodel_write(&opt) == ERR_OK);
    snprintf(p1, sizeof p1, "%s/model-00001-of-00002.safetensors", a);
    struct stat st;
    ASSERT(stat(p1, &st) == 0);
    opt.out_dir = b;
    opt.spill_dir = sp;
    opt.room = (uint64_t) st.st_size;
    CHECK(mkmodel_write(&opt) == ERR_OK);
    snprintf(p1, sizeof p1, "%s/model-00001-of-00002.safetensors", b);
    snprintf(p2, sizeof p2, "%s/model-00002-of-00002.safetensors", b);
    snprintf(t2, sizeof t2, "%s/model-00002-of-00002.safetensors", sp);
    CHECK(lstat(p1, &st) == 0 && S_ISREG(st.st_mode));
    CHECK(lstat(p2, &st) == 0 && S_ISLNK(st.st_mode));
    CHECK(lstat(t2, &st) == 0 && S_ISREG(st.st_mode));
    CHECK(checkpoints_equal(a, b));
    Ckpt ck;
    CHECK(ckpt_open(&ck, b) == ERR_OK);
    ckpt_close(&ck);

    char c[300], p3[400];
    snprintf(c, sizeof c, "%s/spill_c", tmp_root);
    snprintf(p3, sizeof p3, "%s/model-00001-of-00002.safetensors", c);
    MkmodelOptions small = {.out_dir = c, .preset = "tiny", .seed = 5, .room = 1000};
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    CHECK(mkmodel_write(&small) == ERR_IO);
    log_set_level(LOG_LEVEL_WARN);
    CHECK(lstat(p3, &st) != 0);

    opt.spill_dir = NULL;
    opt.room = 0;  // the filesystem's own free space: everything fits
    CHECK(mkmodel_write(&opt) == ERR_OK);
    CHECK(lstat(p2, &st) == 0 && S_ISREG(st.st_mode));
    CHECK(checkpoints_equal(a, b));
}

static void test_quantizer(void)
{
    // The E4M3 encoder itself (kernels/nvfp4_format.h) is checked in test_kern_ref.
    // By hand, with exact arithmetic: row 1 holds the tensor amax 10.5, so scale_2 =
    // 10.5 / 2688 = 2^-8; row 0's block amax 6 gives q = 1 / 2^-8 = 256 (e4m3 0x78) and
    // x = w / (256 * 2^-8) = w. ModelOpt rounds ties at 0.75 / 1.75 / 3.5 up, others down.
    float w[2][16] = {
        {6, -6, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -0.1f, 0, 1, 2, 3, 4, 0.3f}, {10.5f}};
    uint8_t codes[2][8], scale[2];
    float s2 = 0;
    mkmodel_quantize_nvfp4(&w[0][0], 2, 16, &codes[0][0], scale, &s2);
    CHECK(s2 == 0.00390625f);
    CHECK(scale[0] == 0x78 && scale[1] == 0x7e);
    const uint8_t want[16] = {7, 15, 0, 2, 2, 4, 4, 6, 6, 8, 0, 2, 4, 5, 6, 1};
    for (int i = 0; i < 16; i++) {
        const uint8_t got = (uint8_t) ((i & 1) ? codes[0][i / 2] >> 4 : codes[0][i / 2] & 15);
        CHECK(got == want[i]);
    }
    CHECK(codes[1][0] == 0x07);  // 10.5 / (448 * 2^-8) = 6 -> code 7, low nibble
}

static void test_tokenizer(void)
{
    // A small byte-level BPE tokenizer.json that already has <|endoftext|> and <|user|>.
    char src[300], dir[300], path[400];
    snprintf(src, sizeof src, "%s/tok_src.json", tmp_root);
    snprintf(dir, sizeof dir, "%s/tok_model", tmp_root);
    json_object *root = json_object_new_object(), *model = json_object_new_object(),
                *vocab = json_object_new_object(), *added = json_object_new_array();
    for (int i = 0; i < 100; i++) {
        char tok[16];
        snprintf(tok, sizeof tok, "t%d", i);
        json_object_object_add(vocab, tok, json_object_new_int(i));
    }
    json_object_object_add(model, "type", json_object_new_string("BPE"));
    json_object_object_add(model, "vocab", vocab);
    json_object_object_add(model, "merges", json_object_new_array());
    json_object_object_add(root, "version", json_object_new_string("1.0"));
    json_object_object_add(root, "model", model);
    const char *have[2] = {"<|endoftext|>", "<|user|>"};
    for (int i = 0; i < 2; i++) {
        json_object *a = json_object_new_object();
        json_object_object_add(a, "id", json_object_new_int(100 + i));
        json_object_object_add(a, "content", json_object_new_string(have[i]));
        json_object_object_add(a, "special", json_object_new_boolean(1));
        json_object_array_add(added, a);
    }
    json_object_object_add(root, "added_tokens", added);
    json_object_to_file(src, root);
    json_object_put(root);

    MkmodelOptions opt = {.out_dir = dir, .preset = "tiny", .seed = 1, .tokenizer = src};
    CHECK(mkmodel_write(&opt) == ERR_OK);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    root = json_object_from_file(path);
    CHECK(root != NULL);
    json_object *list = NULL;
    CHECK(json_object_object_get_ex(root, "added_tokens", &list));
    // 2 kept + 15 appended, ids 102..116, all special.
    CHECK(json_object_array_length(list) == 17);
    int id_observation = -1, max_id = -1;
    for (size_t i = 0; i < json_object_array_length(list); i++) {
        json_object *a = json_object_array_get_idx(list, i), *id, *content, *special;
        json_object_object_get_ex(a, "id", &id);
        json_object_object_get_ex(a, "content", &content);
        CHECK(json_object_object_get_ex(a, "special", &special)
              && json_object_get_boolean(special));
        if (!strcmp(json_object_get_string(content), "<|observation|>")) {
            id_observation = json_object_get_int(id);
        }
        if (json_object_get_int(id) > max_id) max_id = json_object_get_int(id);
    }
    CHECK(max_id == 116);
    CHECK(id_observation > 101);
    json_object_put(root);

    ModelConfig *cfg = malloc(sizeof *cfg);
    CHECK(config_load(cfg, dir) == ERR_OK);
    CHECK(cfg->vocab_size == 128);  // 117 ids rounded up to a multiple of 64
    CHECK(cfg->n_eos_ids == 3 && cfg->eos_ids[0] == 100 && cfg->eos_ids[1] == 101);
    CHECK(cfg->eos_ids[2] == id_observation && cfg->pad_id == 100);
    free(cfg);
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    root = json_object_from_file(path);
    json_object *eos = NULL;
    CHECK(root && json_object_object_get_ex(root, "eos_token_id", &eos));
    CHECK(json_object_array_length(eos) == 3
          && json_object_get_int(json_object_array_get_idx(eos, 2)) == id_observation);
    json_object_put(root);

    // A tokenizer that is not JSON is refused.
    snprintf(path, sizeof path, "%s/bad_tok.json", tmp_root);
    FILE *f = fopen(path, "w");
    fputs("{not json", f);
    fclose(f);
    opt.tokenizer = path;
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    CHECK(mkmodel_write(&opt) == ERR_INVAL);
    log_set_level(LOG_LEVEL_WARN);
}

// The reference checkpoints the golden tests use (written by Python: transformers + the
// ModelOpt / compressed-tensors recipes) must pass inspect's full validation.
static void test_golden_models(void)
{
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tests/golden/models", src ? src : ".");
    DIR *d = opendir(dir);
    if (!d) {
        char why[600];
        snprintf(why, sizeof why, "test_golden_models: no golden models under %s", dir);
        check_skip(why);
        return;
    }
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char model[1024], cfg_path[1100];
        snprintf(model, sizeof model, "%s/%s", dir, e->d_name);
        snprintf(cfg_path, sizeof cfg_path, "%s/config.json", model);
        if (access(cfg_path, F_OK) != 0) continue;
        char *argv[] = {"inspect", "--model", model, NULL};
        const int status = cli_inspect(3, argv);
        CHECK(status == 0);
        if (status) fprintf(stderr, "  golden model %s\n", model);
        n++;
    }
    closedir(d);
    printf("inspected %d golden models\n", n);
}

// --layers / --dense, NVFP4 experts drawn directly (the reap preset's path) and the
// threaded writer: the same files from 1 and 3 threads; the experts load as NVFP4 with the
// drawn scale codes and an RMS near 1/sqrt(cols); more dense layers than layers is refused.
static void test_direct_layers_threads(void)
{
    char a[300], b[300];
    snprintf(a, sizeof a, "%s/direct_a", tmp_root);
    snprintf(b, sizeof b, "%s/direct_b", tmp_root);
    MkmodelOptions opt = {.out_dir = a,
                          .preset = "tiny",
                          .seed = 3,
                          .layers = 2,
                          .set_dense = true,
                          .dense = 0,
                          .threads = 1,
                          .fp4_direct = true};
    CHECK(mkmodel_write(&opt) == ERR_OK);
    opt.out_dir = b, opt.threads = 3;
    CHECK(mkmodel_write(&opt) == ERR_OK);
    CHECK(checkpoints_equal(a, b));
    ModelConfig *cfg = malloc(sizeof *cfg);
    ASSERT(cfg);
    CHECK(config_load(cfg, a) == ERR_OK);
    CHECK(cfg->n_layers == 2 && cfg->mlp[0] == CONFIG_MLP_MOE && cfg->mlp[1] == CONFIG_MLP_MOE);
    Ckpt ck;
    CHECK(ckpt_open(&ck, a) == ERR_OK);
    const int H = cfg->hidden_size, MI = cfg->moe_intermediate_size;
    CkptLinear w;
    CHECK(ckpt_linear(&ck, "model.layers.1.mlp.experts.5.gate_proj", MI, H, &w) == ERR_OK);
    CHECK(w.format == CKPT_LINEAR_NVFP4);
    int bad_scale = 0;
    for (int i = 0; i < MI * H / 16; i++)
        bad_scale += w.scale[i] < 0x36 || w.scale[i] > 0x3c;
    CHECK(bad_scale == 0);
    float *row = malloc((size_t) H * sizeof *row);
    ASSERT(row);
    double sum2 = 0.0;
    for (int r = 0; r < MI; r++) {
        ckpt_linear_row(&w, r, row);
        for (int c = 0; c < H; c++)
            sum2 += (double) row[c] * row[c];
    }
    const double rms = sqrt(sum2 / ((double) MI * H)) * sqrt((double) H);
    printf("direct NVFP4 experts: RMS x sqrt(cols) = %.3f\n", rms);
    CHECK(rms > 0.8 && rms < 1.25);  // 2,048 values: a few percent of sampling noise
    free(row);
    ckpt_close(&ck);
    free(cfg);
    opt.layers = 2, opt.dense = 3;
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    CHECK(mkmodel_write(&opt) == ERR_INVAL);
    log_set_level(LOG_LEVEL_WARN);
}

// --mtp: the preset's MTP layer count replaced (0 drops tiny's MTP layer, 2 adds one: its
// tensors follow the decoder layers); more than 3 is refused.
static void test_mtp_count(void)
{
    char dir[300];
    for (int mtp = 0; mtp <= 2; mtp += 2) {
        snprintf(dir, sizeof dir, "%s/mtp_%d", tmp_root, mtp);
        const MkmodelOptions opt = {.out_dir = dir, .preset = "tiny", .set_mtp = true, .mtp = mtp};
        CHECK(mkmodel_write(&opt) == ERR_OK);
        ModelConfig *cfg = malloc(sizeof *cfg);
        ASSERT(cfg);
        CHECK(config_load(cfg, dir) == ERR_OK);
        CHECK(cfg->n_mtp_layers == mtp);
        Ckpt ck;
        CHECK(ckpt_open(&ck, dir) == ERR_OK);
        char name[96];
        const int L = cfg->n_layers, H = cfg->hidden_size;
        CkptLinear w;
        for (int i = 0; i < 3; i++) {  // each MTP layer's eh_proj, and none past them
            snprintf(name, sizeof name, "model.layers.%d.eh_proj", L + i);
            log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
            const Err err = ckpt_linear(&ck, name, H, 2 * H, &w);
            log_set_level(LOG_LEVEL_WARN);
            CHECK((err == ERR_OK) == (i < mtp));
        }
        ckpt_close(&ck);
        free(cfg);
    }
    const MkmodelOptions bad = {.out_dir = dir, .preset = "tiny", .set_mtp = true, .mtp = 4};
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    CHECK(mkmodel_write(&bad) == ERR_INVAL);
    log_set_level(LOG_LEVEL_WARN);
}

int main(void)
{
    const char *base = getenv("TMPDIR");
    snprintf(tmp_root, sizeof tmp_root, "%s/glmspark_mkmodel_XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        return 1;
    }
    log_set_level(LOG_LEVEL_WARN);
    test_quantizer();
    test_round_trip();
    test_determinism();
    test_spill();
    test_direct_layers_threads();
    test_mtp_count();
    test_tokenizer();
    test_golden_models();
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp_root);
    return check_exit();
}
