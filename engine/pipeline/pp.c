/*
 * pp.c - pipeline parallelism: split planner, rank discovery, local launcher and the stage
 * runtime (pp.h).
 *
 * Wire format on the data ring (pp_comm), host byte order (every rank runs the same
 * binary on the same architecture):
 *   PPMSG_BATCH   header, PpSeqOp[n_ops], int32 tokens[n_tokens], activations
 *               (model_act_bytes(n_tokens); absent from rank 0 when world == 1). The
 *               activations go through pp_comm_send_act: NCCL between GPU ranks (unless
 *               GLMSPARK_PP_DATA=tcp), the TCP ring otherwise; the rest always over TCP.
 *   PPMSG_RESULT  header, int32 tokens[n_ops], float logits[n_rows, vocab]   (last -> rank 0)
 *               then MtpOut[n_ops] when header.has_mtp (the batch had ops of MTP slots)
 *   PPMSG_END     header                          (travels the whole ring back to rank 0)
 * Every rank sees every op and every token id, so each keeps its own KvSeq per slot and
 * the last rank its samplers and token histories; nothing but activations depends on
 * the layers a rank holds.
 *
 * Flow control: rank 0 may have `world` micro-batches outstanding. Sends block only when
 * the socket buffers (4 MiB each way, pp_comm.c) are full; decode micro-batches are a few
 * KiB, and a full-logits result is only requested by `glmspark logits` with one batch in
 * flight, so the ring cannot fill up and deadlock. An NCCL send blocks until the next
 * rank posts its receive; every rank goes back to receiving as soon as it has sent on,
 * and the last rank's results travel over TCP, so that chain cannot deadlock either.
 *
 * Sampling on the last rank: a step's sequences each own a Sampler and a history, so their
 * penalties, masks and draws (sampler.h; 0.6-0.8 ms a row at a 154,880-token vocabulary
 * with temperature or top-p, docs/perf.md) run as tasks of a thread pool made once per
 * stage (sample_threads). Each task writes only its own slot's state and its op's
 * res_tokens entry, so the tokens are the same for every thread count. MTP slots' ops
 * (mtp_stage_op) stay on the calling thread: they run the MTP head through the backend,
 * which takes one calling thread (backend.h), and share the MtpStage's buffers.
 */
#define _DEFAULT_SOURCE  // setpgid, kill
#include "engine/pipeline/pp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/shared/thread_pool.h"
#include "engine/pipeline/pp_sample.h"
#include "engine/shared/clock.h"

// ---------------------------------------------------------------------------
// Planner

uint64_t pp_kv_bytes_per_token_layer(const ModelConfig *cfg, KvDtype dtype)
{
    const KvEntryLayout lo =
        kv_entry_layout(dtype, cfg->kv_lora_rank, cfg->qk_rope_head_dim,
                        cfg->index_topk > 0 ? cfg->index_head_dim : 0, KV_DEFAULT_BLOCK_SIZE);
    return (uint64_t) kv_token_bytes(&lo);
}

// Bytes of a [rows, cols] linear weight stored as NVFP4 (4-bit codes + e4m3 scale per 16)
// or BF16.
static uint64_t linear_bytes(uint64_t rows, uint64_t cols, bool nvfp4)
{
    return nvfp4 ? rows * cols / 2 + rows * cols / 16 + 4 : rows * cols * 2;
}

uint64_t pp_estimate_layer_bytes(const ModelConfig *c, int l)
{
    const bool q = c->quant == CONFIG_QUANT_NVFP4_MODELOPT || c->quant == CONFIG_QUANT_NVFP4_CT;
    const uint64_t h = (uint64_t) c->hidden_size, H = (uint64_t) c->n_heads;
    const uint64_t qk = (uint64_t) config_qk_head_dim(c);
    uint64_t b = 2 * h * 2;  // two norms, bf16
    if (c->q_lora_rank > 0)
        b += linear_bytes((uint64_t) c->q_lora_rank, h, false)
             + linear_bytes(H * qk, (uint64_t) c->q_lora_rank, false);
    else
        b += linear_bytes(H * qk, h, false);
    b += linear_bytes((uint64_t) (c->kv_lora_rank + c->qk_rope_head_dim), h, false)
         + linear_bytes(H * (uint64_t) (c->qk_nope_head_dim + c->v_head_dim),
                        (uint64_t) c->kv_lora_rank, false)
         + linear_bytes(h, H * (uint64_t) c->v_head_dim, false);
    if (c->indexer[l] == CONFIG_INDEXER_FULL)
        b += linear_bytes((uint64_t) (c->index_n_heads * c->index_head_dim),
                          (uint64_t) c->q_lora_rank, false)
             + linear_bytes((uint64_t) c->index_head_dim, h, false)
             + linear_bytes((uint64_t) c->index_n_heads, h, false);
    if (c->mlp[l] == CONFIG_MLP_DENSE)
        return b + 3 * linear_bytes((uint64_t) c->intermediate_size, h, false);
    const uint64_t I = (uint64_t) c->moe_intermediate_size, E = (uint64_t) c->n_routed_experts;
    b += linear_bytes(E, h, false) + E * 4;
    b += E * 3 * linear_bytes(I, h, q);
    b += 3 * linear_bytes(I * (uint64_t) c->n_shared_experts, h, q);
    return b;
}

uint64_t pp_estimate_embed_bytes(const ModelConfig *c)
{
    return (uint64_t) c->vocab_size * (uint64_t) c->hidden_size * 2;
}

