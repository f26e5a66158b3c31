-- 004_logprobs_owner.sql - per-token log-probabilities, the request's input, revocation doorbell.
--
--   job_chunks.logprobs  the log-probabilities of the chunk's tokens when the request asked
--                        for them: a JSON array with one entry per token of token_ids, in
--                        OpenAI's chat shape {token, logprob, bytes, top_logprobs: [{token,
--                        logprob, bytes}]}; NULL otherwise. Written by the engine.
--   jobs.input           what the caller sent to generate from: the chat messages (an array)
--                        or the completion prompt (a string), so that GET /v1/jobs/{id} can
--                        show it after a reload. NULL for jobs queued before this migration.
--   api_keys trigger     NOTIFY api_keys_revoked (payload: the key's prefix) when a key is
--                        revoked, however it is revoked; glmspark-fcgi drops its auth cache
--                        on it, so a revoked key stops working at once.

ALTER TABLE job_chunks ADD COLUMN logprobs jsonb;
ALTER TABLE jobs ADD COLUMN input jsonb;

CREATE FUNCTION api_keys_notify_revoked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('api_keys_revoked', NEW.prefix);
    RETURN NEW;
END
$$;

CREATE TRIGGER api_keys_revoked AFTER UPDATE OF revoked_at ON api_keys
    FOR EACH ROW WHEN (OLD.revoked_at IS NULL AND NEW.revoked_at IS NOT NULL)
    EXECUTE FUNCTION api_keys_notify_revoked();
