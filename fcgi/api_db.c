/*
 * api_db.c - per-thread PostgreSQL connections and key authentication (see api_db.h).
 *
 * The auth cache is a small direct-mapped table indexed by the first bytes of the key's
 * SHA-256; an entry holds the full digest, so a hit is confirmed with CRYPTO_memcmp
 * before use. It only ever holds keys that verified.
 *
 * The notification hub keeps one ApiDbWaiter per handler thread that ever waited, in a
 * list under hub_mutex. A waiter stays registered for its last job id between waits:
 * the hub bumps its generation on every matching notification and signals its own
 * condition variable, and a wait returns once the generation differs from the one it
 * last saw. So only the threads streaming the notified job wake, and a notification
 * that lands while the thread is reading is seen by its next wait. The list is scanned
 * linearly per notification: it holds at most one entry per handler thread (--threads,
 * 64 in the benchmark), which is a few microseconds per decode step.
 */
#include "fcgi/api_db.h"

#include <openssl/crypto.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/shared/apikey.h"

// ---------------------------------------------------------------------------
// Connections

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long) (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// Connect; true on success. Handler connections LISTEN on nothing: the hub does.
static bool connect_once(ApiDb *db)
{
    for (int i = 0; i < db->n_prepared; i++)
        free(db->prepared[i]);
    db->n_prepared = 0;  // prepared statements die with their connection
    PQfinish(db->conn);
    db->is_read_only = false;
    db->conn = PQconnectdb(db->conninfo);
    return PQstatus(db->conn) == CONNECTION_OK;
}

static void hub_leave(ApiDb *db);

Err api_db_init(ApiDb *db, const char *conninfo)
{
    memset(db, 0, sizeof *db);
    db->conninfo = strdup(conninfo);
    db->prepared = calloc(API_DB_MAX_PREPARED, sizeof *db->prepared);
    if (!db->conninfo || !db->prepared) {
        free(db->conninfo);
        free(db->prepared);
        memset(db, 0, sizeof *db);
        return ERR_NOMEM;
    }
    if (!connect_once(db))
        LOG_WARN("api: database not reachable yet: %s", PQerrorMessage(db->conn));
    return ERR_OK;
}

void api_db_free(ApiDb *db)
{
    if (!db) return;
    hub_leave(db);
    for (int i = 0; i < db->n_prepared; i++)
        free(db->prepared[i]);
    free(db->prepared);
    PQfinish(db->conn);
    free(db->conninfo);
    memset(db, 0, sizeof *db);
}

// True while the connection is usable as far as can be told without a round trip. A
// connection that the server closed while we were idle (pg_terminate_backend, a restart)
// still says CONNECTION_OK until its socket is read: read what is pending (notifications,
// the server's goodbye, the end of the stream) until nothing is.
static bool is_alive(ApiDb *db)
{
    if (!db->conn || PQstatus(db->conn) != CONNECTION_OK) return false;
    for (int i = 0; i < 8; i++) {
        struct pollfd pfd = {.fd = PQsocket(db->conn), .events = POLLIN};
        if (pfd.fd < 0) return false;
        if (poll(&pfd, 1, 0) <= 0) return true;
        if (!PQconsumeInput(db->conn) || PQstatus(db->conn) != CONNECTION_OK) return false;
    }
    return true;
}

// True when a failed statement's connection is gone: libpq says so, or the error is
// libpq's own (no SQLSTATE: "server closed the connection unexpectedly" can leave the
// status OK), or the server ended the session (class 08, 57P0x); or it cannot serve us: a
// write refused as read-only (25006) means the session sits on a standby or a demoted
// primary (a virtual address that moved while the connection stayed), and a new connection
// through the conninfo reaches the primary (docs/reliability.md).
static bool is_lost(const PGconn *conn, const PGresult *res)
{
    if (PQstatus(conn) != CONNECTION_OK || !res) return true;
    if (PQresultStatus(res) != PGRES_FATAL_ERROR) return false;
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    return !state || !strncmp(state, "08", 2) || !strncmp(state, "57P", 3)
           || !strcmp(state, "25006");
}

static bool is_read_only_error(const PGresult *res)
{
    const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    return state && !strcmp(state, "25006");
}

void api_db_note_failure(ApiDb *db, const PGresult *res)
{
    if (!is_read_only_error(res) || db->is_read_only) return;
    LOG_WARN("api: the database refused a write as read-only (a standby?); reconnecting before "
             "the next statement");
    db->is_read_only = true;
}

Err api_db_ensure(ApiDb *db)
{
    if (!db->is_read_only && is_alive(db)) return ERR_OK;
    if (db->conn && PQstatus(db->conn) == CONNECTION_OK)
        LOG_WARN("api: the database closed an idle connection; reconnecting");
    const int budget = db->retry_ms > 0 ? db->retry_ms : API_DB_RETRY_MS;
    int delay = 50, waited = 0;
    for (;;) {
        if (connect_once(db)) {
            LOG_INFO("api: connected to the database");
            return ERR_OK;
        }
        if (waited >= budget) {
            LOG_ERROR("api: could not connect to the database: %s",
                      db->conn ? PQerrorMessage(db->conn) : "out of memory");
            return ERR_DB;
        }
        sleep_ms(delay);
        waited += delay;
        delay = delay * 2 > 1000 ? 1000 : delay * 2;
        if (delay > budget - waited && budget > waited) delay = budget - waited;
    }
}

// Execute sql as a statement prepared on this connection, preparing it on first use while
// there is room; without room (or memory) it runs unprepared. A failed prepare's result
// is returned as the statement's, so callers see the server's error either way.
static PGresult *exec_prepared(ApiDb *db, const char *sql, int n_params, const char *const *params)
{
    char name[16];
    int i = 0;
    while (i < db->n_prepared && strcmp(db->prepared[i], sql) != 0)
        i++;
    if (i == db->n_prepared) {
        char *copy = i < API_DB_MAX_PREPARED ? strdup(sql) : NULL;
        if (!copy) return PQexecParams(db->conn, sql, n_params, NULL, params, NULL, NULL, 0);
        snprintf(name, sizeof name, "s%d", i);
        PGresult *res = PQprepare(db->conn, name, sql, n_params, NULL);
        if (PQresultStatus(res) != PGRES_COMMAND_OK) {
            free(copy);
            return res;
        }
        PQclear(res);
        db->prepared[db->n_prepared++] = copy;
    }
    snprintf(name, sizeof name, "s%d", i);
    return PQexecPrepared(db->conn, name, n_params, params, NULL, NULL, 0);
}

PGresult *api_db_exec(ApiDb *db, const char *sql, int n_params, const char *const *params,
                      ExecStatusType want)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        if (api_db_ensure(db)) return NULL;
        PGresult *res = exec_prepared(db, sql, n_params, params);
        if (PQresultStatus(res) == want) return res;
        const bool lost = is_lost(db->conn, res);
        PQclear(res);
        // A statement that failed because the connection dropped is retried once on a new
        // one; anything else is the server's answer.
        if (!lost) {
            LOG_ERROR("api: statement failed: %s", PQerrorMessage(db->conn));
            return NULL;
        }
        LOG_WARN("api: lost the database connection: %s", PQerrorMessage(db->conn));
        PQfinish(db->conn);
        db->conn = NULL;
    }
    return NULL;
}

