/*
 * test_api_db.c - glmspark-fcgi's connection handling against a real PostgreSQL (run by
 * with_pg.sh): a connection that the server ends while it is idle (pg_terminate_backend,
 * as on a restart) is noticed and replaced, so the next statement succeeds instead of
 * answering 503; a real SQL error is reported and not mistaken for a lost connection.
 * Regression test for the failure found by tests/reliability (listener terminated). A
 * session that cannot write (25006, a standby behind a virtual address) is replaced.
 *
 * Revocation: with the revocation watcher running, a key revoked between the
 * moment a lookup read its row and the moment the lookup cached it (api_db_auth_hook
 * revokes it exactly there and waits for the watcher to empty the cache) is not put back
 * into the cache: the next request is refused at once instead of for the cache's 10 s.
 * A key revoked while the watcher is disconnected is not served from the cache either.
 */
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/cli/cli.h"
#include "fcgi/api_db.h"
#include "tests/check.h"
#include "tests/db/api_key_util.h"

static PGconn *admin;

static long backend_pid(ApiDb *db)
{
    PGresult *res = api_db_exec(db, "SELECT pg_backend_pid()", 0, NULL, PGRES_TUPLES_OK);
    CHECK(res != NULL);
    if (!res) return -1;
    const long pid = atol(PQgetvalue(res, 0, 0));
    PQclear(res);
    return pid;
}

// Terminate the backend and wait until the server has ended it.
static void terminate(long pid)
{
    char sql[128];
    snprintf(sql, sizeof sql, "SELECT pg_terminate_backend(%ld, 5000)", pid);
    PGresult *res = PQexec(admin, sql);
    CHECK(PQresultStatus(res) == PGRES_TUPLES_OK && !strcmp(PQgetvalue(res, 0, 0), "t"));
    PQclear(res);
}

// Each way a statement meets a connection that died while idle.
static void test_terminated_idle_connection(void)
{
    ApiDb db;
    CHECK(api_db_init(&db, getenv("GLMSPARK_DB")) == ERR_OK);
    long pid = backend_pid(&db);
    CHECK(pid > 0);
    for (int i = 0; i < 20; i++) {
        terminate(pid);
        long next;
        if (i % 3 == 0) {
            next = backend_pid(&db);  // api_db_exec
        } else if (i % 3 == 1) {
            CHECK(api_db_ensure(&db) == ERR_OK);  // the enqueue path: ensure, then raw PQexec
            PGresult *res = PQexec(db.conn, "SELECT pg_backend_pid()");
            CHECK(PQresultStatus(res) == PGRES_TUPLES_OK);
            next = PQresultStatus(res) == PGRES_TUPLES_OK ? atol(PQgetvalue(res, 0, 0)) : -1;
            PQclear(res);
        } else {
            api_db_wait(&db, "job-none", 50);  // a streaming thread's wait, then a read
            next = backend_pid(&db);
        }
        CHECK(next > 0 && next != pid);
        pid = next;
    }
    api_db_free(&db);
}

static void test_sql_error_keeps_connection(void)
{
    ApiDb db;
    CHECK(api_db_init(&db, getenv("GLMSPARK_DB")) == ERR_OK);
    const long pid = backend_pid(&db);
    CHECK(api_db_exec(&db, "SELECT * FROM no_such_table", 0, NULL, PGRES_TUPLES_OK) == NULL);
    CHECK(api_db_exec(&db, "SELECT 1/0", 0, NULL, PGRES_TUPLES_OK) == NULL);
    CHECK(backend_pid(&db) == pid);  // not reconnected: the server answered
    api_db_free(&db);
}

// A session that cannot write (as on a standby, or a demoted primary still reached through
// a virtual address): its role defaults to read-only when the connection opens, then no
// longer does, as if the address had moved to the primary. A write through api_db_exec
// reconnects and succeeds; a write run on the connection directly (the enqueue's
// transaction) fails, is noted, and the next api_db_ensure replaces the connection.
static void test_read_only_session(void)
{
    PGresult *r = PQexec(admin, "ALTER ROLE CURRENT_USER SET default_transaction_read_only = on");
    CHECK(PQresultStatus(r) == PGRES_COMMAND_OK);
    PQclear(r);
    ApiDb db;
    CHECK(api_db_init(&db, getenv("GLMSPARK_DB")) == ERR_OK);
    const long pid = backend_pid(&db);
    r = PQexec(admin, "ALTER ROLE CURRENT_USER RESET default_transaction_read_only");
    CHECK(PQresultStatus(r) == PGRES_COMMAND_OK);
    PQclear(r);
    const char *write = "CREATE TABLE IF NOT EXISTS ro_probe (x int)";
    r = api_db_exec(&db, write, 0, NULL, PGRES_COMMAND_OK);
    CHECK(r != NULL);  // refused on the read-only session, then run on a new one
    PQclear(r);
    const long pid2 = backend_pid(&db);
    CHECK(pid2 > 0 && pid2 != pid);

    // The direct path: a read-only session again, a write on db.conn, then ensure.
    r = PQexec(admin, "ALTER ROLE CURRENT_USER SET default_transaction_read_only = on");
    PQclear(r);
    db.is_read_only = false;
    CHECK(api_db_ensure(&db) == ERR_OK);
    PQfinish(db.conn);  // a fresh read-only session
    db.conn = PQconnectdb(getenv("GLMSPARK_DB"));
    r = PQexec(admin, "ALTER ROLE CURRENT_USER RESET default_transaction_read_only");
    PQclear(r);
    r = PQexec(db.conn, "INSERT INTO ro_probe VALUES (1)");
    CHECK(PQresultStatus(r) == PGRES_FATAL_ERROR);
    api_db_note_failure(&db, r);
    PQclear(r);
    CHECK(db.is_read_only);
    CHECK(api_db_ensure(&db) == ERR_OK && !db.is_read_only);
    r = PQexec(db.conn, "INSERT INTO ro_probe VALUES (2)");
    CHECK(PQresultStatus(r) == PGRES_COMMAND_OK);
    PQclear(r);
    // Any other failure is not a read-only session: the connection stays.
    r = PQexec(db.conn, "SELECT 1/0");
    api_db_note_failure(&db, r);
    PQclear(r);
    CHECK(!db.is_read_only);
    r = PQexec(admin, "DROP TABLE ro_probe");
    PQclear(r);
    api_db_free(&db);
}

