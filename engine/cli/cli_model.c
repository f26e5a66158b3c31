/*
 * cli_model.c - `glmspark logits` and `glmspark generate`: run a model on the CPU backend
 * from token ids.
 *
 *   glmspark logits --model DIR --tokens 5,17,42 --out FILE [--threads N] [--decode-check]
 *     [--kv-dtype f32|bf16|fp8]
 *     One forward pass over the tokens; FILE gets float32 little-endian logits
 *     [n_tokens, vocab_size]. --decode-check also runs the tokens one at a time through a
 *     second sequence and reports the largest relative L2 difference per row (stderr);
 *     --decode-out FILE2 does so and writes those one-token steps' logits to FILE2 as FILE
 *     holds the prefill's (the decode path, CUDA graphs included, can then be compared
 *     byte for byte between runs).
 *   glmspark generate --model DIR --tokens 5,17,42 --max-tokens N [--temperature T]
 *     [--top-p P] [--top-k K] [--min-p P] [--seed S] [--ignore-eos] [--threads N]
 *     [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F]
 *     [--kv-dtype f32|bf16|fp8]
 * --kv-dtype chooses the KV cache storage (default f32 on the CPU, exact; bf16 halves it and
 * is the default on CUDA; fp8 is the reference deployment's layout, engine/model/kv_cache.h).
 * --backend cuda runs the ops on GPU --local-rank (default 0; backend_cuda.h; builds with
 * CUDA only), cpu is the default. --precision f32|bf16 chooses the precision recipe
 * (engine/model/backend.h; default: f32 on the CPU; CUDA runs bf16, the recipe of its
 * kernels, only, and no f32 cache); the CPU backend follows bf16 so the two can be compared.
 *     Prefill, then decode token by token; prints the generated ids space-separated on one
 *     line and stops at an eos id unless --ignore-eos. Load time, prefill and decode tok/s
 *     go to stderr at info level.
 * Threads default to GLMSPARK_THREADS or the number of online CPUs.
 *
 * Pipeline parallelism (pp.h): --pp N starts N local ranks of this command (fork/exec) and
 * gives the same output as the single-rank form. Each rank (--rank R --world N --master
 * ADDR:PORT, or the launcher's environment: OMPI_COMM_WORLD_*, PMI_*, SLURM_*) loads only
 * its layers of the split pp_plan_model() computes (identical on every rank, checked by
 * the handshake); rank 0 prints or writes the output, the last rank samples. The local
 * launcher passes --local-rank R (GPU R); under mpirun/srun OMPI_COMM_WORLD_LOCAL_RANK or
 * SLURM_LOCALID does. generate --n-seqs K runs K sequences (seeds seed .. seed+K-1) at once
 * through the scheduler and prints one line per sequence; --max-seqs M runs at most M of them
 * at a time (the others join as sequences end: the batches change composition, as a
 * server's do).
 *
 * generate --mtp K (1..8) decodes speculatively (mtp.h): K drafts from the model's MTP
 * layer, verified in one forward of 1 + K tokens; the greedy output is the same as
 * without it, and sampling keeps the target distribution (temperature only: no top-k/p,
 * min-p or penalties). Acceptance rate and tok/s go to stderr. With --pp N or --n-seqs K
 * it runs through the scheduler (SchedParams.mtp_k): the last rank drafts, the next
 * micro-batch verifies, and the output is again what the run without --mtp prints.
 */
#include "engine/cli/cli.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/backend/backends.h"
#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/model/sampler.h"
#include "engine/pipeline/mtp.h"
#include "engine/pipeline/pp.h"
#include "engine/pipeline/scheduler.h"
#include "engine/shared/clock.h"
#include "engine/shared/num.h"
#include "engine/shared/thread_pool.h"

typedef struct ModelArgs {
    const char *model_dir;
    const char *tokens_arg;
    const char *out_path;
    int max_tokens;
    int n_seqs;  // generate --n-seqs K: K copies of the prompt through the scheduler
    int max_seqs;  // --max-seqs M: at most M of them at once (0: all K)
    int mtp;     // generate --mtp K: K MTP drafts per verify step (0: off)
    int n_threads;
    bool ignore_eos;
    bool decode_check;
    const char *decode_out;  // --decode-out FILE: the decode check's rows (implies it)
    bool cuda;  // --backend cuda
    int precision;  // --precision f32|bf16 (backends.h), or the backend's own
    KvDtype kv_dtype;
    bool kv_set;  // --kv-dtype given (else the backend kind's default, backend_kind_check)
    SamplerParams sampling;
    int pp;    // --pp N: launch N local ranks
    int rank;  // -1: not a pipeline rank (unless the environment says so)
    int world;
    const char *master;
    int local_rank;  // this rank's index on its host: the GPU --backend cuda uses
} ModelArgs;

