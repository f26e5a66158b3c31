/*
 * jobq.h - the engine side of the PostgreSQL job queue: claim, stream chunks, finish.
 *
 * The SQL contract lives in sql/001_queue.sql. In short:
 *   - a claim is one short statement (UPDATE ... FROM (SELECT ... FOR UPDATE SKIP LOCKED)),
 *     never a long transaction: ownership lives in columns (state, lease_epoch, lease_until)
 *     and attempt counts the claims;
 *   - each JobQueue registers one engine boot (a row in engines) whose id is its fencing
 *     epoch. Every write is conditioned on jobs.lease_epoch = epoch, so an engine that
 *     stalled while another took its jobs over writes nothing (its calls get ERR_NOTFOUND);
 *   - any number of engine clusters claim from one queue, each boot under its engine name
 *     (unique among live engines: jobq_create refuses a name that a live boot on this host
 *     holds). jobq_recover() hands back at once the running jobs of this boot and of earlier
 *     boots of the same name (a restart after a crash waits for no lease); another engine's
 *     jobs come back when their leases run out, which fencing makes safe;
 *   - output goes to job_chunks in order (seq 0, 1, 2, ... with no gap, whatever the
 *     attempt), one statement per append, which also extends the lease and NOTIFYs readers
 *     (a doorbell only: readers always re-read by seq). A re-claimed job resumes: the claim
 *     returns the token ids already committed and the next seq. jobq_append_batch() does
 *     that for every running job of an engine step in one statement (one commit);
 *   - engines.stats holds the engine's status JSON (jobq_set_stats, read through
 *     admin.engines and by glmspark-fcgi);
 *   - a job whose lease ran out (no append or heartbeat for lease_s) can be claimed again;
 *   - an engine claims only the jobs of the model it serves (jobs.model = its served name),
 *     so engines of several models share one queue.
 *
 * Ownership: JobQueue is opaque (create/destroy). A JobqJob filled by jobq_claim owns its
 *            arrays until jobq_job_free.
 * Threads:   a JobQueue is one connection; use it from one thread at a time.
 * Errors:    ERR_DB when the connection failed (call jobq_reconnect) or the server refused;
 *            ERR_NOTFOUND from claim when nothing is runnable, and from append, heartbeat,
 *            finish and fail when the job is no longer this engine's (fenced, or finished by
 *            someone else): stop working on it. ERR_AGAIN from create when a live engine
 *            holds the name.
 */
#ifndef ENGINE_SERVE_JOBQ_H
#define ENGINE_SERVE_JOBQ_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/shared/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct JobQueue JobQueue;

typedef struct JobqOptions {
    const char *conninfo;     // libpq connection string
    const char *engine_name;  // shown in admin.running, e.g. host name
    const char *model;        // served model name: only jobs with this jobs.model are claimed
    int lease_s;              // lease length; appends and heartbeats extend it (default 30)
} JobqOptions;

typedef enum JobqChunkKind {
    JOBQ_CHUNK_CONTENT,
    JOBQ_CHUNK_REASONING,
    JOBQ_CHUNK_TOOL,
} JobqChunkKind;

typedef struct JobqChunk {
    JobqChunkKind kind;
    const char *text;           // UTF-8, may be "" (tokens whose text is held back)
    const int32_t *token_ids;   // [n_tokens]
    int n_tokens;
    const char *logprobs_json;  // JSON array, one entry per token (job_chunks.logprobs), or NULL
} JobqChunk;

typedef struct JobqJob {
    int64_t id;
    char public_id[64];
    char kind[16];              // "chat" or "completion"
    int attempt;                // 1 on the first claim
    char *request_json;         // the validated request (sampling parameters, stop, ...)
    int32_t *prompt_ids;        // [n_prompt]
    int n_prompt;
    int max_tokens;
    int32_t *committed_ids;     // [n_committed]: output already committed by earlier attempts
    int n_committed;
    int next_seq;               // seq of the next chunk to append
} JobqJob;

// Connect and register an engine boot. On success *out owns a connection; ERR_AGAIN when a
// live boot (not stopped, beating within the lease, its pid running on this host) has the
// same engine name.
Err jobq_create(const JobqOptions *opt, JobQueue **out);

// Mark the engine boot stopped (best effort) and close. Accepts NULL.
void jobq_destroy(JobQueue *q);

// This boot's fencing epoch (its engines.id).
int64_t jobq_epoch(const JobQueue *q);

// While this engine works on no job (at start, after a reconnect): requeue the running jobs
// of this boot and of earlier boots of its name (marking those stopped); claims resume them
// from their committed output. Other engines' jobs are left to their leases. *n_requeued
// gets the count (may be NULL).
Err jobq_recover(JobQueue *q, int *n_requeued);