Err pp_plan(const PpPlanInput *in, PpPlan *out)
{
    memset(out, 0, sizeof *out);
    const int W = in->world, L = in->n_layers;
    if (W < 1 || W > PP_MAX_WORLD || L < W) {
        LOG_ERROR("cannot split %d layers over %d pipeline ranks (1 .. %d, at most one rank per "
                  "layer)",
                  L, W, PP_MAX_WORLD);
        return ERR_INVAL;
    }
    const double util = in->mem_utilization > 0 ? in->mem_utilization : 0.9;
    const uint64_t kv_layer = in->kv_bytes_per_token_layer * (uint64_t) in->context;
    // prefix[i] = bytes (weights + KV at context) of layers [0, i).
    uint64_t *prefix = calloc((size_t) L + 1, sizeof *prefix);
    uint64_t *best = calloc((size_t) (W + 1) * (size_t) (L + 1), sizeof *best);
    int *cut = calloc((size_t) (W + 1) * (size_t) (L + 1), sizeof *cut);
    if (!prefix || !best || !cut) {
        free(prefix);
        free(best);
        free(cut);
        return ERR_NOMEM;
    }
    for (int i = 0; i < L; i++)
        prefix[i + 1] = prefix[i] + in->layer_bytes[i] + kv_layer;
        // best[k][i]: the smallest possible largest cost of ranks 0..k-1 holding layers [0, i).
        // Ranks cost their layers plus the embeddings (rank 0) and the head (rank W-1).
#define BEST(k, i) best[(size_t) (k) * (size_t) (L + 1) + (size_t) (i)]
#define CUT(k, i)  cut[(size_t) (k) * (size_t) (L + 1) + (size_t) (i)]
    for (int k = 0; k <= W; k++)
        for (int i = 0; i <= L; i++)
            BEST(k, i) = UINT64_MAX;
    BEST(0, 0) = 0;
    for (int k = 1; k <= W; k++)
        for (int i = k; i <= L - (W - k); i++)
            for (int j = k - 1; j < i; j++) {
                if (BEST(k - 1, j) == UINT64_MAX) continue;
                uint64_t cost = prefix[i] - prefix[j];
                if (k == 1) cost += in->first_bytes;
                if (k == W) cost += in->last_bytes;
                const uint64_t worst = cost > BEST(k - 1, j) ? cost : BEST(k - 1, j);
                if (worst < BEST(k, i)) {
                    BEST(k, i) = worst;
                    CUT(k, i) = j;
                }
            }
    int end = L;
    for (int k = W; k >= 1; k--) {
        const int start = CUT(k, end);
        out->ranks[k - 1].first_layer = start;
        out->ranks[k - 1].last_layer = end;
        end = start;
    }
#undef BEST
#undef CUT
    out->world = W;
    out->fits = true;
    const double budget = (double) in->mem_bytes * util;
    for (int r = 0; r < W; r++) {
        PpRankPlan *p = &out->ranks[r];
        uint64_t w = 0;
        for (int l = p->first_layer; l < p->last_layer; l++)
            w += in->layer_bytes[l];
        if (r == 0) w += in->first_bytes;
        if (r == W - 1) w += in->last_bytes;
        p->weight_bytes = w;
        const double room = budget - (double) w - (double) in->reserve_bytes;
        p->kv_room_bytes = room > 0 ? (uint64_t) room : 0;
        const uint64_t per_token =
            in->kv_bytes_per_token_layer * (uint64_t) (p->last_layer - p->first_layer);
        p->max_context = per_token ? (int64_t) (p->kv_room_bytes / per_token) : INT64_MAX;
        if (room <= 0 || p->max_context < in->context) out->fits = false;
    }
    free(prefix);
    free(best);
    free(cut);
    return ERR_OK;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

uint64_t pp_plan_hash(const ModelConfig *cfg, const PpPlan *plan, uint64_t extra)
{
    uint64_t h = fnv(1469598103934665603ull, cfg, sizeof *cfg);
    for (int r = 0; r < plan->world; r++) {
        const int32_t range[2] = {plan->ranks[r].first_layer, plan->ranks[r].last_layer};
        h = fnv(h, range, sizeof range);
    }
    return fnv(h, &extra, sizeof extra);
}

bool pp_parse_bytes(const char *s, uint64_t *out)
{
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    const double v = strtod(s, &end);
    if (errno || end == s || !(v >= 0)) return false;
    double mult = 1;
    if (*end) {
        switch (*end) {
        case 'K':
        case 'k':
            mult = 1024.0;
            break;
        case 'M':
        case 'm':
            mult = 1024.0 * 1024;
            break;
        case 'G':
        case 'g':
            mult = 1024.0 * 1024 * 1024;
            break;
        case 'T':
        case 't':
            mult = 1024.0 * 1024 * 1024 * 1024;
            break;
        default:
            return false;
        }
        end++;
        if (*end == 'i') end++;
        if (*end == 'B') end++;
        if (*end) return false;
    }
    if (v * mult > 1.8e19) return false;
    *out = (uint64_t) (v * mult);
    return true;
}

// ---------------------------------------------------------------------------
// Ranks and the launcher

bool pp_rank_from_env(int *rank, int *world)
{
    static const char *const pairs[][2] = {
        {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
        {"PMI_RANK", "PMI_SIZE"},
        {"SLURM_PROCID", "SLURM_NTASKS"},
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        const char *r = getenv(pairs[i][0]), *w = getenv(pairs[i][1]);
        if (!r || !w) continue;
        char *e1, *e2;
        const long rv = strtol(r, &e1, 10), wv = strtol(w, &e2, 10);
        if (*e1 || *e2 || wv < 1 || wv > PP_MAX_WORLD || rv < 0 || rv >= wv) {
            LOG_ERROR("%s=%s / %s=%s is not a valid rank / world size (1 .. %d)", pairs[i][0], r,
                      pairs[i][1], w, PP_MAX_WORLD);
            return false;
        }
        *rank = (int) rv;
        *world = (int) wv;
        return true;
    }
    return false;
}

// After the first rank fails, the others get this long to notice and exit with their own
// message; then the launcher kills the group (a stopped or wedged rank never exits).
enum { LAUNCH_GRACE_MS = 2000 };

// SIGTERM/SIGINT to the launcher: the first asks rank 0 to stop in order (a serving rank 0
// finishes its step, hands its jobs back and ends the pipeline, so every rank exits by
// itself); the group is killed when that takes longer than LAUNCH_STOP_MS, or at once on
// a second signal.
enum { LAUNCH_STOP_MS = 60000 };

static volatile sig_atomic_t launch_pgid;
static volatile sig_atomic_t launch_n_signals;

static void forward_signal(int sig)
{
    (void) sig;
    launch_n_signals++;
    if (launch_pgid <= 0) return;
    if (launch_n_signals == 1)
        kill((pid_t) launch_pgid, SIGTERM);  // rank 0 leads the group: its pid is the pgid
    else
        kill(-(pid_t) launch_pgid, SIGKILL);
}

extern char **environ;  // unistd.h declares it under _GNU_SOURCE only

int pp_launch_local(int argc, char **argv, int world)
{
    ASSERT(world >= 1 && world <= PP_MAX_WORLD);
    // The master's socket is bound here and inherited by rank 0 (PP_LISTEN_FD_ENV): a port
    // found free and bound again later could be taken in between, even by a rank's own
    // ephemeral data listener.
    int port = 0;
    const int lfd = pp_comm_listen("127.0.0.1", 0, &port);
    if (lfd < 0) {
        LOG_ERROR("could not listen on 127.0.0.1 for the pipeline's control plane: %s",
                  strerror(errno));
        return 1;
    }
    // argv: command, args (without --pp N), --rank R --world N --master ADDR:PORT
    // --local-rank R, NULL.
    char **args = calloc((size_t) argc + 11, sizeof *args);
    // Rank 0's environment: this one and the listening fd. Built before fork: the child only
    // execs.
    size_t n_env = 0;
    while (environ[n_env])
        n_env++;
    char **env0 = calloc(n_env + 2, sizeof *env0);
    char fd_s[64];
    snprintf(fd_s, sizeof fd_s, "%s=%d", PP_LISTEN_FD_ENV, lfd);
    if (!args || !env0) {
        free(args);
        free(env0);
        close(lfd);
        return 1;
    }
    size_t k = 0;
    for (size_t i = 0; i < n_env; i++)
        if (strncmp(environ[i], PP_LISTEN_FD_ENV "=", sizeof PP_LISTEN_FD_ENV) != 0)
            env0[k++] = environ[i];
    env0[k++] = fd_s;
    env0[k] = NULL;
    char rank_s[16], world_s[16], master_s[32];
    snprintf(world_s, sizeof world_s, "%d", world);
    snprintf(master_s, sizeof master_s, "127.0.0.1:%d", port);
    int n = 0;
    args[n++] = "glmspark";
    for (int i = 0; i < argc; i++) {
        if (i > 0 && strcmp(argv[i], "--pp") == 0 && i + 1 < argc) {
            i++;
            continue;
        }
        args[n++] = argv[i];
    }
    args[n++] = "--rank";
    args[n++] = rank_s;
    args[n++] = "--world";
    args[n++] = world_s;
    args[n++] = "--master";
    args[n++] = master_s;
    args[n++] = "--local-rank";  // one GPU per local rank (device backends)
    args[n++] = rank_s;
    args[n] = NULL;

    const pid_t parent = getpid();
    pid_t pids[PP_MAX_WORLD] = {0};
    pid_t pgid = 0;
    int status = 0;
    fflush(NULL);
    for (int r = 0; r < world; r++) {
        snprintf(rank_s, sizeof rank_s, "%d", r);
        const pid_t pid = fork();
        if (pid < 0) {
            LOG_ERROR("could not start pipeline rank %d: %s", r, strerror(errno));
            status = 1;
            break;
        }
        if (pid == 0) {
            // Child: join the group, die with the parent, become the rank.
            setpgid(0, pgid);
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) _exit(1);
            if (r == 0) {
                // Rank 0 keeps the master's socket across exec; the others lose it (cloexec).
                if (fcntl(lfd, F_SETFD, 0) != 0) _exit(127);
                execve("/proc/self/exe", args, env0);
            } else {
                execv("/proc/self/exe", args);
            }
            fprintf(stderr, "could not execute /proc/self/exe: %s\n", strerror(errno));
            _exit(127);
        }
        setpgid(pid, pgid);  // also in the parent, so the group exists before we signal it
        if (r == 0) {
            pgid = pid;
            launch_pgid = pid;
            launch_n_signals = 0;
            signal(SIGINT, forward_signal);
            signal(SIGTERM, forward_signal);
        }
        pids[r] = pid;
    }
    close(lfd);  // rank 0 has it
    free(env0);
    // Reap. After the first failure give the others the comm's grace period to stop on
    // their own (with their messages), then kill whatever is left of the group.
    int alive = 0, rank0_status = 0;
    for (int r = 0; r < world; r++)
        alive += pids[r] > 0;
    double kill_at = status ? clock_now_s() : 0;
    bool is_stopping = false;
    while (alive > 0) {
        if (launch_n_signals > 0 && !is_stopping) {
            is_stopping = true;
            LOG_INFO("stopping the pipeline: rank 0 was asked to stop (killed after %d s)",
                     LAUNCH_STOP_MS / 1000);
            const double stop_at = clock_now_s() + LAUNCH_STOP_MS / 1e3;
            if (kill_at == 0 || stop_at < kill_at) kill_at = stop_at;
        }
        int st;
        const pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid > 0) {
            int r = 0;
            while (r < world && pids[r] != pid)
                r++;
            if (r == world) continue;
            pids[r] = 0;
            alive--;
            const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            if (code != 0) {
                if (WIFSIGNALED(st))
                    LOG_ERROR("pipeline rank %d was killed by signal %d", r, WTERMSIG(st));
                if (!status) status = code;
                if (r == 0) rank0_status = code;
                if (kill_at == 0 || (is_stopping && r == 0))
                    kill_at = clock_now_s() + LAUNCH_GRACE_MS / 1e3;
            }
            continue;
        }
        if (pid < 0 && errno != EINTR) break;
        if (kill_at > 0 && clock_now_s() >= kill_at && pgid > 0) {
            kill(-pgid, SIGKILL);
            kill_at = clock_now_s() + 3600;  // once
        }
        const struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    launch_pgid = 0;
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    free(args);
    return rank0_status ? rank0_status : status;
}

// ---------------------------------------------------------------------------
// Stage runtime

enum { PPMSG_MAGIC = 0x47505042, PPMSG_BATCH = 1, PPMSG_RESULT = 2, PPMSG_END = 3 };

typedef struct MsgHeader {
    uint32_t magic, kind;
    int32_t n_ops, n_tokens, n_rows, has_mtp;
    int32_t n_extra;  // PPMSG_BATCH: extra ids after the tokens (cached prefixes, pp.h)
} MsgHeader;

// Sampler threads for vocabularies below this stay at 1: a row then costs tens of µs, and
// waking the workers ate the gain (tests/bench/bench_sampler.c, 8 rows at temperature 1 on
// the 2-core development VM: 0.49 ms on 1 thread, 0.51 on 2 at 16,384 tokens; 1.00 and
// 0.55 ms at 32,768).
enum { PP_SAMPLE_MIN_VOCAB = 32768, PP_SAMPLE_MAX_THREADS = 16 };
_Static_assert((int) PP_MAX_SLOTS <= (int) PP_SAMPLE_MAX_ROWS, "a micro-batch's rows must fit pp_sample_rows");

typedef struct SlotState {
    KvSeq seq;
    int mtp_k;         // MTP drafts per sample (PP_SEQ_START), every rank
    Sampler sampler;   // last rank
    int32_t *history;  // last rank: tokens fed, for the penalties
    int n_history, cap_history;
    bool active;
} SlotState;

struct PpStage {
    Model *m;     // borrowed
    KvCache *kv;  // borrowed
    int rank, world;
    bool is_last;
    PpComm comm;
    SlotState slots[PP_MAX_SLOTS];
    int n_inflight;
    // Growable buffers (grown to the largest batch seen, then reused).
    PpSeqOp *ops;
    int cap_ops;
    int32_t *tokens;
    int cap_tokens;
    unsigned char *act_in, *act_out;
    size_t cap_act_in, cap_act;
    float *logits;  // [rows, vocab] model output
    size_t cap_logits_rows;
    bool logits_pinned;  // grow_logits
    float *res_logits;  // [rows, vocab] result
    size_t cap_res_rows;
    int32_t *res_tokens;
    int cap_res_tokens;
    KvSeq **batch_seqs;
    int *batch_n;
    // world == 1: the result of the one outstanding submit
    int local_n_ops, local_n_rows;
    // MTP: the last rank's drafting state (has_mtp), and each result's per-op outcome
    bool has_mtp;
    MtpStage mtp;
    MtpOut *res_mtp;
    int cap_res_mtp;
    bool res_has_mtp;
    PpStageTimes times;  // pp_stage_times
    // Last rank: the step's sampling tasks and the threads that run them (sample_threads)
    ThreadPool *sample_pool;
    PpSampleRow sample_rows[PP_MAX_SLOTS];
    MtpStageOp mtp_ops[PP_MAX_SLOTS];  // the step's MTP ops (mtp_stage_ops)
    PpSampleScratch sample_scratch;
};

static Err grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (*cap >= need) return ERR_OK;
    void *q = realloc(*p, need * elem);
    if (!q) {
        LOG_ERROR("out of memory growing a pipeline buffer to %zu bytes", need * elem);
        return ERR_NOMEM;
    }
    *p = q;
    *cap = need;
    return ERR_OK;
}

