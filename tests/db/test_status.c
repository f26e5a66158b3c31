/*
 * test_status.c - `glmspark status` and /metrics' engine internals against a real
 * PostgreSQL (run by with_pg.sh) with seeded engines rows carrying status JSON
 * (engine/shared/stats.h).
 *
 * Status: no engine (down, exit 1), a ready three-rank engine (up, exit 0; every printed
 * figure checked: ranks, hosts, layers, GiB, load %, KV use, jobs, tokens/s, step time,
 * batch), --json (parsed back), a down rank (degraded), loading, a stale heartbeat (stale;
 * up again with --stale-s), a stopped boot (down), unreadable stats, and usage/database
 * errors (exit 2), the settings file as the conninfo's source.
 * /health: its verdict (api_metrics_health) in each of those states, and over several engines
 * and models (test_health_models).
 * Metrics: api_metrics_render's text passes an exposition-format check (expo_check below:
 * names, labels and escapes, HELP/TYPE once and before the samples, groups contiguous, no
 * duplicate series, counters named _total and >= 0, _total on nothing else, histogram
 * buckets cumulative with +Inf = _count), with and without an engine, and its engine
 * samples equal the seeded stats. (promtool check metrics agrees on this text; it is not a
 * CI dependency.)
 */
#include <json-c/json.h>
#include <libpq-fe.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/cli/cli.h"
#include "engine/shared/stats.h"
#include "fcgi/api_metrics.h"
#include "tests/capture.h"
#include "tests/check.h"
#include "tests/db/api_key_util.h"

static PGconn *conn;
static const char *conninfo;

// Run `glmspark status ARGS...` (NULL-terminated); its stdout into out[n]; its exit status.
static int run_status(char *out, size_t n, ...)
{
    char *argv[16] = {"status"};
    int argc = 1;
    va_list ap;
    va_start(ap, n);
    for (char *a; argc < 15 && (a = va_arg(ap, char *));) argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    Capture cap;
    capture_begin(&cap, STDOUT_FILENO);
    const int rc = cli_status(argc, argv);
    capture_end(&cap, out, n);
    return rc;
}

static bool has(const char *text, const char *needle)
{
    if (strstr(text, needle)) return true;
    fprintf(stderr, "missing \"%s\" in:\n%s\n", needle, text);
    return false;
}

// ---------------------------------------------------------------------------
// Prometheus text format 0.0.4 checker

typedef struct Family {
    char name[128];
    char type[16];
    bool has_help, has_samples, is_closed;
} Family;

typedef struct Expo {
    Family fams[128];
    int n_fams;
    char series[512][336];
    int n_series;
    int problems;
    const char *current;  // family of the previous sample
    // histogram state of the current family
    double last_bucket, inf_bucket, count;
    bool has_inf, has_count;
} Expo;

static void problem(Expo *e, int line, const char *what, const char *text)
{
    fprintf(stderr, "exposition line %d: %s: %.120s\n", line, what, text);
    e->problems++;
}

static bool is_name(const char *s, size_t n, bool colon)
{
    if (n == 0) return false;
    for (size_t i = 0; i < n; i++) {
        const char c = s[i];
        const bool ok = c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (colon && c == ':') ||
                        (i > 0 && c >= '0' && c <= '9');
        if (!ok) return false;
    }
    return true;
}

static Family *find_family(Expo *e, const char *name)
{
    for (int i = 0; i < e->n_fams; i++)
        if (!strcmp(e->fams[i].name, name)) return &e->fams[i];
    return NULL;
}

static Family *add_family(Expo *e, const char *name)
{
    Family *f = find_family(e, name);
    if (f || e->n_fams == 128) return f;
    f = &e->fams[e->n_fams++];
    memset(f, 0, sizeof *f);
    snprintf(f->name, sizeof f->name, "%s", name);
    return f;
}

static bool parse_value(const char *s, double *v)
{
    if (!strcmp(s, "+Inf")) *v = INFINITY;
    else if (!strcmp(s, "-Inf")) *v = -INFINITY;
    else if (!strcmp(s, "NaN")) *v = NAN;
    else {
        char *end = NULL;
        *v = strtod(s, &end);
        return *s && !*end && strcmp(s, "inf") && strcmp(s, "nan");
    }
    return true;
}

// Close the histogram checks of the family that just ended.
static void end_family(Expo *e, int line)
{
    Family *f = e->current ? find_family(e, e->current) : NULL;
    if (f && !strcmp(f->type, "histogram") && f->has_samples) {
        if (!e->has_inf) problem(e, line, "histogram without a +Inf bucket", f->name);
        if (!e->has_count || e->count != e->inf_bucket) problem(e, line, "histogram +Inf bucket != _count", f->name);
    }
    if (f) f->is_closed = true;
    e->last_bucket = -1;
    e->has_inf = e->has_count = false;
}