// CPU time of the whole process (all threads), to tell work from waiting on a busy machine.
static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double) ts.tv_sec + ts.tv_nsec * 1e-9;
}

static bool parse_float(const char *s, float *out)
{
    char *end;
    errno = 0;
    const float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

// "5,17,42" -> ids (malloc'd, caller frees). Returns false (after a message) when malformed.
static bool parse_tokens(const char *cmd, const char *s, int **ids_out, int *n_out)
{
    int n = 1;
    for (const char *p = s; *p; p++)
        n += *p == ',';
    int *ids = malloc((size_t) n * sizeof *ids);
    if (!ids) return false;
    const char *p = s;
    for (int i = 0; i < n; i++) {
        char *end;
        errno = 0;
        const long v = strtol(p, &end, 10);
        if (errno || end == p || (*end != ',' && *end != '\0') || v < 0 || v > 0x7fffffff) {
            fprintf(stderr,
                    "glmspark %s: --tokens: \"%s\" is not a comma-separated list of "
                    "token ids\n",
                    cmd, s);
            free(ids);
            return false;
        }
        ids[i] = (int) v;
        p = end + 1;
    }
    *ids_out = ids;
    *n_out = n;
    return true;
}

static int usage(const char *cmd)
{
    if (strcmp(cmd, "logits") == 0)
        fprintf(stderr,
                "usage: glmspark logits --model DIR --tokens 5,17,42 --out FILE "
                "[--threads N] [--backend cpu|cuda] [--precision f32|bf16] [--decode-check] "
                "[--decode-out FILE2] "
                "[--kv-dtype f32|bf16|fp8] "
                "[--pp N | --rank R "
                "--world N --master ADDR:PORT]\n");
    else
        fprintf(stderr, "usage: glmspark generate --model DIR --tokens 5,17,42 --max-tokens N "
                        "[--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S] "
                        "[--ignore-eos] [--threads N] [--backend cpu|cuda] [--precision f32|bf16] "
                        "[--repetition-penalty R] "
                        "[--presence-penalty P] [--frequency-penalty F] [--kv-dtype f32|bf16|fp8] "
                        "[--mtp K] [--n-seqs K [--max-seqs M]] "
                        "[--pp N | --rank R --world N --master ADDR:PORT]\n");
    return 2;
}

// Returns 0 on success, else the exit status (2, usage printed).
static int parse_args(int argc, char **argv, ModelArgs *a)
{
    const char *cmd = argv[0];
    *a = (ModelArgs){.max_tokens = -1,
                     .pp = 1,
                     .rank = -1,
                     .world = 1,
                     .n_seqs = 1,
                     .precision = BACKEND_PRECISION_DEFAULT};
    if (!cli_default_threads(cmd, &a->n_threads)) return 2;
    a->sampling = sampler_default_params();
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (strcmp(opt, "--ignore-eos") == 0) {
            a->ignore_eos = true;
            continue;
        }
        if (strcmp(opt, "--decode-check") == 0) {
            a->decode_check = true;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "glmspark %s: %s needs a value\n", cmd, opt);
            return usage(cmd);
        }
        const char *val = argv[++i];
        long v;
        bool ok = true;
        if (strcmp(opt, "--model") == 0)
            a->model_dir = val;
        else if (strcmp(opt, "--kv-dtype") == 0)
            ok = a->kv_set = kv_dtype_parse(val, &a->kv_dtype);
        else if (strcmp(opt, "--backend") == 0)
            ok = cli_parse_backend(val, &a->cuda);
        else if (strcmp(opt, "--precision") == 0)
            ok = backend_precision_parse(val, &a->precision);
        else if (strcmp(opt, "--tokens") == 0)
            a->tokens_arg = val;
        else if (strcmp(opt, "--out") == 0)
            a->out_path = val;
        else if (strcmp(opt, "--decode-out") == 0)
            a->decode_out = val, a->decode_check = true;
        else if (strcmp(opt, "--max-tokens") == 0)
            ok = num_parse_int(val, 0, 1 << 24, &a->max_tokens);
        else if (strcmp(opt, "--pp") == 0)
            ok = num_parse_int(val, 1, PP_MAX_WORLD, &a->pp);
        else if (strcmp(opt, "--rank") == 0)
            ok = num_parse_int(val, 0, PP_MAX_WORLD - 1, &a->rank);
        else if (strcmp(opt, "--world") == 0)
            ok = num_parse_int(val, 1, PP_MAX_WORLD, &a->world);
        else if (strcmp(opt, "--master") == 0)
            a->master = val;
        else if (strcmp(opt, "--local-rank") == 0)
            ok = num_parse_int(val, 0, 1023, &a->local_rank);
        else if (strcmp(opt, "--mtp") == 0)
            ok = num_parse_int(val, 1, MTP_MAX_DRAFTS, &a->mtp);
        else if (strcmp(opt, "--n-seqs") == 0)
            ok = num_parse_int(val, 1, PP_MAX_SLOTS, &a->n_seqs);
        else if (strcmp(opt, "--max-seqs") == 0)
            ok = num_parse_int(val, 1, PP_MAX_SLOTS, &a->max_seqs);
        else if (strcmp(opt, "--threads") == 0)
            ok = num_parse_int(val, 1, THREAD_POOL_MAX_THREADS, &a->n_threads);
        else if (strcmp(opt, "--top-k") == 0)
            ok = num_parse_int(val, 0, 1 << 30, &a->sampling.top_k);
        else if (strcmp(opt, "--seed") == 0)
            ok = num_parse_long(val, 0, 0x7fffffffffffffffL, &v)
                 && ((a->sampling.seed = (uint64_t) v), true);
        else if (strcmp(opt, "--temperature") == 0)
            ok = parse_float(val, &a->sampling.temperature) && a->sampling.temperature >= 0.0f;
        else if (strcmp(opt, "--top-p") == 0)
            ok = parse_float(val, &a->sampling.top_p) && a->sampling.top_p > 0.0f
                 && a->sampling.top_p <= 1.0f;
        else if (strcmp(opt, "--min-p") == 0)
            ok = parse_float(val, &a->sampling.min_p) && a->sampling.min_p >= 0.0f
                 && a->sampling.min_p <= 1.0f;
        else if (strcmp(opt, "--repetition-penalty") == 0)
            ok = parse_float(val, &a->sampling.repetition_penalty)
                 && a->sampling.repetition_penalty > 0.0f;
        else if (strcmp(opt, "--presence-penalty") == 0)
            ok = parse_float(val, &a->sampling.presence_penalty);
        else if (strcmp(opt, "--frequency-penalty") == 0)
            ok = parse_float(val, &a->sampling.frequency_penalty);
        else {
            fprintf(stderr, "glmspark %s: unknown option %s\n", cmd, opt);
            return usage(cmd);
        }
        if (!ok) {
            fprintf(stderr, "glmspark %s: bad value for %s: \"%s\"\n", cmd, opt, val);
            return usage(cmd);
        }
    }
    if (!a->model_dir || !a->tokens_arg) {
        fprintf(stderr, "glmspark %s: --model and --tokens are required\n", cmd);
        return usage(cmd);
    }
    if (a->max_seqs > 0 && (strcmp(cmd, "generate") != 0 || a->n_seqs < 2)) {
        fprintf(stderr, "glmspark %s: --max-seqs needs generate --n-seqs K with K >= 2\n", cmd);
        return usage(cmd);
    }
    if (a->rank < 0 && a->pp == 1 && pp_rank_from_env(&a->rank, &a->world)) {
        if (!a->master) a->master = getenv("GLMSPARK_MASTER");
        // The launcher's host-local rank picks the GPU (mpirun, srun).
        const char *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        if (!local) local = getenv("SLURM_LOCALID");
        if (local && atoi(local) > 0) a->local_rank = atoi(local);
    }
    if (a->rank >= 0 && (a->rank >= a->world || (a->world > 1 && !a->master))) {
        fprintf(stderr,
                "glmspark %s: --rank must be below --world, and a pipeline rank needs "
                "--master ADDR:PORT (or GLMSPARK_MASTER)\n",
                cmd);
        return usage(cmd);
    }
    if (a->decode_out && (a->pp > 1 || a->world > 1 || a->rank >= 0)) {
        fprintf(stderr, "glmspark %s: --decode-out runs on one rank only (not with --pp or "
                        "pipeline ranks)\n", cmd);
        return usage(cmd);
    }
    if (strcmp(cmd, "logits") == 0 && !a->out_path) {
        fprintf(stderr, "glmspark logits: --out is required\n");
        return usage(cmd);
    }
    if (strcmp(cmd, "generate") == 0 && a->max_tokens < 0) {
        fprintf(stderr, "glmspark generate: --max-tokens is required\n");
        return usage(cmd);
    }
    char who[64];
    snprintf(who, sizeof who, "glmspark %s", cmd);
    if (!backend_kind_check(who, a->cuda, a->precision, a->kv_set, &a->kv_dtype,
                            KV_DEFAULT_BLOCK_SIZE))
        return 2;
    return 0;
}

