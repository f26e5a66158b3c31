/*
 * err.h - error codes, logging, assertions: the one failure vocabulary shared by fcgi/,
 * engine/ and the kernel launchers.
 *
 * Three kinds of failure, three tools:
 *
 *   Err         Recoverable: bad input, I/O, a lost database connection. Returned up the
 *               stack; the caller decides what to do.
 *   ASSERT      A broken invariant, i.e. a bug. Logs file:line and aborts. Always compiled
 *               in. DASSERT is the variant for hot loops and is compiled out under NDEBUG.
 *   CUDA_CHECK  A device or collective failure (engine/shared/cuda_check.h). Fatal by design.
 *
 * The function that detects a failure logs it, once, with everything it knows (path, job
 * id, sizes); callers pass the Err on without logging again unless they add new facts.
 * Messages follow the PostgreSQL style: lower case, no trailing period,
 * "could not <verb> <object>: <reason>".
 *
 * Log lines go to stderr as "2026-11-30T15:04:05.123Z LEVEL file:line: message", one line
 * per call (journald-friendly). GLMSPARK_LOG=debug|info|warn|error sets the threshold.
 *
 * Ownership: nothing is allocated.
 * Threads:   every function may be called from any thread; a line is written with a single
 *            write(2), so lines from different threads never interleave.
 * Errors:    none; logging failures are ignored.
 */
#ifndef ENGINE_SHARED_ERR_H
#define ENGINE_SHARED_ERR_H

#ifdef __cplusplus
extern "C" {
#define NORETURN [[noreturn]]
#else
#define NORETURN _Noreturn
#endif

typedef enum Err {
    ERR_OK = 0,
    ERR_NOMEM,     // an allocation failed
    ERR_IO,        // open, read or write failed; the log has errno's text
    ERR_FORMAT,    // bytes do not follow the expected format
    ERR_INVAL,     // well-formed, but asks for something we do not support
    ERR_NOTFOUND,  // a named thing (tensor, file, job, key) does not exist
    ERR_AGAIN,     // out of capacity for now (KV blocks, queue slots); retry
    ERR_DB,        // the job-queue database rejected the call or went away
} Err;

typedef enum LogLevel {
    LOG_LEVEL_DEBUG,
    LOG_LEVEL_INFO,
    LOG_LEVEL_WARN,
    LOG_LEVEL_ERROR,
} LogLevel;

// Short stable name of err, e.g. "ERR_FORMAT", for logs and JSON errors. Static storage.
const char *err_name(Err err);

// Write one log line at level if level passes the threshold.
void log_at(LogLevel level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

// Write one line at error level, then abort(). Never returns.
NORETURN void log_fatal(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

// Set the threshold (overrides GLMSPARK_LOG). Not thread-safe against concurrent log_at.
void log_set_level(LogLevel level);

// True when a line at level would be written.
int log_enabled(LogLevel level);

#define LOG_DEBUG(...) log_at(LOG_LEVEL_DEBUG, __FILE__, __LINE__, __VA_ARGS__)
#define LOG_INFO(...)  log_at(LOG_LEVEL_INFO, __FILE__, __LINE__, __VA_ARGS__)
#define LOG_WARN(...)  log_at(LOG_LEVEL_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define LOG_ERROR(...) log_at(LOG_LEVEL_ERROR, __FILE__, __LINE__, __VA_ARGS__)

#define ASSERT(cond) \
    ((cond) ? (void) 0 : log_fatal(__FILE__, __LINE__, "assertion failed: %s", #cond))

#ifdef NDEBUG
#define DASSERT(cond) ((void) 0)
#else
#define DASSERT(cond) ASSERT(cond)
#endif

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SHARED_ERR_H