static void check_sample(Expo *e, int line, const char *text)
{
    const size_t n_name = strcspn(text, "{ ");
    char name[128], family_name[128], le[32] = "", labels[200] = "";
    if (!is_name(text, n_name, true) || n_name >= sizeof name) {
        problem(e, line, "bad metric name", text);
        return;
    }
    snprintf(name, sizeof name, "%.*s", (int) n_name, text);
    const char *p = text + n_name;
    char seen_labels[8][64];
    int n_labels = 0;
    if (*p == '{') {
        const char *start = p;
        p++;
        while (*p && *p != '}') {
            const size_t n_l = strcspn(p, "=");
            if (!is_name(p, n_l, false) || p[n_l] != '=' || p[n_l + 1] != '"') {
                problem(e, line, "bad label", text);
                return;
            }
            char lname[64];
            snprintf(lname, sizeof lname, "%.*s", (int) n_l, p);
            for (int i = 0; i < n_labels; i++)
                if (!strcmp(seen_labels[i], lname)) problem(e, line, "repeated label", text);
            if (n_labels < 8) snprintf(seen_labels[n_labels++], 64, "%s", lname);
            p += n_l + 2;
            char value[128];
            size_t n_v = 0;
            for (; *p && *p != '"'; p++) {
                if (*p == '\\') {
                    p++;
                    if (*p != '\\' && *p != '"' && *p != 'n') {
                        problem(e, line, "bad escape in a label value", text);
                        return;
                    }
                }
                if (*p == '\n') problem(e, line, "raw newline in a label value", text);
                if (n_v + 1 < sizeof value) value[n_v++] = *p;
            }
            value[n_v] = '\0';
            if (*p != '"') {
                problem(e, line, "unterminated label value", text);
                return;
            }
            if (!strcmp(lname, "le")) snprintf(le, sizeof le, "%.31s", value);
            p++;
            if (*p == ',') p++;
            else if (*p != '}') {
                problem(e, line, "expected , or } after a label", text);
                return;
            }
        }
        if (*p != '}') {
            problem(e, line, "unterminated label set", text);
            return;
        }
        p++;
        snprintf(labels, sizeof labels, "%.*s", (int) (p - start), start);
    }
    if (*p != ' ') {
        problem(e, line, "no space before the value", text);
        return;
    }
    p++;
    char value_text[64];
    snprintf(value_text, sizeof value_text, "%.*s", (int) strcspn(p, " "), p);
    double v;
    if (!parse_value(value_text, &v)) problem(e, line, "bad value", text);
    if (p[strlen(value_text)] == ' ') {  // a timestamp
        char *end = NULL;
        strtoll(p + strlen(value_text) + 1, &end, 10);
        if (*end) problem(e, line, "bad timestamp", text);
    }

    // The family: the name itself, or a histogram's stem.
    snprintf(family_name, sizeof family_name, "%s", name);
    Family *f = find_family(e, name);
    const char *suffix = "";
    if (!f || !f->type[0]) {
        static const char *const suffixes[] = {"_bucket", "_sum", "_count"};
        for (int i = 0; i < 3; i++) {
            const size_t n_s = strlen(suffixes[i]);
            if (n_name > n_s && !strcmp(name + n_name - n_s, suffixes[i])) {
                snprintf(family_name, sizeof family_name, "%.*s", (int) (n_name - n_s), name);
                Family *stem = find_family(e, family_name);
                if (stem && !strcmp(stem->type, "histogram")) {
                    f = stem;
                    suffix = suffixes[i];
                }
            }
        }
    }
    if (!f || !f->type[0]) {
        problem(e, line, "sample without a TYPE line", text);
        return;
    }
    if (!f->has_help) problem(e, line, "sample without a HELP line", text);
    if (!e->current || strcmp(e->current, f->name) != 0) {
        end_family(e, line);
        if (f->is_closed) problem(e, line, "samples of one family are not contiguous", text);
        e->current = f->name;
    }
    f->has_samples = true;
    char key[336];
    snprintf(key, sizeof key, "%s%s", name, labels);
    for (int i = 0; i < e->n_series; i++)
        if (!strcmp(e->series[i], key)) problem(e, line, "duplicate series", text);
    if (e->n_series < 512) snprintf(e->series[e->n_series++], sizeof e->series[0], "%s", key);
    if (!strcmp(f->type, "counter")) {
        const size_t n = strlen(name);
        if (n < 6 || strcmp(name + n - 6, "_total")) problem(e, line, "counter not named *_total", text);
        if (!(v >= 0)) problem(e, line, "negative counter", text);
    } else if (strlen(name) > 6 && !strcmp(name + strlen(name) - 6, "_total")) {
        problem(e, line, "a non-counter named *_total", text);  // as promtool check metrics
    }
    if (!strcmp(f->type, "histogram")) {
        if (!strcmp(suffix, "_bucket")) {
            double bound;
            if (!le[0] || !parse_value(le, &bound)) problem(e, line, "bucket without a valid le", text);
            if (v < e->last_bucket) problem(e, line, "histogram buckets not cumulative", text);
            e->last_bucket = v;
            if (!strcmp(le, "+Inf")) {
                e->has_inf = true;
                e->inf_bucket = v;
            }
        } else if (!strcmp(suffix, "_count")) {
            e->has_count = true;
            e->count = v;
        } else if (!suffix[0]) {
            problem(e, line, "a histogram sample without _bucket/_sum/_count", text);
        }
    } else if (le[0]) {
        problem(e, line, "le label outside a histogram", text);
    }
}

