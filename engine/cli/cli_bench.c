/*
 * cli_bench.c - `glmspark bench`: time prefill and batched decode through the real engine
 * (model.c's forward pass on a backend), on a checkpoint or a synthetic one.
 *
 *   glmspark bench [--backend cpu|cuda] (--model DIR | --synthetic [--preset NAME] [--seed S])
 *     [--batch 1,8] [--ctx 1024] [--prefill-chunk 4096] [--steps 32] [--threads N]
 *     [--kv-dtype f32|bf16|fp8] [--precision f32|bf16] [--mtp-drafts 1,2,3] [--json]
 * (On CUDA the cache is bf16 (default) or fp8 and the recipe bf16: backends.h
 * backend_kind_check.)
 *
 * For each batch size B: B sequences are prefilled with --ctx deterministic token ids each
 * (forward calls of at most --prefill-chunk tokens, one sequence at a time, as the scheduler
 * chunks long prompts, so that 128K contexts fit the step's workspaces; prefill tok/s, after
 * one untimed chunk before the first batch size: the process's first allocates), then
 * --steps decode steps run all B sequences together (one token each, one
 * model_forward_batch call, each sequence's logits downloaded, which also waits for the GPU),
 * after one untimed warm-up step. Printed per configuration: prefill tok/s, decode ms/step
 * and tok/s, and the weight bytes a decode step reads (estimate: every linear weight except
 * the embedding and the routed experts, plus the routed experts expected to be hit by B
 * tokens under uniform routing, E (1 - (1 - K/E)^B)) with the GB/s that implies, then those
 * bytes by category (attention, indexer, dense MLP, shared expert + router, routed experts,
 * lm_head) and the KV-cache bytes the step reads (estimate: per sequence and layer the latent
 * entries of the positions attention reads, all --ctx or the DSA top-k, and the indexer keys
 * of all positions on layers that own one; not in the GB/s). On the CUDA backend the GB/s is
 * also given as a % of a device-to-device copy (1 GiB cudaMemcpy, read + write bytes, best of
 * 5) measured in the same run, and the prefill's TFLOP/s (prefill_flops below: the linears,
 * the top-k experts, attention and the indexer as computed) as a % of a cuBLASLt bf16 GEMM
 * (8192^3, best of 5) measured in the same run; decode steps replay CUDA graphs unless
 * GLMSPARK_CUDA_GRAPHS=0;
 * GLMSPARK_CUDA_PROFILE=1 prints the time per op kind of the prefill and of the decode steps
 * (synchronized, so slower; backend_cuda.h). --json prints one JSON object per configuration instead.
 *
 * --mtp-drafts K,.. (1-3; the checkpoint needs an MTP layer: `mkmodel --mtp 1`) then times,
 * for each batch size and K, the steps of MTP with K drafts as the engine runs them
 * (engine/pipeline/mtp.c): the verify forward of 1 + K rows a sequence (every row's logits
 * downloaded) and the MTP passes: the MTP layer over 1 + K rows a sequence (the rows of a
 * step whose drafts were all accepted: the most it runs), then K - 1 recursive passes of a
 * row a sequence, each with its logits, every pass over all B sequences at once as the
 * pipeline's last stage batches them (mtp_stage_ops). Printed: the verify step and its ratio to the 1-row step, the draft passes, and
 * the speed-up B tokens a step would give at GLM-5.2's published mean accepted lengths
 * (1.84, 2.50, 2.99 for 1-3 drafts): accepted length x the 1-row step / the MTP step, with
 * the acceptance-free costs so that any other accepted length L gives L x that ratio.
 *
 * --synthetic writes the mkmodel preset (default "default"; see `glmspark mkmodel`) into
 * $TMPDIR (or /tmp)/glmspark-bench-PRESET-SEED first. `--model DIR` on a `glmspark mkmodel
 * --preset reap` checkpoint is the benchmark of record at GLM-5.2-REAP dimensions
 * (docs/perf.md); this command measures the engine path itself, whatever its backend.
 */
#include "engine/cli/cli.h"

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend/backends.h"
#include "engine/model/backend.h"
#ifdef GLMSPARK_HAVE_CUDA
#include "engine/backend/backend_cuda.h"
#endif
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/shared/clock.h"
#include "engine/shared/num.h"
#include "engine/shared/thread_pool.h"
#include "engine/tools/mkmodel.h"

enum { BENCH_MAX_BATCHES = 16, BENCH_MAX_DRAFTS = 3 };

