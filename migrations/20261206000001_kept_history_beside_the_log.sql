-- The history of open tasks, kept past the retention period, lives beside the log (issue
-- 32, decision 0042).
--
-- Retention copied a dropped day's events of still-open tasks aside, dropped the day, and
-- inserted them again into the log: into its default partition, while the DROP still held
-- the whole log in ACCESS EXCLUSIVE. Every writer waited for that insert. A tenant's role
-- may append audit rows to its own open task (a dead letter can stay open for ever), so a
-- tenant chose how long every other tenant's transitions stood still at each day's drop.
--
-- Now those events are copied into `task_events_kept`, an ordinary table outside the
-- partitioned log, before the drop takes any lock on the log; under the lock there is only
-- the DROP. A past day's rows no longer change (writers cannot choose an event's time),
-- and a settled task never opens again, so a copy taken before the lock holds every event
-- that must stay. Readers of a task's history read both tables (core/src/db/reads.rs).

CREATE TABLE task_events_kept (LIKE task_events INCLUDING DEFAULTS);
CREATE INDEX task_events_kept_task ON task_events_kept (task_id, at, seq);
ALTER TABLE task_events_kept ENABLE ROW LEVEL SECURITY;

-- History kept before this migration waits in the default partition, for days older than
-- every dated partition (rows of a day with no partition yet are newer, and stay).
WITH oldest AS (
    SELECT min(to_date(substr(c.relname, 13), 'YYYYMMDD')) AS day
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'public.task_events'::regclass AND c.relname ~ '^task_events_[0-9]{8}$'
), moved AS (
    DELETE FROM task_events_default d USING oldest
    WHERE d.at < oldest.day::timestamp AT TIME ZONE 'UTC'
    RETURNING d.*
)
INSERT INTO task_events_kept SELECT * FROM moved;

-- Whoever may read the log reads its kept part, under the same rule: the gateway's roles
-- (a policy admitting every row of the log) every row, a tenant's role the rows of its own
-- tasks (roles granted from now on get the same from core/src/db/grants.rs).
DO $$
DECLARE
    role record;
BEGIN
    FOR role IN
        SELECT DISTINCT unnest(roles)::text AS grantee, qual = 'true' AS every_row
        FROM pg_policies
        WHERE schemaname = 'public' AND tablename = 'task_events'
    LOOP
        EXECUTE format('GRANT SELECT ON task_events_kept TO %I', role.grantee);
        IF role.every_row THEN
            EXECUTE format('CREATE POLICY %I ON task_events_kept TO %I USING (true)',
                           role.grantee, role.grantee);
        ELSE
            EXECUTE format('CREATE POLICY %I ON task_events_kept TO %I
                            USING (EXISTS (SELECT 1 FROM tasks t WHERE t.id = task_id))',
                           role.grantee, role.grantee);
        END IF;
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
    -- Kept history whose task has settled (or is gone) since goes first: a bounded batch,
    -- with no lock on the log.
    DELETE FROM public.task_events_kept d
    WHERE d.ctid IN (
        SELECT k.ctid FROM public.task_events_kept k
        WHERE NOT EXISTS (SELECT 1 FROM public.tasks t WHERE t.id = k.task_id
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
        -- The events of tasks still open are copied out first, however many a tenant
        -- wrote: nothing waits for this but the caller. Under the log's lock, only the
        -- DROP. (A task that settles meanwhile leaves a copy, let go by a later pass.)
        EXECUTE format(
            'INSERT INTO public.task_events_kept
             SELECT e.* FROM public.%I e
             WHERE EXISTS (SELECT 1 FROM public.tasks t WHERE t.id = e.task_id
                             AND t.state NOT IN (''COMPLETED'', ''CANCELLED''))',
            part);
        EXECUTE format('DROP TABLE public.%I', part);
        RETURN NEXT part;
    EXCEPTION WHEN OTHERS THEN
        RAISE WARNING 'audit partition % not dropped now: %', part, SQLERRM;
    END;
END
$$;