// grow for the logits, which the backend downloads into at every step. Decode-sized buffers
// (at most PP_SAMPLE_MAX_ROWS rows) grow by doubling and are page-locked there (pin_host);
// the larger ones of `glmspark logits` (every row of a prompt) stay pageable.
static Err grow_logits(PpStage *s, size_t rows)
{
    if (s->cap_logits_rows >= rows) return ERR_OK;
    Backend *be = s->m->be;
    const size_t row_bytes = (size_t) s->m->cfg.vocab_size * sizeof(float);
    size_t want = rows;
    if (rows <= PP_SAMPLE_MAX_ROWS && want < 2 * s->cap_logits_rows)
        want = 2 * s->cap_logits_rows < PP_SAMPLE_MAX_ROWS ? 2 * s->cap_logits_rows
                                                           : PP_SAMPLE_MAX_ROWS;
    if (be->unpin_host && s->logits && s->logits_pinned) be->unpin_host(be, s->logits);
    s->logits_pinned = false;
    const Err err = grow((void **) &s->logits, &s->cap_logits_rows, want, row_bytes);
    if (be->pin_host && s->logits && s->cap_logits_rows <= PP_SAMPLE_MAX_ROWS) {
        be->pin_host(be, s->logits, s->cap_logits_rows * row_bytes);
        s->logits_pinned = true;
    }
    return err;
}

