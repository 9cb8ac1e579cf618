//! What a client may do to one of its tasks: cancel it while it waits, retry it once it is
//! dead-lettered. Both are audited with who asked.

use sqlx::Row;
use uuid::Uuid;

use super::audit::storable;
use super::requeue::{state_literals, BackToWork, RetryBudget};
use super::{Db, DbResult, PendingRequeue};
use crate::lifecycle::{self, TaskState::*};

/// What [`Db::cancel`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// Now CANCELLED; its message, if any, is stale and dropped by the worker that gets it.
    Now,
    /// Not waiting any more (a worker has it, or it is settled): left as it is.
    TooLate(crate::TaskState),
    NotFound,
}

impl Db {
    /// INGESTED or QUEUED → CANCELLED, in one statement with its audit row. A claim takes
    /// the same row lock and compares the state after it, so a task is either claimed or
    /// cancelled, never both.
    pub async fn cancel(&self, id: Uuid, by: &str) -> DbResult<CancelOutcome> {
        lifecycle::check(Ingested, Cancelled)?;
        lifecycle::check(Queued, Cancelled)?;
        let row = sqlx::query(&format!(
            "WITH current AS MATERIALIZED (
                 SELECT id, task_type, state, attempt FROM tasks WHERE id = $1 FOR UPDATE
             ), cancelled AS (
                 UPDATE tasks t SET state = $2, owner = NULL, heartbeat_at = NULL, updated_at = now()
                 FROM current WHERE t.id = current.id AND current.state IN ({waiting})
                 RETURNING t.id
             ), events AS (
                 INSERT INTO task_events (task_id, task_type, from_state, to_state, attempt, detail)
                 SELECT current.id, current.task_type, current.state, $2, current.attempt, $3
                 FROM current JOIN cancelled USING (id)
             )
             SELECT current.state, EXISTS (SELECT FROM cancelled) AS done FROM current",
            waiting = state_literals(&[Ingested, Queued]),
        ))
        .bind(id)
        .bind(Cancelled.as_str())
        .bind(storable(&format!("cancelled by {by}")))
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(CancelOutcome::NotFound);
        };
        if row.try_get("done")? {
            return Ok(CancelOutcome::Now);
        }
        let state = super::rows::parse_state(row.try_get("state")?)?;
        Ok(CancelOutcome::TooLate(state))
    }

    /// DEAD_LETTER → QUEUED for one task a client retries or redrives, with a fresh retry
    /// budget, audited with `detail` (who, and which of the two); as [`Db::begin_redrive`],
    /// publish its message before committing. `None` when the task is not dead-lettered at
    /// `attempt` (any more).
    pub async fn begin_retry(
        &self,
        id: Uuid,
        attempt: i32,
        task_type: &str,
        detail: &str,
    ) -> DbResult<Option<PendingRequeue>> {
        let back = BackToWork {
            from: &[DeadLetter],
            budget: RetryBudget::Reset,
            by: None,
            detail: detail.to_owned(),
        };
        self.begin_back_to_work(id, attempt, task_type, back).await
    }
}
