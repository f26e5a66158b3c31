/*
 * cli_bench.c - `glmspark bench`: time prefill and batched decode through the real engine
 * (model.c's forward pass on a backend), on a checkpoint or a synthetic one.
 *
 *   glmspark bench [--backend cpu|cuda] (--model DIR | --synthetic [--preset NAME] [--seed S])
 *     [--batch 1,8] [--ctx 1024] [--steps 32] [--threads N] [--kv-dtype f32|bf16] [--json]
 *
 * For each batch size B: B sequences are prefilled with --ctx deterministic token ids each
 * (one forward call per sequence; prefill tok/s), then --steps decode steps run all B
 * sequences together (one token each, one model_forward_batch call, each sequence's logits
 * downloaded, which also waits for the GPU), after one untimed warm-up step. Printed per
 * configuration: prefill tok/s, decode ms/step and tok/s, and the weight bytes a decode step
 * reads (estimate: every linear weight except the embedding and the routed experts, plus
 * the routed experts expected to be hit by B tokens under uniform routing, E (1 - (1 -
 * K/E)^B)) with the GB/s that implies. KV-cache reads are not counted. --json prints one JSON
 * object per configuration instead.
 *
 * --synthetic writes the mkmodel preset (default "default"; see `glmspark mkmodel`) into
 * $TMPDIR (or /tmp)/glmspark-bench-PRESET-SEED first. The GLM-5.2-REAP-dimension stage
 * benchmark with the tuned kernels is tests/bench/bench_stage.cu (docs/perf.md, CUDA section);
 * this command measures the engine path itself, whatever its backend.
 */
#include "cli.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#ifdef GLMSPARK_HAVE_CUDA
#include "backend_cuda.h"
#endif
#include "kv_cache.h"
#include "mkmodel.h"
#include "model.h"

enum { BENCH_MAX_BATCHES = 16 };

typedef struct BenchArgs {
    const char *model_dir;
    bool synthetic;
    const char *preset;
    unsigned long long seed;
    bool cuda;
    int batches[BENCH_MAX_BATCHES];
    int n_batches;
    int ctx;
    int steps;
    int n_threads;
    KvDtype kv_dtype;
    bool json;
} BenchArgs;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int bench_usage(void)
{
    fprintf(stderr,
            "usage: glmspark bench [--backend cpu|cuda] (--model DIR | --synthetic [--preset NAME] "
            "[--seed S]) [--batch 1,8] [--ctx 1024] [--steps 32] [--threads N] "
            "[--kv-dtype f32|bf16] [--json]\n");
    return 2;
}

static bool parse_int(const char *s, long lo, long hi, int *out)
{
    char *end;
    const long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi) return false;
    *out = (int) v;
    return true;
}

// "1,8,16" -> batches; false on a bad list.
static bool parse_batches(const char *s, BenchArgs *a)
{
    a->n_batches = 0;
    while (*s) {
        char *end;
        const long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 1024 || a->n_batches == BENCH_MAX_BATCHES) return false;
        a->batches[a->n_batches++] = (int) v;
        if (*end == ',')
            end++;
        else if (*end)
            return false;
        s = end;
    }
    return a->n_batches > 0;
}

