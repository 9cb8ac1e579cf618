//! Reads: a task, its timeline, point-in-time states and counts.

use chrono::{DateTime, Utc};
use sqlx::Row;
use uuid::Uuid;

use super::rows::{event_from_row, parse_state, task_from_row, TASK_COLUMNS};
use super::{Db, DbResult};
use crate::lifecycle::TaskState;
use crate::task::{TaskEvent, TaskRecord};

impl Db {
    pub async fn task(&self, id: Uuid) -> DbResult<Option<TaskRecord>> {
        let row = sqlx::query(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(task_from_row).transpose()
    }

    /// A task's audit timeline, oldest first.
    pub async fn events(&self, id: Uuid) -> DbResult<Vec<TaskEvent>> {
        let rows = sqlx::query(
            "SELECT seq, task_id, task_type, from_state, to_state, attempt, worker_id, detail, at
             FROM task_events WHERE task_id = $1 ORDER BY at, seq",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(event_from_row).collect()
    }

    /// Point in time: the state of each task (of `task_type`, or the one task `id`) as of
    /// `at`, rebuilt from the audit log alone.
    pub async fn states_at(
        &self,
        at: DateTime<Utc>,
        task_type: Option<&str>,
        id: Option<Uuid>,
    ) -> DbResult<Vec<(Uuid, TaskState, DateTime<Utc>)>> {
        // Every task: one pass over the log up to `at`. A type or a task: its rows in `tasks`
        // (by `tasks_listed` or the key), then each one's last event before `at` by
        // `task_events_task`; the log has no index by type (the hot path would pay for it).
        let query = if task_type.is_none() && id.is_none() {
            sqlx::query(
                "SELECT DISTINCT ON (task_id) task_id, to_state, at FROM task_events
                 WHERE at <= $1 ORDER BY task_id, at DESC, seq DESC",
            )
            .bind(at)
        } else {
            sqlx::query(
                "SELECT t.id AS task_id, e.to_state, e.at FROM tasks t
                 CROSS JOIN LATERAL (
                     SELECT to_state, at FROM task_events
                     WHERE task_id = t.id AND at <= $1 ORDER BY at DESC, seq DESC LIMIT 1
                 ) e
                 WHERE ($2::text IS NULL OR t.task_type = $2)
                   AND ($3::uuid IS NULL OR t.id = $3)
                 ORDER BY t.id",
            )
            .bind(at)
            .bind(task_type)
            .bind(id)
        };
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter()
            .map(|row| {
                Ok((
                    row.try_get("task_id")?,
                    parse_state(row.try_get("to_state")?)?,
                    row.try_get("at")?,
                ))
            })
            .collect()
    }

    /// How many tasks of each of `types` are dead-lettered (served by the partial index
    /// `tasks_listed_unhappy`, which holds only such rows).
    pub async fn dead_letter_counts(
        &self,
        types: &[String],
    ) -> DbResult<std::collections::HashMap<String, i64>> {
        let rows = sqlx::query(
            "SELECT task_type, count(*) AS n FROM tasks
             WHERE task_type = ANY($1) AND state = 'DEAD_LETTER'
             GROUP BY task_type",
        )
        .bind(types)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| Ok((row.try_get("task_type")?, row.try_get("n")?)))
            .collect()
    }

    /// How many tasks of a type are in each state now.
    pub async fn state_counts(&self, task_type: &str) -> DbResult<Vec<(TaskState, i64)>> {
        let rows = sqlx::query(
            "SELECT state, count(*) AS n FROM tasks WHERE task_type = $1 GROUP BY state",
        )
        .bind(task_type)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| Ok((parse_state(row.try_get("state")?)?, row.try_get("n")?)))
            .collect()
    }
}
