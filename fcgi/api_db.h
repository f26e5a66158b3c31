/*
 * api_db.h - fcgi/'s PostgreSQL side: one connection per thread, reconnect with backoff,
 * API-key authentication with a short-lived cache.
 *
 * Each handler thread owns an ApiDb. The connection LISTENs on job_chunks (the engine's
 * doorbell: the payload is a job's public id) so that a thread streaming a job wakes as
 * soon as output is committed; it re-reads job_chunks by seq on every wake-up and on a
 * poll timer, so a lost notification only costs latency. After a reconnect it LISTENs
 * again before reading, so nothing committed in between is missed.
 *
 * Keys: the presented key is parsed (common/apikey.h), its row found by public prefix and
 * its SHA-256 compared in constant time. Verified keys are cached per process for
 * API_AUTH_TTL_S seconds; with api_db_watch_revocations running, a revocation empties the
 * cache at once (else a revoked key stops working within the TTL). Failures are not
 * cached, so a bad key always costs a lookup of a prefix.
 *
 * Ownership: ApiDb is caller storage (init/free). PGresults returned are the caller's.
 * Threads:   an ApiDb belongs to one thread; the auth cache is shared and locked.
 * Errors:    ERR_DB when the database cannot be reached within the retry budget or
 *            refuses a statement; ERR_NOTFOUND for an unknown or revoked key.
 */
#ifndef FCGI_API_DB_H
#define FCGI_API_DB_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stdint.h>

#include "engine/common/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define API_AUTH_TTL_S 10

typedef struct ApiDb {
    PGconn *conn;
    char *conninfo;
} ApiDb;

typedef struct ApiKey {
    int64_t id;
    char prefix[24];
    bool is_admin;
    int rpm;             // 0 = unlimited
    int max_concurrent;  // 0 = unlimited
} ApiKey;

// Remember conninfo and try to connect (a failure here is retried on first use).
Err api_db_init(ApiDb *db, const char *conninfo);

// Close and zero; accepts a zeroed ApiDb.
void api_db_free(ApiDb *db);

// Make sure the connection is up, reconnecting with backoff (50 ms .. 1 s, about 3 s in
// all). ERR_DB when it stays down.
Err api_db_ensure(ApiDb *db);

// Run a parameterized statement, reconnecting once if the connection had dropped. Returns
// the result when its status is want, else logs and returns NULL.
PGresult *api_db_exec(ApiDb *db, const char *sql, int n_params, const char *const *params,
                      ExecStatusType want);

// Authenticate key[0..n). *out is written on success.
Err api_db_auth(ApiDb *db, const char *key, size_t n, ApiKey *out);

// Start a thread (with its own connection to conninfo) that LISTENs on api_keys_revoked
// (sql/004's trigger) and empties the auth cache on every revocation, so a revoked key
// stops working at once rather than within API_AUTH_TTL_S. While that connection is down
// the cache is bypassed (every request looks its key up). Call once per process.
Err api_db_watch_revocations(const char *conninfo);

// Wait up to timeout_ms for a notification whose payload is job_id (NULL: any). Other
// jobs' notifications are consumed and ignored, so that a thread streaming one job does
// not re-read on every other job's output. true when a matching one came.
bool api_db_wait(ApiDb *db, const char *job_id, int timeout_ms);

#ifdef __cplusplus
}
#endif
#endif  // FCGI_API_DB_H
