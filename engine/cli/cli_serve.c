/*
 * cli_serve.c - `glmspark db migrate` and `glmspark keys create|list|revoke`.
 *
 * Migrations are the files sql/NNN_name.sql, applied in version order, each in its own
 * transaction together with its row in schema_migrations. A session advisory lock makes
 * concurrent `db migrate` runs wait for each other instead of racing, and a second run
 * applies nothing (idempotent). A file whose SHA-256 differs from the one recorded when it
 * was applied is reported: applied migrations are never edited, only followed by new ones.
 *
 * Keys are printed once, on stdout, and only their SHA-256 is stored (engine/shared/apikey.h).
 * The database comes from --db CONNINFO or $GLMSPARK_DB (a libpq connection string).
 */
#include <dirent.h>
#include <libpq-fe.h>
#include <openssl/crypto.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cli/cli.h"
#include "engine/shared/apikey.h"
#include "engine/shared/buf.h"
#include "engine/shared/err.h"
#include "engine/shared/num.h"

// Any fixed 64-bit number; shared by every `glmspark db migrate`.
#define MIGRATE_LOCK_KEY "7406135331560110081"

// ---------------------------------------------------------------------------
// Arguments and connection

typedef struct ServeArgs {
    const char *db;
    const char *sql_dir;
    const char *name;
    const char *scope;
    const char *rpm;
    const char *max_concurrent;
    const char *positional;
} ServeArgs;

static void usage(void)
{
    fprintf(stderr, "usage: glmspark db migrate [--db CONNINFO] [--sql DIR]\n"
                    "       glmspark keys create --name N [--scope user|admin] [--rpm R] "
                    "[--max-concurrent C] [--db CONNINFO]\n"
                    "       glmspark keys list [--db CONNINFO]\n"
                    "       glmspark keys revoke PREFIX|NAME [--db CONNINFO]\n"
                    "CONNINFO defaults to $GLMSPARK_DB.\n");
}

// Parse argv[2..] into a; 0 on success, 2 on a usage error (already reported).
static int parse_args(int argc, char **argv, ServeArgs *a)
{
    memset(a, 0, sizeof *a);
    a->db = getenv("GLMSPARK_DB");
    a->sql_dir = getenv("GLMSPARK_SQL_DIR");
    if (!a->sql_dir) a->sql_dir = GLMSPARK_SQL_DIR;
    a->scope = "user";
    for (int i = 2; i < argc; i++) {
        const char **slot = NULL;
        if (!strcmp(argv[i], "--db"))
            slot = &a->db;
        else if (!strcmp(argv[i], "--sql"))
            slot = &a->sql_dir;
        else if (!strcmp(argv[i], "--name"))
            slot = &a->name;
        else if (!strcmp(argv[i], "--scope"))
            slot = &a->scope;
        else if (!strcmp(argv[i], "--rpm"))
            slot = &a->rpm;
        else if (!strcmp(argv[i], "--max-concurrent"))
            slot = &a->max_concurrent;
        if (slot) {
            if (i + 1 >= argc) {
                fprintf(stderr, "glmspark: option %s needs a value\n", argv[i]);
                return 2;
            }
            *slot = argv[++i];
        } else if (argv[i][0] == '-' || a->positional) {
            fprintf(stderr, "glmspark: unexpected argument \"%s\"\n", argv[i]);
            usage();
            return 2;
        } else {
            a->positional = argv[i];
        }
    }
    if (!a->db) {
        fprintf(stderr, "glmspark: no database: pass --db CONNINFO or set GLMSPARK_DB\n");
        return 2;
    }
    return 0;
}

static PGconn *connect_db(const char *conninfo)
{
    PGconn *conn = PQconnectdb(conninfo);
    if (PQstatus(conn) != CONNECTION_OK) {
        fprintf(stderr, "glmspark: could not connect to the database: %s", PQerrorMessage(conn));
        PQfinish(conn);
        return NULL;
    }
    PQsetNoticeProcessor(conn, NULL, NULL);  // "already exists" notices are noise here
    return conn;
}

