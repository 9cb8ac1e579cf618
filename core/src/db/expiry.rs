//! Retention of settled tasks (decision 0034): COMPLETED and CANCELLED rows settled longer
//! ago than their type's retention are handed out a batch at a time (to be exported), then
//! deleted. A task's idempotency key lives as long as its row: the idempotency window is
//! the retention. DEAD_LETTER rows stay until redriven or cancelled, unless their TaskType
//! was deleted with its queues (decision 0044); open ones always stay.

use chrono::{DateTime, Duration, Utc};
use sqlx::{Postgres, Row, Transaction};
use uuid::Uuid;

use super::listing::{v7_floor, CLOCK_SLACK_MINUTES};
use super::requeue::state_literals;
use super::rows::{task_from_row, TASK_COLUMNS};
use super::{Db, DbResult};
use crate::lifecycle::TaskState::*;
use crate::task::TaskRecord;

/// `types`: every task type of the table, one index probe each (a skip scan of
/// `tasks_listed`), and a NULL at the end.
pub(super) const TYPES_IN_TABLE: &str = "WITH RECURSIVE types AS (
         (SELECT task_type FROM tasks ORDER BY task_type LIMIT 1)
         UNION ALL
         SELECT (SELECT t.task_type FROM tasks t WHERE t.task_type > types.task_type
                 ORDER BY t.task_type LIMIT 1)
         FROM types WHERE types.task_type IS NOT NULL
     )";

/// Expired tasks, locked until [`PendingExpiry::delete`] (or dropped, which keeps them).
pub struct PendingExpiry {
    tx: Transaction<'static, Postgres>,
    /// In id order: the last one is where the next batch of the pass starts.
    pub ids: Vec<Uuid>,
    /// The whole rows, when asked for (to be archived); empty otherwise.
    pub records: Vec<TaskRecord>,
}

impl PendingExpiry {
    /// Deletes the tasks handed out; returns how many went.
    pub async fn delete(mut self) -> DbResult<u64> {
        let deleted = sqlx::query("DELETE FROM tasks WHERE id = ANY($1)")
            .bind(&self.ids)
            .execute(&mut *self.tx)
            .await?
            .rows_affected();
        self.tx.commit().await?;
        Ok(deleted)
    }
}

impl Db {
    /// Every task type the table holds rows of, never a pass over the tasks.
    pub async fn task_types_in_table(&self) -> DbResult<Vec<String>> {
        Ok(sqlx::query_scalar(&format!(
            "{TYPES_IN_TABLE} SELECT task_type FROM types WHERE task_type IS NOT NULL"
        ))
        .fetch_all(&self.pool)
        .await?)
    }

    /// Locks up to `limit` tasks of `task_type` that settled (COMPLETED or CANCELLED, and
    /// DEAD_LETTER with `dead_letters`) before `cutoff`, in id order after `after`; `None`
    /// when there are none. Walks the type's tasks by id (UUIDv7, so by creation time) only
    /// up to the cutoff: a pass costs the tasks made before it, not the table. `whole`: read
    /// the whole rows (to archive them), not only their ids.
    pub async fn begin_expiry(
        &self,
        task_type: &str,
        cutoff: DateTime<Utc>,
        after: Option<Uuid>,
        limit: i64,
        whole: bool,
        dead_letters: bool,
    ) -> DbResult<Option<PendingExpiry>> {
        let mut tx = self.pool.begin().await?;
        let columns = if whole { TASK_COLUMNS } else { "id" };
        let settled: &[_] = if dead_letters {
            &[Completed, Cancelled, DeadLetter]
        } else {
            &[Completed, Cancelled]
        };
        let rows = sqlx::query(&format!(
            "SELECT {columns} FROM tasks
             WHERE task_type = $1 AND id > $2 AND id < $3 AND state IN ({settled})
               AND updated_at < $4
             ORDER BY id LIMIT $5 FOR UPDATE SKIP LOCKED",
            settled = state_literals(settled),
        ))
        .bind(task_type)
        .bind(after.unwrap_or(Uuid::nil()))
        .bind(v7_floor(cutoff + Duration::minutes(CLOCK_SLACK_MINUTES)))
        .bind(cutoff)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let ids = rows
            .iter()
            .map(|row| row.try_get("id"))
            .collect::<Result<_, _>>()?;
        let records = if whole {
            rows.iter().map(task_from_row).collect::<DbResult<_>>()?
        } else {
            Vec::new()
        };
        Ok(Some(PendingExpiry { tx, ids, records }))
    }
}
