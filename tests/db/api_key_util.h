/*
 * api_key_util.h - a test database: open it migrated, run SQL on it, and make API key rows
 * straight in it (tests only).
 *
 * Header-only: static inline functions, one copy per test executable (test_api_db.c,
 * test_api_server_db.c, test_status.c).
 */
#ifndef TESTS_DB_API_KEY_UTIL_H
#define TESTS_DB_API_KEY_UTIL_H

#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cli/cli.h"
#include "engine/shared/apikey.h"
#include "tests/check.h"

// Migrate the test database (GLMSPARK_DB, which with_pg.sh sets) and connect to it: the
// connection, with *conninfo set. NULL, with a message naming test, when GLMSPARK_DB is unset
// or the connection fails; a failed migration is a failed check.
static inline PGconn *db_open_migrated(const char *test, const char **conninfo)
{
    *conninfo = getenv("GLMSPARK_DB");
    if (!*conninfo) {
        fprintf(stderr, "%s: GLMSPARK_DB is not set (run through with_pg.sh)\n", test);
        return NULL;
    }
    char *migrate[] = {"db", "migrate", "--db", (char *) *conninfo, NULL};
    CHECK(cli_db(4, migrate) == 0);
    PGconn *conn = PQconnectdb(*conninfo);
    if (PQstatus(conn) != CONNECTION_OK) {
        fprintf(stderr, "%s: %s", test, PQerrorMessage(conn));
        PQfinish(conn);
        return NULL;
    }
    return conn;
}

// Run q on conn; a failure counts as a failed check (and is printed).
static inline void db_sql(PGconn *conn, const char *q)
{
    PGresult *res = PQexec(conn, q);
    const ExecStatusType st = PQresultStatus(res);
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
        fprintf(stderr, "%s: %s", q, PQerrorMessage(conn));
    CHECK(st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK);
    PQclear(res);
}

// A new key row named name with scope "user" or "admin" and no limits; the key's text goes
// to key[APIKEY_LEN + 1].
static inline void db_make_key(PGconn *conn, char key[APIKEY_LEN + 1], const char *name,
                               const char *scope)
{
    char prefix[APIKEY_PREFIX_LEN + 1], hex[2 * APIKEY_HASH_LEN + 1], q[512];
    uint8_t digest[APIKEY_HASH_LEN];
    CHECK(apikey_generate(key) == ERR_OK);
    CHECK(apikey_parse(key, strlen(key), prefix) == ERR_OK);
    apikey_hash(key, strlen(key), digest);
    for (int i = 0; i < APIKEY_HASH_LEN; i++)
        snprintf(hex + 2 * i, 3, "%02x", digest[i]);
    snprintf(
        q, sizeof q,
        "INSERT INTO api_keys (prefix, key_hash, name, scope) VALUES ('%s', decode('%s', 'hex'),"
        " '%s', '%s')",
        prefix, hex, name, scope);
    db_sql(conn, q);
}

#endif  // TESTS_DB_API_KEY_UTIL_H
