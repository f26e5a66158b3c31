-- 001_queue.sql - the job queue: API keys, jobs, output chunks, engine boots.
--
-- The SQL contract between glmspark-fcgi (inserts jobs, reads chunks) and glmspark-engine
-- (claims jobs, writes chunks). Applied once by `glmspark db migrate`, inside one
-- transaction, under an advisory lock; schema_migrations records it.
--
-- Invariants:
--   * a job is terminal (succeeded|failed|cancelled) exactly when finished_at is set;
--   * job_chunks of one job have seq 0,1,2,... with no gap: the engine appends in order and
--     resumes from the last committed seq, so a stream is the ordered chunks, whatever the
--     attempt that wrote them;
--   * lease_epoch is the engines.id of the engine boot that owns a running job. Every engine
--     write is conditioned on it (fencing): a stalled engine whose job was taken over writes
--     nothing.

CREATE TABLE api_keys (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    prefix         text NOT NULL UNIQUE,            -- public part, e.g. gsk_3f9a1c0b (logs, UIs)
    key_hash       bytea NOT NULL UNIQUE CHECK (length(key_hash) = 32),  -- SHA-256 of the key
    name           text NOT NULL,
    scope          text NOT NULL DEFAULT 'user' CHECK (scope IN ('user', 'admin')),
    rpm            integer CHECK (rpm > 0),          -- requests per minute; NULL = unlimited
    max_concurrent integer CHECK (max_concurrent > 0),  -- unfinished jobs; NULL = unlimited
    created_at     timestamptz NOT NULL DEFAULT now(),
    revoked_at     timestamptz,
    last_used_at   timestamptz
);

-- One row per engine boot; its id is the fencing epoch.
CREATE TABLE engines (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         text NOT NULL,
    model        text NOT NULL,
    pid          integer,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    stopped_at   timestamptz
);

CREATE TABLE jobs (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    public_id        text NOT NULL UNIQUE
                     DEFAULT 'job-' || replace(gen_random_uuid()::text, '-', ''),
    api_key_id       bigint NOT NULL REFERENCES api_keys (id),
    kind             text NOT NULL CHECK (kind IN ('chat', 'completion')),
    model            text NOT NULL,
    state            text NOT NULL DEFAULT 'queued'
                     CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    priority         smallint NOT NULL DEFAULT 0,
    request          jsonb NOT NULL,                -- validated request: sampling, stop, flags
    prompt_ids       integer[] NOT NULL,
    n_prompt_tokens  integer NOT NULL CHECK (n_prompt_tokens >= 0),
    max_tokens       integer NOT NULL CHECK (max_tokens > 0),
    idem_key         text,
    attempt          integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL DEFAULT 3,
    lease_epoch      bigint,                        -- engines.id of the owner while running
    lease_until      timestamptz,
    cancel_requested boolean NOT NULL DEFAULT false,
    created_at       timestamptz NOT NULL DEFAULT now(),
    claimed_at       timestamptz,                   -- first claim
    first_token_at   timestamptz,
    heartbeat_at     timestamptz,
    finished_at      timestamptz,
    n_completion_tokens integer NOT NULL DEFAULT 0,
    n_chunks         integer NOT NULL DEFAULT 0,    -- next seq to write
    finish_reason    text,
    error            text,
    CHECK ((state IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL))
);
CREATE INDEX jobs_runnable ON jobs (priority DESC, id) WHERE state = 'queued';
CREATE INDEX jobs_running ON jobs (lease_until) WHERE state = 'running';
CREATE INDEX jobs_by_key ON jobs (api_key_id, id DESC);
CREATE INDEX jobs_unfinished_by_key ON jobs (api_key_id) WHERE finished_at IS NULL;
CREATE INDEX jobs_finished ON jobs (finished_at) WHERE finished_at IS NOT NULL;
CREATE UNIQUE INDEX jobs_idem ON jobs (api_key_id, idem_key) WHERE idem_key IS NOT NULL;

CREATE TABLE job_chunks (
    job_id     bigint NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    seq        integer NOT NULL CHECK (seq >= 0),
    attempt    integer NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('content', 'reasoning', 'tool')),
    text       text NOT NULL,
    token_ids  integer[] NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_id, seq)
);

-- Request log for per-key rate limits (requests per minute), pruned by the app.
CREATE TABLE key_requests (
    api_key_id bigint NOT NULL REFERENCES api_keys (id) ON DELETE CASCADE,
    at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX key_requests_by_key ON key_requests (api_key_id, at);
