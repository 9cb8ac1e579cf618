-- The rescue of a day's rows from the default partition, made safe beside live writers and
-- kept from taking the other days down with it:
-- - the default partition is locked while a day's rows move out of it, so that no writer
--   slips a row of that day in between the move and the ATTACH (which would then fail);
-- - each day is its own subtransaction: a day that fails is reported (a warning, and it is
--   not in the returned list) and tried again at the next upkeep, the others are made.
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
            EXECUTE format('CREATE TABLE %I (LIKE task_events INCLUDING DEFAULTS)', part);
            LOCK TABLE task_events_default IN ACCESS EXCLUSIVE MODE;
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
