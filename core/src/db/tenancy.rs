//! Moving a task type from before tenancy into its namespace (decision 0012).

use super::rows::{task_from_row, TASK_COLUMNS};
use super::{Db, DbResult};
use crate::lifecycle::TaskState;
use crate::task::TaskRecord;
use crate::task_type::DEFAULT_TENANT;
use uuid::Uuid;

impl Db {
    /// Moves the rows of a type recorded before tenancy (keyed by its bare name `old_key`,
    /// tenant `default`) to `tenant` under `key`: its tasks, their audit rows and its probes,
    /// in one transaction. Returns how many tasks moved (0 when run again).
    pub async fn adopt_type(&self, old_key: &str, tenant: &str, key: &str) -> DbResult<u64> {
        let mut tx = self.maintenance.begin().await?;
        let moved = sqlx::query(
            "UPDATE tasks SET tenant = $2, task_type = $3
             WHERE task_type = $1 AND tenant = $4",
        )
        .bind(old_key)
        .bind(tenant)
        .bind(key)
        .bind(DEFAULT_TENANT)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query("UPDATE task_events SET task_type = $2 WHERE task_type = $1")
            .bind(old_key)
            .bind(key)
            .execute(&mut *tx)
            .await?;
        // Probes of the old queues can never be seen now.
        sqlx::query("DELETE FROM queue_probes WHERE task_type = $1")
            .bind(old_key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(moved)
    }

    /// Up to `limit` tasks of `task_type` in one of `states` with ids above `after`, by id:
    /// pages that a change of the rows in between cannot make skip or repeat one.
    pub async fn tasks_in(
        &self,
        task_type: &str,
        states: &[TaskState],
        after: Option<Uuid>,
        limit: i64,
    ) -> DbResult<Vec<TaskRecord>> {
        let states: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
        let rows = sqlx::query(&format!(
            "SELECT {TASK_COLUMNS} FROM tasks
             WHERE task_type = $1 AND state = ANY($2) AND ($3::uuid IS NULL OR id > $3)
             ORDER BY id LIMIT $4"
        ))
        .bind(task_type)
        .bind(&states)
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(task_from_row).collect()
    }
}