// Number of problems found in text (each printed).
static int expo_check(const char *text)
{
    static Expo e;
    memset(&e, 0, sizeof e);
    e.last_bucket = -1;
    int line = 0;
    const size_t len = strlen(text);
    if (len == 0 || text[len - 1] != '\n') problem(&e, 0, "the text does not end with a newline", "");
    for (const char *p = text; *p;) {
        const size_t n = strcspn(p, "\n");
        char l[512];
        snprintf(l, sizeof l, "%.*s", (int) n, p);
        line++;
        p += n + (p[n] == '\n');
        if (!l[0]) {
            problem(&e, line, "empty line", l);
        } else if (!strncmp(l, "# HELP ", 7) || !strncmp(l, "# TYPE ", 7)) {
            const bool is_type = l[2] == 'T';
            const char *name = l + 7;
            const size_t n_name = strcspn(name, " ");
            char fname[128];
            if (!is_name(name, n_name, true) || name[n_name] != ' ' || n_name >= sizeof fname) {
                problem(&e, line, "bad HELP/TYPE line", l);
                continue;
            }
            snprintf(fname, sizeof fname, "%.*s", (int) n_name, name);
            Family *f = add_family(&e, fname);
            if (!f) continue;
            if (f->has_samples) problem(&e, line, "HELP/TYPE after the family's samples", l);
            if (is_type) {
                const char *type = name + n_name + 1;
                if (f->type[0]) problem(&e, line, "second TYPE line", l);
                if (strcmp(type, "counter") && strcmp(type, "gauge") && strcmp(type, "histogram") &&
                    strcmp(type, "summary") && strcmp(type, "untyped"))
                    problem(&e, line, "unknown type", l);
                snprintf(f->type, sizeof f->type, "%s", type);
            } else {
                if (f->has_help) problem(&e, line, "second HELP line", l);
                f->has_help = true;
            }
        } else if (l[0] == '#') {
            continue;  // a comment
        } else {
            check_sample(&e, line, l);
        }
    }
    end_family(&e, line);
    return e.problems;
}

// The value of the series "name{labels}" (exactly as printed), or NAN when absent.
static double series_value(const char *text, const char *series)
{
    const size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (!strncmp(p, series, n) && p[n] == ' ') return strtod(p + n + 1, NULL);
    }
    fprintf(stderr, "no series %s\n", series);
    return NAN;
}

// The checker itself: a valid text passes, each kind of mistake is caught.
static void test_checker(void)
{
    static const char good[] =
        "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"q\\\"\\\\\\n\"} 3\n"
        "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 3.5\nh_count 2\n"
        "# HELP g G.\n# TYPE g gauge\ng NaN\ng{a=\"1\"} -Inf 1700000000000\n";
    CHECK(expo_check(good) == 0);
    static const char *const bad[] = {
        "g 1\n",                                                            // no TYPE
        "# TYPE g gauge\ng 1\n",                                           // no HELP
        "# HELP g G.\n# TYPE g gauge\ng 1\ng 2\n",                       // duplicate series
        "# HELP g G.\n# TYPE g gauge\ng{a=\"\\x\"} 1\n",               // bad escape
        "# HELP g G.\n# TYPE g gauge\ng{a=1} 1\n",                         // unquoted label
        "# HELP g G.\n# TYPE g gauge\ng one\n",                            // bad value
        "# HELP g_total G.\n# TYPE g_total gauge\ng_total 1\n",            // _total gauge
        "# HELP c C.\n# TYPE c counter\nc 1\n",                            // counter without _total
        "# HELP c_total C.\n# TYPE c_total counter\nc_total -1\n",         // negative counter
        "# HELP g G.\n# TYPE g gauge\n# TYPE g gauge\ng 1\n",             // second TYPE
        "# HELP g G.\n# TYPE g gauge\ng{a=\"1\"} 1\n# HELP f F.\n# TYPE f gauge\nf 1\ng{a=\"2\"} 1\n",
        "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n",
        "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_count 1\n",  // no +Inf
        "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 1\n",  // +Inf != count
        "# HELP g G.\n# TYPE g gauge\ng 1",                                // no final newline
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        fprintf(stderr, "(checker case %zu, a problem is expected:)\n", i);
        CHECK(expo_check(bad[i]) > 0);
    }
}

