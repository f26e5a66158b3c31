/*
 * api_db.c - per-thread PostgreSQL connections and key authentication (see api_db.h).
 *
 * The auth cache is a small direct-mapped table indexed by the first bytes of the key's
 * SHA-256; an entry holds the full digest, so a hit is confirmed with CRYPTO_memcmp
 * before use. It only ever holds keys that verified.
 */
#include "fcgi/api_db.h"

#include <openssl/crypto.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/common/apikey.h"

// ---------------------------------------------------------------------------
// Connections

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long) (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// Connect and LISTEN; true on success.
static bool connect_once(ApiDb *db)
{
    PQfinish(db->conn);
    db->conn = PQconnectdb(db->conninfo);
    if (PQstatus(db->conn) != CONNECTION_OK) return false;
    PGresult *res = PQexec(db->conn, "LISTEN job_chunks");
    const bool ok = PQresultStatus(res) == PGRES_COMMAND_OK;
    PQclear(res);
    return ok;
}

Err api_db_init(ApiDb *db, const char *conninfo)
{
    memset(db, 0, sizeof *db);
    if (!(db->conninfo = strdup(conninfo))) return ERR_NOMEM;
    if (!connect_once(db))
        LOG_WARN("api: database not reachable yet: %s", PQerrorMessage(db->conn));
    return ERR_OK;
}

void api_db_free(ApiDb *db)
{
    if (!db) return;
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
// status OK), or the server ended the session (class 08, 57P0x).
static bool is_lost(const PGconn *conn, const PGresult *res)
{
    if (PQstatus(conn) != CONNECTION_OK || !res) return true;
    if (PQresultStatus(res) != PGRES_FATAL_ERROR) return false;
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    return !state || !strncmp(state, "08", 2) || !strncmp(state, "57P", 3);
}

Err api_db_ensure(ApiDb *db)
{
    if (is_alive(db)) return ERR_OK;
    if (db->conn && PQstatus(db->conn) == CONNECTION_OK)
        LOG_WARN("api: the database closed an idle connection; reconnecting");
    int delay = 50, waited = 0;
    for (;;) {
        if (connect_once(db)) {
            LOG_INFO("api: connected to the database");
            return ERR_OK;
        }
        if (waited >= 3000) {
            LOG_ERROR("api: could not connect to the database: %s",
                      db->conn ? PQerrorMessage(db->conn) : "out of memory");
            return ERR_DB;
        }
        sleep_ms(delay);
        waited += delay;
        delay = delay * 2 > 1000 ? 1000 : delay * 2;
    }
}

PGresult *api_db_exec(ApiDb *db, const char *sql, int n_params, const char *const *params,
                      ExecStatusType want)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        if (api_db_ensure(db)) return NULL;
        PGresult *res = PQexecParams(db->conn, sql, n_params, NULL, params, NULL, NULL, 0);
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

static double mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec * 1e-6;
}

// Consume pending notifications; true when one matches job_id (or any, for NULL).
static bool drain(ApiDb *db, const char *job_id)
{
    bool hit = false;
    PGnotify *note;
    while ((note = PQnotifies(db->conn))) {
        if (!job_id || !strcmp(note->extra, job_id)) hit = true;
        PQfreemem(note);
    }
    return hit;
}

bool api_db_wait(ApiDb *db, const char *job_id, int timeout_ms)
{
    if (api_db_ensure(db)) {
        sleep_ms(timeout_ms);
        return false;
    }
    PQconsumeInput(db->conn);
    if (drain(db, job_id)) return true;
    const double deadline = mono_ms() + timeout_ms;
    for (;;) {
        const double left = deadline - mono_ms();
        if (left <= 0) return false;
        struct pollfd pfd = {.fd = PQsocket(db->conn), .events = POLLIN};
        if (pfd.fd < 0 || poll(&pfd, 1, (int) left + 1) <= 0) return false;
        if (!PQconsumeInput(db->conn)) return false;  // connection lost: the caller's next query reconnects
        if (drain(db, job_id)) return true;
    }
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

static void cache_clear(void)
{
    pthread_mutex_lock(&cache_mutex);
    memset(cache, 0, sizeof cache);
    pthread_mutex_unlock(&cache_mutex);
}

static void set_watch_live(bool live)
{
    pthread_mutex_lock(&cache_mutex);
    is_watch_live = live;
    if (!live) memset(cache, 0, sizeof cache);
    pthread_mutex_unlock(&cache_mutex);
}

static void *watch_main(void *arg)
{
    char *conninfo = arg;
    PGconn *conn = NULL;
    int delay = 100;
    for (;;) {
        PQfinish(conn);
        conn = PQconnectdb(conninfo);
        PGresult *res = PQstatus(conn) == CONNECTION_OK ? PQexec(conn, "LISTEN api_keys_revoked") : NULL;
        const bool ok = res && PQresultStatus(res) == PGRES_COMMAND_OK;
        PQclear(res);
        if (!ok) {
            sleep_ms(delay);
            delay = delay * 2 > 2000 ? 2000 : delay * 2;
            continue;
        }
        delay = 100;
        set_watch_live(true);  // listening from here on: what is cached now stays valid
        for (;;) {
            struct pollfd pfd = {.fd = PQsocket(conn), .events = POLLIN};
            if (pfd.fd < 0 || poll(&pfd, 1, 5000) < 0 || !PQconsumeInput(conn)) break;
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
            if (PQstatus(conn) != CONNECTION_OK) break;
        }
        set_watch_live(false);
        LOG_WARN("api: revocation watcher lost the database; auth cache off until it is back");
    }
    return NULL;
}

Err api_db_watch_revocations(const char *conninfo)
{
    char *copy = strdup(conninfo);
    pthread_t t;
    if (!copy) return ERR_NOMEM;
    pthread_mutex_lock(&cache_mutex);
    is_watch_started = true;
    pthread_mutex_unlock(&cache_mutex);
    if (pthread_create(&t, NULL, watch_main, copy) != 0) {
        free(copy);
        LOG_ERROR("api: could not start the revocation watcher");
        return ERR_NOMEM;
    }
    pthread_detach(t);
    return ERR_OK;
}

static bool cache_get(const uint8_t digest[APIKEY_HASH_LEN], ApiKey *out)
{
    bool hit = false;
    const time_t now = time(NULL);
    pthread_mutex_lock(&cache_mutex);
    const CacheEntry *e = &cache[digest[0]];
    if ((!is_watch_started || is_watch_live) && e->expires > now && CRYPTO_memcmp(e->digest, digest, APIKEY_HASH_LEN) == 0) {
        *out = e->key;
        hit = true;
    }
    pthread_mutex_unlock(&cache_mutex);
    return hit;
}

static void cache_put(const uint8_t digest[APIKEY_HASH_LEN], const ApiKey *key)
{
    pthread_mutex_lock(&cache_mutex);
    CacheEntry *e = &cache[digest[0]];
    memcpy(e->digest, digest, APIKEY_HASH_LEN);
    e->key = *key;
    e->expires = time(NULL) + API_AUTH_TTL_S;
    pthread_mutex_unlock(&cache_mutex);
}

Err api_db_auth(ApiDb *db, const char *key, size_t n, ApiKey *out)
{
    char prefix[APIKEY_PREFIX_LEN + 1];
    uint8_t digest[APIKEY_HASH_LEN], stored[APIKEY_HASH_LEN];
    if (apikey_parse(key, n, prefix)) return ERR_NOTFOUND;
    apikey_hash(key, n, digest);
    if (cache_get(digest, out)) return ERR_OK;

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
            cache_put(digest, &k);
            *out = k;
            err = ERR_OK;
        }
    }
    PQclear(res);
    if (err == ERR_OK) {
        char id_text[24];
        snprintf(id_text, sizeof id_text, "%lld", (long long) out->id);
        PQclear(api_db_exec(db, "UPDATE api_keys SET last_used_at = now() WHERE id = $1::bigint",
                            1, (const char *const[]){id_text}, PGRES_COMMAND_OK));
    }
    return err;
}
