/*
 * api_db.h - fcgi/'s PostgreSQL side: one connection per thread, reconnect with backoff,
 * API-key authentication with a short-lived cache.
 *
 * Each handler thread owns an ApiDb. The engine rings a doorbell when it commits output:
 * NOTIFY job_chunks with the job's public id as payload. One notification hub per process
 * (api_db_hub_start: a thread with its own connection) LISTENs on it and wakes only the
 * handler threads waiting for that job, so a batched decode step that commits 50 streams'
 * chunks costs PostgreSQL one listening backend to signal instead of one per stream.
 * A waiting thread re-reads job_chunks by seq on every wake-up and on a poll timer, so a
 * lost notification (hub down, NOTIFY suppressed) only costs latency; when the hub
 * (re)connects it wakes every waiter once, so nothing committed while it was down waits
 * for the timer.
 *
 * Keys: the presented key is parsed (engine/shared/apikey.h), its row found by public prefix and
 * its SHA-256 compared in constant time. Verified keys are cached per process for
 * API_AUTH_TTL_S seconds; with api_db_watch_revocations running, a revocation empties the
 * cache at once (else a revoked key stops working within the TTL), and a lookup that
 * raced the revocation cannot put the key back (a generation count, api_db.c). Failures
 * are not cached, so a bad key always costs a lookup of a prefix.
 *
 * Ownership: ApiDb is caller storage (init/free). PGresults returned are the caller's.
 * Threads:   an ApiDb belongs to one thread; the auth cache and the hub's table of
 *            waiters are shared and locked.
 * Errors:    ERR_DB when the database cannot be reached within the retry budget or
 *            refuses a statement; ERR_NOTFOUND for an unknown or revoked key.
 */
#ifndef FCGI_API_DB_H
#define FCGI_API_DB_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define API_AUTH_TTL_S 10
// Statements api_db_exec prepares per connection; later distinct SQL runs unprepared.
#define API_DB_MAX_PREPARED 32
// How long api_db_ensure keeps reconnecting by default (a request's patience); a stream
// that must keep writing keep-alives sets ApiDb.retry_ms lower for its reads.
#define API_DB_RETRY_MS 3000

typedef struct ApiDbWaiter ApiDbWaiter;  // private to api_db.c

typedef struct ApiDb {
    PGconn *conn;
    char *conninfo;
    ApiDbWaiter *waiter;  // this thread's entry in the hub's table; created by api_db_wait
    char **prepared;      // [API_DB_MAX_PREPARED] SQL prepared on conn as "s<index>"; owned
    int n_prepared;       // reset whenever conn is replaced
    int retry_ms;         // api_db_ensure's reconnect budget; 0 = API_DB_RETRY_MS
    bool is_read_only;    // a write was refused as read-only: api_db_ensure replaces conn
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

// Close, leave the hub's table and zero; accepts a zeroed ApiDb.
void api_db_free(ApiDb *db);

// Make sure the connection is up, reconnecting with backoff (50 ms .. 1 s, for retry_ms,
// about 3 s by default). ERR_DB when it stays down.
Err api_db_ensure(ApiDb *db);

// Note a failed statement's error (res may be NULL) for statements run on db->conn
// directly (the enqueue's transaction): a write refused as read-only (SQLSTATE 25006: the
// session sits on a standby or a demoted primary, as when a virtual address moved while the
// connection stayed) makes the next api_db_ensure replace the connection, so that a
// conninfo leading to the primary gets there. api_db_exec does this itself.
void api_db_note_failure(ApiDb *db, const PGresult *res);

// Run a parameterized statement, reconnecting once if the connection had dropped (or could
// not write: 25006, api_db_note_failure). Returns
// the result when its status is want, else logs and returns NULL. The first
// API_DB_MAX_PREPARED distinct SQL texts are prepared on the connection and reused, which
// spares PostgreSQL a parse and plan per call (the stream loop runs two per chunk).
PGresult *api_db_exec(ApiDb *db, const char *sql, int n_params, const char *const *params,
                      ExecStatusType want);

// Authenticate key[0..n). *out is written on success. A lookup that overlaps a cache
// clear (a revocation, the watcher reconnecting) does not cache its answer: the row it
// read may predate the revocation. last_used_at is updated on every lookup that reached
// the database (a failure is logged, not returned: the key did verify).
Err api_db_auth(ApiDb *db, const char *key, size_t n, ApiKey *out);

// How many times the auth cache has been emptied (revocations, watcher reconnects).
uint64_t api_db_auth_clears(void);

// Test hook (fault injection, tests/db/test_api_db.c): when set, api_db_auth calls it after
// a key's row has been read and verified and before the answer is cached, so a test can
// revoke the key exactly there. NULL in production; set it before any thread authenticates.
extern void (*api_db_auth_hook)(void);

// Start a thread (with its own connection to conninfo) that LISTENs on api_keys_revoked
// (sql/004's trigger) and empties the auth cache on every revocation, so a revoked key
// stops working at once rather than within API_AUTH_TTL_S. While that connection is down
// the cache is bypassed (every request looks its key up). Call once per process.
Err api_db_watch_revocations(const char *conninfo);

// Start the notification hub: a thread with its own connection to conninfo that LISTENs
// on job_chunks and wakes the api_db_wait callers waiting for the notified job. It
// reconnects with backoff (100 ms .. 2 s) and, once listening again, wakes every waiter
// so that what was committed meanwhile is read. Without it (or while it is down) waits
// simply last timeout_ms. Call once per process.
Err api_db_hub_start(const char *conninfo);

// Wait up to timeout_ms for a job_chunks notification whose payload is job_id (NULL:
// any), through the hub. The thread stays registered for job_id after returning, so a
// notification that arrives between the caller's read and its next wait is not lost: that
// wait returns at once. The first wait for a new job_id returns true at once (a
// notification may have come before registration; the caller re-reads). true when a
// matching notification came (or might have), false on timeout or out of memory.
bool api_db_wait(ApiDb *db, const char *job_id, int timeout_ms);

#ifdef __cplusplus
}
#endif
#endif  // FCGI_API_DB_H