// ---------------------------------------------------------------------------
// Notification hub

struct ApiDbWaiter {
    pthread_cond_t cond;  // CLOCK_MONOTONIC; signalled by the hub, waited on by the owner
    char *job_id;         // the job waited for; NULL: any job
    uint64_t gen, seen;   // bumped by the hub per matching notification; last gen returned
    ApiDbWaiter *next;
};

static pthread_mutex_t hub_mutex = PTHREAD_MUTEX_INITIALIZER;
static ApiDbWaiter *hub_waiters;  // guarded by hub_mutex, as is every field of every waiter

// Wake the waiters for job_id (NULL: all of them). Called with hub_mutex held.
static void hub_ring(const char *job_id)
{
    for (ApiDbWaiter *w = hub_waiters; w; w = w->next) {
        if (job_id && w->job_id && strcmp(w->job_id, job_id) != 0) continue;
        w->gen++;
        pthread_cond_signal(&w->cond);
    }
}

static void hub_leave(ApiDb *db)
{
    ApiDbWaiter *w = db->waiter;
    if (!w) return;
    pthread_mutex_lock(&hub_mutex);
    for (ApiDbWaiter **p = &hub_waiters; *p; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            break;
        }
    }
    pthread_mutex_unlock(&hub_mutex);
    pthread_cond_destroy(&w->cond);
    free(w->job_id);
    free(w);
    db->waiter = NULL;
}