static int parse_bench_args(int argc, char **argv, BenchArgs *a)
{
    const long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
    *a = (BenchArgs){.preset = "default",
                     .ctx = 1024,
                     .steps = 32,
                     .n_threads = n_cpu > 0 ? (n_cpu > 64 ? 64 : (int) n_cpu) : 1};
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
            ok = (strcmp(val, "cpu") == 0 && ((a->cuda = false), true))
                 || (strcmp(val, "cuda") == 0 && ((a->cuda = true), true));
        else if (strcmp(opt, "--batch") == 0)
            ok = parse_batches(val, a);
        else if (strcmp(opt, "--ctx") == 0)
            ok = parse_int(val, 1, 1 << 20, &a->ctx);
        else if (strcmp(opt, "--steps") == 0)
            ok = parse_int(val, 1, 1 << 20, &a->steps);
        else if (strcmp(opt, "--threads") == 0)
            ok = parse_int(val, 1, 64, &a->n_threads);
        else if (strcmp(opt, "--kv-dtype") == 0)
            ok = (strcmp(val, "f32") == 0 && ((a->kv_dtype = KV_DTYPE_F32), true))
                 || (strcmp(val, "bf16") == 0 && ((a->kv_dtype = KV_DTYPE_BF16), true));
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

// Estimated weight bytes one decode step of batch B reads (see the file comment).
static double step_bytes(const Model *m, int B)
{
    const ModelConfig *c = &m->cfg;
    double dense = m->has_head ? linear_bytes(&m->lm_head) : 0.0, experts = 0.0;
    for (int l = m->first_layer; l < m->last_layer; l++) {
        const ModelLayer *L = &m->layers[l];
        const CkptLinear *lin[] = {&L->q_a,         &L->q_b,     &L->q_proj,   &L->kv_a,
                                   &L->kv_b,        &L->o_proj,  &L->idx_wq_b, &L->idx_wk,
                                   &L->idx_weights, &L->gate,    &L->up,       &L->down,
                                   &L->router,      &L->sh_gate, &L->sh_up,    &L->sh_down};
        for (size_t i = 0; i < sizeof lin / sizeof *lin; i++)
            if (lin[i]->rows > 0 && lin[i]->cols > 0) dense += linear_bytes(lin[i]);
        if (L->is_moe && L->experts && c->n_routed_experts > 0) {
            const double E = c->n_routed_experts, K = c->n_experts_per_tok;
            const double hit = E * (1.0 - pow(1.0 - K / E, B));
            experts += hit
                       * (linear_bytes(&L->experts[0]) + linear_bytes(&L->experts[1])
                          + linear_bytes(&L->experts[2]));
        }
    }
    return dense + experts;
}

static Err open_backend(const BenchArgs *a, Backend **be)
{
    if (!a->cuda) return backend_cpu_create(a->n_threads, be);
#ifdef GLMSPARK_HAVE_CUDA
    return backend_cuda_create(0, be);
#else
    *be = NULL;
    LOG_ERROR("--backend cuda: this glmspark was built without CUDA");
    return ERR_INVAL;
#endif
}

// One batch size: prefill B sequences, then time decode steps. Returns false on failure.
static bool bench_batch(const BenchArgs *a, Model *m, const char *model_dir, int B)
{
    const ModelConfig *c = &m->cfg;
    const int block = KV_DEFAULT_BLOCK_SIZE, positions = a->ctx + a->steps + 1;
    KvCacheParams p = model_kv_params(m, B * ((positions + block - 1) / block), block);
    p.dtype = a->kv_dtype;
    KvCache kv = {0};
    KvSeq *seqs = calloc((size_t) B, sizeof *seqs);
    KvSeq **ptrs = calloc((size_t) B, sizeof *ptrs);
    int *ids = malloc((size_t) (a->ctx > B ? a->ctx : B) * sizeof *ids);
    int *n_new = malloc((size_t) B * sizeof *n_new);
    float *logits = malloc((size_t) B * c->vocab_size * sizeof *logits);
    bool ok = false;
    if (!seqs || !ptrs || !ids || !n_new || !logits || kv_init(&kv, &p)) {
        LOG_ERROR("bench: could not set up batch %d (context %d)", B, a->ctx);
        goto done;
    }
    for (int i = 0; i < B; i++)
        ptrs[i] = &seqs[i];

    // Prefill, one sequence per call.
    double t0 = now_s();
    for (int i = 0; i < B; i++) {
        for (int t = 0; t < a->ctx; t++)
            ids[t] = (int) ((1103515245u * (unsigned) (t + 7919 * i) + 12345u)
                            % (unsigned) c->vocab_size);
        n_new[0] = a->ctx;
        const ModelBatch b = {1, &ptrs[i], n_new};
        if (model_forward_batch(m, &kv, &b, ids, NULL, NULL, logits, MODEL_LOGITS_LAST)) goto done;
    }
    const double prefill_s = now_s() - t0;

    // Decode: one warm-up step, then the timed steps.
    for (int i = 0; i < B; i++)
        n_new[i] = 1;
    const ModelBatch b = {B, ptrs, n_new};
    double decode_s = 0.0;
    for (int s = 0; s <= a->steps; s++) {
        for (int i = 0; i < B; i++)
            ids[i] = (int) ((unsigned) (s * 31 + i * 17 + 5) % (unsigned) c->vocab_size);
        const double t1 = now_s();
        if (model_forward_batch(m, &kv, &b, ids, NULL, NULL, logits, MODEL_LOGITS_LAST)) goto done;
        if (s > 0) decode_s += now_s() - t1;
    }
    const double step_s = decode_s / a->steps;
    const double bytes = step_bytes(m, B);
    if (a->json)
        printf("{\"model\":\"%s\",\"backend\":\"%s\",\"layers\":%d,\"batch\":%d,\"ctx\":%d,"
               "\"steps\":%d,\"prefill_tok_s\":%.2f,\"decode_ms_step\":%.4f,\"decode_tok_s\":%.2f,"
               "\"weight_bytes_step\":%.0f,\"weight_gb_s\":%.3f}\n",
               model_dir, m->be->name, m->last_layer - m->first_layer, B, a->ctx, a->steps,
               B * a->ctx / prefill_s, step_s * 1e3, B / step_s, bytes, bytes / step_s * 1e-9);
    else
        printf("%-5s batch %3d ctx %6d: prefill %10.1f tok/s | decode %9.3f ms/step %10.1f tok/s"
               " | ~%.3f GB weights/step, %8.1f GB/s\n",
               m->be->name, B, a->ctx, B * a->ctx / prefill_s, step_s * 1e3, B / step_s,
               bytes * 1e-9, bytes / step_s * 1e-9);
    ok = true;
done:
    if (seqs)
        for (int i = 0; i < B; i++)
            kv_seq_free(&kv, &seqs[i]);
    kv_free(&kv);
    free(seqs);
    free(ptrs);
    free(ids);
    free(n_new);
    free(logits);
    return ok;
}

int cli_bench(int argc, char **argv)
{
    BenchArgs a;
    const int bad = parse_bench_args(argc, argv, &a);
    if (bad) return bad;
    char dir[1024];
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
    if (open_backend(&a, &be) || model_load(&m, dir, NULL, be)) goto done;
    if (!m.has_embed || !m.has_head) {
        LOG_ERROR("bench: \"%s\" is not a whole model", dir);
        goto done;
    }
    rc = 0;
    for (int i = 0; i < a.n_batches && rc == 0; i++)
        if (!bench_batch(&a, &m, dir, a.batches[i])) rc = 1;
done:
    model_free(&m);
    if (be) be->destroy(be);
    return rc;
}
