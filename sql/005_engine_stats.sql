-- 005_engine_stats.sql - the engine's status JSON, and a read-only view of engine boots.
--
--   engines.stats   the status JSON of an engine boot (schema C2 in engine/serve/jobq.h's users:
--                   version, state, ranks, KV blocks, step times, tokens/s ...), written
--                   with the heartbeat by jobq_set_stats(); NULL until the first write.
--   admin.engines   engine boots for operators (`glmspark status`, psql as the admin role):
--                   no other columns exist on engines, but the admin role reads views only.
-- glmspark_app already has SELECT, INSERT, UPDATE on engines (003_roles.sql); the grant
-- below repeats it for the new column so the migration stands alone.

ALTER TABLE engines ADD COLUMN stats jsonb;

GRANT SELECT, UPDATE (stats, heartbeat_at) ON engines TO glmspark_app;

CREATE VIEW admin.engines AS
SELECT e.id, e.name, e.model, e.pid, e.started_at, e.heartbeat_at, e.stopped_at, e.stats
FROM engines e
ORDER BY e.id DESC;

GRANT SELECT ON admin.engines TO glmspark_admin;
