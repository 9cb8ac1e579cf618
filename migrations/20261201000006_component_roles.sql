-- Least privilege for the gateway (decision 0015): it runs as a role that owns nothing, so
-- the upkeep's partition functions run as their owner (SECURITY DEFINER, with a fixed
-- search_path so that a caller cannot put its own objects in their way), and only roles
-- granted EXECUTE may call them: a function is executable by PUBLIC unless revoked.
ALTER FUNCTION conveyor_ensure_event_partitions(integer, date)
    SECURITY DEFINER SET search_path = public, pg_temp;

-- Retention as before, but a caller other than the owner keeps at least a day, counted
-- from the real date: the gateway's role cannot drop today's partition or later ones.
CREATE OR REPLACE FUNCTION conveyor_drop_event_partitions(keep_days integer, today date DEFAULT NULL)
RETURNS SETOF text LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    part record;
    cutoff date := coalesce(today, (now() AT TIME ZONE 'UTC')::date) - keep_days;
BEGIN
    IF NOT pg_has_role(session_user,
                       (SELECT relowner FROM pg_class WHERE oid = 'task_events'::regclass),
                       'MEMBER')
       AND (keep_days < 1 OR today IS NOT NULL) THEN
        RAISE EXCEPTION 'only the owner of task_events may choose the date or keep less than '
                        'a day (keep_days %, today %)', keep_days, today
            USING ERRCODE = '42501';
    END IF;
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

REVOKE EXECUTE ON FUNCTION conveyor_ensure_event_partitions(integer, date) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION conveyor_drop_event_partitions(integer, date) FROM PUBLIC;