// Run sql; true when it returned want. Reports the server's message otherwise.
static bool exec_ok(PGconn *conn, const char *what, const char *sql, ExecStatusType want)
{
    PGresult *res = PQexec(conn, sql);
    const bool ok = PQresultStatus(res) == want;
    if (!ok) fprintf(stderr, "glmspark: %s failed: %s", what, PQerrorMessage(conn));
    PQclear(res);
    return ok;
}

// ---------------------------------------------------------------------------
// db migrate

typedef struct Migration {
    int version;
    char file[256];
} Migration;

static int cmp_migration(const void *a, const void *b)
{
    return ((const Migration *) a)->version - ((const Migration *) b)->version;
}

// Read a whole file into a NUL-terminated heap string; NULL on failure (reported).
static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "glmspark: could not open \"%s\"\n", path);
        return NULL;
    }
    Buf b = {0};
    char *text = buf_add_file(&b, f) ? NULL : buf_take(&b, NULL);
    buf_free(&b);
    if (!text) fprintf(stderr, "glmspark: could not read \"%s\"\n", path);
    fclose(f);
    return text;
}

// List dir's NNN_*.sql files sorted by version; returns the count or -1 (reported).
static int list_migrations(const char *dir, Migration *out, int cap)
{
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "glmspark: could not open migrations directory \"%s\"\n", dir);
        return -1;
    }
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *s = e->d_name;
        const size_t len = strlen(s);
        if (len < 9 || len >= sizeof out[0].file || s[0] < '0' || s[0] > '9' || s[1] < '0'
            || s[1] > '9' || s[2] < '0' || s[2] > '9' || s[3] != '_'
            || strcmp(s + len - 4, ".sql") != 0)
            continue;
        if (n == cap) {
            fprintf(stderr, "glmspark: more than %d migrations in \"%s\"\n", cap, dir);
            n = -1;
            break;
        }
        out[n].version = (s[0] - '0') * 100 + (s[1] - '0') * 10 + (s[2] - '0');
        memcpy(out[n].file, s, len + 1);
        n++;
    }
    closedir(d);
    if (n <= 0) {
        if (n == 0) fprintf(stderr, "glmspark: no migrations in \"%s\"\n", dir);
        return -1;
    }
    qsort(out, (size_t) n, sizeof *out, cmp_migration);
    for (int i = 1; i < n; i++) {
        if (out[i].version == out[i - 1].version) {
            fprintf(stderr, "glmspark: two migrations with version %03d: %s and %s\n",
                    out[i].version, out[i - 1].file, out[i].file);
            return -1;
        }
    }
    return n;
}