typedef struct BenchArgs {
    const char *model_dir;
    bool synthetic;
    const char *preset;
    unsigned long long seed;
    bool cuda;
    int batches[BENCH_MAX_BATCHES];
    int n_batches;
    int ctx;
    int prefill_chunk;
    int steps;
    int n_threads;
    int precision;  // --precision f32|bf16 (backends.h), or the backend's own
    KvDtype kv_dtype;
    bool kv_set;  // --kv-dtype given (else the backend kind's default, backend_kind_check)
    bool json;
    int drafts[BENCH_MAX_DRAFTS];  // --mtp-drafts
    int n_drafts;
    double copy_gbs;     // measured device-to-device copy bandwidth (CUDA), else 0
    double gemm_tflops;  // measured cuBLASLt bf16 GEMM throughput (CUDA), else 0
} BenchArgs;

// GLM-5.2's published mean accepted length (tokens a step) with 1, 2, 3 MTP drafts.
static const double mtp_accept_len[BENCH_MAX_DRAFTS + 1] = {1.0, 1.84, 2.50, 2.99};

static int bench_usage(void)
{
    fprintf(stderr,
            "usage: glmspark bench [--backend cpu|cuda] (--model DIR | --synthetic [--preset NAME] "
            "[--seed S]) [--batch 1,8] [--ctx 1024] [--prefill-chunk 4096] [--steps 32] "
            "[--threads N] [--kv-dtype f32|bf16|fp8] [--precision f32|bf16] "
            "[--mtp-drafts 1,2,3] [--json]\n");
    return 2;
}

// "1,8,16" -> out[0..*n) (at most cap values in [lo, hi]); false on a bad list.
static bool parse_list(const char *s, int lo, int hi, int cap, int *out, int *n)
{
    *n = 0;
    while (*s) {
        char *end;
        const long v = strtol(s, &end, 10);
        if (end == s || v < lo || v > hi || *n == cap) return false;
        out[(*n)++] = (int) v;
        if (*end == ',')
            end++;
        else if (*end)
            return false;
        s = end;
    }
    return *n > 0;
}

static int parse_bench_args(int argc, char **argv, BenchArgs *a)
{
    *a = (BenchArgs){.preset = "default",
                     .precision = BACKEND_PRECISION_DEFAULT,
                     .ctx = 1024,
                     .prefill_chunk = 4096,
                     .steps = 32};
    if (!cli_default_threads(argv[0], &a->n_threads)) return 2;
    a->batches[0] = 1;
    a->n_batches = 1;
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (strcmp(opt, "--synthetic") == 0) {
            a->synthetic = true;
            continue;
        }
        if (strcmp(opt, "--json") == 0) {
            a->json = true;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "glmspark bench: %s needs a value\n", opt);
            return bench_usage();
        }
        const char *val = argv[++i];
        bool ok = true;
        if (strcmp(opt, "--model") == 0)
            a->model_dir = val;
        else if (strcmp(opt, "--preset") == 0)
            a->preset = val;
        else if (strcmp(opt, "--seed") == 0) {
            char *end;
            a->seed = strtoull(val, &end, 10);
            ok = end != val && !*end;
        } else if (strcmp(opt, "--backend") == 0)
            ok = cli_parse_backend(val, &a->cuda);
        else if (strcmp(opt, "--batch") == 0)
            ok = parse_list(val, 1, 1024, BENCH_MAX_BATCHES, a->batches, &a->n_batches);
        else if (strcmp(opt, "--mtp-drafts") == 0)
            ok = parse_list(val, 1, BENCH_MAX_DRAFTS, BENCH_MAX_DRAFTS, a->drafts, &a->n_drafts);
        else if (strcmp(opt, "--ctx") == 0)
            ok = num_parse_int(val, 1, 1 << 20, &a->ctx);
        else if (strcmp(opt, "--prefill-chunk") == 0)
            ok = num_parse_int(val, 1, 1 << 20, &a->prefill_chunk);
        else if (strcmp(opt, "--steps") == 0)
            ok = num_parse_int(val, 1, 1 << 20, &a->steps);
        else if (strcmp(opt, "--threads") == 0)
            ok = num_parse_int(val, 1, THREAD_POOL_MAX_THREADS, &a->n_threads);
        else if (strcmp(opt, "--kv-dtype") == 0)
            ok = a->kv_set = kv_dtype_parse(val, &a->kv_dtype);
        else if (strcmp(opt, "--precision") == 0)
            ok = backend_precision_parse(val, &a->precision);
        else {
            fprintf(stderr, "glmspark bench: unknown option %s\n", opt);
            return bench_usage();
        }
        if (!ok) {
            fprintf(stderr, "glmspark bench: bad value for %s: \"%s\"\n", opt, val);
            return bench_usage();
        }
    }
    if (!a->model_dir == !a->synthetic) {
        fprintf(stderr, "glmspark bench: give exactly one of --model DIR and --synthetic\n");
        return bench_usage();
    }
    if (!backend_kind_check("glmspark bench", a->cuda, a->precision, a->kv_set, &a->kv_dtype,
                            KV_DEFAULT_BLOCK_SIZE))
        return 2;
    return 0;
}

