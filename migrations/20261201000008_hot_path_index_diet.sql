-- The hot path's index diet (issue 12, decision 0016). Every index on tasks is written again
-- for each new version of a row, and a task has four; an index that no query needs is pure
-- cost, and one on a column an update changes rules out a HOT update.
--
-- tasks_type_state served only the test suites' per-state counts (a scan of a test database
-- is as fast); nothing on the data path reads by (type, state).
DROP INDEX tasks_type_state;
-- The reaper's index, without heartbeat_at: a heartbeat then changes no indexed column and
-- can be a HOT update (no index writes at all). The reaper reads the owned rows of a type,
-- which are bounded by the pool's concurrency, and compares their heartbeats itself.
DROP INDEX tasks_owned_heartbeat;
CREATE INDEX tasks_owned ON tasks (task_type, owner) WHERE state IN ('CLAIMED', 'PROCESSING');
-- Room on each page for a HOT version, and vacuum before the dead versions of a busy table
-- pile up (the default waits for a fifth of the table to be dead).
ALTER TABLE tasks SET (fillfactor = 90, autovacuum_vacuum_scale_factor = 0.02,
                       autovacuum_vacuum_insert_scale_factor = 0.05);