// The backend --backend chose (cpu by default), on GPU --local-rank.
static Err open_backend(const ModelArgs *a, Backend **be)
{
    return backend_open(a->cuda, a->n_threads, a->local_rank, a->precision, be);
}

// Backend, model and a KV cache with room for n_positions, or an error message.
static Err open_model(const ModelArgs *a, int n_positions, Backend **be, Model *m, KvCache *kv)
{
    const double t0 = clock_now_s();
    Err err = open_backend(a, be);
    if (err) return err;
    if ((err = model_load(m, a->model_dir, NULL, *be))) return err;
    const int block = KV_DEFAULT_BLOCK_SIZE;
    // Two sequences' worth, for --decode-check.
    KvCacheParams p = model_kv_params(m, 2 * ((n_positions + block - 1) / block), block);
    p.dtype = a->kv_dtype;
    if ((err = kv_init(kv, &p))) return err;
    LOG_INFO("loaded \"%s\" in %.3f s (%d threads)", a->model_dir, clock_now_s() - t0,
             a->n_threads);
    return ERR_OK;
}

static void close_model(Backend *be, Model *m, KvCache *kv)
{
    kv_free(kv);
    model_free(m);
    if (be) be->destroy(be);
}

// ---------------------------------------------------------------------------
// Several sequences through the scheduler (generate --n-seqs K)