// Bytes of a linear weight as stored (codes and scales).
static double linear_bytes(const CkptLinear *w)
{
    const double n = (double) w->rows * (double) w->cols;
    switch (w->format) {
    case CKPT_LINEAR_F32:
        return 4.0 * n;
    case CKPT_LINEAR_F16:
    case CKPT_LINEAR_BF16:
        return 2.0 * n;
    case CKPT_LINEAR_FP8:
        return n + (w->scale_f32 ? 4.0 * ceil(w->rows / 128.0) * ceil(w->cols / 128.0) : 0.0);
    case CKPT_LINEAR_NVFP4:
        return n / 2.0 + n / 16.0;
    }
    return 0.0;
}

// A layer's linear weights other than the routed experts, by category: attention [0, 6),
// indexer [6, 9), dense MLP [9, 12), router and shared expert [12, 16). Absent ones have no
// rows.
enum { LAYER_LINEARS = 16 };
static void layer_linears(const ModelLayer *L, const CkptLinear *lin[LAYER_LINEARS])
{
    const CkptLinear *all[LAYER_LINEARS] = {
        &L->q_a,      &L->q_b,   &L->q_proj,      &L->kv_a,    &L->kv_b, &L->o_proj,
        &L->idx_wq_b, &L->idx_wk, &L->idx_weights,
        &L->gate,     &L->up,    &L->down,
        &L->router,   &L->sh_gate, &L->sh_up,     &L->sh_down};
    memcpy(lin, all, sizeof all);
}

// Multiply-adds of a linear weight applied to one row.
static double linear_macs(const CkptLinear *w)
{
    return w->rows > 0 && w->cols > 0 ? (double) w->rows * (double) w->cols : 0.0;
}

// sum over p = 0 .. n-1 of min(p + 1, cap): the keys the n positions of a prompt attend.
static double attended_sum(int n, int cap)
{
    const double m = n < cap ? n : cap;  // positions that see p + 1 keys
    return m * (m + 1.0) / 2.0 + ((double) n - m) * cap;
}

// FLOPs (2 per multiply-add) of prefilling one sequence's ctx tokens in calls of chunk: every
// linear once per token (the routed experts: top-k of them; kv_b as the absorbed W_UK / W_UV
// products, the same multiply-adds), the head once per call (its last row), and attention as
// the kernels compute it, absorbed: per head and attended key kv_lora + rope multiply-adds
// for the score and kv_lora for the value, the keys all earlier positions or, on DSA layers,
// at most the top-k; the indexer's scores on the layers that own one, index heads x dim per
// earlier position. The figure `glmspark bench` divides by the prefill time (TFLOP/s).
static double prefill_flops(const Model *m, int ctx, int chunk)
{
    const ModelConfig *c = &m->cfg;
    double per_tok = 0.0, attn = 0.0;
    for (int l = m->first_layer; l < m->last_layer; l++) {
        const ModelLayer *L = &m->layers[l];
        const CkptLinear *lin[LAYER_LINEARS];
        layer_linears(L, lin);
        for (int i = 0; i < LAYER_LINEARS; i++)
            per_tok += linear_macs(lin[i]);
        if (L->is_moe && L->experts && c->n_routed_experts > 0)
            per_tok += c->n_experts_per_tok
                       * (linear_macs(&L->experts[0]) + linear_macs(&L->experts[1])
                          + linear_macs(&L->experts[2]));
        const bool sparse = c->indexer[l] != CONFIG_INDEXER_NONE && c->index_topk > 0;
        const double keys = attended_sum(ctx, sparse ? c->index_topk : ctx);
        attn += keys * c->n_heads * (2.0 * c->kv_lora_rank + c->qk_rope_head_dim);
        if (c->indexer[l] == CONFIG_INDEXER_FULL)
            attn += attended_sum(ctx, ctx) * c->index_n_heads * c->index_head_dim;
    }
    const double calls = ceil((double) ctx / chunk);
    return 2.0 * (per_tok * ctx + attn + (m->has_head ? calls * linear_macs(&m->lm_head) : 0.0));
}

