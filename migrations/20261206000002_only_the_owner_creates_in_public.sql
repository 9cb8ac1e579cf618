-- Issue 33, item 6. On PostgreSQL 14 and older, and in a database upgraded from one, every
-- role may create objects in `public`. A tenant's role could then put a table or function
-- there named like one the application calls (a function with a closer argument type wins
-- the call). Only the owner creates in `public` from now on, and every role the project made
-- searches `pg_catalog` first (`conveyorctl grant` does both for the roles it makes later).
-- REVOKE by a role that does not own `public` only warns; the notice says what to run.
DO $$
BEGIN
    REVOKE CREATE ON SCHEMA public FROM PUBLIC;
    IF has_schema_privilege('public', 'public', 'CREATE') THEN
        RAISE NOTICE 'every role may still create in schema public: run REVOKE CREATE ON SCHEMA public FROM PUBLIC as its owner';
    END IF;
END $$;

DO $$
DECLARE
    role record;
BEGIN
    FOR role IN
        SELECT DISTINCT grantee FROM information_schema.role_table_grants
        WHERE table_schema = 'public' AND table_name = 'tasks'
          AND grantee NOT IN ('PUBLIC', current_user)
          -- The tables' owner makes the audit partitions in `public`: never revoked here.
          AND grantee <> (SELECT pg_get_userbyid(relowner) FROM pg_class
                          WHERE oid = 'public.tasks'::regclass)
    LOOP
        BEGIN
            EXECUTE format('REVOKE CREATE ON SCHEMA public FROM %I', role.grantee);
            EXECUTE format('ALTER ROLE %I SET search_path = pg_catalog, public', role.grantee);
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'cannot pin the search_path of role %: run conveyorctl grant for it again', role.grantee;
        END;
    END LOOP;
END $$;
