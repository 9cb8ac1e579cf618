-- Making a partition beside live writers. A writer routes its row to a partition when its
-- INSERT starts: one that chose the default partition and then waited for the rescue's lock
-- would insert there after the ATTACH and fail ("new row for relation task_events_default
-- violates partition constraint"), failing a task's transition with it (found by
-- db_layer::a_partition_rescue_beside_live_writers_loses_no_row_and_leaves_none_behind).
-- So each day's partition is made holding the parent in EXCLUSIVE mode: audit writers (ROW
-- EXCLUSIVE) wait before they route, and route to the new partition once it is attached;
-- readers are not blocked. Partitions are made about once a day, so writers wait rarely, for
-- as long as one day's rows take to move.
CREATE OR REPLACE FUNCTION conveyor_ensure_event_partitions(days_ahead integer DEFAULT 14,
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
        BEGIN
            -- The parent first, as writers take it: no deadlock with them.
            LOCK TABLE task_events IN EXCLUSIVE MODE;
            LOCK TABLE task_events_default IN ACCESS EXCLUSIVE MODE;
            EXECUTE format('CREATE TABLE %I (LIKE task_events INCLUDING DEFAULTS)', part);
            EXECUTE format(
                'WITH moved AS (DELETE FROM task_events_default WHERE at >= %L AND at < %L RETURNING *)
                 INSERT INTO %I SELECT * FROM moved', lo, hi, part);
            EXECUTE format('ALTER TABLE task_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                           part, lo, hi);
            RETURN NEXT part;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'audit partition % not made: %', part, SQLERRM;
        END;
    END LOOP;
END
$$;