static int db_migrate(const ServeArgs *a)
{
    Migration migs[256];
    int status = 1, n_applied = 0;
    char *sql = NULL;
    PGconn *conn = NULL;
    PGresult *res = NULL;

    const int n = list_migrations(a->sql_dir, migs, 256);
    if (n < 0) goto done;
    if (!(conn = connect_db(a->db))) goto done;
    if (!exec_ok(conn, "taking the migration lock", "SELECT pg_advisory_lock(" MIGRATE_LOCK_KEY ")",
                 PGRES_TUPLES_OK))
        goto done;
    if (!exec_ok(conn, "creating schema_migrations",
                 "CREATE TABLE IF NOT EXISTS schema_migrations ("
                 " version integer PRIMARY KEY, name text NOT NULL,"
                 " sha256 text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
                 PGRES_COMMAND_OK))
        goto done;

    for (int i = 0; i < n; i++) {
        char path[4096], version[16];
        snprintf(path, sizeof path, "%s/%s", a->sql_dir, migs[i].file);
        snprintf(version, sizeof version, "%d", migs[i].version);
        free(sql);
        if (!(sql = read_text(path))) goto done;
        PGresult *hres = PQexecParams(conn, "SELECT encode(sha256(convert_to($1, 'UTF8')), 'hex')",
                                      1, NULL, (const char *const[]){sql}, NULL, NULL, 0);
        char sha[65] = "";
        if (PQresultStatus(hres) == PGRES_TUPLES_OK)
            snprintf(sha, sizeof sha, "%s", PQgetvalue(hres, 0, 0));
        PQclear(hres);

        PQclear(res);
        res = PQexecParams(conn, "SELECT sha256 FROM schema_migrations WHERE version = $1::int", 1,
                           NULL, (const char *const[]){version}, NULL, NULL, 0);
        if (PQresultStatus(res) != PGRES_TUPLES_OK) {
            fprintf(stderr, "glmspark: reading schema_migrations failed: %s", PQerrorMessage(conn));
            goto done;
        }
        if (PQntuples(res) == 1) {
            if (strcmp(PQgetvalue(res, 0, 0), sha) != 0)
                fprintf(stderr,
                        "glmspark: warning: %s changed after it was applied; applied "
                        "migrations are never re-run, add a new one instead\n",
                        migs[i].file);
            continue;
        }
        if (!exec_ok(conn, "BEGIN", "BEGIN", PGRES_COMMAND_OK)) goto done;
        PGresult *mres = PQexec(conn, sql);
        const ExecStatusType st = PQresultStatus(mres);
        PQclear(mres);
        if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
            fprintf(stderr, "glmspark: migration %s failed: %s", migs[i].file,
                    PQerrorMessage(conn));
            exec_ok(conn, "ROLLBACK", "ROLLBACK", PGRES_COMMAND_OK);
            goto done;
        }
        PGresult *ires = PQexecParams(
            conn, "INSERT INTO schema_migrations (version, name, sha256) VALUES ($1::int, $2, $3)",
            3, NULL, (const char *const[]){version, migs[i].file, sha}, NULL, NULL, 0);
        const bool inserted = PQresultStatus(ires) == PGRES_COMMAND_OK;
        PQclear(ires);
        if (!inserted || !exec_ok(conn, "COMMIT", "COMMIT", PGRES_COMMAND_OK)) {
            fprintf(stderr, "glmspark: recording migration %s failed: %s", migs[i].file,
                    PQerrorMessage(conn));
            exec_ok(conn, "ROLLBACK", "ROLLBACK", PGRES_COMMAND_OK);
            goto done;
        }
        fprintf(stderr, "glmspark: applied %s\n", migs[i].file);
        n_applied++;
    }
    printf("migrations: %d applied, %d up to date\n", n_applied, n - n_applied);
    status = 0;
done:
    free(sql);
    PQclear(res);
    PQfinish(conn);  // ends the session, releasing the advisory lock
    return status;
}

int cli_db(int argc, char **argv)
{
    ServeArgs a;
    if (argc < 2 || strcmp(argv[1], "migrate") != 0) {
        usage();
        return 2;
    }
    const int rc = parse_args(argc, argv, &a);
    return rc ? rc : db_migrate(&a);
}

// ---------------------------------------------------------------------------
// keys

// Parse a positive integer option; NULL stays NULL (unlimited). false on a bad value.
static bool check_positive(const char *opt, const char *s)
{
    long v;
    if (!s || num_parse_long(s, 1, 1000000000, &v)) return true;
    fprintf(stderr, "glmspark: %s must be a positive integer, got \"%s\"\n", opt, s);
    return false;
}

static int keys_create(const ServeArgs *a)
{
    int status = 1;
    PGconn *conn = NULL;
    PGresult *res = NULL;
    char key[APIKEY_LEN + 1], prefix[APIKEY_PREFIX_LEN + 1], hash_hex[2 * APIKEY_HASH_LEN + 3];
    uint8_t digest[APIKEY_HASH_LEN];

    if (!a->name || !*a->name) {
        fprintf(stderr, "glmspark: keys create needs --name N\n");
        return 2;
    }
    if (strcmp(a->scope, "user") != 0 && strcmp(a->scope, "admin") != 0) {
        fprintf(stderr, "glmspark: --scope must be user or admin, got \"%s\"\n", a->scope);
        return 2;
    }
    if (!check_positive("--rpm", a->rpm) || !check_positive("--max-concurrent", a->max_concurrent))
        return 2;
    if (apikey_generate(key)) goto done;
    if (apikey_parse(key, APIKEY_LEN, prefix)) goto done;
    apikey_hash(key, APIKEY_LEN, digest);
    hash_hex[0] = '\\';
    hash_hex[1] = 'x';
    for (int i = 0; i < APIKEY_HASH_LEN; i++)
        snprintf(hash_hex + 2 + 2 * i, 3, "%02x", digest[i]);
    if (!(conn = connect_db(a->db))) goto done;
    res = PQexecParams(
        conn,
        "INSERT INTO api_keys (prefix, key_hash, name, scope, rpm, max_concurrent)"
        " VALUES ($1, $2::bytea, $3, $4, $5::int, $6::int)",
        6, NULL,
        (const char *const[]){prefix, hash_hex, a->name, a->scope, a->rpm, a->max_concurrent}, NULL,
        NULL, 0);
    if (PQresultStatus(res) != PGRES_COMMAND_OK) {
        fprintf(stderr, "glmspark: could not store the key: %s", PQerrorMessage(conn));
        goto done;
    }
    fprintf(stderr, "glmspark: created key \"%s\" (prefix %s, scope %s); it is shown only once\n",
            a->name, prefix, a->scope);
    printf("%s\n", key);
    fflush(stdout);
    status = 0;
done:
    OPENSSL_cleanse(key, sizeof key);
    PQclear(res);
    PQfinish(conn);
    return status;
}

