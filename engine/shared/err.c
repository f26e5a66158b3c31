/*
 * err.c - error names and the logger behind LOG_* and ASSERT.
 *
 * The threshold is read once from GLMSPARK_LOG on first use. Each line is formatted into a
 * stack buffer and written with one write(2) so that concurrent lines stay whole.
 */
#include "engine/shared/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int log_threshold = -1;  // -1: not read from the environment yet

const char *err_name(Err err)
{
    switch (err) {
    case ERR_OK:
        return "ERR_OK";
    case ERR_NOMEM:
        return "ERR_NOMEM";
    case ERR_IO:
        return "ERR_IO";
    case ERR_FORMAT:
        return "ERR_FORMAT";
    case ERR_INVAL:
        return "ERR_INVAL";
    case ERR_NOTFOUND:
        return "ERR_NOTFOUND";
    case ERR_AGAIN:
        return "ERR_AGAIN";
    case ERR_DB:
        return "ERR_DB";
    }
    return "ERR_UNKNOWN";
}

static int threshold(void)
{
    if (log_threshold < 0) {
        const char *env = getenv("GLMSPARK_LOG");
        int level = LOG_LEVEL_INFO;
        if (env && strcmp(env, "debug") == 0) level = LOG_LEVEL_DEBUG;
        if (env && strcmp(env, "warn") == 0) level = LOG_LEVEL_WARN;
        if (env && strcmp(env, "error") == 0) level = LOG_LEVEL_ERROR;
        log_threshold = level;
    }
    return log_threshold;
}

void log_set_level(LogLevel level)
{
    log_threshold = (int) level;
}

int log_enabled(LogLevel level)
{
    return (int) level >= threshold();
}

static void log_vline(LogLevel level, const char *file, int line, const char *fmt, va_list ap)
{
    static const char *const names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    char buf[4096];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);

    // Keep only the last path component: build paths are long and say nothing new.
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;

    int n = snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s %s:%d: ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, names[level], base, line);
    if (n < 0) return;
    if ((size_t) n < sizeof buf) {
        const int m = vsnprintf(buf + n, sizeof buf - (size_t) n, fmt, ap);
        if (m > 0) n += m;
    }
    if ((size_t) n >= sizeof buf - 1) n = (int) sizeof buf - 2;  // truncated: keep the newline
    buf[n++] = '\n';
    ssize_t off = 0;
    while (off < n) {
        const ssize_t w = write(STDERR_FILENO, buf + off, (size_t) (n - off));
        if (w <= 0) break;
        off += w;
    }
}

void log_at(LogLevel level, const char *file, int line, const char *fmt, ...)
{
    if ((int) level < threshold()) return;
    va_list ap;
    va_start(ap, fmt);
    log_vline(level, file, line, fmt, ap);
    va_end(ap);
}

void log_fatal(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vline(LOG_LEVEL_ERROR, file, line, fmt, ap);
    va_end(ap);
    abort();
}
