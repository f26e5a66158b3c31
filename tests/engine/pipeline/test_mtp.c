/*
 * test_mtp.c - the MTP layer and speculative decoding (engine/pipeline/mtp.h):
 *   - the MTP layer's logits on the golden model mtp_theta against the float64 numpy
 *     reference of tests/tools/gen_mtp_golden.py (tests/golden/mtp/), rel L2 <= 1e-4 per
 *     row, and chunked MTP calls equal one call bit for bit;
 *   - greedy output with 1, 2 and 3 drafts equals plain greedy decoding on mtp_theta and on
 *     the mkmodel tiny and default presets (written to a temporary directory), both with
 *     the MTP layer's own drafts (random weights: almost none accepted) and with a draft
 *     hook that proposes the true continuation except at chosen places, so that every
 *     acceptance length 0..K is exercised;
 *   - after those runs the main and MTP caches hold exactly what a fresh run over the
 *     committed tokens writes (rollback leaves nothing behind);
 *   - the acceptance rule keeps the target distribution: chi-square on the first emitted
 *     token and on the second given the first draft was kept, with fixed p and q rows;
 *   - the same end to end on mkmodel tiny at temperature 1: the second generated token's
 *     distribution over many seeds against its exact marginal sum_y1 p(y1) p(y2 | y1);
 *   - refusals: no MTP layer, K out of range, sampling filters.
 * Deterministic seeds throughout; chi-square thresholds at p = 1e-4.
 */
#include <json-c/json.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model.h"
#include "engine/model/sampler.h"
#include "engine/pipeline/mtp.h"
#include "engine/shared/err.h"
#include "engine/tools/mkmodel.h"
#include "tests/check.h"
#include "tests/engine/pipeline/mtp_test_util.h"

static char src_dir[1024];
static char tmp_root[512];
static int n_rollback_checks;

typedef struct Env {
    Backend *be;
    Model m;
    KvCache kv, mkv;
} Env;

static void env_open(Env *e, const char *dir, int n_blocks)
{
    ASSERT(backend_cpu_create(2, &e->be) == ERR_OK);
    const ModelOptions o = {.load_mtp = true};
    ASSERT(model_load(&e->m, dir, &o, e->be) == ERR_OK);
    ASSERT(e->m.mtp != NULL);
    const KvCacheParams p = model_kv_params(&e->m, n_blocks, 8);
    const KvCacheParams mp = model_mtp_kv_params(&e->m, n_blocks, 8);
    ASSERT(kv_init(&e->kv, &p) == ERR_OK && kv_init(&e->mkv, &mp) == ERR_OK);
}

static void env_close(Env *e)
{
    kv_free(&e->kv);
    kv_free(&e->mkv);
    model_free(&e->m);
    e->be->destroy(e->be);
}

static double rel_l2(const float *a, const float *b, int n)
{
    double num = 0.0, den = 0.0;
    for (int i = 0; i < n; i++) {
        num += ((double) a[i] - b[i]) * ((double) a[i] - b[i]);
        den += (double) b[i] * b[i];
    }
    return sqrt(num / (den > 0.0 ? den : 1.0));
}

// ---------------------------------------------------------------------------
// MTP logits against the numpy reference

