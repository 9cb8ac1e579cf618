-- Audit-partition upkeep that never stalls the platform, and retention that keeps the
-- history of open tasks (issue 32, decision 0031).
--
-- A lock request that waits makes every later request on the same table wait behind it. The
-- functions of migration 7 took EXCLUSIVE on task_events and then waited, with no limit, for
-- ACCESS EXCLUSIVE on the default partition, which any reader of the whole log holds in
-- ACCESS SHARE (pg_dump, an analytics query, `conveyorctl state-at`): every audit writer,
-- hence every ingest, claim and completion, stopped until that reader ended. Now:
-- - a day's partition is made as a table of its own with a CHECK constraint on its range,
--   then attached: ATTACH holds task_events only in SHARE UPDATE EXCLUSIVE, which writers
--   (ROW EXCLUSIVE) and readers (ACCESS SHARE) pass; it still takes the default partition
--   in ACCESS EXCLUSIVE, which writers never touch (an INSERT locks the partition it
--   routes to) but whole-log readers do;
-- - the parent is taken in EXCLUSIVE only to rescue a day's rows from the default
--   partition (after days with no upkeep), never for a day that has none;
-- - every lock is asked for with a 100 ms lock_timeout, so nobody waits behind upkeep for
--   longer than that; a day not made or dropped now is tried at the next pass (the gateway
--   comes back sooner while work is left, see core/src/db/partitions.rs);
-- - a second caller does not queue on the advisory lock: one at a time is enough.
--
-- Retention keeps the history of open tasks (invariant 3): a dead letter parked longer
-- than the retention period keeps its whole timeline. Before a day's partition is dropped,
-- the events in it of tasks that are neither COMPLETED nor CANCELLED are copied aside; once
-- it is dropped, its range belongs to no partition, so re-inserted they land in the default
-- partition, where every reader of the log still finds them. They leave it when their task
-- settles and the retention period has passed.
--
-- Rows of a day older than every dated partition are such kept history (retention dropped
-- that day), so the rescue leaves them in the default partition; rows of later days (upkeep
-- missed) are rescued into their day's partition as before.

CREATE OR REPLACE FUNCTION conveyor_ensure_event_partitions(days_ahead integer DEFAULT 14,
                                                            today date DEFAULT NULL)
RETURNS SETOF text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    day date;
    part text;
    lo timestamptz;
    hi timestamptz;
    oldest date;
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
            IF EXISTS (SELECT 1 FROM public.task_events_default WHERE at >= lo AND at < hi) THEN
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
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'audit partition % not made now: %', part, SQLERRM;
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
    -- The same lock as the making: both change the set of partitions.
    IF NOT pg_try_advisory_xact_lock(hashtext('conveyor_ensure_event_partitions')) THEN
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', '100ms', true);
    FOR part IN
        SELECT c.relname FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'public.task_events'::regclass
          AND c.relname ~ '^task_events_[0-9]{8}$'
          AND to_date(substr(c.relname, 13), 'YYYYMMDD') < cutoff
        ORDER BY c.relname
    LOOP
        BEGIN
            -- Copied aside before the lock: a past day's rows no longer change, and the
            -- copy may take a while on a big day.
            DROP TABLE IF EXISTS pg_temp.conveyor_kept_events;
            EXECUTE format(
                'CREATE TEMP TABLE conveyor_kept_events ON COMMIT DROP AS
                 SELECT e.* FROM public.%I e
                 WHERE EXISTS (SELECT 1 FROM public.tasks t WHERE t.id = e.task_id
                                 AND t.state NOT IN (''COMPLETED'', ''CANCELLED''))',
                part.relname);
            EXECUTE format('DROP TABLE public.%I', part.relname);
            INSERT INTO public.task_events SELECT * FROM pg_temp.conveyor_kept_events;
            RETURN NEXT part.relname;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'audit partition % not dropped now: %', part.relname, SQLERRM;
        END;
    END LOOP;
    -- Kept history whose task has settled (or is gone) since, and whose day is past the
    -- retention period, goes now; a bounded batch per pass.
    DELETE FROM public.task_events_default d
    WHERE d.ctid IN (
        SELECT k.ctid FROM public.task_events_default k
        WHERE k.at < cutoff::timestamp AT TIME ZONE 'UTC'
          AND NOT EXISTS (SELECT 1 FROM public.tasks t WHERE t.id = k.task_id
                            AND t.state NOT IN ('COMPLETED', 'CANCELLED'))
        LIMIT 10000);
END
$$;

-- What upkeep still owes, for its metrics and to come back sooner: how many days from
-- today (UTC) on have their partition without a gap, and how many partitions are past
-- `keep_days` (0: none counted).
CREATE FUNCTION conveyor_event_partitions_owed(keep_days integer, today date DEFAULT NULL,
                                               OUT days_ahead integer, OUT overdue integer)
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    day date := coalesce(today, (now() AT TIME ZONE 'UTC')::date);
BEGIN
    days_ahead := 0;
    WHILE to_regclass('public.task_events_' || to_char(day + days_ahead, 'YYYYMMDD')) IS NOT NULL
          AND days_ahead < 366 LOOP
        days_ahead := days_ahead + 1;
    END LOOP;
    SELECT count(*) INTO overdue
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE keep_days > 0
      AND i.inhparent = 'public.task_events'::regclass
      AND c.relname ~ '^task_events_[0-9]{8}$'
      AND to_date(substr(c.relname, 13), 'YYYYMMDD') < day - keep_days;
END
$$;

-- Tenant roles (decision 0013) write only what their workers write: an audit row's time and
-- sequence number come from the database, never from the writer (a forged day would add a
-- partition, or hide among kept history); a probe is only marked seen. Column privileges
-- also keep LOCK TABLE, which needs them on the whole table, to ACCESS SHARE. Roles granted
-- before this migration are narrowed here; `grant_tenant` grants the same from now on.
DO $$
DECLARE
    role record;
BEGIN
    FOR role IN
        SELECT DISTINCT grantee FROM information_schema.role_table_grants
        WHERE table_name IN ('task_events', 'queue_probes') AND grantee LIKE 'conveyor-%'
    LOOP
        EXECUTE format('REVOKE INSERT, UPDATE ON task_events, queue_probes FROM %I', role.grantee);
        EXECUTE format('GRANT INSERT (task_id, task_type, from_state, to_state, attempt, '
                       'worker_id, detail) ON task_events TO %I', role.grantee);
        EXECUTE format('GRANT UPDATE (seen_at) ON queue_probes TO %I', role.grantee);
    END LOOP;
END
$$;
