-- Find, follow and fix tasks (issue 16, decision 0024): labels given at submission, a
-- CANCELLED state, and what listing needs, at a cost the hot path can afford.

-- Labels never change after the insert, so they never cost an update anything.
ALTER TABLE tasks ADD COLUMN labels jsonb NOT NULL DEFAULT '{}';

ALTER TABLE tasks DROP CONSTRAINT tasks_state_check;
ALTER TABLE tasks ADD CONSTRAINT tasks_state_check CHECK (state IN ('INGESTED', 'QUEUED',
    'CLAIMED', 'PROCESSING', 'COMPLETED', 'FAILED', 'RETRY_CLAIMED', 'DEAD_LETTER', 'CANCELLED'))
    NOT VALID;
ALTER TABLE tasks VALIDATE CONSTRAINT tasks_state_check;

-- Lists are newest first within a type; ids are time-ordered (UUIDv7). A type's key names
-- its tenant, so no tenant column is needed in front. Both columns are immutable, but a
-- state change is not a HOT update (tasks_owned's predicate reads state), so this index
-- gains an entry per state change: the cost make bench measures (decision 0024).
CREATE INDEX tasks_listed ON tasks (task_type, id);
-- "Which tasks failed": dead letters are few, so a list of them must not walk every
-- completed task. Rows enter it only in the states it names: free on the happy path.
CREATE INDEX tasks_listed_unhappy ON tasks (task_type, id) WHERE state IN ('DEAD_LETTER', 'CANCELLED');
-- Label selectors; tasks without labels (the bench's, most pipelines') never enter it.
CREATE INDEX tasks_labels ON tasks USING gin (labels) WHERE labels <> '{}';
