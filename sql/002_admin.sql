-- 002_admin.sql - read-only views for operators, in schema admin.
--
-- The admin role reads these views and nothing else: no key hashes, no writes. Views run
-- with their owner's rights, so granting SELECT on a view does not grant the base table.

CREATE SCHEMA admin;

-- Queued jobs in claim order, with their position and how long they have waited.
CREATE VIEW admin.queue AS
SELECT row_number() OVER (ORDER BY j.priority DESC, j.id) AS position,
       j.public_id, k.name AS key_name, k.prefix AS key_prefix, j.kind, j.model, j.priority,
       j.n_prompt_tokens, j.max_tokens, j.attempt, j.created_at,
       now() - j.created_at AS waiting
FROM jobs j JOIN api_keys k ON k.id = j.api_key_id
WHERE j.state = 'queued';

CREATE VIEW admin.running AS
SELECT j.public_id, k.name AS key_name, k.prefix AS key_prefix, j.kind, j.attempt,
       e.name AS engine, j.lease_epoch, j.lease_until, j.claimed_at, j.first_token_at,
       j.heartbeat_at, j.n_prompt_tokens, j.n_completion_tokens, j.cancel_requested,
       now() - j.claimed_at AS running_for
FROM jobs j JOIN api_keys k ON k.id = j.api_key_id
LEFT JOIN engines e ON e.id = j.lease_epoch
WHERE j.state = 'running';

CREATE VIEW admin.recent_jobs AS
SELECT j.public_id, k.name AS key_name, k.prefix AS key_prefix, j.kind, j.state, j.attempt,
       j.n_prompt_tokens, j.n_completion_tokens, j.finish_reason, j.error, j.created_at,
       j.claimed_at - j.created_at AS queue_wait, j.first_token_at - j.claimed_at AS ttft,
       j.finished_at - j.claimed_at AS run_time, j.finished_at
FROM jobs j JOIN api_keys k ON k.id = j.api_key_id
WHERE j.created_at > now() - interval '24 hours'
ORDER BY j.id DESC;

CREATE VIEW admin.usage_by_key AS
SELECT date_trunc('day', j.created_at) AS day, k.name AS key_name, k.prefix AS key_prefix,
       count(*) AS jobs,
       count(*) FILTER (WHERE j.state = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE j.state = 'failed') AS failed,
       sum(j.n_prompt_tokens) AS prompt_tokens,
       sum(j.n_completion_tokens) AS completion_tokens
FROM jobs j JOIN api_keys k ON k.id = j.api_key_id
GROUP BY 1, 2, 3;

-- Tokens/s, TTFT and queue wait over the last 1, 5 and 60 minutes of finished jobs.
CREATE VIEW admin.throughput AS
SELECT w.minutes AS window_minutes,
       count(j.id) AS jobs,
       coalesce(sum(j.n_completion_tokens), 0) AS completion_tokens,
       coalesce(sum(j.n_completion_tokens), 0) / (w.minutes * 60.0) AS tokens_per_s,
       avg(j.first_token_at - j.claimed_at) AS avg_ttft,
       percentile_cont(0.99) WITHIN GROUP (
           ORDER BY extract(epoch FROM j.first_token_at - j.claimed_at)) AS p99_ttft_s,
       avg(j.claimed_at - j.created_at) AS avg_queue_wait
FROM (VALUES (1), (5), (60)) AS w (minutes)
LEFT JOIN jobs j ON j.finished_at > now() - w.minutes * interval '1 minute'
GROUP BY w.minutes
ORDER BY w.minutes;
