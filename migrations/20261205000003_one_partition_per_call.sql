-- One partition per call of the making too (issue 32, decision 0031, second review).
--
-- An ATTACH takes the default partition in ACCESS EXCLUSIVE until the call's transaction
-- ends. Writers route rows of a day with no partition (today's, after upkeep missed a day)
-- to the default partition, so a call that attached one day and went on to the next held
-- them out for the rest of it. Now every call makes at most one partition and returns;
-- the caller calls again until a call makes none (core/src/db/partitions.rs).
--
-- And an index for the dead letters of a type no TaskType defines any more (decision
-- 0033): found without walking the type's cancelled rows, which share tasks_listed_unhappy.

CREATE OR REPLACE FUNCTION conveyor_ensure_event_partitions(days_ahead integer DEFAULT 14,
                                                            today date DEFAULT NULL)
RETURNS SETOF text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    day date;
    part text;
    lo timestamptz;
    hi timestamptz;
    oldest date;
    rescued boolean;
BEGIN
    IF NOT pg_has_role(session_user,
                       (SELECT relowner FROM pg_class WHERE oid = 'public.task_events'::regclass),
                       'MEMBER')
       AND (days_ahead NOT BETWEEN 0 AND 62 OR today IS NOT NULL) THEN
        RAISE EXCEPTION 'only the owner of task_events may choose the date or make partitions '
                        'more than 62 days ahead (days_ahead %, today %)', days_ahead, today
            USING ERRCODE = '42501';
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtext('conveyor_ensure_event_partitions')) THEN
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', '100ms', true);
    today := coalesce(today, (now() AT TIME ZONE 'UTC')::date);
    SELECT min(to_date(substr(c.relname, 13), 'YYYYMMDD')) INTO oldest
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'public.task_events'::regclass AND c.relname ~ '^task_events_[0-9]{8}$';
    FOR day IN
        SELECT today + i FROM generate_series(-1, days_ahead) AS i
        UNION
        SELECT DISTINCT (at AT TIME ZONE 'UTC')::date FROM public.task_events_default
        WHERE oldest IS NULL OR at >= oldest::timestamp AT TIME ZONE 'UTC'
        ORDER BY 1
    LOOP
        part := 'task_events_' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN to_regclass('public.' || part) IS NOT NULL;
        lo := day::timestamp AT TIME ZONE 'UTC';
        hi := (day + 1)::timestamp AT TIME ZONE 'UTC';
        BEGIN
            EXECUTE format('CREATE TABLE public.%I (LIKE public.task_events INCLUDING DEFAULTS)',
                           part);
            -- ATTACH trusts this instead of scanning the new table for rows out of range.
            EXECUTE format('ALTER TABLE public.%I ADD CONSTRAINT %I CHECK (at >= %L AND at < %L)',
                           part, part || '_day', lo, hi);
            rescued := EXISTS (SELECT 1 FROM public.task_events_default
                               WHERE at >= lo AND at < hi);
            IF rescued THEN
                -- The parent first, as writers take it (no deadlock with them), and in
                -- EXCLUSIVE so that no writer routes a row of that day to the default
                -- partition between the move and the ATTACH (migration 3).
                LOCK TABLE public.task_events IN EXCLUSIVE MODE;
                LOCK TABLE public.task_events_default IN ACCESS EXCLUSIVE MODE;
                EXECUTE format(
                    'WITH moved AS (DELETE FROM public.task_events_default
                                    WHERE at >= %L AND at < %L RETURNING *)
                     INSERT INTO public.%I SELECT * FROM moved', lo, hi, part);
            END IF;
            EXECUTE format('ALTER TABLE public.task_events ATTACH PARTITION public.%I
                            FOR VALUES FROM (%L) TO (%L)', part, lo, hi);
            RETURN NEXT part;
            -- The locks of an ATTACH (ACCESS EXCLUSIVE on the default partition) and of
            -- a rescue (EXCLUSIVE on the log) last until the call's transaction ends:
            -- end it now, and let the caller's next call go on with the next day.
            RETURN;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'audit partition % not made now: %', part, SQLERRM;
        END;
    END LOOP;
END
$$;


CREATE INDEX tasks_dead_letter ON tasks (task_type) WHERE state = 'DEAD_LETTER';