// ---------------------------------------------------------------------------

// A version-1 status object with three ranks, state and rank 2's state as given, for the
// engine boot named name.
static void seed_engine_named(const char *name, const char *state, const char *rank2_state,
                              double rank2_load)
{
    char text[4096], *esc;
    snprintf(text, sizeof text,
             "{\"version\":1,\"updated_unix\":1764520000.25,\"backend\":\"cpu\",\"model\":\"glm-test\","
             "\"world\":3,\"state\":\"%s\",\"ranks\":["
             "{\"rank\":0,\"host\":\"node1\",\"pid\":1234,\"state\":\"up\",\"first_layer\":0,"
             "\"last_layer\":26,\"weight_bytes\":90000000000,\"load_fraction\":1.0},"
             "{\"rank\":1,\"host\":\"node\\\"2\",\"pid\":1300,\"state\":\"up\",\"first_layer\":26,"
             "\"last_layer\":53,\"weight_bytes\":96963468083,\"load_fraction\":1.0},"
             "{\"rank\":2,\"host\":\"node3\",\"pid\":1400,\"state\":\"%s\",\"first_layer\":53,"
             "\"last_layer\":79,\"weight_bytes\":98905300582,\"load_fraction\":%g}],"
             "\"kv_blocks_total\":1024,\"kv_blocks_used\":17,\"kv_block_size\":128,"
             "\"max_num_seqs\":16,\"running\":3,\"waiting\":1,\"inflight_microbatches\":2,"
             "\"steps_total\":12345,\"step_ms_avg\":41.5,\"step_ms_max\":80.1,\"commit_ms_avg\":2.25,"
             "\"decode_steps_total\":12000,\"decode_step_ms_total\":480000.5,\"decode_commit_ms_total\":24000.25,"
             "\"batch_seqs_avg\":3.2,\"batch_tokens_avg\":5.1,"
             "\"prompt_tokens_total\":1000,\"generated_tokens_total\":5000,"
             "\"tokens_per_s\":75.3,\"window_s\":10}",
             state, rank2_state, rank2_load);
    esc = PQescapeLiteral(conn, text, strlen(text));
    char q[8192];
    snprintf(q, sizeof q, "UPDATE engines SET stats = %s::jsonb, heartbeat_at = now() WHERE name = '%s'",
             esc, name);
    PQfreemem(esc);
    db_sql(conn, q);
}

static void seed_engine(const char *state, const char *rank2_state, double rank2_load)
{
    seed_engine_named("obs-test", state, rank2_state, rank2_load);
}

// GET /health's verdict now: status, and ranks_up/world when the engine publishes stats.
static void check_health(const char *want, int ranks_up, int world)
{
    ApiDb db;
    ApiHealth h;
    CHECK(api_db_init(&db, conninfo) == ERR_OK);
    CHECK(api_metrics_health(&db, NULL, &h) == ERR_OK);
    CHECK(!strcmp(h.status, want));
    if (strcmp(h.status, want)) fprintf(stderr, "  /health says %s, want %s\n", h.status, want);
    if (ranks_up >= 0) CHECK(h.has_stats && h.ranks_up == ranks_up && h.world == world);
    api_db_free(&db);
}

