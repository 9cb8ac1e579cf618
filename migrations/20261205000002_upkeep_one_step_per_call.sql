-- Audit-partition upkeep one step per call (issue 32, decision 0031, after review).
--
-- A lock taken in a PL/pgSQL block that succeeded lasts until the calling statement ends,
-- not until the block does. The functions of 20261205000001 went on after a DROP (ACCESS
-- EXCLUSIVE on task_events) or a rescue (EXCLUSIVE) to the next day, so a pass that
-- dropped several days, or rescued one and then made more, held every writer out for the
-- rest of it. Now a call drops at most one day (the oldest; the caller calls again), and
-- ends right after a rescue; the caller loops (core/src/db/partitions.rs). Writers wait at
-- most for one day's drop or rescue and the 100 ms lock timeout.

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
            -- The locks of a rescue last until the statement ends: end it now, and let
            -- the caller's next call go on with the next day.
            IF rescued THEN
                RETURN;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'audit partition % not made now: %', part, SQLERRM;
        END;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION conveyor_drop_event_partitions(keep_days integer, today date DEFAULT NULL)
RETURNS SETOF text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    part text;
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
    -- The same lock as the making: both change the set of partitions.
    IF NOT pg_try_advisory_xact_lock(hashtext('conveyor_ensure_event_partitions')) THEN
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', '100ms', true);
    -- Kept history whose task has settled (or is gone) since, and whose day is past the
    -- retention period, goes first, before any lock on the parent: a bounded batch.
    DELETE FROM public.task_events_default d
    WHERE d.ctid IN (
        SELECT k.ctid FROM public.task_events_default k
        WHERE k.at < cutoff::timestamp AT TIME ZONE 'UTC'
          AND NOT EXISTS (SELECT 1 FROM public.tasks t WHERE t.id = k.task_id
                            AND t.state NOT IN ('COMPLETED', 'CANCELLED'))
        LIMIT 10000);
    -- Then the oldest overdue day, and only it: DROP holds the parent in ACCESS EXCLUSIVE
    -- until the statement ends, so nothing else may follow it here. Days go oldest first,
    -- and a day that cannot go now stops the caller, so that every dropped day is older
    -- than every dated partition left (the making relies on it).
    SELECT c.relname INTO part FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'public.task_events'::regclass
      AND c.relname ~ '^task_events_[0-9]{8}$'
      AND to_date(substr(c.relname, 13), 'YYYYMMDD') < cutoff
    ORDER BY c.relname LIMIT 1;
    IF part IS NULL THEN
        RETURN;
    END IF;
    BEGIN
        -- Copied aside before the lock: a past day's rows no longer change, and the copy
        -- may take a while on a big day. Re-inserted under the lock: only the events of
        -- tasks still open, which is what must not be lost.
        DROP TABLE IF EXISTS pg_temp.conveyor_kept_events;
        EXECUTE format(
            'CREATE TEMP TABLE conveyor_kept_events ON COMMIT DROP AS
             SELECT e.* FROM public.%I e
             WHERE EXISTS (SELECT 1 FROM public.tasks t WHERE t.id = e.task_id
                             AND t.state NOT IN (''COMPLETED'', ''CANCELLED''))',
            part);
        EXECUTE format('DROP TABLE public.%I', part);
        INSERT INTO public.task_events SELECT * FROM pg_temp.conveyor_kept_events;
        RETURN NEXT part;
    EXCEPTION WHEN OTHERS THEN
        RAISE WARNING 'audit partition % not dropped now: %', part, SQLERRM;
    END;
END
$$;