typedef struct BatchOut {
    int32_t **ids;  // [K][max_tokens]
    int *n;         // [K]
    int n_finished;  // sequences whose last event came
} BatchOut;

static void on_batch_event(void *user, const SchedEvent *ev)
{
    BatchOut *o = user;
    if (ev->token >= 0) o->ids[ev->id][o->n[ev->id]++] = ev->token;
    if (ev->finish != SCHED_FINISH_NONE) o->n_finished++;
}

// The decode rate over a run of batches: tokens, wall seconds and this rank's split of them
// (pp_stage_times), logged as "decode with all K sequences WHAT".
static void log_decode_phase(int K, const char *what, int tokens, double wall_s,
                             PpStageTimes t0, PpStageTimes t1)
{
    const long long nb = t1.batches - t0.batches;
    if (tokens <= 0 || wall_s <= 0.0 || nb <= 0) return;
    const double fwd = t1.forward_s - t0.forward_s, smp = t1.sample_s - t0.sample_s;
    // Per batch on this rank (all of it with one rank): the forward (the device's work,
    // waiting for it, the logits' download), sampling, and the rest (the scheduler, the
    // cache's bookkeeping, other ranks).
    LOG_INFO("decode with all %d sequences %s: %d tokens in %.3f s (%.2f tok/s aggregate); "
             "%lld batches on rank 0, per batch %.3f ms: forward %.3f, sampling %.3f, the rest "
             "%.3f",
             K, what, tokens, wall_s, tokens / wall_s, nb, 1e3 * wall_s / nb, 1e3 * fwd / nb,
             1e3 * smp / nb, 1e3 * (wall_s - fwd - smp) / nb);
}

// Rank 0 (or the only rank): K copies of the prompt, sequence i seeded with seed + i, all
// running at once; prints one line of ids per sequence and the aggregate decode rate.
static int drive_scheduler(const ModelArgs *a, PpStage *st, const Model *m, KvCache *kv,
                           const int *ids, int n)
{
    const int K = a->n_seqs;
    BatchOut out = {calloc((size_t) K, sizeof(int32_t *)), calloc((size_t) K, sizeof(int)), 0};
    Scheduler *s = NULL;
    int rc = 1;
    if (!out.ids || !out.n) goto done;
    for (int i = 0; i < K; i++)
        if (!(out.ids[i] = malloc(((size_t) a->max_tokens + 1) * sizeof(int32_t)))) goto done;
    // --max-seqs M < K: the sequences take turns, one joining as another ends.
    const SchedParams sp = {.max_num_seqs = a->max_seqs > 0 && a->max_seqs < K ? a->max_seqs : K,
                            .mtp_k = a->mtp,
                            .on_event = on_batch_event,
                            .user = &out};
    if (sched_create(st, m, kv, &sp, &s)) goto done;
    for (int i = 0; i < K; i++) {
        SchedRequest r = {.id = (uint64_t) i,
                          .prompt = ids,
                          .n_prompt = n,
                          .max_tokens = a->max_tokens,
                          .sampling = a->sampling,
                          .n_top_logprobs = -1,
                          .ignore_eos = a->ignore_eos};
        r.sampling.seed += (uint64_t) i;
        if (sched_submit(s, &r)) goto done;
    }
    const double t0 = clock_now_s(), c0 = cpu_s();
    // The decode phase: from the step after which every sequence has its first token (all
    // prompts prefilled) to the end; and its part in which every batch holds all K sequences
    // (up to the step in which the first one ends; sequences prefilled earlier end earlier,
    // leaving smaller batches at the end): that rate is the batch's decode speed, comparable
    // with `glmspark bench` at batch K and the same context.
    double t_all = -1.0, t_full = -1.0;
    int tok_all = 0, tok_full = 0;
    PpStageTimes times_all = {0}, times_full = {0};
    bool full = false;
    while (sched_has_work(s)) {
        if (sched_step(s)) goto done;
        int emitted = 0, started = 0;
        for (int i = 0; i < K; i++) {
            emitted += out.n[i];
            started += out.n[i] > 0;
        }
        if (t_all < 0.0 && started == K) {
            t_all = clock_now_s();
            tok_all = emitted;
            times_all = pp_stage_times(st);
            full = out.n_finished == 0;  // else no batch held them all
        } else if (full && t_full < 0.0 && out.n_finished > 0) {
            t_full = clock_now_s();
            tok_full = emitted;
            times_full = pp_stage_times(st);
        }
    }
    const double t_end = clock_now_s(), dt = t_end - t0, dc = cpu_s() - c0;
    int total = 0;
    for (int i = 0; i < K; i++) {
        for (int j = 0; j < out.n[i]; j++)
            printf(j ? " %d" : "%d", out.ids[i][j]);
        printf("\n");
        total += out.n[i];
    }
    fflush(stdout);
    LOG_INFO("%d sequences x %d prompt tokens: %d tokens generated in %.3f s (%.2f tok/s "
             "aggregate, %.3f s cpu on rank 0) over %d ranks",
             K, n, total, dt, total / dt, dc, pp_world(st));
    if (t_all >= 0.0 && sp.max_num_seqs == K) {  // else no batch held all K
        log_decode_phase(K, "prefilled", total - tok_all, t_end - t_all, times_all,
                         pp_stage_times(st));
        if (t_full >= 0.0)
            log_decode_phase(K, "in every batch", tok_full - tok_all, t_full - t_all, times_all,
                             times_full);
    }
    if (a->mtp > 0) {
        SchedStats ss;
        sched_stats(s, &ss);
        LOG_INFO("mtp %d: %llu verify steps, %llu of %llu drafts accepted (%.1f%%)", a->mtp,
                 (unsigned long long) ss.mtp_steps, (unsigned long long) ss.mtp_accepted,
                 (unsigned long long) ss.mtp_drafted,
                 ss.mtp_drafted ? 100.0 * (double) ss.mtp_accepted / (double) ss.mtp_drafted : 0.0);
    }
    rc = 0;

done:
    sched_destroy(s);
    for (int i = 0; out.ids && i < K; i++)
        free(out.ids[i]);
    free(out.ids);
    free(out.n);
    return rc;
}