static Err grow_int(void **p, int *cap, int need, size_t elem)
{
    size_t c = (size_t) *cap;
    const Err err = grow(p, &c, (size_t) need, elem);
    *cap = (int) c;
    return err;
}

static void slot_free(PpStage *s, SlotState *st)
{
    if (s->has_mtp) mtp_slot_end(&s->mtp, (int) (st - s->slots));
    kv_seq_free(s->kv, &st->seq);
    sampler_free(&st->sampler);
    free(st->history);
    memset(st, 0, sizeof *st);
}

// Threads for the last rank's sampling: GLMSPARK_SAMPLE_THREADS when set (1..64), else 1
// below PP_SAMPLE_MIN_VOCAB, else one per online core up to PP_SAMPLE_MAX_THREADS (16 rows
// cover the decode batches we serve). The pool's idle workers sleep on a condition
// variable (thread_pool.c), so more threads than rows cost nothing between steps.
static int sample_threads(int vocab_size)
{
    const char *env = getenv("GLMSPARK_SAMPLE_THREADS");
    if (env && *env) {
        const int n = atoi(env);
        return n < 1 ? 1 : n > THREAD_POOL_MAX_THREADS ? THREAD_POOL_MAX_THREADS : n;
    }
    if (vocab_size < PP_SAMPLE_MIN_VOCAB) return 1;
    return thread_pool_cores(PP_SAMPLE_MAX_THREADS);
}

Err pp_stage_create(Model *m, KvCache *kv, int rank, int world, const char *master,
                    uint64_t config_hash, PpStage **out)
{
    *out = NULL;
    PpStage *s = calloc(1, sizeof *s);
    if (!s) return ERR_NOMEM;
    s->m = m;
    s->kv = kv;
    s->rank = rank;
    s->world = world;
    s->is_last = rank == world - 1;
    ASSERT(m->has_embed == (rank == 0) && m->has_head == s->is_last);
    s->batch_seqs = calloc(PP_MAX_SLOTS, sizeof *s->batch_seqs);
    s->batch_n = calloc(PP_MAX_SLOTS, sizeof *s->batch_n);
    Err err = ERR_NOMEM;
    if (!s->batch_seqs || !s->batch_n) goto fail;
    if (s->is_last && m->mtp) {
        if ((err = mtp_stage_init(&s->mtp, m, &kv->params, PP_MAX_SLOTS))) goto fail;
        s->has_mtp = true;
    }
    if (s->is_last
        && (err = thread_pool_create(sample_threads(m->cfg.vocab_size), &s->sample_pool)))
        goto fail;
    if (world > 1) {
        // GPU ranks move activations with NCCL unless rank 0 says otherwise (pp_comm.h).
        const bool gpu = m->be && strcmp(m->be->name, "cuda") == 0;
        unsigned char id[PP_NCCL_ID_BYTES];
        const bool offer = rank == 0 && gpu && pp_comm_nccl_offer(id);
        if ((err = pp_comm_init(&s->comm, rank, world, master, config_hash, offer ? id : NULL)))
            goto fail;
        if ((err = pp_comm_data_start(&s->comm, gpu))) {
            pp_comm_free(&s->comm);
            goto fail;
        }
    } else {
        s->comm.world = 1;
        s->comm.next_fd = s->comm.prev_fd = -1;
        for (int r = 0; r < PP_MAX_WORLD; r++)
            s->comm.ctrl_fd[r] = -1;
    }
    *out = s;
    return ERR_OK;

fail:
    thread_pool_destroy(s->sample_pool);
    mtp_stage_free(&s->mtp);
    free(s->batch_seqs);
    free(s->batch_n);
    free(s);
    return err;
}