static void test_golden_logits(void)
{
    char path[1200], dir[1200];
    snprintf(path, sizeof path, "%s/tests/golden/mtp/mtp_theta.json", src_dir);
    snprintf(dir, sizeof dir, "%s/tests/golden/models/mtp_theta", src_dir);
    json_object *root = json_object_from_file(path), *arr, *jv, *jr;
    ASSERT(root && json_object_object_get_ex(root, "tokens", &arr)
           && json_object_object_get_ex(root, "vocab_size", &jv)
           && json_object_object_get_ex(root, "rows", &jr));
    const int T = (int) json_object_array_length(arr), V = json_object_get_int(jv);
    const int R = json_object_get_int(jr);
    CHECK(R == T - 1);
    int *tok = malloc((size_t) T * sizeof *tok);
    ASSERT(tok);
    for (int i = 0; i < T; i++)
        tok[i] = json_object_get_int(json_object_array_get_idx(arr, (size_t) i));
    json_object_put(root);
    float *ref = malloc((size_t) R * V * sizeof *ref);
    snprintf(path, sizeof path, "%s/tests/golden/mtp/mtp_theta_logits.f32", src_dir);
    FILE *f = fopen(path, "rb");
    ASSERT(f && ref && fread(ref, sizeof *ref, (size_t) R * V, f) == (size_t) R * V);
    fclose(f);

    Env e;
    env_open(&e, dir, 16);
    ASSERT(e.m.cfg.vocab_size == V);
    const int H = e.m.cfg.hidden_size;
    float *lg = malloc((size_t) T * V * sizeof *lg), *hid = malloc((size_t) T * H * sizeof *hid);
    float *mlg = malloc((size_t) R * V * sizeof *mlg), *mh = malloc((size_t) R * H * sizeof *mh);
    float *mlg2 = malloc((size_t) R * V * sizeof *mlg2);
    ASSERT(lg && hid && mlg && mh && mlg2);
    KvSeq seq = {0}, ms = {0}, ms2 = {0};
    CHECK(model_forward_hidden(&e.m, &e.kv, &seq, tok, T, lg, true, hid) == ERR_OK);
    CHECK(model_mtp_forward(&e.m, &e.mkv, &ms, tok + 1, hid, R, mlg, mh, true) == ERR_OK);
    CHECK(ms.n_tokens == R);
    double worst = 0.0;
    for (int r = 0; r < R; r++) {
        const double d = rel_l2(mlg + (size_t) r * V, ref + (size_t) r * V, V);
        if (d > worst) worst = d;
    }
    printf("mtp_theta: MTP logits vs numpy float64, worst row rel L2 %.3g over %d rows\n", worst,
           R);
    CHECK(worst <= 1e-4);

    // The same rows in chunks of 10, 1 and 16, last-row outputs: the same bits and cache.
    const int chunks[3] = {10, 1, 16};
    for (int c = 0, off = 0; c < 3; off += chunks[c++]) {
        float row[1024];
        ASSERT(V <= 1024);
        CHECK(model_mtp_forward(&e.m, &e.mkv, &ms2, tok + 1 + off, hid + (size_t) off * H,
                                chunks[c], row, NULL, false)
              == ERR_OK);
        const int last = off + chunks[c] - 1;
        CHECK(memcmp(row, mlg + (size_t) last * V, (size_t) V * sizeof *row) == 0);
    }
    bool same = ms2.n_tokens == R;
    for (int p = 0; same && p < R; p++)
        same = memcmp(kv_entry_bytes(&e.mkv, &ms, 0, p), kv_entry_bytes(&e.mkv, &ms2, 0, p),
                      (size_t) e.mkv.entry[0].bytes)
               == 0;
    CHECK(same);

    // Refusals: a token outside the vocabulary; a model loaded without its MTP layer.
    int bad = V;
    CHECK(model_mtp_forward(&e.m, &e.mkv, &ms2, &bad, hid, 1, NULL, NULL, false) == ERR_INVAL);
    CHECK(ms2.n_tokens == R);
    Model plain;
    ASSERT(model_load(&plain, dir, NULL, e.be) == ERR_OK);
    KvSeq ms3 = {0};
    CHECK(model_mtp_forward(&plain, &e.mkv, &ms3, tok, hid, 1, NULL, NULL, false) == ERR_INVAL);
    Sampler s;
    ASSERT(sampler_init(&s, V, sampler_default_params()) == ERR_OK);
    MtpGen g;
    CHECK(mtp_gen_init(&g, &plain, &e.kv, &e.mkv, &s, 1) == ERR_INVAL);
    mtp_gen_free(&g);
    CHECK(mtp_gen_init(&g, &e.m, &e.kv, &e.mkv, &s, 0) == ERR_INVAL);
    CHECK(mtp_gen_init(&g, &e.m, &e.kv, &e.mkv, &s, MTP_MAX_DRAFTS + 1) == ERR_INVAL);
    sampler_free(&s);
    SamplerParams sp = sampler_default_params();
    sp.temperature = 0.7f;
    sp.top_p = 0.9f;
    ASSERT(sampler_init(&s, V, sp) == ERR_OK);
    CHECK(mtp_gen_init(&g, &e.m, &e.kv, &e.mkv, &s, 2) == ERR_INVAL);
    sampler_free(&s);
    sp = sampler_default_params();
    sp.repetition_penalty = 1.2f;
    CHECK(mtp_check_params(&sp) == ERR_INVAL);
    model_free(&plain);

    kv_seq_free(&e.kv, &seq);
    kv_seq_free(&e.mkv, &ms);
    kv_seq_free(&e.mkv, &ms2);
    env_close(&e);
    free(tok);
    free(ref);
    free(lg);
    free(hid);
    free(mlg);
    free(mh);
    free(mlg2);
}

