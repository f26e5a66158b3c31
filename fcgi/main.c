/*
 * main.c - glmspark-fcgi: the FastCGI application behind nginx.
 *
 *   glmspark-fcgi --socket PATH --db CONNINFO
 *                 --model DIR [--tokenizer FILE] [--model-name NAME] [--context N]
 *                 [--chat-template glm47|glm52]   (--model and its options, once per model)
 *                 [--threads N] [--max-queue N] [--max-body-mb N] [--socket-mode OCTAL]
 *                 [--socket-group NAME] [--stream-outage-s N]
 *
 * A pool of threads, each with its own FCGX_Request and PostgreSQL connection, accepts on
 * one Unix socket (nginx must use fastcgi_keep_conn off: with keep-alive a libfcgi thread
 * stays pinned to an idle connection). Without --socket the socket is fd 0, as systemd
 * socket activation and spawn-fcgi hand it over. The model directory gives the tokenizer
 * (tokenizer.json), the context length (config.json max_position_embeddings) and, by
 * default, the served model name (the directory's name). Several --model options accept
 * several models (each engine serves one; api_server.h): --tokenizer, --model-name, --context
 * and --chat-template apply to the --model before them. Several processes may serve one
 * nginx upstream (stateless: everything lives in PostgreSQL). The socket is created 0660 (or
 * --socket-mode, which may not let others write) and handed to --socket-group, the group
 * nginx's workers run in; authentication does not rest on it (api_server.h: every request
 * is verified from its key), it only keeps other local users off. SIGTERM/SIGINT stop
 * accepting and exit after in-flight requests had a moment to finish; a stream cut short
 * resumes from the job's committed output.
 */
#include <errno.h>
#include <fcgiapp.h>
#include <grp.h>
#include <json-c/json.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/shared/err.h"
#include "fcgi/api_db.h"
#include "fcgi/api_server.h"

static int listen_fd = 0;
static const char *conninfo;
static ApiConfig config;
static pthread_mutex_t accept_mutex = PTHREAD_MUTEX_INITIALIZER;
static volatile sig_atomic_t is_stopping;

static void *worker(void *arg)
{
    (void) arg;
    ApiDb db;
    FCGX_Request req;
    if (api_db_init(&db, conninfo)) return NULL;
    FCGX_InitRequest(&req, listen_fd, 0);
    for (;;) {
        pthread_mutex_lock(&accept_mutex);
        const int rc = is_stopping ? -1 : FCGX_Accept_r(&req);
        pthread_mutex_unlock(&accept_mutex);
        if (rc < 0) break;
        api_server_handle(&req, &db, &config);
        FCGX_Finish_r(&req);
    }
    api_db_free(&db);
    return NULL;
}

static int usage(void)
{
    fprintf(stderr, "usage: glmspark-fcgi [--socket PATH] --db CONNINFO\n"
                    "       --model DIR [--tokenizer FILE] [--model-name NAME] [--context N]\n"
                    "       [--chat-template glm47|glm52]   (once per model; options follow their --model)\n"
                    "       [--threads N] [--max-queue N] [--max-body-mb N] [--socket-mode OCTAL]\n"
                    "       [--socket-group NAME] [--stream-outage-s N]\n");
    return 2;
}

// max_position_embeddings from DIR/config.json; 0 when absent.
static int read_context(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_object *cfg = json_object_from_file(path), *v;
    int n = 0;
    if (!cfg) {
        LOG_ERROR("could not read \"%s\"", path);
        return 0;
    }
    if (json_object_object_get_ex(cfg, "max_position_embeddings", &v)) n = json_object_get_int(v);
    json_object_put(cfg);
    return n;
}

// One --model and the options that follow it.
typedef struct ModelArgs {
    const char *dir, *tok_path, *name, *tmpl;
    int context;
    char name_buf[256];
} ModelArgs;