void pp_stage_destroy(PpStage *s)
{
    if (!s) return;
    for (int i = 0; i < PP_MAX_SLOTS; i++)
        slot_free(s, &s->slots[i]);
    if (s->world > 1) pp_comm_free(&s->comm);
    free(s->ops);
    free(s->tokens);
    free(s->act_in);
    free(s->act_out);
    if (s->logits_pinned && s->m->be->unpin_host) s->m->be->unpin_host(s->m->be, s->logits);
    free(s->logits);
    free(s->res_logits);
    free(s->res_tokens);
    free(s->res_mtp);
    mtp_stage_free(&s->mtp);
    thread_pool_destroy(s->sample_pool);
    free(s->batch_seqs);
    free(s->batch_n);
    free(s);
}

int pp_world(const PpStage *s)
{
    return s->world;
}

const char *pp_rank_host(const PpStage *s, int r)
{
    if (r < 0 || r >= s->world) return "";
    if (s->world == 1) {
        static char self[64];
        if (!self[0] && gethostname(self, sizeof self - 1) != 0) snprintf(self, sizeof self, "?");
        return self;
    }
    return s->comm.hosts[r];
}

int pp_rank_pid(const PpStage *s, int r)
{
    if (r < 0 || r >= s->world) return 0;
    return s->world == 1 ? (int) getpid() : s->comm.pids[r];
}

int pp_inflight(const PpStage *s)
{
    return s->n_inflight;
}

MtpStage *pp_mtp(PpStage *s)
{
    return s->has_mtp ? &s->mtp : NULL;
}

const KvSeq *pp_slot_seq(const PpStage *s, int slot)
{
    return slot >= 0 && slot < PP_MAX_SLOTS ? &s->slots[slot].seq : NULL;
}

int pp_slot_positions(const PpStage *s, int slot)
{
    return slot >= 0 && slot < PP_MAX_SLOTS ? s->slots[slot].seq.n_tokens : 0;
}

int pp_mask_words(const PpStage *s) { return (s->m->cfg.vocab_size + 31) / 32; }

PpStageTimes pp_stage_times(const PpStage *s) { return s->times; }

// Checks a batch; *n_extra gets the extra ids its cached prefixes and masks carry
// (block_size bs, mask_words per mask).
static Err check_ops(const PpSeqOp *ops, int n_ops, int n_tokens, int bs, int mask_words,
                     int *n_extra)
{
    int sum = 0;
    long long extra = 0;
    for (int i = 0; i < n_ops; i++) {
        if (ops[i].n_cached < 0 || ops[i].n_cached > (1 << 20) / bs
            || (ops[i].n_cached > 0 && (!(ops[i].flags & PP_SEQ_START) || ops[i].mtp_k > 0))
            || ops[i].publish_first < 0 || ops[i].publish_last < ops[i].publish_first
            || (ops[i].publish_last > 0 && !(ops[i].flags & PP_SEQ_FREE))) {
            LOG_ERROR("bad pipeline op %d: slot %d, %d cached blocks, publish %d..%d, flags %#x", i,
                      ops[i].slot, ops[i].n_cached, ops[i].publish_first, ops[i].publish_last,
                      ops[i].flags);
            return ERR_FORMAT;
        }
        extra += (long long) ops[i].n_cached * (1 + bs);
        if (ops[i].flags & PP_SEQ_MASK) {
            if (!(ops[i].flags & PP_SEQ_SAMPLE) || ops[i].n_draft > 0) {
                LOG_ERROR("bad pipeline op %d: slot %d masks a step that does not sample alone "
                          "(flags %#x, %d drafts)",
                          i, ops[i].slot, ops[i].flags, ops[i].n_draft);
                return ERR_FORMAT;
            }
            extra += mask_words;
        }
        if (ops[i].slot < 0 || ops[i].slot >= PP_MAX_SLOTS || ops[i].n_new < 0
            || (ops[i].n_new == 0 && !(ops[i].flags & PP_SEQ_FREE)) || ops[i].mtp_k < 0
            || ops[i].mtp_k > MTP_MAX_DRAFTS || ops[i].n_draft < 0
            || (ops[i].n_draft > 0
                && (ops[i].n_new != ops[i].n_draft + 1 || !(ops[i].flags & PP_SEQ_SAMPLE)))
            || ops[i].n_rollback < 0 || ops[i].n_rollback > MTP_MAX_DRAFTS
            || (ops[i].n_rollback > 0 && (ops[i].flags & PP_SEQ_START))) {
            LOG_ERROR("bad pipeline op %d: slot %d, %d new tokens, flags %#x", i, ops[i].slot,
                      ops[i].n_new, ops[i].flags);
            return ERR_FORMAT;
        }
        for (int j = 0; j < i; j++)
            if (ops[j].slot == ops[i].slot) {
                LOG_ERROR("pipeline batch names slot %d twice", ops[i].slot);
                return ERR_FORMAT;
            }
        sum += ops[i].n_new;
    }
    if (sum != n_tokens) {
        LOG_ERROR("pipeline batch has %d tokens but its ops add up to %d", n_tokens, sum);
        return ERR_FORMAT;
    }
    if (extra > (1 << 24)) {
        LOG_ERROR("pipeline batch carries %lld cached-prefix ids", extra);
        return ERR_FORMAT;
    }
    *n_extra = (int) extra;
    return ERR_OK;
}

