-- The audit log's index diet (issue 12, decision 0027). Each task writes five audit rows, and
-- every row entered two indexes: (task_id, at, seq) and (task_type, at). The second served
-- only point-in-time questions about one task type (`conveyorctl state-at --type`), which
-- now find the type's tasks through `tasks_listed` (task_type, id) and each task's last
-- event through `task_events_task`: a rare operator's question pays instead of every task.
DROP INDEX task_events_type_at;