// ---------------------------------------------------------------------------
// Greedy equivalence and rollback

typedef struct Oracle {
    const int *truth;  // prompt then the plain greedy output
    int n_truth;
    int salt;  // draft i at position P is wrong when (P + i * 7 + salt) % 4 == 0 (or never)
    bool always_right;
} Oracle;

static int oracle_draft(void *user, const MtpGen *g, int i, const float *mtp_logits)
{
    (void) mtp_logits;
    const Oracle *o = user;
    const int pos = g->seq.n_tokens + 1 + i;
    const int V = g->m->cfg.vocab_size;
    if (pos >= o->n_truth) return 0;
    const bool wrong = !o->always_right && (g->seq.n_tokens + i * 7 + o->salt) % 4 == 0;
    return wrong ? (o->truth[pos] + 1) % V : o->truth[pos];
}

// Plain greedy decoding through model_forward: n_gen tokens after the prompt.
static void plain_greedy(Env *e, const int *prompt, int n, int n_gen, int *out)
{
    const int V = e->m.cfg.vocab_size;
    float *lg = malloc((size_t) V * sizeof *lg);
    ASSERT(lg);
    KvSeq seq = {0};
    ASSERT(model_forward(&e->m, &e->kv, &seq, prompt, n, lg, false) == ERR_OK);
    for (int i = 0; i < n_gen; i++) {
        int best = 0;
        for (int v = 1; v < V; v++)
            if (lg[v] > lg[best]) best = v;
        out[i] = best;
        if (i + 1 < n_gen) ASSERT(model_forward(&e->m, &e->kv, &seq, &best, 1, lg, false) == 0);
    }
    kv_seq_free(&e->kv, &seq);
    free(lg);
}

// The caches of g equal what a fresh run over the committed tokens writes.
static bool caches_match_fresh(Env *e, const MtpGen *g, const int *committed)
{
    const int P = g->seq.n_tokens, PM = g->mseq.n_tokens;
    const int V = e->m.cfg.vocab_size, H = e->m.cfg.hidden_size;
    float *lg = malloc((size_t) V * sizeof *lg), *hid = malloc((size_t) P * H * sizeof *hid);
    ASSERT(lg && hid && PM <= P - 1);
    KvSeq seq = {0}, ms = {0};
    ASSERT(model_forward_hidden(&e->m, &e->kv, &seq, committed, P, lg, false, hid) == ERR_OK);
    ASSERT(model_mtp_forward(&e->m, &e->mkv, &ms, committed + 1, hid, PM, NULL, NULL, false)
           == ERR_OK);
    bool same = true;
    for (int l = 0; l < e->kv.params.n_layers; l++)
        for (int p = 0; same && p < P; p++)
            same = memcmp(kv_entry_bytes(&e->kv, &seq, l, p), kv_entry_bytes(&e->kv, &g->seq, l, p),
                          (size_t) e->kv.entry[l].bytes)
                   == 0;
    for (int p = 0; same && p < PM; p++)
        same = memcmp(kv_entry_bytes(&e->mkv, &ms, 0, p), kv_entry_bytes(&e->mkv, &g->mseq, 0, p),
                      (size_t) e->mkv.entry[0].bytes)
               == 0;
    kv_seq_free(&e->kv, &seq);
    kv_seq_free(&e->mkv, &ms);
    free(lg);
    free(hid);
    return same;
}