// This rank's share of a micro-batch: starts, the forward over its layers, then (last
// rank) logits and samples into res_*, then frees. act_in is NULL on rank 0.
static Err run_ops(PpStage *s, const PpSeqOp *ops, int n_ops, const int32_t *tokens, int n_tokens,
                   const void *act_in, int *n_rows_out)
{
    Model *m = s->m;
    const size_t V = (size_t) m->cfg.vocab_size;
    const int bs = s->kv->params.block_size;
    const int32_t *extra = tokens + n_tokens;  // cached prefixes: block ids, then tokens
    Err err = ERR_OK;
    int n_batch = 0, n_rows = 0, n_mtp = 0, off0 = 0;
    bool all = false;
    // A vocabulary mask and MTP drafting do not go together (the scheduler turns MTP off for
    // constrained requests): a drafting slot would ignore its mask, and every later op would
    // read the wrong one. Refused before anything changes.
    for (int i = 0; i < n_ops; i++) {
        const int mtp_k =
            ops[i].flags & PP_SEQ_START ? ops[i].mtp_k : s->slots[ops[i].slot].mtp_k;
        if ((ops[i].flags & PP_SEQ_MASK) && mtp_k > 0) {
            LOG_ERROR("bad pipeline op %d: slot %d drafts with MTP (mtp_k %d) and carries a "
                      "vocabulary mask",
                      i, ops[i].slot, mtp_k);
            return ERR_FORMAT;
        }
    }
    for (int i = 0; i < n_ops; i++) {
        SlotState *st = &s->slots[ops[i].slot];
        if (ops[i].flags & PP_SEQ_START) {
            slot_free(s, st);
            st->active = true;
            st->mtp_k = ops[i].mtp_k;
            if (s->is_last && (err = sampler_init(&st->sampler, m->cfg.vocab_size, ops[i].params)))
                return err;
            if (ops[i].n_cached > 0) {
                const int n_pos = ops[i].n_cached * bs;
                if ((err = kv_seq_attach(s->kv, &st->seq, extra, ops[i].n_cached))) {
                    LOG_ERROR("pipeline rank %d: slot %d's cached prefix does not match this rank's "
                              "cache",
                              s->rank, ops[i].slot);
                    return err;
                }
                if (s->is_last) {  // the prefix's tokens are the history's start
                    if ((err = grow_int((void **) &st->history, &st->cap_history, n_pos * 2,
                                        sizeof(int32_t))))
                        return err;
                    memcpy(st->history, extra + ops[i].n_cached, (size_t) n_pos * sizeof(int32_t));
                    st->n_history = n_pos;
                }
                extra += ops[i].n_cached + n_pos;
            }
            if (s->is_last && st->mtp_k > 0
                && (err = s->has_mtp
                              ? mtp_slot_start(&s->mtp, ops[i].slot, st->mtp_k, &ops[i].params)
                              : ERR_INVAL)) {
                if (!s->has_mtp)
                    LOG_ERROR("pipeline slot %d asks for MTP drafts; the last rank has no MTP "
                              "layer loaded",
                              ops[i].slot);
                st->active = false;
                return err;
            }
        } else if (!st->active) {
            LOG_ERROR("pipeline op on slot %d, which holds no sequence", ops[i].slot);
            return ERR_FORMAT;
        }
        if ((ops[i].flags & PP_SEQ_FREE) && ops[i].n_new == 0) {
            // Free-only ops release their blocks before the forward: a sequence the
            // scheduler admitted into this micro-batch may have been promised them.
            kv_seq_publish(s->kv, &st->seq, ops[i].publish_first, ops[i].publish_last);
            slot_free(s, st);
            continue;
        }
        if ((ops[i].n_rollback > 0 || ops[i].n_draft > 0)
            && (st->mtp_k == 0 || ops[i].n_rollback > st->seq.n_tokens)) {
            LOG_ERROR("pipeline op on slot %d: %d drafts, %d positions to drop (slot without MTP "
                      "or shorter)",
                      ops[i].slot, ops[i].n_draft, ops[i].n_rollback);
            return ERR_FORMAT;
        }
        if (st->mtp_k > 0 && !(ops[i].flags & PP_SEQ_START)
            && (ops[i].n_new > 0 || !(ops[i].flags & PP_SEQ_FREE))) {
            // The previous op's rejected drafts leave every rank's cache.
            // Drafts are checked before anything changes (the forward writes the cache).
            if (s->is_last && ops[i].n_new > 0
                && (err = mtp_slot_check(&s->mtp, ops[i].slot, tokens + off0, ops[i].n_new,
                                         ops[i].n_draft, ops[i].flags & PP_SEQ_SAMPLE)))
                return err;
            if (s->is_last && (err = mtp_slot_rollback(&s->mtp, ops[i].slot, ops[i].n_rollback)))
                return err;
            st->seq.n_tokens -= ops[i].n_rollback;
            if (s->is_last) st->n_history -= ops[i].n_rollback;
        }
        if (st->mtp_k > 0 && ops[i].n_new > 0) n_mtp++;
        off0 += ops[i].n_new;
        if (ops[i].n_new > 0) {
            s->batch_seqs[n_batch] = &st->seq;
            s->batch_n[n_batch++] = ops[i].n_new;
        }
        if (ops[i].flags & PP_SEQ_LOGITS) {
            all = true;
            n_rows += ops[i].n_new;
        }
    }
    if (s->is_last) {
        if ((err = grow_int((void **) &s->res_tokens, &s->cap_res_tokens, n_ops, sizeof(int32_t)))
            || (err = grow((void **) &s->res_logits, &s->cap_res_rows, (size_t) n_rows,
                           V * sizeof(float)))
            || (err = grow_logits(s, (size_t) (all ? n_tokens : n_batch)))
            || (err = grow_int((void **) &s->res_mtp, &s->cap_res_mtp, n_ops, sizeof(MtpOut))))
            return err;
        // MTP slots need their rows' residual stream (mtp_stage_op runs their head).
        if (n_mtp > 0
            && (err = grow((void **) &s->act_out, &s->cap_act, model_act_bytes(m, n_tokens), 1)))
            return err;
        s->res_has_mtp = n_mtp > 0;
    } else if ((err = grow((void **) &s->act_out, &s->cap_act, model_act_bytes(m, n_tokens), 1))) {
        return err;
    }
    if (n_batch > 0) {
        const ModelBatch b = {n_batch, s->batch_seqs, s->batch_n};
        const double t0 = clock_now_s();
        err = model_forward_batch(m, s->kv, &b, tokens, act_in,
                                  s->is_last && n_mtp == 0 ? NULL : s->act_out,
                                  s->is_last ? s->logits : NULL,
                                  !s->is_last ? MODEL_LOGITS_NONE
                                  : all       ? MODEL_LOGITS_ALL
                                              : MODEL_LOGITS_LAST);
        s->times.forward_s += clock_now_s() - t0;
        s->times.batches++;
        if (err) {
            LOG_ERROR("pipeline rank %d: forward over %d sequences (%d tokens) failed: %s", s->rank,
                      n_batch, n_tokens, err_name(err));
            return err;
        }
    }
    if (s->is_last) {
        int off = 0, bi = 0, row = 0, n_sample = 0, n_mops = 0;
        const int32_t *mask = extra;  // the masks follow the cached prefixes
        const int mask_words = pp_mask_words(s);
        for (int i = 0; i < n_ops; i++) {
            SlotState *st = &s->slots[ops[i].slot];
            const int k = ops[i].n_new;
            s->res_tokens[i] = -1;
            s->res_mtp[i] = (MtpOut){0};
            if (k > 0) {
                if (st->n_history + k > st->cap_history) {
                    const int cap = (st->n_history + k) * 2;
                    if ((err = grow_int((void **) &st->history, &st->cap_history, cap,
                                        sizeof(int32_t))))
                        return err;
                }
                memcpy(st->history + st->n_history, tokens + off, (size_t) k * sizeof(int32_t));
                st->n_history += k;
                float *last = s->logits + (all ? (size_t) (off + k - 1) : (size_t) bi) * V;
                if (ops[i].flags & PP_SEQ_LOGITS) {
                    memcpy(s->res_logits + (size_t) row * V, s->logits + (size_t) off * V,
                           (size_t) k * V * sizeof(float));
                    row += k;
                }
                if (st->mtp_k > 0) {
                    // Run below with the step's other MTP ops (their drafting batched).
                    const float *x = (const float *) s->act_out + (size_t) off * m->cfg.hidden_size;
                    s->mtp_ops[n_mops++] = (MtpStageOp){ops[i].slot,
                                                       &st->sampler,
                                                       tokens + off,
                                                       k,
                                                       ops[i].n_draft,
                                                       ops[i].flags & PP_SEQ_SAMPLE,
                                                       x,
                                                       last,
                                                       &s->res_mtp[i]};
                } else if (ops[i].flags & PP_SEQ_SAMPLE) {
                    // Sampled below with the step's other sequences, once the histories
                    // hold this step's tokens.
                    const uint32_t *w = NULL;
                    if (ops[i].flags & PP_SEQ_MASK) {
                        w = (const uint32_t *) mask;
                        mask += mask_words;
                    }
                    s->sample_rows[n_sample++] = (PpSampleRow){.sampler = &st->sampler,
                                                               .logits = last,
                                                               .history = st->history,
                                                               .n_history = st->n_history,
                                                               .mask = w,
                                                               .token = &s->res_tokens[i]};
                }
                bi++;
            }
            off += k;
        }
        if (n_mops > 0) {
            const double t0 = clock_now_s();  // the drafts' forwards: forward time
            err = mtp_stage_ops(&s->mtp, s->mtp_ops, n_mops);
            s->times.forward_s += clock_now_s() - t0;
            if (err) return err;
            for (int i = 0; i < n_ops; i++) {
                const MtpOut *mo = &s->res_mtp[i];
                if (mo->n_emit > 0) s->res_tokens[i] = mo->emit[mo->n_emit - 1];
            }
        }
        const double t0 = clock_now_s();
        pp_sample_rows(s->sample_pool, s->sample_rows, n_sample, &s->sample_scratch);
        s->times.sample_s += clock_now_s() - t0;
    }
    for (int i = 0; i < n_ops; i++)
        if ((ops[i].flags & PP_SEQ_FREE) && s->slots[ops[i].slot].active) {
            SlotState *st = &s->slots[ops[i].slot];
            kv_seq_publish(s->kv, &st->seq, ops[i].publish_first, ops[i].publish_last);
            slot_free(s, st);
        }
    *n_rows_out = n_rows;
    return ERR_OK;
}

