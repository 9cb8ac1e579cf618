//! Reads: a task, its timeline, point-in-time states and counts.

use chrono::{DateTime, Utc};
use sqlx::Row;
use uuid::Uuid;

use super::rows::{event_from_row, parse_state, task_from_row, TASK_COLUMNS};
use super::{Db, DbResult};
use crate::lifecycle::TaskState;
use crate::task::{TaskEvent, TaskRecord};

/// How much later than a task's `updated_at` (its transaction's start) the audit rows of that
/// transition may be stamped: statements are bounded by `statement_timeout` (30 s) and a
/// transaction left idle by `idle_in_transaction_session_timeout` (30 s); a wide margin
/// costs only a few more probes.
const TRANSITION_SKEW: std::time::Duration = std::time::Duration::from_secs(300);

impl Db {
    pub async fn task(&self, id: Uuid) -> DbResult<Option<TaskRecord>> {
        let row = sqlx::query(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(task_from_row).transpose()
    }

    /// A task's audit timeline, oldest first: the log, and what retention kept of an open
    /// task's older days beside it (`task_events_kept`, migration 20261206000001).
    pub async fn events(&self, id: Uuid) -> DbResult<Vec<TaskEvent>> {
        let rows = sqlx::query(
            "SELECT seq, task_id, task_type, from_state, to_state, attempt, worker_id, detail, at
             FROM task_events WHERE task_id = $1
             UNION ALL
             SELECT seq, task_id, task_type, from_state, to_state, attempt, worker_id, detail, at
             FROM task_events_kept WHERE task_id = $1
             ORDER BY at, seq",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(event_from_row).collect()
    }

    /// Point in time: the state of each task (of `task_type`, the one task `id`, or every
    /// task) as of `at`, and since when, from the audit log.
    ///
    /// A task whose last transition (`updated_at`, written with each one) came well before
    /// `at` is in the state it is in now: only the tasks that changed since, or shortly
    /// before (a transaction stamps `updated_at` at its start and its events a little
    /// later), are looked up in the log, one index probe each. The cost follows the work
    /// done since `at`, not the size of the log (before, every task of the type was probed,
    /// and every event of the log sorted). A task created after `at` is left out; so is one
    /// whose events before `at` retention has dropped, when it changed since.
    pub async fn states_at(
        &self,
        at: DateTime<Utc>,
        task_type: Option<&str>,
        id: Option<Uuid>,
    ) -> DbResult<Vec<(Uuid, TaskState, DateTime<Utc>)>> {
        let query = match id {
            Some(id) => sqlx::query(
                "SELECT task_id, to_state, at, seq FROM task_events WHERE task_id = $2 AND at <= $1
                 UNION ALL
                 SELECT task_id, to_state, at, seq FROM task_events_kept
                 WHERE task_id = $2 AND at <= $1
                 ORDER BY at DESC, seq DESC LIMIT 1",
            )
            .bind(at)
            .bind(id),
            None => sqlx::query(
                "SELECT t.id AS task_id, t.state AS to_state, t.updated_at AS at FROM tasks t
                 WHERE ($2::text IS NULL OR t.task_type = $2)
                   AND t.updated_at <= $1 - make_interval(secs => $3)
                 UNION ALL
                 SELECT t.id, e.to_state, e.at FROM tasks t
                 CROSS JOIN LATERAL (
                     SELECT to_state, at, seq FROM task_events WHERE task_id = t.id AND at <= $1
                     UNION ALL
                     SELECT to_state, at, seq FROM task_events_kept
                     WHERE task_id = t.id AND at <= $1
                     ORDER BY at DESC, seq DESC LIMIT 1
                 ) e
                 WHERE ($2::text IS NULL OR t.task_type = $2)
                   AND t.updated_at > $1 - make_interval(secs => $3)
                 ORDER BY 1",
            )
            .bind(at)
            .bind(task_type)
            .bind(TRANSITION_SKEW.as_secs_f64()),
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