// Generate n_gen tokens with k drafts (hook o, or the MTP's own drafts when NULL).
static void mtp_greedy(Env *e, const int *prompt, int n, int n_gen, int k, Oracle *o, int *out,
                       MtpStats *st, const int *truth)
{
    Sampler s;
    ASSERT(sampler_init(&s, e->m.cfg.vocab_size, sampler_default_params()) == ERR_OK);
    MtpGen g;
    ASSERT(mtp_gen_init(&g, &e->m, &e->kv, &e->mkv, &s, k) == ERR_OK);
    if (o) {
        g.draft_hook = oracle_draft;
        g.hook_user = o;
    }
    int n_out = 0;
    ASSERT(mtp_gen_prefill(&g, prompt, n, &out[n_out++]) == ERR_OK);
    while (n_out < n_gen) {
        int buf[MTP_MAX_DRAFTS + 1], got = 0;
        ASSERT(mtp_gen_step(&g, buf, &got) == ERR_OK);
        CHECK(got >= 1 && got <= k + 1);
        for (int i = 0; i < got && n_out < n_gen; i++)
            out[n_out++] = buf[i];
        // Rollback check at a few steps (the committed tokens are the truth's prefix when
        // the output has matched so far).
        if (truth && g.stats.steps % 3 == 1 && memcmp(out, truth + n, n_out * sizeof *out) == 0) {
            CHECK(caches_match_fresh(e, &g, truth));
            n_rollback_checks++;
        }
    }
    *st = g.stats;
    mtp_gen_free(&g);
    sampler_free(&s);
}

static void greedy_case(const char *name, const char *dir, int n_gen)
{
    Env e;
    env_open(&e, dir, 64);
    const int V = e.m.cfg.vocab_size;
    enum { N_PROMPT = 9 };
    int prompt[N_PROMPT];
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < N_PROMPT; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        prompt[i] = (int) (x % (uint64_t) (V - 3));
    }
    // The truth runs K + 1 tokens past n_gen, so that the hook knows every draft.
    int *truth = malloc((size_t) (N_PROMPT + n_gen + 4) * sizeof *truth);
    int *out = malloc((size_t) n_gen * sizeof *out);
    ASSERT(truth && out);
    memcpy(truth, prompt, sizeof prompt);
    plain_greedy(&e, prompt, N_PROMPT, n_gen + 4, truth + N_PROMPT);
    for (int k = 1; k <= 3; k++) {
        MtpStats own, hook, right;
        mtp_greedy(&e, prompt, N_PROMPT, n_gen, k, NULL, out, &own, truth);
        CHECK(memcmp(out, truth + N_PROMPT, (size_t) n_gen * sizeof *out) == 0);
        Oracle o = {truth, N_PROMPT + n_gen + 4, k, false};
        mtp_greedy(&e, prompt, N_PROMPT, n_gen, k, &o, out, &hook, truth);
        CHECK(memcmp(out, truth + N_PROMPT, (size_t) n_gen * sizeof *out) == 0);
        CHECK(hook.accepted > 0 && hook.accepted < hook.drafted);
        o.always_right = true;
        mtp_greedy(&e, prompt, N_PROMPT, n_gen, k, &o, out, &right, truth);
        CHECK(memcmp(out, truth + N_PROMPT, (size_t) n_gen * sizeof *out) == 0);
        CHECK(right.accepted == right.drafted);
        printf("%s: --mtp %d greedy == plain over %d tokens; MTP's own drafts accepted %ld/%ld "
               "(%.1f%%), hook %ld/%ld, always-right hook %ld/%ld (%.2f tokens/step)\n",
               name, k, n_gen, own.accepted, own.drafted,
               100.0 * (double) own.accepted / (double) own.drafted, hook.accepted, hook.drafted,
               right.accepted, right.drafted, (double) right.emitted / (double) right.steps);
    }
    free(truth);
    free(out);
    env_close(&e);
}

