-- Current state of every task. One row per task; the audit log below holds its history.
CREATE TABLE tasks (
    id              uuid        PRIMARY KEY,
    idempotency_key uuid        NOT NULL UNIQUE,
    task_type       text        NOT NULL,
    state           text        NOT NULL CHECK (state IN ('INGESTED', 'QUEUED', 'CLAIMED',
                        'PROCESSING', 'COMPLETED', 'FAILED', 'RETRY_CLAIMED', 'DEAD_LETTER')),
    -- Fencing epoch: bumped on every re-queue; a message or owner with an older one is stale.
    attempt         integer     NOT NULL DEFAULT 0,
    -- Retries consumed since the last redrive; compared with the type's maxRetries.
    retries         integer     NOT NULL DEFAULT 0,
    owner           text,
    heartbeat_at    timestamptz,
    payload         jsonb       NOT NULL,
    result          jsonb,
    error           text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- The heartbeat reaper scans only tasks that someone owns.
CREATE INDEX tasks_owned_heartbeat ON tasks (task_type, heartbeat_at)
    WHERE state IN ('CLAIMED', 'PROCESSING');
CREATE INDEX tasks_type_state ON tasks (task_type, state);

-- Append-only audit log, partitioned by day so that retention is DROP TABLE, not DELETE.
CREATE TABLE task_events (
    seq        bigserial   NOT NULL,
    task_id    uuid        NOT NULL,
    task_type  text        NOT NULL,
    from_state text,
    to_state   text        NOT NULL,
    attempt    integer     NOT NULL,
    worker_id  text,
    detail     text,
    -- clock_timestamp, not now(): a writer that waited for another's row lock must record
    -- a later time than the event it waited for, or the timeline would read backwards.
    at         timestamptz NOT NULL DEFAULT clock_timestamp()
) PARTITION BY RANGE (at);

-- A task's timeline, and point-in-time questions per task.
CREATE INDEX task_events_task ON task_events (task_id, at, seq);
-- Point-in-time questions per task type ("every transcode at 14:05").
CREATE INDEX task_events_type_at ON task_events (task_type, at);

-- Catches rows when a day's partition is missing, so that an audit write never fails.
CREATE TABLE task_events_default PARTITION OF task_events DEFAULT;

-- Creates the daily partitions from yesterday to `days_ahead` days from now (UTC).
-- Every gateway and worker calls it at start; it is idempotent and safe to race.
CREATE FUNCTION conveyor_ensure_event_partitions(days_ahead integer DEFAULT 7)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    day date;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('conveyor_ensure_event_partitions'));
    FOR i IN -1..days_ahead LOOP
        day := (now() AT TIME ZONE 'UTC')::date + i;
        IF to_regclass('task_events_' || to_char(day, 'YYYYMMDD')) IS NULL THEN
            EXECUTE format(
                'CREATE TABLE %I PARTITION OF task_events FOR VALUES FROM (%L) TO (%L)',
                'task_events_' || to_char(day, 'YYYYMMDD'),
                (day::timestamp AT TIME ZONE 'UTC'),
                ((day + 1)::timestamp AT TIME ZONE 'UTC'));
        END IF;
    END LOOP;
END
$$;

-- Retention: drops daily partitions entirely older than `keep_days`. Returns what it dropped.
CREATE FUNCTION conveyor_drop_event_partitions(keep_days integer)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    part record;
    cutoff date := (now() AT TIME ZONE 'UTC')::date - keep_days;
BEGIN
    FOR part IN
        SELECT c.relname FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'task_events'::regclass
          AND c.relname ~ '^task_events_[0-9]{8}$'
          AND to_date(substr(c.relname, 13), 'YYYYMMDD') < cutoff
    LOOP
        EXECUTE format('DROP TABLE %I', part.relname);
        RETURN NEXT part.relname;
    END LOOP;
END
$$;

SELECT conveyor_ensure_event_partitions();