// Several engines: one ready engine makes the answer ok whatever the newer ones do (a second
// engine loading, a restart); per model, the best of its engines; ?model= asks for one.
static void test_health_models(void)
{
    db_sql(conn, "UPDATE engines SET stopped_at = now() WHERE stopped_at IS NULL");
    db_sql(conn, "INSERT INTO engines (name, model, pid) VALUES ('h-a1', 'm-a', 11), ('h-a2', 'm-a', 12),"
                 " ('h-b', 'm-b', 13)");  // ids in this order: h-b is the newest boot
    seed_engine_named("h-a1", "ready", "up", 1.0);
    seed_engine_named("h-a2", "loading", "loading", 0.5);
    seed_engine_named("h-b", "loading", "loading", 0.25);
    ApiDb db;
    ApiHealth h;
    CHECK(api_db_init(&db, conninfo) == ERR_OK);
    CHECK(api_metrics_health(&db, NULL, &h) == ERR_OK);
    CHECK(!strcmp(h.status, "ok") && h.n_engines == 3 && h.has_stats && h.ranks_up == 3);
    CHECK(h.n_models == 2);
    for (int i = 0; i < h.n_models; i++) {
        const bool is_a = !strcmp(h.models[i].name, "m-a");
        CHECK(is_a || !strcmp(h.models[i].name, "m-b"));
        CHECK(!strcmp(h.models[i].status, is_a ? "ok" : "loading"));
        CHECK(h.models[i].n_engines == (is_a ? 2 : 1));
    }
    CHECK(api_metrics_health(&db, "m-a", &h) == ERR_OK);
    CHECK(!strcmp(h.status, "ok") && h.n_engines == 2);
    CHECK(api_metrics_health(&db, "m-b", &h) == ERR_OK);
    CHECK(!strcmp(h.status, "loading") && h.n_engines == 1 && h.ranks_up == 2 && h.world == 3);
    CHECK(api_metrics_health(&db, "m-c", &h) == ERR_OK);
    CHECK(!strcmp(h.status, "unavailable") && h.n_engines == 0 && h.n_models == 2);
    // The ready engine stops: m-a is as good as its other engine, degraded beats loading.
    db_sql(conn, "UPDATE engines SET stopped_at = now() WHERE name = 'h-a1'");
    seed_engine_named("h-b", "ready", "down", 1.0);
    CHECK(api_metrics_health(&db, NULL, &h) == ERR_OK);
    CHECK(!strcmp(h.status, "degraded") && h.n_engines == 2);
    CHECK(api_metrics_health(&db, "m-a", &h) == ERR_OK);
    CHECK(!strcmp(h.status, "loading"));
    db_sql(conn, "UPDATE engines SET stopped_at = now() WHERE stopped_at IS NULL");
    api_db_free(&db);
}

static void test_no_engine(void)
{
    char out[8192];
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 1);
    CHECK(has(out, "engine: down: no engine is running"));
    CHECK(has(out, "jobs: 2 queued, 1 running"));
    CHECK(has(out, "live engines: 0\nmodels: 1\n"));
    CHECK(has(out, "  glm-test                     0        2        1        0.0\n"));
    check_health("unavailable", -1, 0);
    char *text = NULL;
    size_t n = 0;
    ApiDb db;
    CHECK(api_db_init(&db, conninfo) == ERR_OK);
    CHECK(api_metrics_render(&db, &text, &n) == ERR_OK);
    CHECK(text && n == strlen(text));
    if (text) {
        CHECK(expo_check(text) == 0);
        CHECK(series_value(text, "glmspark_queue_depth") == 2);
        CHECK(series_value(text, "glmspark_jobs_running") == 1);
        CHECK(series_value(text, "glmspark_engine_up") == 0);
        CHECK(series_value(text, "glmspark_model_queue_depth{model=\"glm-test\"}") == 2);
        CHECK(series_value(text, "glmspark_model_jobs_running{model=\"glm-test\"}") == 1);
        CHECK(series_value(text, "glmspark_model_engines_up{model=\"glm-test\"}") == 0);
        CHECK(strstr(text, "\nglmspark_engine_kv_blocks_used{") == NULL);  // no engine, no sample
        CHECK(strstr(text, "# TYPE glmspark_engine_kv_blocks_used gauge\n") != NULL);
    }
    free(text);
    api_db_free(&db);
}

