/*
 * main.c - glmspark-fcgi: the FastCGI application behind nginx.
 *
 *   glmspark-fcgi --socket PATH --db CONNINFO --model DIR [--tokenizer FILE]
 *                 [--model-name NAME] [--threads N] [--max-queue N] [--context N]
 *                 [--chat-template glm47|glm52] [--max-body-mb N] [--socket-mode OCTAL]
 *                 [--socket-group NAME] [--stream-outage-s N]
 *
 * A pool of threads, each with its own FCGX_Request and PostgreSQL connection, accepts on
 * one Unix socket (nginx must use fastcgi_keep_conn off: with keep-alive a libfcgi thread
 * stays pinned to an idle connection). Without --socket the socket is fd 0, as systemd
 * socket activation and spawn-fcgi hand it over. The model directory gives the tokenizer
 * (tokenizer.json), the context length (config.json max_position_embeddings) and, by
 * default, the served model name (the directory's name). The socket is created 0660 (or
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
    fprintf(stderr, "usage: glmspark-fcgi [--socket PATH] --db CONNINFO --model DIR [--tokenizer FILE]\n"
                    "       [--model-name NAME] [--threads N] [--max-queue N] [--context N]\n"
                    "       [--chat-template glm47|glm52] [--max-body-mb N] [--socket-mode OCTAL]\n"
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

int main(int argc, char **argv)
{
    const char *socket_path = NULL, *model_dir = NULL, *tok_path = NULL, *model_name = NULL;
    const char *tmpl = "glm52", *socket_group = NULL;
    int n_threads = 16, max_queue = 1000, context = 0, max_body_mb = 32, socket_mode = 0660;
    int stream_outage_s = 300;
    conninfo = getenv("GLMSPARK_DB");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) return usage();
        i++;
        if (!strcmp(a, "--socket")) socket_path = v;
        else if (!strcmp(a, "--db")) conninfo = v;
        else if (!strcmp(a, "--model")) model_dir = v;
        else if (!strcmp(a, "--tokenizer")) tok_path = v;
        else if (!strcmp(a, "--model-name")) model_name = v;
        else if (!strcmp(a, "--threads")) n_threads = atoi(v);
        else if (!strcmp(a, "--max-queue")) max_queue = atoi(v);
        else if (!strcmp(a, "--context")) context = atoi(v);
        else if (!strcmp(a, "--chat-template")) tmpl = v;
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
    if (!conninfo || !model_dir || n_threads < 1 || n_threads > 1024 || max_body_mb < 1) return usage();
    if (strcmp(tmpl, "glm47") != 0 && strcmp(tmpl, "glm52") != 0) return usage();

    char tok_default[4096], name_buf[256];
    if (!tok_path) {
        snprintf(tok_default, sizeof tok_default, "%s/tokenizer.json", model_dir);
        tok_path = tok_default;
    }
    if (!model_name) {
        size_t n = strlen(model_dir);
        while (n > 1 && model_dir[n - 1] == '/') n--;
        size_t start = n;
        while (start > 0 && model_dir[start - 1] != '/') start--;
        snprintf(name_buf, sizeof name_buf, "%.*s", (int) (n - start), model_dir + start);
        model_name = name_buf;
    }
    if (!context) context = read_context(model_dir);
    if (context <= 0) {
        fprintf(stderr, "glmspark-fcgi: no context length: config.json lacks max_position_embeddings; "
                        "pass --context N\n");
        return 1;
    }
    Tokenizer *tok = NULL;
    if (tok_load(&tok, tok_path)) {
        fprintf(stderr, "glmspark-fcgi: could not load the tokenizer \"%s\"\n", tok_path);
        return 1;
    }
    config = (ApiConfig){
        .model_name = model_name,
        .tok = tok,
        .chat_template = strcmp(tmpl, "glm47") ? CHAT_TEMPLATE_GLM52 : CHAT_TEMPLATE_GLM47,
        .context_len = context,
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
    LOG_INFO("glmspark-fcgi: serving model \"%s\" (context %d) with %d threads on %s", model_name,
             context, n_threads, socket_path ? socket_path : "fd 0");

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
    tok_destroy(tok);
    return 0;
}