// ---------------------------------------------------------------------------
// Pipeline ranks

// logits [count] as float32 little-endian into path (the host is little-endian: x86-64,
// aarch64, the format's byte order). Returns 1 after a message on stderr, else 0.
static int write_logits(const char *path, const float *logits, size_t count)
{
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "glmspark logits: could not open \"%s\": %s\n", path, strerror(errno));
        return 1;
    }
    if (fwrite(logits, sizeof *logits, count, f) != count || fclose(f) != 0) {
        fprintf(stderr, "glmspark logits: could not write \"%s\": %s\n", path, strerror(errno));
        return 1;
    }
    return 0;
}

static bool is_eos(const Model *m, int id)
{
    for (int e = 0; e < m->cfg.n_eos_ids; e++)
        if (id == m->cfg.eos_ids[e]) return true;
    return false;
}

// One rank of `logits` or `generate` over world ranks: plan the split (the same on every
// rank), load this rank's layers, connect; rank 0 drives, the others serve.
static int run_pipeline(const ModelArgs *a, const char *cmd, const int *ids, int n)
{
    const bool is_logits = strcmp(cmd, "logits") == 0;
    // MTP: the last rank's draft recursion runs up to --mtp positions past the output.
    const int positions = n + (is_logits ? 0 : a->max_tokens + a->mtp);
    Backend *be = NULL;
    Model m = {0};
    KvCache kv = {0};
    PpStage *st = NULL;
    ModelConfig *cfg = malloc(sizeof *cfg);
    int rc = 1;
    if (!cfg || config_load(cfg, a->model_dir)) goto done;
    if (a->mtp > 0 && cfg->n_mtp_layers < 1) {
        LOG_ERROR("--mtp needs the model's MTP layer; \"%s\" has none (num_nextn_predict_layers "
                  "0)",
                  a->model_dir);
        goto done;
    }
    PpPlan plan;
    // Memory is not the constraint on the CPU: balance bytes (weights + KV at the context).
    if (pp_plan_model(a->model_dir, cfg, a->world, UINT64_C(1) << 60, 1.0, positions, a->kv_dtype,
                      &plan))
        goto done;
    const PpRankPlan *mine = &plan.ranks[a->rank];
    const double t0 = clock_now_s();
    const ModelOptions opts = {.load_mtp = a->mtp > 0 && !is_logits,
                               .first_layer = mine->first_layer,
                               .last_layer = mine->last_layer};
    if (open_backend(a, &be) || model_load(&m, a->model_dir, &opts, be)) goto done;
    // Read this rank's weights once now, with progress (bytes, GB/s, ETA) in the log, rather
    // than page-faulting them in during the first forward pass.
    CkptTouchStats touch;
    ckpt_touch(&m.ckpt, &touch);
    const int block = KV_DEFAULT_BLOCK_SIZE;
    KvCacheParams kp = model_kv_params(&m, a->n_seqs * ((positions + block - 1) / block), block);
    kp.dtype = a->kv_dtype;
    if (kv_init(&kv, &kp)) goto done;
    LOG_INFO("pipeline rank %d of %d: layers [%d, %d)%s%s, %.3f GB of weights from %d shards, "
             "loaded in %.3f s (%.2f GB/s)",
             a->rank, a->world, mine->first_layer, mine->last_layer,
             m.has_embed ? " + embeddings" : "", m.has_head ? " + head" : "",
             mine->weight_bytes / 1e9, m.ckpt.n_shards, clock_now_s() - t0, touch.gb_per_s);
    const uint64_t extra =
        (uint64_t) a->mtp << 48 | (uint64_t) positions << 8 | (uint64_t) a->kv_dtype;
    if (pp_stage_create(&m, &kv, a->rank, a->world, a->master, pp_plan_hash(cfg, &plan, extra),
                        &st))
        goto done;
    if (a->rank > 0) {
        rc = pp_serve(st) ? 1 : 0;
        goto done;
    }

    PpResult res;
    PpSeqOp op = {.slot = 0, .n_new = n, .flags = PP_SEQ_START, .params = a->sampling};
    if (is_logits) {
        if (a->decode_check) LOG_WARN("--decode-check is not available with pipeline ranks");
        op.flags |= PP_SEQ_LOGITS | PP_SEQ_FREE;
        const double t1 = clock_now_s();
        if (pp_submit(st, &op, 1, ids) || pp_collect(st, &res)) goto done;
        LOG_INFO("prefill: %d tokens in %.3f s over %d ranks", n, clock_now_s() - t1, a->world);
        if (write_logits(a->out_path, res.logits, (size_t) n * (size_t) cfg->vocab_size)) goto done;
    } else if (a->n_seqs > 1 || a->mtp > 0) {
        if (drive_scheduler(a, st, &m, &kv, ids, n)) goto done;
    } else {
        op.flags |= PP_SEQ_SAMPLE;
        double t1 = clock_now_s();
        if (pp_submit(st, &op, 1, ids) || pp_collect(st, &res)) goto done;
        const double prefill_s = clock_now_s() - t1;
        t1 = clock_now_s();
        int n_out = 0;
        for (; n_out < a->max_tokens; n_out++) {
            const int32_t next = res.tokens[0];
            printf(n_out ? " %d" : "%d", next);
            if (is_eos(&m, next) && !a->ignore_eos) {
                n_out++;
                break;
            }
            if (n_out + 1 < a->max_tokens) {
                const PpSeqOp step = {.slot = 0, .n_new = 1, .flags = PP_SEQ_SAMPLE};
                if (pp_submit(st, &step, 1, &next) || pp_collect(st, &res)) goto done;
            }
        }
        printf("\n");
        fflush(stdout);
        const double decode_s = clock_now_s() - t1;
        const PpSeqOp fin = {.slot = 0, .n_new = 0, .flags = PP_SEQ_FREE};
        if (pp_submit(st, &fin, 1, NULL) || pp_collect(st, &res)) goto done;
        LOG_INFO("prefill: %d tokens in %.3f s; decode: %d tokens in %.3f s (%.2f tok/s) over %d "
                 "ranks",
                 n, prefill_s, n_out > 0 ? n_out - 1 : 0, decode_s,
                 n_out > 1 ? (n_out - 1) / decode_s : 0.0, a->world);
    }
    if (pp_end(st)) goto done;
    rc = 0;

done:
    pp_stage_destroy(st);
    kv_free(&kv);
    model_free(&m);
    if (be) be->destroy(be);
    free(cfg);
    return rc;
}