static void test_ready(void)
{
    char out[8192];
    db_sql(conn, "INSERT INTO engines (name, model, pid) VALUES ('obs-test', 'glm-test', 1234)");
    seed_engine("ready", "up", 1.0);
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 0);
    check_health("ok", 3, 3);
    CHECK(has(out, "engine: up\n"));
    CHECK(has(out, "\"obs-test\", pid 1234, model \"glm-test\", heartbeat 0."));
    CHECK(has(out, "backend cpu, state ready, world 3, 3 of 3 ranks up"));
    // 90000000000 / 2^30 = 83.82; 96963468083 / 2^30 = 90.30; 98905300582 / 2^30 = 92.11.
    CHECK(has(out, "0     node1                1234     up       0-25      83.8 GiB    100%"));
    CHECK(has(out, "1     node\"2               1300     up       26-52     90.3 GiB    100%"));
    CHECK(has(out, "2     node3                1400     up       53-78     92.1 GiB    100%"));
    CHECK(has(out, "kv cache: 17 of 1024 blocks used (1.7%), 128 tokens per block"));
    CHECK(has(out, "jobs: 2 queued, 1 running; scheduler: 3 running, 1 waiting (max 16), 2 microbatches"));
    CHECK(has(out, "throughput: 75.3 tokens/s over the last 10 s; step 41.5 ms avg, 80.1 ms max, "
                   "commit 2.2 ms avg; batch 3.2 sequences, 5.1 tokens"));
    CHECK(has(out, "totals: 12345 steps, 1000 prompt tokens, 5000 generated tokens"));
    CHECK(has(out, "live engines: 1\n"));
    CHECK(has(out, "obs-test             glm-test                     1234"));
    CHECK(has(out, "  glm-test                     1        2        1        75.3\n"));
    // The admin role reads the same through its views.
    char admin[600], same[8192];
    snprintf(admin, sizeof admin, "%s user=glmspark_admin", conninfo);
    CHECK(run_status(same, sizeof same, "--db", admin, NULL) == 0);
    CHECK(has(same, "jobs: 2 queued, 1 running; scheduler: 3 running"));
    CHECK(has(same, "2     node3                1400     up       53-78     92.1 GiB    100%"));

    CHECK(run_status(out, sizeof out, "--json", "--db", conninfo, NULL) == 0);
    json_object *o = json_tokener_parse(out), *v = NULL, *stats = NULL, *e = NULL;
    CHECK(o != NULL);
    CHECK(json_object_object_get_ex(o, "status", &v) && !strcmp(json_object_get_string(v), "up"));
    CHECK(json_object_object_get_ex(o, "ranks_up", &v) && json_object_get_int(v) == 3);
    CHECK(json_object_object_get_ex(o, "kv_used_percent", &v) && fabs(json_object_get_double(v) - 1.66015625) < 1e-9);
    CHECK(json_object_object_get_ex(o, "engine", &e) && json_object_object_get_ex(e, "pid", &v) &&
          json_object_get_int(v) == 1234);
    CHECK(json_object_object_get_ex(o, "jobs", &e) && json_object_object_get_ex(e, "queued", &v) &&
          json_object_get_int(v) == 2);
    CHECK(json_object_object_get_ex(o, "stats", &stats) && json_object_object_get_ex(stats, "kv_blocks_used", &v) &&
          json_object_get_int(v) == 17);
    json_object *arr = NULL;
    CHECK(json_object_object_get_ex(o, "engines", &arr) && json_object_array_length(arr) == 1
          && json_object_object_get_ex(json_object_array_get_idx(arr, 0), "model", &v)
          && !strcmp(json_object_get_string(v), "glm-test"));
    CHECK(json_object_object_get_ex(o, "models", &arr) && json_object_array_length(arr) == 1
          && json_object_object_get_ex(json_object_array_get_idx(arr, 0), "queued", &v)
          && json_object_get_int(v) == 2);
    json_object_put(o);

    // /metrics.
    char *text = NULL;
    size_t n = 0;
    ApiDb db;
    CHECK(api_db_init(&db, conninfo) == ERR_OK);
    CHECK(api_metrics_render(&db, &text, &n) == ERR_OK);
    if (text) {
        CHECK(expo_check(text) == 0);
        CHECK(series_value(text, "glmspark_engine_up") == 1);
        CHECK_NEAR(series_value(text, "glmspark_engine_step_seconds{engine=\"obs-test\",model=\"glm-test\",stat=\"avg\"}"), 0.0415, 1e-12);
        CHECK_NEAR(series_value(text, "glmspark_engine_step_seconds{engine=\"obs-test\",model=\"glm-test\",stat=\"max\"}"), 0.0801, 1e-12);
        CHECK_NEAR(series_value(text, "glmspark_engine_commit_seconds{engine=\"obs-test\",model=\"glm-test\"}"), 0.00225, 1e-12);
        CHECK_NEAR(series_value(text, "glmspark_engine_decode_steps_total{engine=\"obs-test\",model=\"glm-test\"}"), 12000, 1e-9);
        CHECK_NEAR(series_value(text, "glmspark_engine_decode_step_seconds_total{engine=\"obs-test\",model=\"glm-test\"}"), 480.0005, 1e-9);
        CHECK_NEAR(series_value(text, "glmspark_engine_decode_commit_seconds_total{engine=\"obs-test\",model=\"glm-test\"}"), 24.00025, 1e-9);
        CHECK_NEAR(series_value(text, "glmspark_engine_batch_sequences{engine=\"obs-test\",model=\"glm-test\"}"), 3.2, 1e-12);
        CHECK_NEAR(series_value(text, "glmspark_engine_batch_tokens{engine=\"obs-test\",model=\"glm-test\"}"), 5.1, 1e-12);
        CHECK(series_value(text, "glmspark_engine_kv_blocks_used{engine=\"obs-test\",model=\"glm-test\"}") == 17);
        CHECK(series_value(text, "glmspark_engine_kv_blocks_capacity{engine=\"obs-test\",model=\"glm-test\"}") == 1024);
        CHECK_NEAR(series_value(text, "glmspark_engine_kv_usage_ratio{engine=\"obs-test\",model=\"glm-test\"}"), 17.0 / 1024, 1e-12);
        CHECK(series_value(text, "glmspark_engine_running_sequences{engine=\"obs-test\",model=\"glm-test\"}") == 3);
        CHECK(series_value(text, "glmspark_engine_waiting_sequences{engine=\"obs-test\",model=\"glm-test\"}") == 1);
        CHECK_NEAR(series_value(text, "glmspark_engine_tokens_per_second{engine=\"obs-test\",model=\"glm-test\"}"), 75.3, 1e-12);
        CHECK(series_value(text, "glmspark_engine_generated_tokens_total{engine=\"obs-test\",model=\"glm-test\"}") == 5000);
        CHECK(series_value(text, "glmspark_engine_prompt_tokens_total{engine=\"obs-test\",model=\"glm-test\"}") == 1000);
        CHECK(series_value(text, "glmspark_engine_steps_total{engine=\"obs-test\",model=\"glm-test\"}") == 12345);
        CHECK(series_value(text, "glmspark_engine_rank_up{engine=\"obs-test\",model=\"glm-test\",rank=\"0\",host=\"node1\"}") == 1);
        CHECK(series_value(text, "glmspark_engine_rank_up{engine=\"obs-test\",model=\"glm-test\",rank=\"1\",host=\"node\\\"2\"}") == 1);  // escaped
        CHECK(series_value(text, "glmspark_engine_rank_up{engine=\"obs-test\",model=\"glm-test\",rank=\"2\",host=\"node3\"}") == 1);
        CHECK(series_value(text, "glmspark_engine_rank_weight_bytes{engine=\"obs-test\",model=\"glm-test\",rank=\"1\",host=\"node\\\"2\"}") == 96963468083.0);
        CHECK(series_value(text, "glmspark_engine_info{engine=\"obs-test\",backend=\"cpu\",model=\"glm-test\",state=\"ready\",world=\"3\"}") == 1);
        CHECK(series_value(text, "glmspark_engine_heartbeat_age_seconds{engine=\"obs-test\",model=\"glm-test\"}") < STATS_STALE_S);
        CHECK(series_value(text, "glmspark_queue_depth") == 2);
        CHECK(series_value(text, "glmspark_model_engines_up{model=\"glm-test\"}") == 1);
        CHECK_NEAR(series_value(text, "glmspark_model_tokens_per_second{model=\"glm-test\"}"), 75.3, 1e-12);
        CHECK(series_value(text, "glmspark_model_prompt_tokens_total{model=\"glm-test\"}") == 6);
    }
    free(text);
    // A second engine (another model): its own series beside the first's, and per model.
    db_sql(conn, "INSERT INTO engines (name, model, pid, stats) SELECT 'obs-two', 'glm-b', 4321, stats"
                 " FROM engines WHERE name = 'obs-test'");
    CHECK(api_metrics_render(&db, &text, &n) == ERR_OK);
    if (text) {
        CHECK(expo_check(text) == 0);
        CHECK_NEAR(series_value(text, "glmspark_engine_tokens_per_second{engine=\"obs-two\",model=\"glm-b\"}"), 75.3, 1e-12);
        CHECK_NEAR(series_value(text, "glmspark_engine_tokens_per_second{engine=\"obs-test\",model=\"glm-test\"}"), 75.3, 1e-12);
        CHECK(series_value(text, "glmspark_model_engines_up{model=\"glm-b\"}") == 1);
    }
    free(text);
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 0);
    CHECK(has(out, "live engines: 2\n"));
    db_sql(conn, "UPDATE engines SET stopped_at = now() WHERE name = 'obs-two'");

    // A rank down: degraded, and /metrics says which.
    seed_engine("ready", "down", 1.0);
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 1);
    CHECK(has(out, "engine: degraded: rank 2 on node3 is down"));
    check_health("degraded", 2, 3);
    CHECK(api_metrics_render(&db, &text, &n) == ERR_OK);
    if (text) {
        CHECK(expo_check(text) == 0);
        CHECK(series_value(text, "glmspark_engine_rank_up{engine=\"obs-test\",model=\"glm-test\",rank=\"2\",host=\"node3\"}") == 0);
        CHECK(series_value(text, "glmspark_engine_rank_up{engine=\"obs-test\",model=\"glm-test\",rank=\"0\",host=\"node1\"}") == 1);
    }
    free(text);
    api_db_free(&db);

    // Loading: rank 2 at 25 %.
    seed_engine("loading", "loading", 0.25);
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 1);
    CHECK(has(out, "engine: loading: 2 of 3 ranks up"));
    CHECK(has(out, "2     node3                1400     loading  53-78     92.1 GiB    25%"));
    CHECK(run_status(out, sizeof out, "--json", "--db", conninfo, NULL) == 1);
    CHECK(has(out, "\"status\":\"loading\""));
    check_health("loading", 2, 3);

    // Stopping.
    seed_engine("stopping", "up", 1.0);
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 1);
    CHECK(has(out, "engine: degraded: the engine is stopping"));
    check_health("stopping", 3, 3);

    // A stale heartbeat (5 minutes): stale, exit 1; a limit of 10 minutes: up again.
    seed_engine("ready", "up", 1.0);
    db_sql(conn, "UPDATE engines SET heartbeat_at = now() - interval '5 minutes' WHERE name = 'obs-test'");
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 1);
    CHECK(has(out, "engine: stale: last heartbeat 300 s ago (more than 30 s)"));
    check_health("unavailable", -1, 0);
    CHECK(run_status(out, sizeof out, "--db", conninfo, "--stale-s", "600", NULL) == 0);
    CHECK(has(out, "engine: up\n"));
    CHECK(api_db_init(&db, conninfo) == ERR_OK);
    CHECK(api_metrics_render(&db, &text, &n) == ERR_OK);
    if (text) {
        CHECK(expo_check(text) == 0);
        CHECK(series_value(text, "glmspark_engine_up") == 0);
        CHECK_NEAR(series_value(text, "glmspark_engine_heartbeat_age_seconds{engine=\"obs-test\",model=\"glm-test\"}"), 300, 5);
    }
    free(text);
    api_db_free(&db);

    // Unreadable stats: exit 1 with the key named.
    db_sql(conn, "UPDATE engines SET heartbeat_at = now(), stats = '{\"kv_blocks_used\":\"many\"}' WHERE name = 'obs-test'");
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 1);
    check_health("ok", -1, 0);  // /health does not judge what it cannot read: the heartbeat is fresh
    // No stats at all (an engine older than the status JSON): the heartbeat decides.
    db_sql(conn, "UPDATE engines SET stats = NULL WHERE name = 'obs-test'");
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 0);
    CHECK(has(out, "no stats published"));
    check_health("ok", -1, 0);

    // The boot stopped: down.
    db_sql(conn, "UPDATE engines SET stopped_at = now() WHERE name = 'obs-test'");
    CHECK(run_status(out, sizeof out, "--db", conninfo, NULL) == 1);
    CHECK(has(out, "engine: down"));
}