// Claim the next runnable job into *job (zeroed on failure). Jobs past max_attempts are
// failed on the way. ERR_NOTFOUND when none is runnable.
Err jobq_claim(JobQueue *q, JobqJob *job);

// Free what jobq_claim allocated; zeroes *job. Accepts a zeroed job.
void jobq_job_free(JobqJob *job);

// Append chunks[0..n) at job->next_seq (advanced on success), extend the lease and wake
// readers. *is_cancelled tells whether a cancel was requested (may be NULL).
Err jobq_append(JobQueue *q, JobqJob *job, const JobqChunk *chunks, int n, bool *is_cancelled);

// Extend the lease without output (long prefills); also the engine's own heartbeat.
Err jobq_heartbeat(JobQueue *q, const JobqJob *job, bool *is_cancelled);

// End the job: state cancelled when finish_reason is "cancelled", else succeeded.
Err jobq_finish(JobQueue *q, const JobqJob *job, const char *finish_reason);

// End the job as failed with a message for the client (no internals).
Err jobq_fail(JobQueue *q, const JobqJob *job, const char *error);

typedef struct JobqAppend {
    JobqJob *job;               // next_seq advanced on success
    const JobqChunk *chunks;    // may be NULL when n_chunks == 0 (lease renewal only)
    int n_chunks;               // 0..64
    const char *finish_reason;  // non-NULL: finish the job in the same transaction
                                // ("stop", "length", "tool_calls", "cancelled", ...)
    const char *error;          // non-NULL: fail the job with this client message instead
    int n_cached;               // >= 0: this attempt's prompt tokens served from the prefix
                                // cache (jobs.n_cached_tokens); < 0: leave it
    bool is_cancelled;          // out: a cancel was requested for this job
    Err result;                 // out: ERR_OK, or ERR_NOTFOUND when the job is no longer
                                // this engine's (fenced / finished elsewhere); the other
                                // items are unaffected
} JobqAppend;

// One transaction (one commit, one WAL flush) for every item: append each item's chunks
// at its job's next_seq, extend every item's lease, finish/fail where asked, wake the
// readers (NOTIFY as the single-job calls do). Returns ERR_DB when the connection failed
// or the server refused (nothing committed); per-item fencing goes to item.result.
// (A lease with more than 3/4 of lease_s left is kept as it is: most steps then change
// no indexed column of the job row, so PostgreSQL can update it in place (HOT). A job
// renewed at least every lease_s * 3/4 never expires.)
// ERR_INVAL (logged, nothing sent) for a malformed batch: a NULL job, the same job twice,
// n_chunks outside 0..64, or chunks with negative n_tokens or NULL token_ids.
Err jobq_append_batch(JobQueue *q, JobqAppend *items, int n);

// jobq_append_batch in two halves, so that the caller works while the server commits:
// jobq_append_send sends the statement (ERR_DB when it could not be sent, ERR_INVAL and
// ERR_NOMEM as above: nothing in flight then) and returns; jobq_append_finish reads the
// answer into the items (result, is_cancelled, next_seq) and returns what jobq_append_batch
// would have (ERR_OK when nothing was in flight; on ERR_DB items may be partly updated, and
// the caller drops them anyway). items and the jobs they name must stay valid until
// jobq_append_finish (their chunks may go once jobq_append_send returns: the statement holds
// a copy); every other call on q may come in between (each first reads the answer, waiting
// for it), but not a second send. The commit, and the readers' wake-up,
// happen when the server gets the statement, not when the answer is read.
Err jobq_append_send(JobQueue *q, JobqAppend *items, int n);
Err jobq_append_finish(JobQueue *q);

// Hand a running job back to the queue at once (state queued, lease cleared; its committed
// chunks stay, so the next claim resumes it). ERR_NOTFOUND when it is no longer ours.
Err jobq_release(JobQueue *q, const JobqJob *job);

// Publish the engine's status JSON (engine/shared/stats.h) into engines.stats of this boot
// and renew the engine heartbeat (what /health reads), in one statement.
Err jobq_set_stats(JobQueue *q, const char *stats_json);

// Wait up to timeout_ms for a new-job notification. ERR_OK on a wake-up or timeout.
Err jobq_wait(JobQueue *q, int timeout_ms);

// Re-establish a lost connection, retrying with exponential backoff (100 ms .. 1 s) for up
// to max_wait_ms (< 0: forever).
Err jobq_reconnect(JobQueue *q, int max_wait_ms);

#ifdef __cplusplus
}
#endif
#endif  // ENGINE_SERVE_JOBQ_H