// Last rank: send the result of the batch just run to rank 0.
static Err send_result(PpStage *s, int n_ops, int n_rows)
{
    const MsgHeader h = {PPMSG_MAGIC, PPMSG_RESULT, n_ops, 0, n_rows, s->res_has_mtp, 0};
    const size_t V = (size_t) s->m->cfg.vocab_size;
    Err err = pp_comm_send(&s->comm, &h, sizeof h);
    if (!err) err = pp_comm_send(&s->comm, s->res_tokens, (size_t) n_ops * sizeof(int32_t));
    if (!err && n_rows)
        err = pp_comm_send(&s->comm, s->res_logits, (size_t) n_rows * V * sizeof(float));
    if (!err && s->res_has_mtp)
        err = pp_comm_send(&s->comm, s->res_mtp, (size_t) n_ops * sizeof(MtpOut));
    return err;
}

static Err send_batch(PpStage *s, const PpSeqOp *ops, int n_ops, const int32_t *tokens,
                      int n_tokens, int n_extra)
{
    const MsgHeader h = {PPMSG_MAGIC, PPMSG_BATCH, n_ops, n_tokens, 0, 0, n_extra};
    Err err = pp_comm_send(&s->comm, &h, sizeof h);
    if (!err) err = pp_comm_send(&s->comm, ops, (size_t) n_ops * sizeof *ops);
    if (!err)
        err = pp_comm_send(&s->comm, tokens, (size_t) (n_tokens + n_extra) * sizeof(int32_t));
    if (!err) err = pp_comm_send_act(&s->comm, s->act_out, model_act_bytes(s->m, n_tokens));
    return err;
}

Err pp_submit(PpStage *s, const PpSeqOp *ops, int n_ops, const int32_t *tokens)
{
    ASSERT(s->rank == 0 && n_ops > 0 && s->n_inflight < s->world);
    int n_tokens = 0;
    for (int i = 0; i < n_ops; i++)
        n_tokens += ops[i].n_new;
    int n_extra = 0;
    Err err = check_ops(ops, n_ops, n_tokens, s->kv->params.block_size, pp_mask_words(s), &n_extra);
    if (err) return err;
    int n_rows = 0;
    if ((err = run_ops(s, ops, n_ops, tokens, n_tokens, NULL, &n_rows))) return err;
    if (s->world == 1) {
        s->local_n_ops = n_ops;
        s->local_n_rows = n_rows;
    } else if ((err = send_batch(s, ops, n_ops, tokens, n_tokens, n_extra))) {
        return err;
    }
    s->n_inflight++;
    return ERR_OK;
}

Err pp_collect(PpStage *s, PpResult *out)
{
    ASSERT(s->rank == 0 && s->n_inflight > 0);
    memset(out, 0, sizeof *out);
    if (s->world > 1) {
        MsgHeader h;
        Err err = pp_comm_recv(&s->comm, &h, sizeof h);
        if (err) return err;
        if (h.magic != PPMSG_MAGIC || h.kind != PPMSG_RESULT || h.n_ops < 0 || h.n_rows < 0) {
            LOG_ERROR("rank 0: malformed result from rank %d", s->world - 1);
            return ERR_FORMAT;
        }
        const size_t V = (size_t) s->m->cfg.vocab_size;
        if ((err = grow_int((void **) &s->res_tokens, &s->cap_res_tokens, h.n_ops, sizeof(int32_t)))
            || (err = grow((void **) &s->res_logits, &s->cap_res_rows, (size_t) h.n_rows,
                           V * sizeof(float)))
            || (err = pp_comm_recv(&s->comm, s->res_tokens, (size_t) h.n_ops * sizeof(int32_t)))
            || (h.n_rows
                && (err = pp_comm_recv(&s->comm, s->res_logits,
                                       (size_t) h.n_rows * V * sizeof(float))))
            || (h.has_mtp
                && ((err =
                         grow_int((void **) &s->res_mtp, &s->cap_res_mtp, h.n_ops, sizeof(MtpOut)))
                    || (err = pp_comm_recv(&s->comm, s->res_mtp,
                                           (size_t) h.n_ops * sizeof(MtpOut))))))
            return err;
        s->local_n_ops = h.n_ops;
        s->local_n_rows = h.n_rows;
        s->res_has_mtp = h.has_mtp != 0;
    }
    s->n_inflight--;
    out->n_ops = s->local_n_ops;
    out->tokens = s->res_tokens;
    out->n_rows = s->local_n_rows;
    out->logits = s->res_logits;
    out->mtp = s->res_has_mtp ? s->res_mtp : NULL;
    return ERR_OK;
}