// Fill in a model's defaults, load its tokenizer and describe it in *out. false after a
// message.
static bool load_model(ModelArgs *a, ApiModel *out)
{
    char tok_default[4096];
    if (strcmp(a->tmpl, "glm47") != 0 && strcmp(a->tmpl, "glm52") != 0) {
        fprintf(stderr, "glmspark-fcgi: --chat-template must be glm47 or glm52, not \"%s\"\n", a->tmpl);
        return false;
    }
    if (!a->tok_path) {
        snprintf(tok_default, sizeof tok_default, "%s/tokenizer.json", a->dir);
        a->tok_path = tok_default;
    }
    if (!a->name) {
        size_t n = strlen(a->dir);
        while (n > 1 && a->dir[n - 1] == '/') n--;
        size_t start = n;
        while (start > 0 && a->dir[start - 1] != '/') start--;
        snprintf(a->name_buf, sizeof a->name_buf, "%.*s", (int) (n - start), a->dir + start);
        a->name = a->name_buf;
    }
    if (!a->context) a->context = read_context(a->dir);
    if (a->context <= 0) {
        fprintf(stderr, "glmspark-fcgi: model \"%s\": no context length: config.json lacks "
                        "max_position_embeddings; pass --context N after its --model\n", a->name);
        return false;
    }
    Tokenizer *tok = NULL;
    if (tok_load(&tok, a->tok_path)) {
        fprintf(stderr, "glmspark-fcgi: could not load the tokenizer \"%s\"\n", a->tok_path);
        return false;
    }
    a->tok_path = NULL;  // tok_default goes out of scope
    *out = (ApiModel){
        .name = a->name,
        .tok = tok,
        .chat_template = strcmp(a->tmpl, "glm47") ? CHAT_TEMPLATE_GLM52 : CHAT_TEMPLATE_GLM47,
        .context_len = a->context,
    };
    return true;
}