static void test_usage(void)
{
    char out[4096], path[] = "/tmp/obs-status-env.XXXXXX";
    CHECK(run_status(out, sizeof out, "--bogus", NULL) == 2);
    CHECK(run_status(out, sizeof out, "--db", NULL) == 2);
    CHECK(run_status(out, sizeof out, "--stale-s", "-1", "--db", conninfo, NULL) == 2);
    CHECK(run_status(out, sizeof out, "--stale-s", "x", "--db", conninfo, NULL) == 2);
    CHECK(run_status(out, sizeof out, "--db", "host=/nonexistent-dir dbname=none connect_timeout=2", NULL) == 2);
    // Conninfo from the settings file when neither --db nor GLMSPARK_DB is given.
    const int fd = mkstemp(path);
    CHECK(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "# settings\nGLMSPARK_NODES=\"a b\"\nGLMSPARK_DB=\"%s\"\n", conninfo);
    fclose(f);
    char *saved = strdup(conninfo);
    unsetenv("GLMSPARK_DB");
    setenv("GLMSPARK_ENV", "/nonexistent/env", 1);
    CHECK(run_status(out, sizeof out, NULL) == 2);  // nowhere to find a database
    CHECK(run_status(out, sizeof out, "--env", path, NULL) == 1);  // found: the engine is down
    CHECK(has(out, "engine: down"));
    setenv("GLMSPARK_ENV", path, 1);
    CHECK(run_status(out, sizeof out, NULL) == 1);
    CHECK(run_status(out, sizeof out, "--env", "/nonexistent/env", NULL) == 2);
    setenv("GLMSPARK_DB", saved, 1);
    unsetenv("GLMSPARK_ENV");
    unlink(path);
    free(saved);
}

int main(void)
{
    if (!(conn = db_open_migrated("test_status", &conninfo))) return 1;
    PQsetNoticeProcessor(conn, NULL, NULL);
    db_sql(conn, "ALTER TABLE engines ADD COLUMN IF NOT EXISTS stats jsonb");  // sql/005 (no-op once it is there)
    db_sql(conn, "INSERT INTO api_keys (prefix, key_hash, name) VALUES ('gsk_obs00000001', sha256('o'), 'obs')");
    db_sql(conn, "INSERT INTO jobs (api_key_id, kind, model, request, prompt_ids, n_prompt_tokens, max_tokens)"
        " SELECT (SELECT id FROM api_keys WHERE prefix = 'gsk_obs00000001'), 'chat', 'glm-test', '{}', '{1,2}', 2, 8 FROM generate_series(1, 3)");
    db_sql(conn, "UPDATE jobs SET state = 'running', claimed_at = now() WHERE id = (SELECT max(id) FROM jobs)");
    test_checker();
    test_no_engine();
    test_ready();
    test_health_models();
    test_usage();
    PQfinish(conn);
    return check_exit();
}
