-- The partition functions run as their owner (migration 8), so nothing a caller can create
-- may stand in for what they call. A SECURITY DEFINER function must not search a schema
-- that others can write (PostgreSQL 14 and older let every role create in `public`, where
-- a function with a closer argument type, such as substr(name, integer), would win over
-- the built-in, CVE-2018-1058): they search only pg_catalog and name their tables in full.
-- A caller other than the owner (the gateway's role) gets the upkeep it needs and no more:
-- partitions from the real date, at most 62 days ahead; retention of at least a day.
CREATE OR REPLACE FUNCTION conveyor_ensure_event_partitions(days_ahead integer DEFAULT 14,
                                                            today date DEFAULT NULL)
RETURNS SETOF text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    day date;
    part text;
    lo timestamptz;
    hi timestamptz;
BEGIN
    IF NOT pg_has_role(session_user,
                       (SELECT relowner FROM pg_class WHERE oid = 'public.task_events'::regclass),
                       'MEMBER')
       AND (days_ahead NOT BETWEEN 0 AND 62 OR today IS NOT NULL) THEN
        RAISE EXCEPTION 'only the owner of task_events may choose the date or make partitions '
                        'more than 62 days ahead (days_ahead %, today %)', days_ahead, today
            USING ERRCODE = '42501';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('conveyor_ensure_event_partitions'));
    today := coalesce(today, (now() AT TIME ZONE 'UTC')::date);
    FOR day IN
        SELECT today + i FROM generate_series(-1, days_ahead) AS i
        UNION
        SELECT DISTINCT (at AT TIME ZONE 'UTC')::date FROM public.task_events_default
        ORDER BY 1
    LOOP
        part := 'task_events_' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN to_regclass('public.' || part) IS NOT NULL;
        lo := day::timestamp AT TIME ZONE 'UTC';
        hi := (day + 1)::timestamp AT TIME ZONE 'UTC';
        BEGIN
            -- The parent first, as writers take it: no deadlock with them (migration 3).
            LOCK TABLE public.task_events IN EXCLUSIVE MODE;
            LOCK TABLE public.task_events_default IN ACCESS EXCLUSIVE MODE;
            EXECUTE format('CREATE TABLE public.%I (LIKE public.task_events INCLUDING DEFAULTS)',
                           part);
            EXECUTE format(
                'WITH moved AS (DELETE FROM public.task_events_default
                                WHERE at >= %L AND at < %L RETURNING *)
                 INSERT INTO public.%I SELECT * FROM moved', lo, hi, part);
            EXECUTE format('ALTER TABLE public.task_events ATTACH PARTITION public.%I
                            FOR VALUES FROM (%L) TO (%L)', part, lo, hi);
            RETURN NEXT part;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'audit partition % not made: %', part, SQLERRM;
        END;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION conveyor_drop_event_partitions(keep_days integer, today date DEFAULT NULL)
RETURNS SETOF text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    part record;
    cutoff date := coalesce(today, (now() AT TIME ZONE 'UTC')::date) - keep_days;
BEGIN
    IF NOT pg_has_role(session_user,
                       (SELECT relowner FROM pg_class WHERE oid = 'public.task_events'::regclass),
                       'MEMBER')
       AND (keep_days < 1 OR today IS NOT NULL) THEN
        RAISE EXCEPTION 'only the owner of task_events may choose the date or keep less than '
                        'a day (keep_days %, today %)', keep_days, today
            USING ERRCODE = '42501';
    END IF;
    FOR part IN
        SELECT c.relname FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'public.task_events'::regclass
          AND c.relname ~ '^task_events_[0-9]{8}$'
          AND to_date(substr(c.relname, 13), 'YYYYMMDD') < cutoff
        ORDER BY c.relname
    LOOP
        EXECUTE format('DROP TABLE public.%I', part.relname);
        RETURN NEXT part.relname;
    END LOOP;
END
$$;

REVOKE EXECUTE ON FUNCTION conveyor_ensure_event_partitions(integer, date) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION conveyor_drop_event_partitions(integer, date) FROM PUBLIC;