// ---------------------------------------------------------------------------
// The only rank

// `logits` on this process alone.
static int logits_alone(const ModelArgs *a, const int *ids, int n)
{
    Backend *be = NULL;
    Model m = {0};
    KvCache kv = {0};
    KvSeq seq = {0}, seq2 = {0};
    float *logits = NULL, *row = NULL, *dec = NULL;
    int rc = 1;
    if (open_model(a, n, &be, &m, &kv)) goto done;
    const size_t V = (size_t) m.cfg.vocab_size;
    logits = malloc((size_t) n * V * sizeof *logits);
    row = malloc(V * sizeof *row);
    if (!logits || !row) goto done;
    const double t0 = clock_now_s();
    if (model_forward(&m, &kv, &seq, ids, n, logits, true)) goto done;
    LOG_INFO("prefill: %d tokens in %.3f s (%.1f tok/s)", n, clock_now_s() - t0,
             n / (clock_now_s() - t0));

    if (write_logits(a->out_path, logits, (size_t) n * V)) goto done;

    if (a->decode_check) {
        double worst = 0.0;
        if (a->decode_out) {
            dec = malloc((size_t) n * V * sizeof *dec);
            if (!dec) {
                LOG_ERROR("--decode-out: could not allocate %d rows of logits", n);
                goto done;
            }
        }
        for (int t = 0; t < n; t++) {
            if (model_forward(&m, &kv, &seq2, ids + t, 1, row, false)) goto done;
            if (dec) memcpy(dec + (size_t) t * V, row, V * sizeof *row);
            double num = 0.0, den = 0.0;
            for (size_t i = 0; i < V; i++) {
                const double d = (double) row[i] - logits[(size_t) t * V + i];
                num += d * d;
                den += (double) logits[(size_t) t * V + i] * logits[(size_t) t * V + i];
            }
            const double rel = sqrt(num / (den > 0 ? den : 1));
            if (rel > worst) worst = rel;
        }
        fprintf(stderr, "decode-check: max relative L2 difference decode vs prefill %.3g\n", worst);
        if (dec && write_logits(a->decode_out, dec, (size_t) n * V)) goto done;
    }
    rc = 0;

done:
    free(logits);
    free(row);
    free(dec);
    kv_seq_free(&kv, &seq);
    kv_seq_free(&kv, &seq2);
    close_model(be, &m, &kv);
    return rc;
}

