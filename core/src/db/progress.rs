//! Handlers' progress reports: the latest of each task, written by its owner.

use uuid::Uuid;

use super::{Db, DbResult, Fence};
use crate::lifecycle::TaskState::{Completed, Processing};

impl Db {
    /// Stores each report on its task while the reporter still owns it at that attempt,
    /// PROCESSING or just COMPLETED by it (a flush that raced the completion still lands; a
    /// re-queue clears the owner, so no report outlives its attempt). A row locked right now
    /// (a heartbeat, the completion) is waited for, in id order as claims and completions
    /// lock: skipping it lost the report of a handler that does not report again for long.
    /// One statement for all of a worker's reports. Returns how many were stored.
    pub async fn report_progress(&self, reports: &[(Fence, serde_json::Value)]) -> DbResult<u64> {
        if reports.is_empty() {
            return Ok(0);
        }
        let ids: Vec<Uuid> = reports.iter().map(|(f, _)| f.id).collect();
        let attempts: Vec<i32> = reports.iter().map(|(f, _)| f.attempt).collect();
        let owners: Vec<&str> = reports.iter().map(|(f, _)| f.owner.as_str()).collect();
        let values: Vec<&serde_json::Value> = reports.iter().map(|(_, v)| v).collect();
        Ok(sqlx::query(
            "WITH reported AS (
                 SELECT t.id, c.progress FROM tasks t
                 JOIN unnest($1::uuid[], $2::int[], $3::text[], $4::jsonb[])
                     AS c(id, attempt, owner, progress)
                     ON t.id = c.id AND t.attempt = c.attempt AND t.owner = c.owner
                 WHERE t.state IN ($5, $6)
                 ORDER BY t.id FOR UPDATE OF t
             )
             UPDATE tasks SET progress = reported.progress FROM reported WHERE tasks.id = reported.id",
        )
        .bind(&ids)
        .bind(&attempts)
        .bind(&owners)
        .bind(&values)
        .bind(Processing.as_str())
        .bind(Completed.as_str())
        .execute(&self.pool)
        .await?
        .rows_affected())
    }
}