// A full main cache mid-generation: the step fails with ERR_AGAIN and leaves the state so
// that, once blocks are free again, the retry continues with the plain greedy output.
static void test_full_cache(const char *dir)
{
    Env e;
    env_open(&e, dir, 6);  // 6 blocks of 8 positions in each cache
    const int prompt[9] = {3, 14, 15, 92, 65, 35, 89, 79, 32};
    enum { N_GEN = 30 };
    int truth[9 + N_GEN + 4], out[N_GEN + MTP_MAX_DRAFTS + 1];
    memcpy(truth, prompt, sizeof prompt);
    plain_greedy(&e, prompt, 9, N_GEN + 4, truth + 9);
    KvSeq hog = {0};
    ASSERT(kv_seq_reserve(&e.kv, &hog, 16) == ERR_OK);  // leaves 4 blocks: 32 positions
    Sampler s;
    ASSERT(sampler_init(&s, e.m.cfg.vocab_size, sampler_default_params()) == ERR_OK);
    MtpGen g;
    ASSERT(mtp_gen_init(&g, &e.m, &e.kv, &e.mkv, &s, 3) == ERR_OK);
    Oracle o = {truth, 9 + N_GEN + 4, 1, false};
    g.draft_hook = oracle_draft;
    g.hook_user = &o;
    int n_out = 0, n_again = 0;
    ASSERT(mtp_gen_prefill(&g, prompt, 9, &out[n_out++]) == ERR_OK);
    while (n_out < N_GEN) {
        int got = 0;
        const Err err = mtp_gen_step(&g, out + n_out, &got);
        if (err == ERR_AGAIN) {
            n_again++;
            kv_seq_free(&e.kv, &hog);
            continue;
        }
        ASSERT(err == ERR_OK);
        n_out += got;
    }
    CHECK(n_again == 1);
    CHECK(memcmp(out, truth + 9, N_GEN * sizeof *out) == 0);
    mtp_gen_free(&g);
    sampler_free(&s);
    env_close(&e);
}

static void test_greedy(void)
{
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/tests/golden/models/mtp_theta", src_dir);
    greedy_case("mtp_theta", dir, 24);
    test_full_cache(dir);
    static const char *const presets[] = {"tiny", "default"};
    for (int i = 0; i < 2; i++) {
        snprintf(dir, sizeof dir, "%s/%s", tmp_root, presets[i]);
        const MkmodelOptions opt = {.out_dir = dir, .preset = presets[i], .seed = 11};
        ASSERT(mkdir(dir, 0755) == 0 && mkmodel_write(&opt) == ERR_OK);
        greedy_case(presets[i], dir, i == 0 ? 24 : 14);
    }
}

// ---------------------------------------------------------------------------
// The acceptance rule keeps the target distribution

static void test_accept_rule(void)
{
    enum { V = 6, K = 2, TRIALS = 60000 };
    const double p[(K + 1) * V] = {0.30, 0.05, 0.25, 0.10, 0.30, 0.00,   // target, position 0
                                   0.10, 0.40, 0.10, 0.20, 0.05, 0.15,   // position 1
                                   0.20, 0.20, 0.20, 0.20, 0.10, 0.10};  // position 2
    const double q[K * V] = {0.05, 0.50, 0.10, 0.15, 0.10, 0.10,         // draft distributions
                             0.30, 0.10, 0.30, 0.10, 0.10, 0.10};
    SamplerParams sp = sampler_default_params();
    sp.seed = 12345;
    Sampler s;
    ASSERT(sampler_init(&s, V, sp) == ERR_OK);
    long first[V] = {0}, second[V] = {0}, n_second = 0, accepted = 0;
    double resid[V];
    for (long t = 0; t < TRIALS; t++) {
        // Drafts drawn from q, as mtp_gen_step does.
        int d[K];
        for (int i = 0; i < K; i++) {
            const double u = sampler_uniform(&s);
            double c = 0.0;
            d[i] = V - 1;
            for (int j = 0; j < V; j++)
                if (u < (c += q[i * V + j])) {
                    d[i] = j;
                    break;
                }
        }
        int out[K + 1];
        const int n = mtp_accept(p, q, d, K, V, &s, resid, out);
        CHECK(n >= 1 && n <= K + 1);
        accepted += n - 1;
        first[out[0]]++;
        if (n >= 2) {  // d_1 kept: the next token must follow p_1
            second[out[1]]++;
            n_second++;
        }
    }
    int dof1, dof2;
    const double c1 = chi2(first, p, V, TRIALS, &dof1);
    const double c2 = chi2(second, p + V, V, n_second, &dof2);
    printf("acceptance rule: %ld of %d first drafts kept (expected sum min(p,q) = 0.40), %ld "
           "drafts in all; first token chi2 %.2f (dof %d, limit %.1f), second chi2 %.2f (dof %d, "
           "limit %.1f, "
           "%ld samples)\n",
           n_second, TRIALS, accepted, c1, dof1, chi2_crit(dof1), c2, dof2, chi2_crit(dof2),
           n_second);
    CHECK(c1 < chi2_crit(dof1) && c2 < chi2_crit(dof2));
    CHECK(first[5] == 0);  // p_0(5) = 0 is never emitted though q_0(5) > 0
    // The first draft is kept with probability sum_j min(p_0j, q_0j) = 0.40.
    CHECK(fabs((double) n_second / TRIALS - 0.40) < 0.01);
    // q == p: every draft kept.
    const int dd[K] = {2, 3};
    int out[K + 1];
    for (int t = 0; t < 100; t++)
        CHECK(mtp_accept(p, p, dd, K, V, &s, resid, out) == K + 1 && out[0] == 2 && out[1] == 3);
    sampler_free(&s);
}

