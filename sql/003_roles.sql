-- 003_roles.sql - least-privilege roles.
--
--   glmspark_app    what glmspark-fcgi and glmspark-engine log in as: reads and writes the
--                   queue tables, cannot change the schema.
--   glmspark_admin  operators with psql: SELECT on the admin views only; cannot write jobs
--                   or read api_keys (so never a key hash).
-- Roles are cluster-wide, so they are created only when missing. Passwords (for TCP logins)
-- are set by the operator; the local devstack uses peer/trust on a Unix socket.

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'glmspark_app') THEN
        CREATE ROLE glmspark_app LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'glmspark_admin') THEN
        CREATE ROLE glmspark_admin LOGIN;
    END IF;
END
$$;

ALTER ROLE glmspark_admin SET idle_in_transaction_session_timeout = '60s';
ALTER ROLE glmspark_admin SET default_transaction_read_only = on;

REVOKE ALL ON ALL TABLES IN SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO glmspark_app;
GRANT SELECT, INSERT, UPDATE ON api_keys, jobs, engines TO glmspark_app;
GRANT SELECT, INSERT, DELETE ON job_chunks, key_requests TO glmspark_app;
GRANT DELETE ON jobs TO glmspark_app;  -- retention
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO glmspark_app;

REVOKE ALL ON SCHEMA admin FROM PUBLIC;
GRANT USAGE ON SCHEMA admin TO glmspark_admin;
GRANT SELECT ON ALL TABLES IN SCHEMA admin TO glmspark_admin;
