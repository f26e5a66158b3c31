-- 006_models.sql - several models on one queue.
--
-- Each engine boot serves one model (engines.model, its served name) and claims only the
-- jobs of that model (engine/serve/jobq.c's claim filters on jobs.model), so engines of
-- several models, and any number of engines per model, share one queue. The runnable index
-- leads with the model so that each engine's claim reads only its own model's queue.
--
--   admin.models   one row per model that a live engine serves or that has unfinished jobs:
--                  live engine boots, queued and running jobs, the oldest queued job's wait,
--                  completion tokens/s of the jobs that finished in the last 1 and 5
--                  minutes, and the live engines' own tokens/s (engines.stats, summed).
--   admin.running  gains the job's model (a last column: CREATE OR REPLACE VIEW only appends).
-- A boot is live while it is not stopped and its heartbeat is under 30 s old, the rule of
-- /health, /metrics and `glmspark status`.

CREATE INDEX jobs_runnable_by_model ON jobs (model, priority DESC, id) WHERE state = 'queued';
DROP INDEX jobs_runnable;

CREATE VIEW admin.models AS
WITH live AS (
    SELECT model, stats FROM engines
    WHERE stopped_at IS NULL AND heartbeat_at > now() - interval '30 seconds'),
names AS (
    SELECT model FROM live
    UNION
    SELECT model FROM jobs WHERE finished_at IS NULL)
SELECT n.model,
       (SELECT count(*) FROM live l WHERE l.model = n.model) AS engines_live,
       (SELECT count(*) FROM jobs j WHERE j.model = n.model AND j.state = 'queued') AS queued,
       (SELECT count(*) FROM jobs j WHERE j.model = n.model AND j.state = 'running') AS running,
       (SELECT now() - min(j.created_at) FROM jobs j
        WHERE j.model = n.model AND j.state = 'queued') AS oldest_queued_wait,
       (SELECT coalesce(sum(j.n_completion_tokens), 0) / 60.0 FROM jobs j
        WHERE j.model = n.model AND j.finished_at > now() - interval '1 minute')
           AS tokens_per_s_1m,
       (SELECT coalesce(sum(j.n_completion_tokens), 0) / 300.0 FROM jobs j
        WHERE j.model = n.model AND j.finished_at > now() - interval '5 minutes')
           AS tokens_per_s_5m,
       (SELECT coalesce(sum((l.stats ->> 'tokens_per_s')::float8), 0) FROM live l
        WHERE l.model = n.model AND jsonb_typeof(l.stats -> 'tokens_per_s') = 'number')
           AS engine_tokens_per_s
FROM names n
ORDER BY n.model;

CREATE OR REPLACE VIEW admin.running AS
SELECT j.public_id, k.name AS key_name, k.prefix AS key_prefix, j.kind, j.attempt,
       e.name AS engine, j.lease_epoch, j.lease_until, j.claimed_at, j.first_token_at,
       j.heartbeat_at, j.n_prompt_tokens, j.n_completion_tokens, j.cancel_requested,
       now() - j.claimed_at AS running_for, j.model
FROM jobs j JOIN api_keys k ON k.id = j.api_key_id
LEFT JOIN engines e ON e.id = j.lease_epoch
WHERE j.state = 'running';

GRANT SELECT ON admin.models TO glmspark_admin;
-- `glmspark status` reads admin.models under the app role too (a view of what that role reads
-- anyway).
GRANT USAGE ON SCHEMA admin TO glmspark_app;
GRANT SELECT ON admin.models TO glmspark_app;
