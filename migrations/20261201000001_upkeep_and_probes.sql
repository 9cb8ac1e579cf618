-- Upkeep that runs by itself (SPEC invariant 8) and the probes that find lost messages
-- (invariant 7, decision 0011).

-- Partitions for the days around `today` (UTC) and for every day whose rows sit in the
-- default partition. A day's rows that landed in the default partition (nobody made its
-- partition in time) are moved into the new partition before it is attached: a plain
-- CREATE ... PARTITION OF would fail with "updated partition constraint for default
-- partition would be violated" and take every later start down with it.
DROP FUNCTION conveyor_ensure_event_partitions(integer);
CREATE FUNCTION conveyor_ensure_event_partitions(days_ahead integer DEFAULT 14,
                                                 today date DEFAULT NULL)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    day date;
    part text;
    lo timestamptz;
    hi timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('conveyor_ensure_event_partitions'));
    today := coalesce(today, (now() AT TIME ZONE 'UTC')::date);
    FOR day IN
        SELECT today + i FROM generate_series(-1, days_ahead) AS i
        UNION
        SELECT DISTINCT (at AT TIME ZONE 'UTC')::date FROM task_events_default
        ORDER BY 1
    LOOP
        part := 'task_events_' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN to_regclass(part) IS NOT NULL;
        lo := day::timestamp AT TIME ZONE 'UTC';
        hi := (day + 1)::timestamp AT TIME ZONE 'UTC';
        EXECUTE format('CREATE TABLE %I (LIKE task_events INCLUDING DEFAULTS)', part);
        EXECUTE format(
            'WITH moved AS (DELETE FROM task_events_default WHERE at >= %L AND at < %L RETURNING *)
             INSERT INTO %I SELECT * FROM moved', lo, hi, part);
        EXECUTE format('ALTER TABLE task_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       part, lo, hi);
        RETURN NEXT part;
    END LOOP;
END
$$;

-- Retention relative to `today` (UTC, default: now), so that tests can move through dates.
DROP FUNCTION conveyor_drop_event_partitions(integer);
CREATE FUNCTION conveyor_drop_event_partitions(keep_days integer, today date DEFAULT NULL)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    part record;
    cutoff date := coalesce(today, (now() AT TIME ZONE 'UTC')::date) - keep_days;
BEGIN
    FOR part IN
        SELECT c.relname FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'task_events'::regclass
          AND c.relname ~ '^task_events_[0-9]{8}$'
          AND to_date(substr(c.relname, 13), 'YYYYMMDD') < cutoff
        ORDER BY c.relname
    LOOP
        EXECUTE format('DROP TABLE %I', part.relname);
        RETURN NEXT part.relname;
    END LOOP;
END
$$;

-- A probe is a marker message published to a work queue. The queue is FIFO, so once a
-- worker has seen a probe, every message published before it has been delivered: a task
-- still waiting unclaimed from before the probe has lost its message (decision 0011).
CREATE TABLE queue_probes (
    id        uuid        PRIMARY KEY,
    task_type text        NOT NULL,
    sent_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    seen_at   timestamptz
);
CREATE INDEX queue_probes_type_sent ON queue_probes (task_type, sent_at);

-- Tasks waiting for a worker, oldest first: what the sweeper and the probe decision read.
CREATE INDEX tasks_waiting ON tasks (task_type, updated_at) WHERE state IN ('INGESTED', 'QUEUED');