// generate --mtp K: speculative decoding on one rank (mtp.h).
static int generate_mtp(const ModelArgs *a, const int *ids, int n)
{
    Backend *be = NULL;
    Model m = {0};
    KvCache kv = {0}, mkv = {0};
    Sampler s = {0};
    MtpGen g = {0};
    int *out = NULL;
    int rc = 1;
    if (mtp_check_params(&a->sampling)) return 2;
    const double t0 = clock_now_s();
    const ModelOptions opts = {.load_mtp = true};
    if (open_backend(a, &be) || model_load(&m, a->model_dir, &opts, be)) goto done;
    const int block = KV_DEFAULT_BLOCK_SIZE;
    // Room for the prompt, the output and one step's drafts past the end.
    const int blocks = (n + a->max_tokens + a->mtp + 1 + block - 1) / block;
    KvCacheParams p = model_kv_params(&m, blocks, block);
    p.dtype = a->kv_dtype;
    KvCacheParams mp = model_mtp_kv_params(&m, blocks, block);
    mp.dtype = a->kv_dtype;
    if (kv_init(&kv, &p) || kv_init(&mkv, &mp)) goto done;
    if (sampler_init(&s, m.cfg.vocab_size, a->sampling)) goto done;
    if (mtp_gen_init(&g, &m, &kv, &mkv, &s, a->mtp)) goto done;
    out = malloc((size_t) (a->mtp + 1) * sizeof *out);
    if (!out) goto done;
    LOG_INFO("loaded \"%s\" with its MTP layer in %.3f s (%d threads)", a->model_dir,
             clock_now_s() - t0, a->n_threads);

    double t1 = clock_now_s();
    int n_out = 0, first = 0;
    if (a->max_tokens > 0 && mtp_gen_prefill(&g, ids, n, &first)) goto done;
    const double prefill_s = clock_now_s() - t1;
    t1 = clock_now_s();
    bool stop = a->max_tokens == 0;
    if (!stop) {
        printf("%d", first);
        n_out = 1;
        stop = !a->ignore_eos && is_eos(&m, first);
    }
    while (!stop && n_out < a->max_tokens) {
        int k = 0;
        if (mtp_gen_step(&g, out, &k)) goto done;
        for (int i = 0; i < k && !stop && n_out < a->max_tokens; i++) {
            printf(" %d", out[i]);
            n_out++;
            stop = !a->ignore_eos && is_eos(&m, out[i]);
        }
    }
    printf("\n");
    const double decode_s = clock_now_s() - t1;
    const MtpStats *st = &g.stats;
    LOG_INFO("prefill: %d tokens in %.3f s (%.1f tok/s); decode: %d tokens in %.3f s (%.2f "
             "tok/s)",
             n, prefill_s, n / prefill_s, n_out > 0 ? n_out - 1 : 0, decode_s,
             n_out > 1 ? (n_out - 1) / decode_s : 0.0);
    LOG_INFO("mtp %d: %ld verify steps, %ld of %ld drafts accepted (%.1f%%), %.2f tokens per "
             "step",
             a->mtp, st->steps, st->accepted, st->drafted,
             st->drafted ? 100.0 * (double) st->accepted / (double) st->drafted : 0.0,
             st->steps ? (double) st->emitted / (double) st->steps : 0.0);
    rc = 0;

done:
    fflush(stdout);
    free(out);
    mtp_gen_free(&g);
    sampler_free(&s);
    kv_free(&mkv);
    close_model(be, &m, &kv);
    return rc;
}