// Bytes one decode step of batch B at context ctx reads, by category (see the file
// comment): weights as stored, the routed experts expected to be hit, and the KV cache (each
// sequence's latent entries at the positions its attention reads: all ctx, or the DSA
// top-k when the model has an indexer; the indexer keys at every position on layers that own
// one).
typedef struct StepBytes {
    double attn, indexer, mlp, shared, experts, head, kv;
} StepBytes;

static void add_linears(double *sum, const CkptLinear *const *lin, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (lin[i]->rows > 0 && lin[i]->cols > 0) *sum += linear_bytes(lin[i]);
}

static StepBytes step_bytes(const Model *m, const KvCache *kv, int B, int ctx)
{
    const ModelConfig *c = &m->cfg;
    StepBytes s = {0};
    if (m->has_head) s.head = linear_bytes(&m->lm_head);
    const int attended = c->index_topk > 0 && c->index_topk < ctx ? c->index_topk : ctx;
    for (int l = m->first_layer; l < m->last_layer; l++) {
        const ModelLayer *L = &m->layers[l];
        const CkptLinear *lin[LAYER_LINEARS];
        layer_linears(L, lin);
        add_linears(&s.attn, lin, 6);
        add_linears(&s.indexer, lin + 6, 3);
        add_linears(&s.mlp, lin + 9, 3);
        add_linears(&s.shared, lin + 12, 4);
        if (L->is_moe && L->experts && c->n_routed_experts > 0) {
            const double E = c->n_routed_experts, K = c->n_experts_per_tok;
            const double hit = E * (1.0 - pow(1.0 - K / E, B));
            s.experts += hit
                         * (linear_bytes(&L->experts[0]) + linear_bytes(&L->experts[1])
                            + linear_bytes(&L->experts[2]));
        }
        const KvEntryLayout *lo = &kv->entry[l];
        s.kv += (double) B * attended * lo->bytes;
        if (lo->key_page > 0)
            s.kv += (double) B * ctx * (lo->key_bytes + (lo->key_scales > 0 ? 4.0 : 0.0));
    }
    return s;
}

static double step_weight_bytes(const StepBytes *s)
{
    return s->attn + s->indexer + s->mlp + s->shared + s->experts + s->head;
}

// Sequence i's deterministic prompt ids[0..n).
static void prompt_ids(int *ids, int n, int i, int vocab_size)
{
    for (int t = 0; t < n; t++)
        ids[t] = (int) ((1103515245u * (unsigned) (t + 7919 * i) + 12345u) % (unsigned) vocab_size);
}