// db's waiter, created and listed on first use; NULL when out of memory.
static ApiDbWaiter *hub_join(ApiDb *db)
{
    if (db->waiter) return db->waiter;
    ApiDbWaiter *w = calloc(1, sizeof *w);
    pthread_condattr_t attr;
    if (!w) return NULL;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    const int rc = pthread_cond_init(&w->cond, &attr);
    pthread_condattr_destroy(&attr);
    if (rc != 0) {
        free(w);
        return NULL;
    }
    pthread_mutex_lock(&hub_mutex);
    w->next = hub_waiters;
    hub_waiters = w;
    pthread_mutex_unlock(&hub_mutex);
    db->waiter = w;
    return w;
}

bool api_db_wait(ApiDb *db, const char *job_id, int timeout_ms)
{
    ApiDbWaiter *w = hub_join(db);
    if (!w) {
        LOG_ERROR("api: out of memory for a notification waiter; polling");
        sleep_ms(timeout_ms);
        return false;
    }
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (long) (timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    bool hit = false;
    pthread_mutex_lock(&hub_mutex);
    const bool is_same = job_id ? w->job_id && !strcmp(w->job_id, job_id) : !w->job_id;
    if (!is_same) {
        // A new job: notifications before this point were not counted for it, so the
        // caller re-reads once before really waiting. Waiting for any job needs no re-read.
        char *copy = job_id ? strdup(job_id) : NULL;
        free(w->job_id);
        w->job_id = copy;  // NULL on out of memory: woken by every job, which is only slower
        w->seen = w->gen;
        hit = job_id != NULL;
    }
    while (!hit && w->gen == w->seen) {
        // 0 is a wake-up (maybe spurious: the loop re-checks); anything else is the timeout.
        if (pthread_cond_timedwait(&w->cond, &hub_mutex, &deadline) != 0) break;
    }
    if (w->gen != w->seen) hit = true;
    w->seen = w->gen;
    pthread_mutex_unlock(&hub_mutex);
    return hit;
}

// A thread with its own connection that LISTENs on one channel and reconnects with backoff
// (100 ms .. 2 s). on_live(true) runs once it listens, on_live(false) when the connection is
// lost; on_notes drains PQnotifies() after each wake-up.
typedef struct Listener {
    char *conninfo;  // owned
    const char *listen_sql;
    void (*on_live)(bool is_live);
    void (*on_notes)(PGconn *conn);
} Listener;

static void *listener_main(void *arg)
{
    const Listener *l = arg;
    PGconn *conn = NULL;
    int delay = 100;
    for (;;) {
        PQfinish(conn);
        conn = PQconnectdb(l->conninfo);
        PGresult *res = PQstatus(conn) == CONNECTION_OK ? PQexec(conn, l->listen_sql) : NULL;
        const bool ok = res && PQresultStatus(res) == PGRES_COMMAND_OK;
        PQclear(res);
        if (!ok) {
            sleep_ms(delay);
            delay = delay * 2 > 2000 ? 2000 : delay * 2;
            continue;
        }
        delay = 100;
        l->on_live(true);
        for (;;) {
            struct pollfd pfd = {.fd = PQsocket(conn), .events = POLLIN};
            if (pfd.fd < 0 || poll(&pfd, 1, 5000) < 0 || !PQconsumeInput(conn)) break;
            l->on_notes(conn);
            if (PQstatus(conn) != CONNECTION_OK) break;
        }
        l->on_live(false);
    }
    return NULL;
}

// Start a listener thread (what: for the error message). The Listener lives for the process.
static Err listener_start(const char *conninfo, const char *listen_sql, void (*on_live)(bool),
                          void (*on_notes)(PGconn *), const char *what)
{
    Listener *l = calloc(1, sizeof *l);
    char *copy = strdup(conninfo);
    pthread_t t;
    if (!l || !copy) {
        free(l);
        free(copy);
        return ERR_NOMEM;
    }
    *l = (Listener){copy, listen_sql, on_live, on_notes};
    if (pthread_create(&t, NULL, listener_main, l) != 0) {
        free(copy);
        free(l);
        LOG_ERROR("api: could not start the %s", what);
        return ERR_NOMEM;
    }
    pthread_detach(t);
    return ERR_OK;
}

static void hub_live(bool is_live)
{
    static bool was_live;
    if (!is_live) {
        LOG_WARN("api: notification hub lost the database; streams poll until it is back");
        return;
    }
    if (was_live) LOG_INFO("api: notification hub listening again");
    // Listening from here on; what was committed before is read by every waiter once.
    pthread_mutex_lock(&hub_mutex);
    hub_ring(NULL);
    pthread_mutex_unlock(&hub_mutex);
    was_live = true;
}

static void hub_notes(PGconn *conn)
{
    PGnotify *note = PQnotifies(conn);
    if (!note) return;
    pthread_mutex_lock(&hub_mutex);
    for (; note; note = PQnotifies(conn)) {
        hub_ring(note->extra);
        PQfreemem(note);
    }
    pthread_mutex_unlock(&hub_mutex);
}

Err api_db_hub_start(const char *conninfo)
{
    return listener_start(conninfo, "LISTEN job_chunks", hub_live, hub_notes,
                          "notification hub");
}

// ---------------------------------------------------------------------------
// Authentication

enum { CACHE_SLOTS = 256 };

typedef struct CacheEntry {
    uint8_t digest[APIKEY_HASH_LEN];
    time_t expires;
    ApiKey key;
} CacheEntry;

static CacheEntry cache[CACHE_SLOTS];
static pthread_mutex_t cache_mutex = PTHREAD_MUTEX_INITIALIZER;
// Revocation watcher (api_db_watch_revocations): once started, the cache is trusted only
// while the watcher is connected and listening, so a missed revocation cannot linger.
static bool is_watch_started, is_watch_live;
// Bumped by every clear. A lookup notes it before reading api_keys and caches its answer
// only if it is unchanged: otherwise a revocation may have committed after the read (its
// NOTIFY emptied the cache meanwhile) and the row the lookup saw is stale.
static uint64_t cache_gen;

// Empty the cache. Called with cache_mutex held.
static void cache_clear_locked(void)
{
    memset(cache, 0, sizeof cache);
    cache_gen++;
}

void (*api_db_auth_hook)(void);

uint64_t api_db_auth_clears(void)
{
    pthread_mutex_lock(&cache_mutex);
    const uint64_t n = cache_gen;
    pthread_mutex_unlock(&cache_mutex);
    return n;
}

static void cache_clear(void)
{
    pthread_mutex_lock(&cache_mutex);
    cache_clear_locked();
    pthread_mutex_unlock(&cache_mutex);
}

static void watch_live(bool is_live)
{
    // Either way the cache starts empty: entries made while the watcher was away may be of
    // keys revoked meanwhile (their NOTIFY went nowhere).
    pthread_mutex_lock(&cache_mutex);
    is_watch_live = is_live;
    cache_clear_locked();
    pthread_mutex_unlock(&cache_mutex);
    if (!is_live)
        LOG_WARN("api: revocation watcher lost the database; auth cache off until it is back");
}

static void watch_notes(PGconn *conn)
{
    PGnotify *note;
    bool is_revoked = false;
    while ((note = PQnotifies(conn))) {
        is_revoked = true;
        PQfreemem(note);
    }
    if (is_revoked) {
        cache_clear();
        LOG_INFO("api: a key was revoked; auth cache cleared");
    }
}

Err api_db_watch_revocations(const char *conninfo)
{
    pthread_mutex_lock(&cache_mutex);
    is_watch_started = true;
    pthread_mutex_unlock(&cache_mutex);
    return listener_start(conninfo, "LISTEN api_keys_revoked", watch_live, watch_notes,
                          "revocation watcher");
}

// Look digest up; on a miss *gen gets the generation that a later cache_put must match.
static bool cache_get(const uint8_t digest[APIKEY_HASH_LEN], ApiKey *out, uint64_t *gen)
{
    bool hit = false;
    const time_t now = time(NULL);
    pthread_mutex_lock(&cache_mutex);
    const CacheEntry *e = &cache[digest[0]];
    const bool is_trusted = !is_watch_started || is_watch_live;
    if (is_trusted && e->expires > now && CRYPTO_memcmp(e->digest, digest, APIKEY_HASH_LEN) == 0) {
        *out = e->key;
        hit = true;
    }
    *gen = cache_gen;
    pthread_mutex_unlock(&cache_mutex);
    return hit;
}

// Cache key unless the cache was cleared since gen was read or is not trusted now.
static void cache_put(const uint8_t digest[APIKEY_HASH_LEN], const ApiKey *key, uint64_t gen)
{
    pthread_mutex_lock(&cache_mutex);
    if (gen == cache_gen && (!is_watch_started || is_watch_live)) {
        CacheEntry *e = &cache[digest[0]];
        memcpy(e->digest, digest, APIKEY_HASH_LEN);
        e->key = *key;
        e->expires = time(NULL) + API_AUTH_TTL_S;
    }
    pthread_mutex_unlock(&cache_mutex);
}

Err api_db_auth(ApiDb *db, const char *key, size_t n, ApiKey *out)
{
    char prefix[APIKEY_PREFIX_LEN + 1];
    uint8_t digest[APIKEY_HASH_LEN], stored[APIKEY_HASH_LEN];
    uint64_t gen = 0;
    if (apikey_parse(key, n, prefix)) return ERR_NOTFOUND;
    apikey_hash(key, n, digest);
    if (cache_get(digest, out, &gen)) return ERR_OK;

    PGresult *res = api_db_exec(db,
                                "SELECT id, encode(key_hash, 'hex'), scope, coalesce(rpm, 0),"
                                " coalesce(max_concurrent, 0) FROM api_keys"
                                " WHERE prefix = $1 AND revoked_at IS NULL",
                                1, (const char *const[]){prefix}, PGRES_TUPLES_OK);
    if (!res) return ERR_DB;
    Err err = ERR_NOTFOUND;
    if (PQntuples(res) == 1) {
        const char *hex = PQgetvalue(res, 0, 1);
        for (int i = 0; i < APIKEY_HASH_LEN; i++) {
            unsigned v = 0;
            for (int j = 0; j < 2; j++) {
                const char c = hex[2 * i + j];
                v = v * 16 + (unsigned) (c <= '9' ? c - '0' : c - 'a' + 10);
            }
            stored[i] = (uint8_t) v;
        }
        if (CRYPTO_memcmp(stored, digest, APIKEY_HASH_LEN) == 0) {
            ApiKey k = {0};
            k.id = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
            memcpy(k.prefix, prefix, sizeof prefix);
            k.is_admin = strcmp(PQgetvalue(res, 0, 2), "admin") == 0;
            k.rpm = atoi(PQgetvalue(res, 0, 3));
            k.max_concurrent = atoi(PQgetvalue(res, 0, 4));
            if (api_db_auth_hook) api_db_auth_hook();
            cache_put(digest, &k, gen);
            *out = k;
            err = ERR_OK;
        }
    }
    PQclear(res);
    if (err == ERR_OK) {
        char id_text[24];
        snprintf(id_text, sizeof id_text, "%lld", (long long) out->id);
        PGresult *upd = api_db_exec(db, "UPDATE api_keys SET last_used_at = now() WHERE id = $1::bigint",
                                    1, (const char *const[]){id_text}, PGRES_COMMAND_OK);
        if (!upd) LOG_WARN("api: could not record the use of key %s", prefix);
        PQclear(upd);
    }
    return err;
}