// `generate` on this process alone: one sequence, or --n-seqs K through the scheduler.
static int generate_alone(const ModelArgs *a, const int *ids, int n)
{
    Backend *be = NULL;
    Model m = {0};
    KvCache kv = {0};
    KvSeq seq = {0};
    Sampler s = {0};
    float *logits = NULL;
    int32_t *history = NULL;  // prompt then generated ids, for the penalties
    int rc = 1;
    if (a->n_seqs > 1) {
        // Through the scheduler on one stage: the cache holds every sequence at once.
        PpStage *st = NULL;
        KvCacheParams p;
        const ModelOptions opts = {.load_mtp = a->mtp > 0};
        if (open_backend(a, &be) || model_load(&m, a->model_dir, &opts, be)) goto done;
        const int block = KV_DEFAULT_BLOCK_SIZE;
        p = model_kv_params(&m, a->n_seqs * ((n + a->max_tokens + a->mtp + block - 1) / block),
                            block);
        p.dtype = a->kv_dtype;
        if (kv_init(&kv, &p) == ERR_OK && pp_stage_create(&m, &kv, 0, 1, NULL, 0, &st) == ERR_OK)
            rc = drive_scheduler(a, st, &m, &kv, ids, n);
        pp_stage_destroy(st);
        goto done;
    }
    if (open_model(a, n + a->max_tokens, &be, &m, &kv)) goto done;
    if (sampler_init(&s, m.cfg.vocab_size, a->sampling)) goto done;
    logits = malloc((size_t) m.cfg.vocab_size * sizeof *logits);
    history = malloc(((size_t) n + a->max_tokens) * sizeof *history);
    if (!logits || !history) goto done;
    for (int i = 0; i < n; i++)
        history[i] = ids[i];

    double t0 = clock_now_s(), c0 = cpu_s();
    if (model_forward(&m, &kv, &seq, ids, n, logits, false)) goto done;
    const double prefill_s = clock_now_s() - t0, prefill_cpu_s = cpu_s() - c0;
    t0 = clock_now_s();
    c0 = cpu_s();
    int n_out = 0;
    for (; n_out < a->max_tokens; n_out++) {
        sampler_apply_penalties(&s, logits, history, n + n_out);  // prompt and output
        const int next = sampler_sample(&s, logits);
        history[n + n_out] = next;
        printf(n_out ? " %d" : "%d", next);
        if (is_eos(&m, next) && !a->ignore_eos) {
            n_out++;
            break;
        }
        if (n_out + 1 < a->max_tokens && model_forward(&m, &kv, &seq, &next, 1, logits, false))
            goto done;
    }
    printf("\n");
    const double decode_s = clock_now_s() - t0, decode_cpu_s = cpu_s() - c0;
    // The first generated token comes from the prefill's logits: decode ran n_out - 1 steps.
    LOG_INFO("prefill: %d tokens in %.3f s (%.1f tok/s, %.3f s cpu); decode: %d tokens in "
             "%.3f s (%.2f tok/s, %.3f s cpu)",
             n, prefill_s, n / prefill_s, prefill_cpu_s, n_out > 0 ? n_out - 1 : 0, decode_s,
             n_out > 1 ? (n_out - 1) / decode_s : 0.0, decode_cpu_s);
    rc = 0;

done:
    fflush(stdout);
    free(logits);
    free(history);
    sampler_free(&s);
    kv_seq_free(&kv, &seq);
    close_model(be, &m, &kv);
    return rc;
}

// ---------------------------------------------------------------------------
// The commands

// What `logits` and `generate` share: parse the options and the tokens, then run as the
// local launcher of --pp N ranks, as one of world pipeline ranks, or alone (generate --mtp
// K on one rank has its own loop). Returns the exit status.
static int run_command(int argc, char **argv, int (*run_alone)(const ModelArgs *, const int *, int))
{
    ModelArgs a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc;
    int *ids = NULL, n = 0;
    if (!parse_tokens(argv[0], a.tokens_arg, &ids, &n)) return 2;
    const bool is_generate = strcmp(argv[0], "generate") == 0;
    if (is_generate && a.mtp > 0 && mtp_check_params(&a.sampling))
        rc = 2;
    else if (is_generate && a.mtp > 0 && a.pp == 1 && a.rank < 0 && a.n_seqs <= 1)
        rc = generate_mtp(&a, ids, n);
    else if (a.pp > 1 && a.rank < 0)
        rc = pp_launch_local(argc, argv, a.pp);
    else if (a.rank >= 0 && a.world > 1)
        rc = run_pipeline(&a, argv[0], ids, n);
    else
        rc = run_alone(&a, ids, n);
    free(ids);
    return rc;
}

int cli_logits(int argc, char **argv)
{
    return run_command(argc, argv, logits_alone);
}

int cli_generate(int argc, char **argv)
{
    return run_command(argc, argv, generate_alone);
}