Err pp_serve(PpStage *s)
{
    ASSERT(s->rank > 0);
    Err err = ERR_OK;
    uint64_t n_batches = 0;
    for (;;) {
        MsgHeader h;
        int n_extra = 0;
        if ((err = pp_comm_recv(&s->comm, &h, sizeof h))) break;
        if (h.magic != PPMSG_MAGIC || (h.kind != PPMSG_BATCH && h.kind != PPMSG_END)) {
            LOG_ERROR("rank %d: malformed message from rank %d", s->rank, s->rank - 1);
            err = ERR_FORMAT;
            break;
        }
        if (h.kind == PPMSG_END) {
            err = pp_comm_send(&s->comm, &h, sizeof h);  // on around the ring to rank 0
            break;
        }
        if (h.n_ops < 1 || h.n_ops > PP_MAX_SLOTS || h.n_tokens < 0 || h.n_tokens > (1 << 24)
            || h.n_extra < 0 || h.n_extra > (1 << 24)) {
            LOG_ERROR("rank %d: batch with %d ops and %d tokens is out of range", s->rank, h.n_ops,
                      h.n_tokens);
            err = ERR_FORMAT;
            break;
        }
        if ((err = grow_int((void **) &s->ops, &s->cap_ops, h.n_ops, sizeof *s->ops))
            || (err = grow_int((void **) &s->tokens, &s->cap_tokens, h.n_tokens + h.n_extra + 1,
                               sizeof(int32_t)))
            || (err = grow((void **) &s->act_in, &s->cap_act_in, model_act_bytes(s->m, h.n_tokens),
                           1)))
            break;
        if ((err = pp_comm_recv(&s->comm, s->ops, (size_t) h.n_ops * sizeof *s->ops))
            || (err = pp_comm_recv(&s->comm, s->tokens,
                                   (size_t) (h.n_tokens + h.n_extra) * sizeof(int32_t)))
            || (err = pp_comm_recv_act(&s->comm, s->act_in, model_act_bytes(s->m, h.n_tokens)))
            || (err = check_ops(s->ops, h.n_ops, h.n_tokens, s->kv->params.block_size, pp_mask_words(s),
                                   &n_extra)))
            break;
        if (n_extra != h.n_extra) {
            LOG_ERROR("rank %d: batch carries %d extra ids, its ops %d", s->rank, h.n_extra, n_extra);
            err = ERR_FORMAT;
            break;
        }
        int n_rows = 0;
        if ((err = run_ops(s, s->ops, h.n_ops, s->tokens, h.n_tokens, s->act_in, &n_rows))) break;
        err = s->is_last ? send_result(s, h.n_ops, n_rows)
                         : send_batch(s, s->ops, h.n_ops, s->tokens, h.n_tokens, h.n_extra);
        if (err) break;
        n_batches++;
    }
    if (!err) {
        pp_comm_finish(&s->comm);
        LOG_INFO("pipeline rank %d: served %llu micro-batches, stopping", s->rank,
                 (unsigned long long) n_batches);
    }
    return err;
}

Err pp_end(PpStage *s)
{
    ASSERT(s->rank == 0 && s->n_inflight == 0);
    if (s->world == 1) return ERR_OK;
    MsgHeader h = {PPMSG_MAGIC, PPMSG_END, 0, 0, 0, 0, 0};
    Err err = pp_comm_send(&s->comm, &h, sizeof h);
    if (!err) err = pp_comm_recv(&s->comm, &h, sizeof h);
    if (!err && (h.magic != PPMSG_MAGIC || h.kind != PPMSG_END)) {
        LOG_ERROR("rank 0: expected the end of the pipeline, got message kind %u", h.kind);
        err = ERR_FORMAT;
    }
    if (!err) pp_comm_finish(&s->comm);
    return err;
}

// ---------------------------------------------------------------------------
// Planning from a checkpoint

Err pp_plan_model(const char *dir, const ModelConfig *cfg, int world, uint64_t mem_bytes,
                  double mem_utilization, int context, KvDtype kv_dtype, PpPlan *plan)
{
    Ckpt ck = {0};
    uint64_t *layer_bytes = calloc((size_t) cfg->n_layers, sizeof *layer_bytes);
    if (!layer_bytes) return ERR_NOMEM;
    Err err = ckpt_open(&ck, dir);  // headers and mappings only; no tensor byte is read
    if (err) goto done;
    uint64_t first = 0, last = 0;
    const bool tied_head = cfg->tie_word_embeddings && !ckpt_find(&ck, "lm_head.weight");
    for (int i = 0; i < ck.n_tensors; i++) {
        const CkptTensor *t = &ck.tensors[i];
        const char *pre = "model.layers.";
        if (strncmp(t->name, pre, strlen(pre)) == 0) {
            const long l = strtol(t->name + strlen(pre), NULL, 10);
            if (l >= 0 && l < cfg->n_layers)
                layer_bytes[l] += t->n_bytes;
            else
                last += t->n_bytes;  // MTP layer(s)
        } else if (strncmp(t->name, "model.embed_tokens.", 19) == 0) {
            first += t->n_bytes;
            // The last rank's MTP layer embeds its next token with the same table (as a
            // tied lm_head does): it holds a copy when the checkpoint has an MTP layer.
            if (tied_head || cfg->n_mtp_layers > 0) last += t->n_bytes;
        } else {
            last += t->n_bytes;  // final norm, lm_head
        }
    }
    const PpPlanInput in = {
        .world = world,
        .n_layers = cfg->n_layers,
        .layer_bytes = layer_bytes,
        .first_bytes = first,
        .last_bytes = last,
        .kv_bytes_per_token_layer = pp_kv_bytes_per_token_layer(cfg, kv_dtype),
        .context = context,
        .mem_bytes = mem_bytes,
        .mem_utilization = mem_utilization,
    };
    err = pp_plan(&in, plan);

done:
    ckpt_close(&ck);
    free(layer_bytes);
    return err;
}