// End to end on mkmodel tiny at temperature 1: the second generated token's distribution
// over many seeds against sum_y1 p(y1 | prompt) p(y2 | prompt, y1).
static void test_sampling_end_to_end(void)
{
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/tiny", tmp_root);  // written by test_greedy
    Env e;
    env_open(&e, dir, 64);
    const int V = e.m.cfg.vocab_size;
    const int prompt[5] = {11, 200, 37, 5, 99};
    double *marg = calloc((size_t) V, sizeof *marg);
    long *count = calloc((size_t) V, sizeof *count);
    ASSERT(marg && count);
    second_token_marginal(&e.m, &e.kv, prompt, 5, marg);
    enum { RUNS = 3000 };
    long drafted = 0, kept = 0;
    for (int r = 0; r < RUNS; r++) {
        SamplerParams sp = sampler_default_params();
        sp.temperature = 1.0f;
        sp.seed = 1000 + (uint64_t) r;
        Sampler s;
        ASSERT(sampler_init(&s, V, sp) == ERR_OK);
        MtpGen g;
        ASSERT(mtp_gen_init(&g, &e.m, &e.kv, &e.mkv, &s, 2) == ERR_OK);
        int first, out[MTP_MAX_DRAFTS + 1], n = 0;
        ASSERT(mtp_gen_prefill(&g, prompt, 5, &first) == ERR_OK);
        ASSERT(mtp_gen_step(&g, out, &n) == ERR_OK);
        count[out[0]]++;
        drafted += g.stats.drafted;
        kept += g.stats.accepted;
        mtp_gen_free(&g);
        sampler_free(&s);
    }
    int dof;
    const double c = chi2(count, marg, V, RUNS, &dof);
    printf("tiny, temperature 1, --mtp 2: second token over %d seeds: chi2 %.1f (dof %d, limit "
           "%.1f); drafts kept %ld/%ld\n",
           RUNS, c, dof, chi2_crit(dof), kept, drafted);
    CHECK(dof >= 5 && c < chi2_crit(dof));
    CHECK(kept > 0);  // the acceptance path ran
    free(marg);
    free(count);
    env_close(&e);
}

int main(void)
{
    if (!mtp_test_dirs(src_dir, sizeof src_dir, "tests/golden/mtp/mtp_theta.json", tmp_root,
                       sizeof tmp_root, "glmspark_mtp"))
        return 1;
    log_set_level(LOG_LEVEL_WARN);
    test_golden_logits();
    test_accept_rule();
    test_greedy();
    test_sampling_end_to_end();
    printf("%d rollback checks: main and MTP caches equal a fresh run's\n", n_rollback_checks);
    CHECK(n_rollback_checks > 20);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp_root);
    return check_exit();
}