// GLMSPARK_CUDA_PROFILE=1: the time per op kind since the last report, under a title (CUDA
// backend; nothing otherwise).
static void profile_report(const BenchArgs *a, Model *m, const char *fmt, ...)
{
#ifdef GLMSPARK_HAVE_CUDA
    if (!a->cuda) return;
    char title[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(title, sizeof title, fmt, ap);
    va_end(ap);
    backend_cuda_profile_report(m->be, title);
#else
    (void) a, (void) m, (void) fmt;
#endif
}

typedef struct MtpTime {
    double verify_s, draft_s;  // per step: the verify forward, the MTP passes
} MtpTime;

// Timed MTP steps with k drafts for the B prefilled sequences ptrs (--mtp-drafts; see the file
// comment): the verify forwards of 1 + k rows a sequence into logits [B (1 + k), V], then the
// MTP passes over all B sequences (each on its own sequence of mkv, mseqs) from the hidden
// rows hid [B (1 + k), hidden] (host; any values: the costs do not depend on them), each
// sequence's last row's logits into logits too and its state into hcur [B, hidden]. The two
// are timed in separate loops (the engine runs them in turn; neither's cost depends on the
// other's values), so that GLMSPARK_CUDA_PROFILE=1 can report each's ops. After one untimed
// step of each, seconds per step into *t. False on failure.
static bool bench_mtp(const BenchArgs *a, Model *m, KvCache *kv, KvSeq *const *ptrs, KvCache *mkv,
                      KvSeq *mseqs, int B, int k, int *ids, int *n_new, float *logits,
                      const float *hid, float *hcur, MtpTime *t)
{
    const int V = m->cfg.vocab_size, rows = 1 + k;
    for (int i = 0; i < B; i++)
        n_new[i] = rows;
    const ModelBatch b = {B, ptrs, n_new};
    *t = (MtpTime){0.0, 0.0};
    for (int s = 0; s <= a->steps; s++) {
        for (int i = 0; i < B * rows; i++)
            ids[i] = (int) ((unsigned) (s * 31 + i * 17 + 11) % (unsigned) V);
        const double t1 = clock_now_s();
        if (model_forward_batch(m, kv, &b, ids, NULL, NULL, logits, MODEL_LOGITS_ALL)) return false;
        if (s > 0) t->verify_s += clock_now_s() - t1;
    }
    profile_report(a, m, "MTP verify, %d sequence(s) x %d rows, %d steps", B, rows, a->steps + 1);
    // The passes as mtp_stage_ops runs a step's: one batched MTP forward over every
    // sequence's rows, then one per recursion depth (a row a sequence).
    KvSeq **mptrs = malloc((size_t) B * sizeof *mptrs);
    int *dtok = malloc((size_t) B * sizeof *dtok), *ones = malloc((size_t) B * sizeof *ones);
    bool ok = mptrs && dtok && ones;
    for (int i = 0; ok && i < B; i++) {
        mptrs[i] = &mseqs[i];
        ones[i] = 1;
    }
    for (int s = 0; ok && s <= a->steps; s++) {
        const double t1 = clock_now_s();
        const ModelBatch mb = {B, mptrs, n_new}, mb1 = {B, mptrs, ones};
        ok = model_mtp_forward_batch(m, mkv, &mb, ids, hid, logits, hcur, false) == ERR_OK;
        for (int j = 1; ok && j < k; j++) {
            for (int i = 0; i < B; i++)
                dtok[i] = ids[(size_t) i * rows + j];
            ok = model_mtp_forward_batch(m, mkv, &mb1, dtok, hcur, logits, hcur, false) == ERR_OK;
        }
        if (s > 0) t->draft_s += clock_now_s() - t1;
    }
    free(mptrs);
    free(dtok);
    free(ones);
    if (!ok) return false;
    profile_report(a, m, "MTP passes, %d sequence(s), %d drafts, %d steps", B, k, a->steps + 1);
    t->verify_s /= a->steps;
    t->draft_s /= a->steps;
    return true;
}

// One batch size: prefill B sequences, then time decode steps. Returns false on failure.
// *is_warm: whether a prefill chunk has run in this process (the first one allocates the
// workspaces, and on CUDA loads modules: untimed, on a sequence freed again).
static bool bench_batch(const BenchArgs *a, Model *m, const char *model_dir, int B, bool *is_warm)
{
    const ModelConfig *c = &m->cfg;
    // Positions a sequence reaches: the prompt, the decode steps, each MTP configuration's
    // verify rows (1 + k a step) in kv, and its MTP passes (1 + k, then k - 1 single rows) in
    // the MTP layer's own cache.
    int max_rows = 1, verify_pos = 0, mtp_pos = 0;
    for (int i = 0; i < a->n_drafts; i++) {
        const int k = a->drafts[i];
        max_rows = 1 + k > max_rows ? 1 + k : max_rows;
        verify_pos += (a->steps + 1) * (1 + k);
        mtp_pos += (a->steps + 1) * 2 * k;
    }
    const int block = KV_DEFAULT_BLOCK_SIZE, positions = a->ctx + a->steps + 1 + verify_pos;
    KvCacheParams p = model_kv_params(m, B * ((positions + block - 1) / block), block);
    p.dtype = a->kv_dtype;
    KvCache kv = {0}, mkv = {0};
    KvSeq *seqs = calloc((size_t) B, sizeof *seqs);
    KvSeq *mseqs = calloc((size_t) B, sizeof *mseqs);
    KvSeq **ptrs = calloc((size_t) B, sizeof *ptrs);
    const int n_ids = a->ctx > B * max_rows ? a->ctx : B * max_rows;
    int *ids = malloc((size_t) n_ids * sizeof *ids);
    int *n_new = malloc((size_t) B * sizeof *n_new);
    float *logits = malloc((size_t) B * max_rows * c->vocab_size * sizeof *logits);
    float *hid = malloc((size_t) B * max_rows * c->hidden_size * sizeof *hid);
    float *hcur = malloc((size_t) B * c->hidden_size * sizeof *hcur);
    MtpTime mt[BENCH_MAX_DRAFTS];
    bool ok = false;
    if (!seqs || !mseqs || !ptrs || !ids || !n_new || !logits || !hid || !hcur
        || kv_init(&kv, &p)) {
        LOG_ERROR("bench: could not set up batch %d (context %d)", B, a->ctx);
        goto done;
    }
    if (a->n_drafts > 0) {
        KvCacheParams mp = model_mtp_kv_params(m, B * ((mtp_pos + block - 1) / block), block);
        mp.dtype = a->kv_dtype;
        if (kv_init(&mkv, &mp)) {
            LOG_ERROR("bench: could not set up the MTP layer's cache for batch %d", B);
            goto done;
        }
        for (size_t i = 0; i < (size_t) B * max_rows * c->hidden_size; i++)
            hid[i] = 0.5f * sinf(0.37f * (float) i);
    }
    for (int i = 0; i < B; i++)
        ptrs[i] = &seqs[i];

    // Warm-up: the first chunk of sequence 0, untimed, then its blocks freed.
    if (!*is_warm) {
        const int n = a->ctx < a->prefill_chunk ? a->ctx : a->prefill_chunk;
        prompt_ids(ids, n, 0, c->vocab_size);
        n_new[0] = n;
        const ModelBatch b = {1, &ptrs[0], n_new};
        if (model_forward_batch(m, &kv, &b, ids, NULL, NULL, logits, MODEL_LOGITS_LAST)) goto done;
        kv_seq_free(&kv, &seqs[0]);
        *is_warm = true;
    }
#ifdef GLMSPARK_HAVE_CUDA
    if (a->cuda) backend_cuda_profile_report(m->be, NULL);  // GLMSPARK_CUDA_PROFILE=1: from here
#endif
    // Prefill, one sequence at a time, in calls of at most --prefill-chunk tokens.
    double t0 = clock_now_s();
    for (int i = 0; i < B; i++) {
        prompt_ids(ids, a->ctx, i, c->vocab_size);
        const ModelBatch b = {1, &ptrs[i], n_new};
        for (int t = 0; t < a->ctx; t += a->prefill_chunk) {
            n_new[0] = a->ctx - t < a->prefill_chunk ? a->ctx - t : a->prefill_chunk;
            if (model_forward_batch(m, &kv, &b, ids + t, NULL, NULL, logits, MODEL_LOGITS_LAST))
                goto done;
        }
    }
    const double prefill_s = clock_now_s() - t0;

    // Decode: one warm-up step, then the timed steps.
    for (int i = 0; i < B; i++)
        n_new[i] = 1;
    const ModelBatch b = {B, ptrs, n_new};
    double decode_s = 0.0;
    // GLMSPARK_CUDA_PROFILE=1: the prefill's ops, then the decode steps'
    profile_report(a, m, "prefill, batch %d x %d tokens in calls of %d", B, a->ctx,
                   a->prefill_chunk);
    for (int s = 0; s <= a->steps; s++) {
        for (int i = 0; i < B; i++)
            ids[i] = (int) ((unsigned) (s * 31 + i * 17 + 5) % (unsigned) c->vocab_size);
        const double t1 = clock_now_s();
        if (model_forward_batch(m, &kv, &b, ids, NULL, NULL, logits, MODEL_LOGITS_LAST)) goto done;
        if (s > 0) decode_s += clock_now_s() - t1;
    }
    const double step_s = decode_s / a->steps;
    profile_report(a, m, "batch %d ctx %d, %d decode steps", B, a->ctx, a->steps + 1);
    for (int i = 0; i < a->n_drafts; i++)
        if (!bench_mtp(a, m, &kv, ptrs, &mkv, mseqs, B, a->drafts[i], ids, n_new, logits, hid,
                       hcur, &mt[i]))
            goto done;
    const StepBytes sb = step_bytes(m, &kv, B, a->ctx);
    const double bytes = step_weight_bytes(&sb), gbs = bytes / step_s * 1e-9;
    const double pct = a->copy_gbs > 0.0 ? 100.0 * gbs / a->copy_gbs : 0.0;
    const char *prec = backend_precision_name(m->be->precision);
    const double flops = prefill_flops(m, a->ctx, a->prefill_chunk);
    const double tflops = B * flops / prefill_s * 1e-12;
    const double pct_gemm = a->gemm_tflops > 0.0 ? 100.0 * tflops / a->gemm_tflops : 0.0;
    if (a->json)
        printf("{\"model\":\"%s\",\"backend\":\"%s\",\"precision\":\"%s\",\"layers\":%d,"
               "\"batch\":%d,\"ctx\":%d,"
               "\"steps\":%d,\"prefill_tok_s\":%.2f,\"decode_ms_step\":%.4f,\"decode_tok_s\":%.2f,"
               "\"weight_bytes_step\":%.0f,\"weight_gb_s\":%.3f,\"copy_gb_s\":%.1f,"
               "\"pct_copy\":%.2f,\"prefill_flops_seq\":%.0f,\"prefill_tflop_s\":%.4f,"
               "\"gemm_tflop_s\":%.1f,\"pct_gemm\":%.2f,"
               "\"bytes_step\":{\"attention\":%.0f,\"indexer\":%.0f,"
               "\"dense_mlp\":%.0f,\"shared_expert_router\":%.0f,\"routed_experts\":%.0f,"
               "\"lm_head\":%.0f,\"kv_cache\":%.0f}",
               model_dir, m->be->name, prec, m->last_layer - m->first_layer, B, a->ctx, a->steps,
               B * a->ctx / prefill_s, step_s * 1e3, B / step_s, bytes, gbs, a->copy_gbs, pct,
               flops, tflops, a->gemm_tflops, pct_gemm, sb.attn, sb.indexer, sb.mlp, sb.shared,
               sb.experts, sb.head, sb.kv);
    else if (a->copy_gbs > 0.0)
        printf("%s/%-4s batch %3d ctx %6d: prefill %10.1f tok/s | decode %9.3f ms/step %10.1f "
               "tok/s | ~%.3f GB weights/step, %8.1f GB/s = %5.2f%% of copy\n",
               m->be->name, prec, B, a->ctx, B * a->ctx / prefill_s, step_s * 1e3, B / step_s,
               bytes * 1e-9, gbs, pct);
    else
        printf("%s/%-4s batch %3d ctx %6d: prefill %10.1f tok/s | decode %9.3f ms/step %10.1f "
               "tok/s | ~%.3f GB weights/step, %8.1f GB/s\n",
               m->be->name, prec, B, a->ctx, B * a->ctx / prefill_s, step_s * 1e3, B / step_s,
               bytes * 1e-9, gbs);
    if (!a->json)
        printf("    bytes/step (GB): attention %.3f, indexer %.3f, dense MLP %.3f, shared expert + "
               "router %.3f, routed experts %.3f, lm_head %.3f; KV cache %.4f\n",
               sb.attn * 1e-9, sb.indexer * 1e-9, sb.mlp * 1e-9, sb.shared * 1e-9,
               sb.experts * 1e-9, sb.head * 1e-9, sb.kv * 1e-9);
    if (!a->json && a->gemm_tflops > 0.0)
        printf("    prefill: %.1f GFLOP a sequence, %.2f TFLOP/s = %.2f%% of the cuBLASLt bf16 "
               "GEMM\n",
               flops * 1e-9, tflops, pct_gemm);
    else if (!a->json)
        printf("    prefill: %.1f GFLOP a sequence, %.3f TFLOP/s\n", flops * 1e-9, tflops);
#ifdef GLMSPARK_HAVE_CUDA
    if (a->cuda && !a->json) {
        // What the device holds at the end of the batch: weights, this batch's KV cache and
        // the workspaces and scratch its prefill chunks and decode steps grew (measured: the
        // planner's headroom, docs/perf.md).
        size_t total = 0;
        const size_t used = backend_cuda_mem_used(m->be, &total);
        const double kv_bytes = (double) kv.block_bytes * kv.params.n_blocks
                                + (a->n_drafts > 0 ? (double) mkv.block_bytes * mkv.params.n_blocks : 0.0);
        printf("    device memory: %.2f GiB in use of %.2f GiB after this batch (its KV cache %.2f "
               "GiB; prefill chunks of %d tokens)\n",
               used / 1073741824.0, total / 1073741824.0, kv_bytes / 1073741824.0, a->prefill_chunk);
    }
#endif
    if (a->json && a->n_drafts > 0) printf(",\"mtp\":[");
    for (int i = 0; i < a->n_drafts; i++) {
        // The speed-up at accepted length L is L x step_s / (verify + drafts): per_len.
        const int k = a->drafts[i];
        const double mtp_s = mt[i].verify_s + mt[i].draft_s, per_len = step_s / mtp_s;
        if (a->json)
            printf("%s{\"drafts\":%d,\"verify_ms\":%.4f,\"verify_ratio\":%.4f,"
                   "\"draft_ms\":%.4f,\"step_ms\":%.4f,\"speedup_per_accepted_token\":%.4f,"
                   "\"published_accept_len\":%.2f,\"speedup\":%.4f}",
                   i ? "," : "", k, mt[i].verify_s * 1e3, mt[i].verify_s / step_s,
                   mt[i].draft_s * 1e3, mtp_s * 1e3, per_len, mtp_accept_len[k],
                   mtp_accept_len[k] * per_len);
        else
            printf("    mtp %d draft%s: verify %d rows a sequence %.3f ms/step (%.2fx the 1-row "
                   "step) + %d MTP pass%s %.3f ms = %.3f ms; at GLM-5.2's mean accepted length "
                   "%.2f: %.2fx the 1-row tok/s (accepted length L: L x %.3f)\n",
                   k, k > 1 ? "s" : "", 1 + k, mt[i].verify_s * 1e3, mt[i].verify_s / step_s, k,
                   k > 1 ? "es" : "", mt[i].draft_s * 1e3, mtp_s * 1e3, mtp_accept_len[k],
                   mtp_accept_len[k] * per_len, per_len);
    }
    if (a->json) printf("%s}\n", a->n_drafts > 0 ? "]" : "");
    ok = true;
done:
    if (seqs)
        for (int i = 0; i < B; i++)
            kv_seq_free(&kv, &seqs[i]);
    if (mseqs)
        for (int i = 0; i < B; i++)
            kv_seq_free(&mkv, &mseqs[i]);
    kv_free(&kv);
    kv_free(&mkv);
    free(seqs);
    free(mseqs);
    free(ptrs);
    free(ids);
    free(n_new);
    free(logits);
    free(hid);
    free(hcur);
    return ok;
}

int cli_bench(int argc, char **argv)
{
    BenchArgs a;
    const int bad = parse_bench_args(argc, argv, &a);
    if (bad) return bad;
    char dir[1024] = "";
    if (a.synthetic) {
        const char *tmp = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/glmspark-bench-%s-%llu", tmp && *tmp ? tmp : "/tmp", a.preset,
                 a.seed);
        const MkmodelOptions mo = {.out_dir = dir, .preset = a.preset, .seed = a.seed};
        if (mkmodel_write(&mo)) return 1;
    } else {
        snprintf(dir, sizeof dir, "%s", a.model_dir);
    }
    Backend *be = NULL;
    Model m = {0};
    int rc = 1;
    if (backend_open(a.cuda, a.n_threads, 0, a.precision, &be)) goto done;
#ifdef GLMSPARK_HAVE_CUDA
    if (a.cuda) {
        a.copy_gbs = backend_cuda_copy_gbs(be, (size_t) 1 << 30);
        a.gemm_tflops = backend_cuda_gemm_tflops(be, 8192);
        const int pdl = backend_cuda_pdl_tokens();
        char pdl_s[64] = "off";
        if (pdl > 0)
            snprintf(pdl_s, sizeof pdl_s, "on (not in decode steps of more than %d tokens)", pdl);
        if (!a.json)
            printf("cuda  device-to-device copy (1 GiB, read+write): %.1f GB/s; cuBLASLt bf16 "
                   "GEMM 8192^3: %.1f TFLOP/s; graphs %s, programmatic dependent launch %s, "
                   "fused launches %s\n",
                   a.copy_gbs, a.gemm_tflops,
                   backend_env_flag("GLMSPARK_CUDA_GRAPHS", true) ? "on" : "off", pdl_s,
                   backend_env_flag("GLMSPARK_CUDA_FUSE", true) ? "on" : "off");
    }
#endif
    const ModelOptions opts = {.load_mtp = a.n_drafts > 0};
    if (model_load(&m, dir, &opts, be)) goto done;
    if (!m.has_embed || !m.has_head) {
        LOG_ERROR("bench: \"%s\" is not a whole model", dir);
        goto done;
    }
    if (a.n_drafts > 0 && !m.mtp) {
        LOG_ERROR("bench: --mtp-drafts needs an MTP layer, and \"%s\" has none "
                  "(num_nextn_predict_layers %d; `glmspark mkmodel --mtp 1` writes one)",
                  dir, m.cfg.n_mtp_layers);
        goto done;
    }
#ifdef GLMSPARK_HAVE_CUDA
    if (a.cuda && !a.json) {
        size_t total = 0;
        const size_t used = backend_cuda_mem_used(be, &total);
        printf("cuda  device memory after loading the model: %.2f GiB in use of %.2f GiB\n",
               used / 1073741824.0, total / 1073741824.0);
    }
#endif
    rc = 0;
    bool is_warm = false;
    for (int i = 0; i < a.n_batches && rc == 0; i++)
        if (!bench_batch(&a, &m, dir, a.batches[i], &is_warm)) rc = 1;
done:
    model_free(&m);
    if (be) be->destroy(be);
    return rc;
}