int main(int argc, char **argv)
{
    const char *socket_path = NULL, *socket_group = NULL;
    int n_threads = 16, max_queue = 1000, max_body_mb = 32, socket_mode = 0660;
    int stream_outage_s = 300, n_models = 0;
    static ModelArgs margs[API_MAX_MODELS];
    static ApiModel models[API_MAX_MODELS];
    conninfo = getenv("GLMSPARK_DB");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) return usage();
        i++;
        ModelArgs *m = n_models ? &margs[n_models - 1] : NULL;
        const bool is_model_opt = !strcmp(a, "--tokenizer") || !strcmp(a, "--model-name")
                                  || !strcmp(a, "--context") || !strcmp(a, "--chat-template");
        if (is_model_opt && !m) {
            fprintf(stderr, "glmspark-fcgi: %s applies to the --model before it\n", a);
            return 2;
        }
        if (!strcmp(a, "--socket")) socket_path = v;
        else if (!strcmp(a, "--db")) conninfo = v;
        else if (!strcmp(a, "--model")) {
            if (n_models == API_MAX_MODELS) {
                fprintf(stderr, "glmspark-fcgi: at most %d models\n", API_MAX_MODELS);
                return 2;
            }
            margs[n_models++] = (ModelArgs){.dir = v, .tmpl = "glm52"};
        } else if (!strcmp(a, "--tokenizer")) m->tok_path = v;
        else if (!strcmp(a, "--model-name")) m->name = v;
        else if (!strcmp(a, "--threads")) n_threads = atoi(v);
        else if (!strcmp(a, "--max-queue")) max_queue = atoi(v);
        else if (!strcmp(a, "--context")) m->context = atoi(v);
        else if (!strcmp(a, "--chat-template")) m->tmpl = v;
        else if (!strcmp(a, "--max-body-mb")) max_body_mb = atoi(v);
        else if (!strcmp(a, "--socket-mode")) socket_mode = (int) strtol(v, NULL, 8);
        else if (!strcmp(a, "--socket-group")) socket_group = v;
        else if (!strcmp(a, "--stream-outage-s")) stream_outage_s = atoi(v);
        else return usage();
    }
    if (socket_mode <= 0 || socket_mode > 0777) {
        fprintf(stderr, "glmspark-fcgi: --socket-mode must be an octal mode such as 0660\n");
        return 2;
    }
    if (socket_mode & 0002) {
        fprintf(stderr, "glmspark-fcgi: --socket-mode %o would let any local user connect; "
                        "use 0660 and --socket-group\n", (unsigned) socket_mode);
        return 2;
    }
    if (stream_outage_s < 1) return usage();
    if (!conninfo || !n_models || n_threads < 1 || n_threads > 1024 || max_body_mb < 1) return usage();
    for (int i = 0; i < n_models; i++) {
        if (!load_model(&margs[i], &models[i])) return 1;
        for (int j = 0; j < i; j++)
            if (!strcmp(models[j].name, models[i].name)) {
                fprintf(stderr, "glmspark-fcgi: two models are named \"%s\" (--model-name)\n",
                        models[i].name);
                return 2;
            }
    }
    config = (ApiConfig){
        .models = models,
        .n_models = n_models,
        .max_queue = max_queue,
        .max_body_bytes = (size_t) max_body_mb << 20,
        .keepalive_s = 15,
        .poll_ms = 1000,
        .stream_outage_s = stream_outage_s,
    };
    if (getenv("GLMSPARK_SSE_KEEPALIVE_S")) config.keepalive_s = atoi(getenv("GLMSPARK_SSE_KEEPALIVE_S"));

    if (FCGX_Init() != 0) {
        fprintf(stderr, "glmspark-fcgi: FCGX_Init failed\n");
        return 1;
    }
    if (socket_path) {
        gid_t gid = (gid_t) -1;
        if (socket_group) {
            const struct group *g = getgrnam(socket_group);
            if (!g) {
                fprintf(stderr, "glmspark-fcgi: no such group \"%s\"\n", socket_group);
                return 1;
            }
            gid = g->gr_gid;
        }
        unlink(socket_path);
        // Created with no access for others from the start (no window before the chmod).
        const mode_t old_umask = umask(0077);
        listen_fd = FCGX_OpenSocket(socket_path, 256);
        umask(old_umask);
        if (listen_fd < 0) {
            fprintf(stderr, "glmspark-fcgi: could not listen on \"%s\"\n", socket_path);
            return 1;
        }
        if ((socket_group && chown(socket_path, (uid_t) -1, gid) != 0)
            || chmod(socket_path, (mode_t) socket_mode) != 0) {
            fprintf(stderr, "glmspark-fcgi: could not set the owner or mode of \"%s\": %s\n",
                    socket_path, strerror(errno));
            return 1;
        }
    }

    // Signals go to this thread only (sigwait below); workers never see them.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    if (api_db_watch_revocations(conninfo)) return 1;
    if (api_db_hub_start(conninfo)) return 1;  // one LISTEN job_chunks for every stream
    pthread_t *threads = calloc((size_t) n_threads, sizeof *threads);
    if (!threads) return 1;
    for (int i = 0; i < n_threads; i++) pthread_create(&threads[i], NULL, worker, NULL);
    for (int i = 0; i < n_models; i++)
        LOG_INFO("glmspark-fcgi: accepting model \"%s\" (context %d)", models[i].name,
                 models[i].context_len);
    LOG_INFO("glmspark-fcgi: %d threads on %s", n_threads, socket_path ? socket_path : "fd 0");

    int sig = 0;
    sigwait(&set, &sig);
    LOG_INFO("glmspark-fcgi: signal %d: stopping", sig);
    is_stopping = 1;
    FCGX_ShutdownPending();
    shutdown(listen_fd, SHUT_RDWR);
    if (socket_path) unlink(socket_path);
    // Give in-flight requests a moment; streams that are cut resume from the database.
    struct timespec ts = {1, 0};
    nanosleep(&ts, NULL);
    for (int i = 0; i < n_models; i++)
        tok_destroy((Tokenizer *) models[i].tok);
    return 0;
}