static int keys_list(const ServeArgs *a)
{
    int status = 1;
    PGconn *conn = connect_db(a->db);
    PGresult *res = NULL;
    if (!conn) goto done;
    res = PQexec(conn, "SELECT prefix, name, scope, coalesce(rpm::text, '-'),"
                       " coalesce(max_concurrent::text, '-'),"
                       " to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),"
                       " CASE WHEN revoked_at IS NULL THEN 'active' ELSE 'revoked' END,"
                       " coalesce(to_char(last_used_at AT TIME ZONE 'UTC',"
                       " 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), '-')"
                       " FROM api_keys ORDER BY id");
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        fprintf(stderr, "glmspark: could not list keys: %s", PQerrorMessage(conn));
        goto done;
    }
    printf("%-17s %-20s %-6s %6s %6s %-20s %-8s %s\n", "PREFIX", "NAME", "SCOPE", "RPM", "CONC",
           "CREATED", "STATE", "LAST_USED");
    for (int i = 0; i < PQntuples(res); i++)
        printf("%-17s %-20s %-6s %6s %6s %-20s %-8s %s\n", PQgetvalue(res, i, 0),
               PQgetvalue(res, i, 1), PQgetvalue(res, i, 2), PQgetvalue(res, i, 3),
               PQgetvalue(res, i, 4), PQgetvalue(res, i, 5), PQgetvalue(res, i, 6),
               PQgetvalue(res, i, 7));
    status = 0;
done:
    PQclear(res);
    PQfinish(conn);
    return status;
}

static int keys_revoke(const ServeArgs *a)
{
    int status = 1;
    PGconn *conn = NULL;
    PGresult *res = NULL;
    if (!a->positional) {
        fprintf(stderr, "glmspark: keys revoke needs a key prefix or name\n");
        return 2;
    }
    if (!(conn = connect_db(a->db))) goto done;
    res = PQexecParams(conn,
                       "UPDATE api_keys SET revoked_at = now()"
                       " WHERE (prefix = $1 OR name = $1) AND revoked_at IS NULL RETURNING prefix",
                       1, NULL, (const char *const[]){a->positional}, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        fprintf(stderr, "glmspark: could not revoke: %s", PQerrorMessage(conn));
        goto done;
    }
    if (PQntuples(res) == 0) {
        fprintf(stderr, "glmspark: no active key with prefix or name \"%s\"\n", a->positional);
        goto done;
    }
    for (int i = 0; i < PQntuples(res); i++)
        printf("revoked %s\n", PQgetvalue(res, i, 0));
    status = 0;
done:
    PQclear(res);
    PQfinish(conn);
    return status;
}

int cli_keys(int argc, char **argv)
{
    ServeArgs a;
    if (argc < 2) {
        usage();
        return 2;
    }
    const int rc = parse_args(argc, argv, &a);
    if (rc) return rc;
    if (!strcmp(argv[1], "create")) return keys_create(&a);
    if (!strcmp(argv[1], "list")) return keys_list(&a);
    if (!strcmp(argv[1], "revoke")) return keys_revoke(&a);
    usage();
    return 2;
}
