-- The worker bounds a progress report to 1 KiB of compact JSON (worker/src/progress.rs),
-- but a tenant's worker role may write the column directly: the database bounds it too.
-- 2 KiB of jsonb's text, which adds spaces the compact JSON has not (at most half again).
-- NOT VALID: new writes are checked without scanning a large table.
ALTER TABLE tasks ADD CONSTRAINT tasks_progress_bounded
    CHECK (progress IS NULL OR octet_length(progress::text) <= 2048) NOT VALID;