// ---------------------------------------------------------------------------
// Revocation racing a lookup

static void sql(const char *q)
{
    db_sql(admin, q);
}

static const char *revoke_name;  // the key the hook revokes

// Wait until f() is true (up to 10 s).
static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long) (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static bool eventually(bool (*f)(void))
{
    for (int i = 0; i < 1000; i++) {
        if (f()) return true;
        sleep_ms(10);
    }
    return false;
}

static uint64_t clears_before;
static bool cache_was_cleared(void)
{
    return api_db_auth_clears() > clears_before;
}

static bool watcher_listens(void)
{
    PGresult *res = PQexec(admin, "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN api_keys_revoked'"
                                  " AND state = 'idle'");
    const bool ok = PQresultStatus(res) == PGRES_TUPLES_OK && atoi(PQgetvalue(res, 0, 0)) == 1;
    PQclear(res);
    return ok;
}

// Between the lookup's read and its cache_put: revoke, and wait for the watcher's clear.
static void revoke_in_the_middle(void)
{
    char q[256];
    clears_before = api_db_auth_clears();
    snprintf(q, sizeof q, "UPDATE api_keys SET revoked_at = now() WHERE name = '%s'", revoke_name);
    sql(q);
    CHECK(eventually(cache_was_cleared));
}

static void test_revocation_race(void)
{
    ApiDb db;
    ApiKey k;
    char key[APIKEY_LEN + 1], other[APIKEY_LEN + 1], q[256];
    CHECK(api_db_init(&db, getenv("GLMSPARK_DB")) == ERR_OK);
    CHECK(api_db_watch_revocations(getenv("GLMSPARK_DB")) == ERR_OK);
    CHECK(eventually(watcher_listens));
    sleep_ms(100);  // the watcher marks itself live right after its LISTEN returns

    db_make_key(admin, key, "race", "user");
    db_make_key(admin, other, "bystander", "user");
    CHECK(api_db_auth(&db, other, strlen(other), &k) == ERR_OK);  // cached
    revoke_name = "race";
    api_db_auth_hook = revoke_in_the_middle;
    // The row was read before the revocation: this request itself is let through.
    CHECK(api_db_auth(&db, key, strlen(key), &k) == ERR_OK);
    api_db_auth_hook = NULL;
    // But it must not have been cached: the very next lookup sees the revocation.
    CHECK(api_db_auth(&db, key, strlen(key), &k) == ERR_NOTFOUND);
    CHECK(api_db_auth(&db, other, strlen(other), &k) == ERR_OK);  // others still work

    // A revocation while the watcher is away: its NOTIFY goes nowhere, so nothing cached
    // before (or during) the outage may be served.
    CHECK(api_db_auth(&db, other, strlen(other), &k) == ERR_OK);
    clears_before = api_db_auth_clears();
    sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = 'LISTEN api_keys_revoked'");
    CHECK(eventually(cache_was_cleared));
    snprintf(q, sizeof q, "UPDATE api_keys SET revoked_at = now() WHERE name = 'bystander'");
    sql(q);
    CHECK(api_db_auth(&db, other, strlen(other), &k) == ERR_NOTFOUND);
    CHECK(eventually(watcher_listens));
    CHECK(api_db_auth(&db, other, strlen(other), &k) == ERR_NOTFOUND);
    api_db_free(&db);
}

int main(void)
{
    const char *conninfo = getenv("GLMSPARK_DB");
    if (!conninfo) {
        fprintf(stderr, "test_api_db: GLMSPARK_DB is not set (run through with_pg.sh)\n");
        return 1;
    }
    admin = PQconnectdb(conninfo);
    if (PQstatus(admin) != CONNECTION_OK) {
        fprintf(stderr, "test_api_db: %s", PQerrorMessage(admin));
        return 1;
    }
    test_terminated_idle_connection();
    test_sql_error_keeps_connection();
    test_read_only_session();
    char *migrate[] = {"db", "migrate", "--db", (char *) conninfo, NULL};
    CHECK(cli_db(4, migrate) == 0);
    test_revocation_race();
    PQfinish(admin);
    return check_exit();
}
