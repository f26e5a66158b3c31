/*
 * main_engine.c - glmspark-engine: claim jobs from PostgreSQL, generate them together
 * through the scheduler (continuous batching over a pipeline of ranks), stream chunks back.
 *
 *   glmspark-engine --model DIR --db CONNINFO [--tokenizer FILE] [--model-name NAME]
 *                   [--threads N] [--kv-blocks N] [--name NAME] [--lease-s S]
 *                   [--max-num-seqs N] [--max-num-batched-tokens N] [--prefill-slice N]
 *                   [--backend cpu|cuda] [--precision f32|bf16] [--kv-dtype fp8|bf16|f32]
 *                   [--step-delay-ms MS] [--mtp K] [--prefix-caching 0|1]
 *                   [--pp N | --rank R --world N --master HOST:PORT [--local-rank L]]
 *                   [--recipe FILE]
 *   glmspark-engine --check-recipe FILE
 *
 * --recipe FILE (engine/serve/recipe.h, ops/recipes/) supplies model, model_name, tokenizer,
 * threads, kv_blocks (or max_model_len / block_size), lease_s, max_num_seqs,
 * max_num_batched_tokens, pipeline_parallel, backend, precision and kv_cache_dtype; flags
 * given on the
 * command line override it wherever they appear (--prefill-slice is another name for
 * --max-num-batched-tokens, the scheduler's prefill chunk; --kv-dtype, the other commands'
 * name, for --kv-cache-dtype). --check-recipe validates a
 * recipe, prints every key's effective value (`key = value`) and exits 0, or 2 naming the
 * bad key (or a combination the backend does not take: backends.h backend_kind_check).
 *
 * Ranks: --pp N (or pipeline_parallel = N) starts N local ranks of this
 * command (pp_launch_local); --rank/--world/--master (or OMPI_COMM_WORLD_RANK/SIZE,
 * PMI_RANK/SIZE, SLURM_PROCID/NTASKS with --master or GLMSPARK_MASTER) make this process
 * one rank of a pipeline spread over hosts. Every rank plans the same split
 * (pp_plan_model) and loads only its layers; rank 0 is the serving engine (scheduler,
 * PostgreSQL), the others serve micro-batches (pp_serve) until rank 0 ends the pipeline.
 * When a rank fails, rank 0 (pp names the rank and host) hands its jobs back
 * (jobq_release) and exits 1; the others see the failure through pp_comm's heartbeats and
 * exit non-zero within seconds.
 *
 * Serving loop (rank 0): while the scheduler has room (max_num_seqs, and no claimed job
 * still waiting for KV blocks) claim jobs and submit them (prompt plus the output earlier
 * attempts committed); one sched_step; route each token event to its job's output state
 * (serve_out.h: detokenizer, chat parser, stop strings with hold-back, logprobs, the
 * forced tool-call opening); then ONE batch statement (jobq_append_send) for every job with
 * new chunks, an end, a failure, or a lease due for renewal (every lease_s / 3 s, 1..5). It
 * is sent, not waited for: the server commits it (one transaction and its WAL flush, 0.7-1.7
 * ms on the H200 machine, docs/perf.md) and wakes the streams while the next step runs, and
 * its answer (which jobs are still ours, which were cancelled) is read after that step
 * (commit_collect), before the next batch goes out; any other use of the connection reads it
 * first. With commit_interval_ms > 0 (0, every step, by default) output commits at most that
 * often (a job's end, a failure or a half-full chunk buffer commits at once): streams then
 * lag by up to the interval and a chunk holds several tokens; uncommitted tokens are
 * regenerated on resume as before (a client only ever sees committed ones). A cancel flag
 * in its answer cancels the sequence; a job that is no longer ours (ERR_NOTFOUND) is
 * dropped. The status JSON (serve_stats.h) goes out with jobq_set_stats every second,
 * busy or idle, which is also the engine heartbeat /health reads; long prefills are cut
 * into max_num_batched_tokens chunks, so beats never wait for one.
 *
 * Resume: a re-claimed job's committed ids are submitted after its prompt and replayed
 * through the output state without emitting, so the stream continues at the next seq
 * with no gap and no duplicate.
 *
 * Any number of engines (clusters) serve one queue, each under its own --name (default the
 * host name); one started under the name of a live engine on this host exits with status 3.
 * At start it requeues the jobs that earlier boots of its name left running (jobq_recover);
 * another engine's jobs come back when their leases run out. When PostgreSQL goes away it
 * drops every sequence (nothing uncommitted is lost: jobs resume from their committed
 * output), reconnects with backoff, requeues its own jobs and claims again. SIGTERM and SIGINT stop
 * it after the current step and its commit: running jobs are handed back at once (jobq_release).
 * --step-delay-ms sleeps after each step (demos and the kill tests).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/backend/backends.h"
#include "engine/model/model.h"
#include "engine/pipeline/pp.h"
#include "engine/pipeline/scheduler.h"
#include "engine/serve/jobq.h"
#include "engine/serve/recipe.h"
#include "engine/serve/serve_out.h"
#include "engine/serve/serve_stage.h"
#include "engine/serve/serve_stats.h"
#include "engine/shared/clock.h"
#include "engine/shared/err.h"
#include "engine/shared/num.h"
#include "engine/shared/tokenizer.h"

static volatile sig_atomic_t is_stopping;

static void on_signal(int sig)
{
    (void) sig;
    is_stopping = 1;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long) (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// ---------------------------------------------------------------------------
// Settings

typedef struct Opts {
    Recipe r;  // recipe, then flags
    const char *model_dir, *conninfo, *tok_path, *model_name, *name, *master;
    int step_delay_ms;
    int rank, world, local_rank;  // rank -1: not a pipeline rank
    bool is_pp_flag;              // --pp given (else pipeline_parallel from the recipe)
} Opts;

// Flags that set a recipe key (validated as in a file).
static const struct {
    const char *flag, *key;
} KEY_FLAGS[] = {
    {"--model", "model"},
    {"--tokenizer", "tokenizer"},
    {"--model-name", "model_name"},
    {"--threads", "threads"},
    {"--kv-blocks", "kv_blocks"},
    {"--lease-s", "lease_s"},
    {"--max-num-seqs", "max_num_seqs"},
    {"--max-num-batched-tokens", "max_num_batched_tokens"},
    {"--prefill-slice", "max_num_batched_tokens"},
    {"--pp", "pipeline_parallel"},
    {"--backend", "backend"},
    {"--precision", "precision"},
    {"--kv-cache-dtype", "kv_cache_dtype"},
    {"--kv-dtype", "kv_cache_dtype"},
    {"--mtp", "mtp_tokens"},
    {"--prefix-caching", "prefix_caching"},
    {"--max-model-len", "max_model_len"},
    {"--block-size", "block_size"},
    {"--commit-interval-ms", "commit_interval_ms"},
};

static int usage(void)
{
    fprintf(stderr,
            "usage: glmspark-engine --model DIR --db CONNINFO [--tokenizer FILE]\n"
            "       [--model-name NAME] [--threads N] [--kv-blocks N] [--name NAME] [--lease-s S]\n"
            "       [--max-num-seqs N] [--max-num-batched-tokens N] [--prefill-slice N]\n"
            "       [--backend cpu|cuda] [--precision f32|bf16] [--kv-dtype fp8|bf16|f32]\n"
            "       [--max-model-len N] [--mtp K] [--prefix-caching 0|1]\n"
            "       [--block-size N] [--commit-interval-ms MS] [--step-delay-ms MS]\n"
            "       [--recipe FILE]\n"
            "       [--pp N | --rank R --world N --master HOST:PORT [--local-rank L]]\n"
            "       glmspark-engine --check-recipe FILE\n");
    return 2;
}

// Recipe first (wherever --recipe appears), then flags. Returns 0 or main's exit status.
static int parse_opts(int argc, char **argv, Opts *o)
{
    memset(o, 0, sizeof *o);
    o->conninfo = getenv("GLMSPARK_DB");
    o->rank = -1;
    recipe_defaults(&o->r);
    for (int i = 1; i + 1 < argc; i += 2)
        if (!strcmp(argv[i], "--recipe") && recipe_load(&o->r, argv[i + 1])) return 2;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) return usage();
        bool ok = true, known = false;
        for (size_t k = 0; k < sizeof KEY_FLAGS / sizeof KEY_FLAGS[0]; k++)
            if (!strcmp(a, KEY_FLAGS[k].flag)) {
                known = true;
                if (recipe_set(&o->r, KEY_FLAGS[k].key, v, "command line")) return 2;
            }
        if (!strcmp(a, "--pp")) o->is_pp_flag = true;
        if (known) continue;
        if (!strcmp(a, "--db"))
            o->conninfo = v;
        else if (!strcmp(a, "--name"))
            o->name = v;
        else if (!strcmp(a, "--master"))
            o->master = v;
        else if (!strcmp(a, "--step-delay-ms"))
            ok = num_parse_int(v, 0, 600000, &o->step_delay_ms);
        else if (!strcmp(a, "--rank"))
            ok = num_parse_int(v, 0, PP_MAX_WORLD - 1, &o->rank);
        else if (!strcmp(a, "--world"))
            ok = num_parse_int(v, 1, PP_MAX_WORLD, &o->world);
        else if (!strcmp(a, "--local-rank"))
            ok = num_parse_int(v, 0, 1023, &o->local_rank);
        else if (strcmp(a, "--recipe") != 0)
            return usage();
        if (!ok) {
            fprintf(stderr, "glmspark-engine: bad value for %s: \"%s\"\n", a, v);
            return usage();
        }
    }
    if (o->r.model[0]) o->model_dir = o->r.model;
    if (o->r.tokenizer[0]) o->tok_path = o->r.tokenizer;
    if (o->r.model_name[0]) o->model_name = o->r.model_name;
    if (!o->master) o->master = getenv("GLMSPARK_MASTER");
    if (o->rank < 0 && !o->is_pp_flag && pp_rank_from_env(&o->rank, &o->world)) {
        const char *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        if (!local) local = getenv("SLURM_LOCALID");
        if (local && atoi(local) > 0) o->local_rank = atoi(local);
    }
    if (o->rank >= 0 && o->world == 0) o->world = o->r.pipeline_parallel;
    if (!o->model_dir) return usage();
    if (o->rank >= 0 && (o->rank >= o->world || (o->world > 1 && !o->master))) {
        fprintf(stderr, "glmspark-engine: --rank must be below --world, and a pipeline rank "
                        "needs --master HOST:PORT (or GLMSPARK_MASTER)\n");
        return usage();
    }
    if (o->rank <= 0 && !o->conninfo) {
        fprintf(stderr, "glmspark-engine: the serving rank needs --db CONNINFO (or GLMSPARK_DB)\n");
        return usage();
    }
    return 0;
}

// ---------------------------------------------------------------------------
// Engine state

typedef struct Job {
    bool is_live;
    JobqJob job;
    uint64_t sched_id;  // this claim's id in the scheduler (unique in the process: a job
                        // claimed again while a stale slot still holds it gets a new one)
    ServeOut out;
    const char *finish;  // non-NULL: finish the job at the next commit
    const char *error;   // non-NULL: fail the job (message for the client) at the next commit
    int n_gen;           // tokens generated by this attempt
    int n_cached;        // prompt tokens served from the prefix cache (this attempt)
    int n_left;          // tokens before max_tokens (constrained jobs' masks look at it)
    bool needs_mask;     // constrained: a token came, the next mask is due
    double last_lease;   // monotonic time of the last append or renewal
} Job;

typedef struct Engine {
    Opts *o;
    ServeStage st;  // this rank's backend, layers, KV cache and pipeline stage
    Tokenizer *tok;
    ConstrainVocab *cv;  // token bytes for response_format masks, built at first use
    JobQueue *q;
    Scheduler *sched;
    Job *jobs;  // [max_num_seqs]
    int n_slots;
    double beat_s;
    ServeStats stats;
    int step_seqs, step_gen;  // of the current step, counted by on_event
    uint64_t n_claims;        // claims so far: the next sched_id
    double last_stats;
    double last_commit;  // when commit_send() last wrote (clock_now_s)
    // The commit in flight (commit_send .. commit_collect): its items, whose jobs, when sent.
    JobqAppend pend[PP_MAX_SLOTS];
    Job *pend_who[PP_MAX_SLOTS];
    int n_pend;
    double pend_at;
} Engine;

static Job *find_job(Engine *e, uint64_t id)
{
    for (int i = 0; i < e->n_slots; i++)
        if (e->jobs[i].is_live && e->jobs[i].sched_id == id) return &e->jobs[i];
    return NULL;
}

static int n_live(const Engine *e)
{
    int n = 0;
    for (int i = 0; i < e->n_slots; i++)
        n += e->jobs[i].is_live;
    return n;
}

static void job_drop(Job *j)
{
    serve_out_free(&j->out);
    jobq_job_free(&j->job);
    memset(j, 0, sizeof *j);
}

// A token event: through the job's output state; the last event ends the job.
static void on_event(void *user, const SchedEvent *ev)
{
    Engine *e = user;
    if (ev->token >= 0) {
        e->step_seqs++;
        e->step_gen++;
    }
    Job *j = find_job(e, ev->id);
    if (!j || j->finish || j->error) return;  // already ending (a stop string, a failure)
    j->n_cached = ev->n_cached;
    // SCHED_FINISH_STOP's token is an end-of-sequence id: not part of the output.
    if (ev->token >= 0 && ev->finish != SCHED_FINISH_STOP) {
        j->n_gen++;
        j->n_left--;
        j->needs_mask = j->out.con != NULL;
        if (serve_out_token(&j->out, ev->token, ev->logprob, ev->top_ids, ev->top_logprobs,
                            ev->n_top)) {
            j->error = "out of memory";
            sched_cancel(e->sched, ev->id);
            return;
        }
        if (j->out.is_stopped) {  // a stop string matched
            j->finish = "stop";
            sched_cancel(e->sched, ev->id);
            return;
        }
    }
    switch (ev->finish) {
    case SCHED_FINISH_NONE:
        return;
    case SCHED_FINISH_LENGTH:
        j->finish = "length";
        break;
    case SCHED_FINISH_STOP:
        j->finish = "stop";
        break;
    case SCHED_FINISH_CANCELLED:
        j->finish = "cancelled";
        return;
    case SCHED_FINISH_ERROR:
        j->error = "the prompt and max_tokens do not fit in the KV cache";
        return;
    }
    if (serve_out_end(&j->out)) j->error = "out of memory";
}

// A constrained job's mask for its next token (n_left tokens to max_tokens) to the
// scheduler; out of memory fails the job.
static void job_set_mask(Engine *e, Job *j)
{
    if (sched_set_mask(e->sched, j->sched_id, serve_out_mask(&j->out, j->n_left))) {
        j->error = "out of memory";
        sched_cancel(e->sched, j->sched_id);
    }
}

// Start a claimed job: its output state, the replay of committed output, the request.
static void job_start(Engine *e, Job *j)
{
    const JobqJob *job = &j->job;
    const char *msg = NULL;
    j->sched_id = ++e->n_claims;
    const uint64_t seed = (uint64_t) job->id * 0x9E3779B97F4A7C15ull + (uint64_t) job->attempt;
    if (serve_out_init(&j->out, e->tok, job, seed, &msg)) {
        j->error = msg;
        return;
    }
    if (sampler_check_params(j->out.sampling)) {
        j->error = "invalid sampling parameters";
        return;
    }
    if (j->out.grammar) {  // response_format: the token bytes once, then this job's constraint
        if (!e->cv) {
            const double t0 = clock_now_s();
            const ModelConfig *cfg = e->st.cfg;
            if (constrain_vocab_create(e->tok, cfg->vocab_size, cfg->eos_ids, cfg->n_eos_ids, &e->cv)) {
                j->error = "out of memory";
                return;
            }
            LOG_INFO("constrained decoding: token bytes ready in %.0f ms", (clock_now_s() - t0) * 1e3);
        }
        if (serve_out_constrain(&j->out, e->cv)) {
            j->error = "out of memory";
            return;
        }
    }
    if (serve_out_replay(&j->out, job->committed_ids, job->n_committed)) {
        j->error = "out of memory";
        return;
    }
    const int rest = job->max_tokens - job->n_committed;
    if (rest <= 0 || j->out.is_stopped) {  // it ended before the interruption
        j->finish = j->out.is_stopped ? "stop" : "length";
        if (serve_out_end(&j->out)) j->error = "out of memory";
        return;
    }
    const int n = job->n_prompt + job->n_committed;
    int32_t *ids = malloc((size_t) n * sizeof *ids);
    if (!ids) {
        j->error = "out of memory";
        return;
    }
    memcpy(ids, job->prompt_ids, (size_t) job->n_prompt * sizeof *ids);
    if (job->n_committed)
        memcpy(ids + job->n_prompt, job->committed_ids, (size_t) job->n_committed * sizeof *ids);
    const SchedRequest r = {.id = j->sched_id,
                            .prompt = ids,
                            .n_prompt = n,
                            .max_tokens = rest,
                            .sampling = j->out.sampling,
                            .n_top_logprobs = j->out.n_top_logprobs,
                            .constrained = j->out.con != NULL};
    const Err err = sched_submit(e->sched, &r);
    free(ids);
    if (err) {
        j->error = "the request could not be scheduled (token ids outside the vocabulary?)";
        return;
    }
    serve_stats_prompt(&e->stats, n);
    j->n_left = rest;
    if (j->out.con) job_set_mask(e, j);
    if (j->error) return;
    int n_force;
    const int32_t *force = serve_out_force(&j->out, &n_force);
    if (force) sched_force(e->sched, j->sched_id, force, n_force);
}

static Err commit_collect(Engine *e);

// Claim jobs while the scheduler has room: a free slot, and no claimed job still waiting
// for KV blocks (so we never hold a job the cache cannot admit soon). A claim returns a job
// we may still hold in another slot when it was put back in the queue behind our back (an
// operator's requeue, a lease that ran out): that attempt is no longer ours, so its slot
// and sequence go (the commit in flight, which may name it, is collected first).
static Err claim_jobs(Engine *e, double now)
{
    for (;;) {
        SchedStats st;
        sched_stats(e->sched, &st);
        if (st.n_waiting > 0 || n_live(e) >= e->n_slots || is_stopping) return ERR_OK;
        Err err = commit_collect(e);  // the claim would wait for its answer anyway
        if (err) return err;
        Job *j = NULL;
        for (int i = 0; i < e->n_slots && !j; i++)
            if (!e->jobs[i].is_live) j = &e->jobs[i];
        if (!j) return ERR_OK;  // the collect dropped nothing and freed nothing
        err = jobq_claim(e->q, &j->job);
        if (err == ERR_NOTFOUND) return ERR_OK;
        if (err) return err;
        j->is_live = true;
        j->last_lease = now;
        for (int i = 0; i < e->n_slots; i++) {
            Job *old = &e->jobs[i];
            if (old == j || !old->is_live || old->job.id != j->job.id) continue;
            LOG_WARN("engine: job %s was put back in the queue and claimed again (attempt %d); "
                     "attempt %d's sequence is dropped",
                     j->job.public_id, j->job.attempt, old->job.attempt);
            sched_cancel(e->sched, old->sched_id);
            job_drop(old);
        }
        LOG_INFO("engine: job %s claimed (attempt %d, %d prompt + %d committed tokens)",
                 j->job.public_id, j->job.attempt, j->job.n_prompt, j->job.n_committed);
        job_start(e, j);
        if (j->error) LOG_ERROR("engine: job %s failed: %s", j->job.public_id, j->error);
    }
}

// Whether to commit now: commit_interval_ms since the last commit, or a job that ended,
// failed or filled half its step chunks (serve_out holds SERVE_MAX_STEP_CHUNKS until a
// commit), or no step ran (idle: leases and ends wait for nothing).
static bool commit_due(const Engine *e, double now, bool has_work)
{
    if (!has_work || now - e->last_commit >= e->o->r.commit_interval_ms * 1e-3 || is_stopping)
        return true;
    for (int i = 0; i < e->n_slots; i++) {
        const Job *j = &e->jobs[i];
        if (j->is_live && (j->finish || j->error || j->out.n_chunks >= SERVE_MAX_STEP_CHUNKS / 2))
            return true;
    }
    return false;
}

// Send one batch (jobq_append_send) for every job with output, an end, or a lease due; its
// answer is read by commit_collect, after the next step (the server commits meanwhile, and
// the streams get the chunks then: the answer only says which jobs are still ours and which
// were cancelled). The step's chunks are cleared once sent: if the commit fails, every
// sequence is dropped and resumes from what was committed.
static Err commit_send(Engine *e, double now)
{
    ASSERT(e->n_pend == 0);
    JobqAppend *items = e->pend;
    int n = 0;
    for (int i = 0; i < e->n_slots; i++) {
        Job *j = &e->jobs[i];
        if (!j->is_live) continue;
        int n_chunks = 0;
        const JobqChunk *chunks = serve_out_chunks(&j->out, &n_chunks);
        if (!chunks && !j->error) {
            j->error = "out of memory";
            sched_cancel(e->sched, j->sched_id);
        }
        if (n_chunks == 0 && !j->finish && !j->error && now - j->last_lease < e->beat_s) continue;
        items[n] = (JobqAppend){.job = &j->job,
                                .chunks = chunks,
                                .n_chunks = chunks ? n_chunks : 0,
                                .finish_reason = j->error ? NULL : j->finish,
                                .error = j->error,
                                .n_cached = j->n_cached};
        e->pend_who[n++] = j;
    }
    if (n == 0) return ERR_OK;
    const Err err = jobq_append_send(e->q, items, n);
    if (err) return err;
    e->n_pend = n;
    e->pend_at = now;
    for (int i = 0; i < n; i++)
        serve_out_clear_step(&e->pend_who[i]->out);
    return ERR_OK;
}

// Read the answer of the commit in flight (if any) and act on it: drop the jobs that are no
// longer ours and those it ended, cancel those whose cancel was requested.
static Err commit_collect(Engine *e)
{
    if (e->n_pend == 0) return ERR_OK;
    const int n = e->n_pend;
    e->n_pend = 0;
    const Err err = jobq_append_finish(e->q);
    if (err) return err;
    for (int i = 0; i < n; i++) {
        Job *j = e->pend_who[i];
        const JobqAppend *it = &e->pend[i];
        const uint64_t id = j->sched_id;
        if (it->result == ERR_NOTFOUND) {
            LOG_WARN("engine: job %s is no longer ours (taken over or ended elsewhere); dropped",
                     j->job.public_id);
            sched_cancel(e->sched, id);
            job_drop(j);
            continue;
        }
        j->last_lease = e->pend_at;
        if (it->error) {
            LOG_ERROR("engine: job %s failed: %s", j->job.public_id, it->error);
            job_drop(j);
        } else if (it->finish_reason) {
            LOG_INFO("engine: job %s %s after %d tokens (attempt %d)", j->job.public_id,
                     it->finish_reason, j->job.n_committed + j->n_gen, j->job.attempt);
            if (j->out.con) {
                ConstrainStats cs;
                constrain_stats(j->out.con, &cs);
                LOG_INFO("engine: job %s response_format: %llu masks (%llu from the cache), %.0f us "
                         "each on average%s",
                         j->job.public_id, (unsigned long long) cs.n_masks,
                         (unsigned long long) cs.n_cached, cs.n_masks ? cs.us / (double) cs.n_masks : 0.0,
                         j->out.is_con_broken ? "; the output left the grammar" : "");
            }
            job_drop(j);
        } else if (it->is_cancelled) {
            sched_cancel(e->sched, id);
        }
    }
    return ERR_OK;
}

// Cancel every sequence and run the pipeline empty; the jobs stay (the caller releases or
// drops them: nothing they got since the last commit is kept).
static Err drain(Engine *e)
{
    for (int i = 0; i < e->n_slots; i++)
        if (e->jobs[i].is_live) sched_cancel(e->sched, e->jobs[i].sched_id);
    Err err = ERR_OK;
    while (!err && sched_has_work(e->sched))
        err = sched_step(e->sched);
    return err;
}

// Hand every job back to the queue (SIGTERM, a failed rank) and forget it. Output since
// the last commit is not kept: the next claim resumes from what was committed.
static void release_all(Engine *e)
{
    int n = 0;
    for (int i = 0; i < e->n_slots; i++) {
        Job *j = &e->jobs[i];
        if (!j->is_live) continue;
        if (jobq_release(e->q, &j->job) == ERR_OK) n++;
        job_drop(j);
    }
    if (n) LOG_INFO("engine: %d running jobs handed back to the queue", n);
}

static void publish_stats(Engine *e, const char *state, double now)
{
    ServeStats *s = &e->stats;
    SchedStats st = {0};
    if (e->sched) sched_stats(e->sched, &st);
    s->state = state;
    s->running = st.n_running;
    s->waiting = st.n_waiting;
    s->inflight = st.n_inflight;
    s->kv_blocks_used = e->st.kv.params.n_blocks - kv_n_free_blocks(&e->st.kv);
    s->prefix_query_tokens = st.prefix_query_tokens;
    s->prefix_hit_tokens = st.prefix_hit_tokens;
    s->prefix_blocks = st.prefix_blocks;
    s->prefix_blocks_idle = st.prefix_blocks_idle;
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    char *json = serve_stats_json(s, now, (double) wall.tv_sec + wall.tv_nsec / 1e9);
    if (json && jobq_set_stats(e->q, json) == ERR_OK) e->last_stats = now;
    free(json);
}

// The serving loop. Returns ERR_OK when stopped by a signal, ERR_DB when the database
// went away (the caller reconnects), ERR_IO when the pipeline failed.
static Err serve(Engine *e)
{
    double last_empty_claim = -1;
    for (;;) {
        double now = clock_now_s();
        Err err = ERR_OK;
        // Claim at once when the last claim found a job, else at most every 100 ms while
        // busy (each claim is a round trip).
        if (!is_stopping && now - last_empty_claim >= 0.1) {
            const int before = n_live(e);
            if ((err = claim_jobs(e, now))) return err;
            // No slot free (a job that ended waits for its commit's answer, one step): try
            // again next iteration rather than in 100 ms.
            if (n_live(e) == before && before < e->n_slots) last_empty_claim = now;
        }
        const bool has_work = sched_has_work(e->sched);
        ServeStep step = {0};
        if (has_work) {
            SchedStats a, b;
            sched_stats(e->sched, &a);
            e->step_seqs = e->step_gen = 0;
            now = clock_now_s();
            if ((err = sched_step(e->sched))) return ERR_IO;
            sched_stats(e->sched, &b);
            const double t = clock_now_s();
            step = (ServeStep){t, (float) ((t - now) * 1e3), 0, e->step_seqs,
                               (int) (b.n_tokens - a.n_tokens), e->step_gen};
            now = t;
            for (int i = 0; i < e->n_slots; i++) {  // response_format masks for the next token
                Job *j = &e->jobs[i];
                if (!j->is_live || !j->needs_mask || j->finish || j->error) continue;
                j->needs_mask = false;
                job_set_mask(e, j);
            }
            for (int i = 0; i < e->n_slots; i++) {  // tool-call openings due now
                Job *j = &e->jobs[i];
                int n;
                const int32_t *force = j->is_live ? serve_out_force(&j->out, &n) : NULL;
                if (force) sched_force(e->sched, j->sched_id, force, n);
            }
        }
        // The last commit's answer (the server committed it while this step ran), then this
        // step's commit, sent; commit_ms is what the two held this thread.
        if ((err = commit_collect(e))) return err;
        if (commit_due(e, now, has_work)) {
            if ((err = commit_send(e, now))) return err;
            e->last_commit = now;
        }
        step.commit_ms = (float) ((clock_now_s() - now) * 1e3);
        if (has_work) serve_stats_step(&e->stats, &step);
        if (now - e->last_stats >= 1.0) publish_stats(e, is_stopping ? "stopping" : "ready", now);
        if (is_stopping) return commit_collect(e);
        if (has_work) {
            if (e->o->step_delay_ms > 0) sleep_ms(e->o->step_delay_ms);
        } else if (n_live(e) == 0) {
            if ((err = jobq_wait(e->q, 1000))) return err;
            last_empty_claim = -1;  // woken (or a second passed): claim now
        }
    }
}

static void engine_free(Engine *e)
{
    if (e->q && e->n_pend) {  // the answer writes into the jobs: read it before they go
        e->n_pend = 0;
        jobq_append_finish(e->q);
    }
    for (int i = 0; e->jobs && i < e->n_slots; i++)
        if (e->jobs[i].is_live) job_drop(&e->jobs[i]);
    free(e->jobs);
    sched_destroy(e->sched);
    jobq_destroy(e->q);
    serve_stage_free(&e->st);
    tok_destroy(e->tok);
    constrain_vocab_destroy(e->cv);
}

// A rank > 0: load, connect, serve micro-batches until rank 0 ends the pipeline.
static int run_stage_rank(Opts *o)
{
    Engine e = {.o = o};
    // SIGTERM reaches every rank (the local launcher forwards it, cleanup.sh signals
    // each): rank 0 stops in order and ends the pipeline, or its failure ends ours.
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    int rc = 1;
    if (!serve_stage_load(&e.st, &o->r, o->model_dir, o->local_rank, o->rank, o->world)
        && !serve_stage_connect(&e.st, o->rank, o->world, o->master))
        rc = pp_serve(e.st.stage) ? 1 : 0;
    engine_free(&e);
    return rc;
}

// Rank 0 (or the only rank): the serving engine.
static int run_engine(Opts *o)
{
    Engine e = {.o = o};
    const int world = o->rank >= 0 ? o->world : 1;
    int rc = 1;
    char tok_default[4096], name_buf[256], host[128] = "engine";
    gethostname(host, sizeof host - 1);
    if (!o->tok_path) {
        snprintf(tok_default, sizeof tok_default, "%s/tokenizer.json", o->model_dir);
        o->tok_path = tok_default;
    }
    if (!o->model_name) {
        size_t n = strlen(o->model_dir);
        while (n > 1 && o->model_dir[n - 1] == '/')
            n--;
        size_t start = n;
        while (start > 0 && o->model_dir[start - 1] != '/')
            start--;
        snprintf(name_buf, sizeof name_buf, "%.*s", (int) (n - start), o->model_dir + start);
        o->model_name = name_buf;
    }
    if (!o->name) o->name = host;
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    e.beat_s = o->r.lease_s / 3 < 1 ? 1 : o->r.lease_s / 3 > 5 ? 5 : o->r.lease_s / 3;
    e.n_slots = o->r.max_num_seqs;

    // Load first: a model that cannot load should not take the queue.
    if (serve_stage_load(&e.st, &o->r, o->model_dir, o->local_rank, 0, world)) goto done;
    if (tok_load(&e.tok, o->tok_path)) {
        fprintf(stderr, "glmspark-engine: could not load the tokenizer \"%s\"\n", o->tok_path);
        goto done;
    }
    if (!(e.jobs = calloc((size_t) e.n_slots, sizeof *e.jobs))) goto done;
    ServeStats *st = &e.stats;
    st->backend = recipe_backend_name(o->r.backend);
    st->model = o->model_name;
    st->world = world;
    for (int r = 0; r < world; r++)
        st->ranks[r] = (ServeRank){.state = "loading",
                                   .first_layer = e.st.plan.ranks[r].first_layer,
                                   .last_layer = e.st.plan.ranks[r].last_layer,
                                   .weight_bytes = e.st.plan.ranks[r].weight_bytes};
    snprintf(st->ranks[0].host, sizeof st->ranks[0].host, "%.63s", host);
    st->ranks[0].pid = (int) getpid();
    st->ranks[0].load_fraction = 1.0;
    st->kv_blocks_total = e.st.kv.params.n_blocks;
    st->kv_block_size = e.st.kv.params.block_size;
    st->max_num_seqs = e.n_slots;

    JobqOptions qo = {.conninfo = o->conninfo,
                      .engine_name = o->name,
                      .model = o->model_name,
                      .lease_s = o->r.lease_s};
    for (int delay = 100;;) {
        const Err err = jobq_create(&qo, &e.q);
        if (err == ERR_AGAIN) {
            fprintf(stderr,
                    "glmspark-engine: a live engine on this host is named \"%s\"; give each "
                    "engine its own --name; exiting\n",
                    o->name);
            rc = 3;
            goto done;
        }
        if (!err) break;
        if (is_stopping) goto done;
        sleep_ms(delay);
        delay = delay * 2 > 5000 ? 5000 : delay * 2;
    }
    publish_stats(&e, "loading", clock_now_s());
    if (serve_stage_connect(&e.st, 0, world, o->master)) goto done;
    for (int r = 0; r < world; r++) {
        st->ranks[r].state = "up";
        st->ranks[r].load_fraction = 1.0;
        if (r > 0) {
            snprintf(st->ranks[r].host, sizeof st->ranks[r].host, "%s",
                     pp_rank_host(e.st.stage, r));
            st->ranks[r].pid = pp_rank_pid(e.st.stage, r);
        }
    }
    const SchedParams sp = {.max_num_seqs = e.n_slots,
                            .max_num_batched_tokens = o->r.max_num_batched_tokens,
                            .mtp_k = o->r.mtp_tokens,
                            .prefix_caching = o->r.prefix_caching != 0,
                            .on_event = on_event,
                            .user = &e};
    if (sched_create(e.st.stage, &e.st.model, &e.st.kv, &sp, &e.sched)) goto done;
    int n_requeued = 0;
    if (jobq_recover(e.q, &n_requeued)) goto done;
    LOG_INFO("engine: serving \"%s\" as \"%s\" (%d KV blocks); %d interrupted jobs requeued",
             o->model_name, o->name, e.st.kv.params.n_blocks, n_requeued);
    LOG_INFO("engine: %d ranks, backend %s, max_num_seqs %d, max_num_batched_tokens %d, "
             "mtp_tokens %d, prefix caching %s",
             world, st->backend, e.n_slots, o->r.max_num_batched_tokens, o->r.mtp_tokens,
             o->r.prefix_caching ? "on" : "off");

    for (;;) {
        const Err err = serve(&e);
        // A commit in flight: its answer (the jobs it ended are dropped, not handed back),
        // or its failure.
        if (err != ERR_OK && e.n_pend) commit_collect(&e);
        if (err == ERR_OK) break;  // a signal
        if (err == ERR_IO) {
            LOG_ERROR("engine: the pipeline failed (the rank and host are named above); handing "
                      "%d jobs back and exiting",
                      n_live(&e));
            for (int r = 1; r < world; r++)
                st->ranks[r].state = "down";
            release_all(&e);
            publish_stats(&e, "stopping", clock_now_s());
            goto done;
        }
        // ERR_DB: drop every sequence (their output resumes from what was committed),
        // reconnect, requeue our jobs, claim again.
        if (drain(&e)) goto done;
        for (int i = 0; i < e.n_slots; i++)
            if (e.jobs[i].is_live) job_drop(&e.jobs[i]);
        Err rerr = ERR_DB;
        while (rerr == ERR_DB && !is_stopping)
            rerr = jobq_reconnect(e.q, 2000);
        if (rerr) break;  // stopping while the database is away: the leases run out
        if (jobq_recover(e.q, NULL) == ERR_DB) continue;
    }
    LOG_INFO("engine: stopping");
    const Err derr = drain(&e);
    release_all(&e);
    publish_stats(&e, "stopping", clock_now_s());
    if (derr || pp_end(e.st.stage)) goto done;
    rc = 0;
done:
    engine_free(&e);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--check-recipe")) {
        Recipe recipe;
        recipe_defaults(&recipe);
        if (recipe_load(&recipe, argv[2])) return 2;
        KvDtype kv = recipe.kv_cache_dtype;
        if (!backend_kind_check(argv[2], recipe.backend == RECIPE_BACKEND_CUDA, recipe.precision,
                                recipe_is_set(&recipe, "kv_cache_dtype"), &kv,
                                recipe_is_set(&recipe, "block_size") ? recipe.block_size
                                                                     : KV_DEFAULT_BLOCK_SIZE))
            return 2;
        for (int k = 0; k < recipe_n_keys(); k++) {
            char val[RECIPE_MAX_STR + 8];
            printf("%s = %s\n", recipe_key_name(k),
                   recipe_format_value(&recipe, k, val, sizeof val));
        }
        return 0;
    }
    Opts o;
    const int rc = parse_opts(argc, argv, &o);
    if (rc) return rc;
    // pp_launch_local re-executes this program with its argv after a program name (it
    // serves `glmspark <cmd>`, whose argv starts at the command): ours starts at argv[1].
    if (o.rank < 0 && o.r.pipeline_parallel > 1)
        return pp_launch_local(argc - 1, argv + 1, o.r.pipeline_parallel);
    if (o.rank > 0) return run_stage_rank(&o);
    return run_engine(&o);
}
