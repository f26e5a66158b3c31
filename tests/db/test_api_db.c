/*
 * test_api_db.c - glmspark-fcgi's connection handling against a real PostgreSQL (run by
 * with_pg.sh): a connection that the server ends while it is idle (pg_terminate_backend,
 * as on a restart) is noticed and replaced, so the next statement succeeds instead of
 * answering 503; a real SQL error is reported and not mistaken for a lost connection.
 * Regression test for the failure found by tests/reliability (listener terminated).
 */
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../check.h"
#include "fcgi/api_db.h"

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
    PQfinish(admin);
    return check_exit();
}
