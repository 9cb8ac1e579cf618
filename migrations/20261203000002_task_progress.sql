-- A handler's progress, stored with its task (issue 16, decision 0024): the latest report
-- only, bounded by the worker (1 KiB), written at most once a second per worker in one
-- statement. An unindexed column: the update can be HOT.
ALTER TABLE tasks ADD COLUMN progress jsonb;

-- Tenants' worker roles made before this column may write it too (new ones get it from
-- `conveyorctl grant`, core/src/db/grants.rs).
DO $$
DECLARE
    role record;
BEGIN
    FOR role IN SELECT rolname FROM pg_roles WHERE rolname LIKE 'conveyor-%' LOOP
        IF has_table_privilege(role.rolname, 'tasks', 'SELECT') THEN
            EXECUTE format('GRANT UPDATE (progress) ON tasks TO %I', role.rolname);
        END IF;
    END LOOP;
END
$$;
