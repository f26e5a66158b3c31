-- 007_prefix_cache.sql - prompt tokens served from the engine's prefix cache.
--
--   jobs.n_cached_tokens   prompt tokens whose KV the engine reused from an earlier request
--                          with the same prefix (engine/pipeline/scheduler.h), as of the
--                          attempt that ran last; the API reports it as
--                          usage.prompt_tokens_details.cached_tokens.
--   admin.recent_jobs      gains it (a last column: CREATE OR REPLACE VIEW only appends).

ALTER TABLE jobs ADD COLUMN n_cached_tokens integer NOT NULL DEFAULT 0
    CHECK (n_cached_tokens >= 0);

CREATE OR REPLACE VIEW admin.recent_jobs AS
SELECT j.public_id, k.name AS key_name, k.prefix AS key_prefix, j.kind, j.state, j.attempt,
       j.n_prompt_tokens, j.n_completion_tokens, j.finish_reason, j.error, j.created_at,
       j.claimed_at - j.created_at AS queue_wait, j.first_token_at - j.claimed_at AS ttft,
       j.finished_at - j.claimed_at AS run_time, j.finished_at, j.n_cached_tokens
FROM jobs j JOIN api_keys k ON k.id = j.api_key_id
WHERE j.created_at > now() - interval '24 hours'
ORDER BY j.id DESC;
