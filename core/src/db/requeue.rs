//! Re-queues, each a transaction left open for the caller to publish the next message in
//! before it commits (decision 0002): a failed attempt, a release on shutdown, a reap of a
//! silent owner, a redrive.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Row, Transaction};
use uuid::Uuid;

use super::audit::{append_events, storable, EventRow};
use super::rows::{task_from_row, TASK_COLUMNS};
use super::{Db, DbResult, Fence};
use crate::lifecycle::TaskState::{self, *};
use crate::task::{Requeue, TaskMessage, TaskRecord};

/// One task re-queued inside a [`PendingRequeue`], with the message that must carry it.
#[derive(Debug, Clone)]
pub struct Requeued {
    pub message: TaskMessage,
    pub route: Requeue,
    /// Retries consumed, counting this one; the retry queue's backoff is computed from it.
    pub retries: i32,
}

/// Re-queues written but not committed. Publish every [`Requeued::message`], wait for the
/// broker's confirms, then [`commit`](PendingRequeue::commit); drop it to roll back.
pub struct PendingRequeue {
    pub(super) tx: Transaction<'static, Postgres>,
    pub tasks: Vec<Requeued>,
}

impl PendingRequeue {
    pub async fn commit(self) -> DbResult<()> {
        self.tx.commit().await?;
        Ok(())
    }
}

impl Db {
    /// PROCESSING → FAILED, then QUEUED for the retry queue or DEAD_LETTER when `max_retries`
    /// are used up. `None` when the worker was fenced off.
    pub async fn begin_failure(
        &self,
        fence: &Fence,
        error: &str,
        max_retries: i32,
    ) -> DbResult<Option<PendingRequeue>> {
        let mut tx = self.pool.begin().await?;
        let Some(task) = lock_owned(&mut tx, fence).await? else {
            return Ok(None);
        };
        let route = if task.retries < max_retries {
            Requeue::Retry
        } else {
            Requeue::Remediation
        };
        let step = Step {
            edge: (Processing, Failed),
            by: Some(&fence.owner),
            detail: error,
            route,
            budget: RetryBudget::Consume,
        };
        let requeued = requeue(&mut tx, &task, step).await?;
        Ok(Some(PendingRequeue {
            tx,
            tasks: vec![requeued],
        }))
    }

    /// PROCESSING → RETRY_CLAIMED → QUEUED for a task a draining worker cannot finish.
    /// Does not consume a retry: the task did nothing wrong.
    pub async fn begin_release(&self, fence: &Fence) -> DbResult<Option<PendingRequeue>> {
        let mut tx = self.pool.begin().await?;
        let Some(task) = lock_owned(&mut tx, fence).await? else {
            return Ok(None);
        };
        let step = Step {
            edge: (Processing, RetryClaimed),
            by: Some(&fence.owner),
            detail: "released by a worker shutting down",
            route: Requeue::Main,
            budget: RetryBudget::Keep,
        };
        let requeued = requeue(&mut tx, &task, step).await?;
        Ok(Some(PendingRequeue {
            tx,
            tasks: vec![requeued],
        }))
    }

    /// Finds up to `limit` tasks of `task_type` whose owner stopped heartbeating for
    /// `timeout` and re-queues them (RETRY_CLAIMED → QUEUED, or DEAD_LETTER when retries are
    /// exhausted). Rows another reaper holds are skipped, so every worker can run this.
    ///
    /// Blame (decision 0008): a task its owner ran alone consumes a retry; one that died
    /// beside others does not, because any of them may have crashed the worker. Each comes
    /// back as a suspect, which runs alone next time: a task that crashes every worker then
    /// runs out of retries, and its healthy neighbours do not.
    pub async fn begin_reap(&self, reap: &Reap<'_>) -> DbResult<Option<PendingRequeue>> {
        let Reap {
            task_type,
            timeout,
            max_retries,
            reaper,
            limit,
        } = *reap;
        let mut tx = self.pool.begin().await?;
        // The owned states are written into the statement, not bound: a generic plan must
        // still see that they match the partial index tasks_owned (migration 10).
        let owned = owned_states();
        let rows = sqlx::query(&format!(
            "SELECT {TASK_COLUMNS}, heartbeat_at,
                 (SELECT count(*) FROM tasks o
                  WHERE o.owner = tasks.owner AND o.state IN ({owned})) AS in_flight_beside
             FROM tasks
             WHERE task_type = $1 AND state IN ({owned})
               AND heartbeat_at < now() - make_interval(secs => $2)
             ORDER BY heartbeat_at
             LIMIT $3
             FOR UPDATE SKIP LOCKED"
        ))
        .bind(task_type)
        .bind(timeout.as_secs_f64())
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut tasks = Vec::with_capacity(rows.len());
        for row in &rows {
            let task = task_from_row(row)?;
            let last_beat: Option<DateTime<Utc>> = row.try_get("heartbeat_at")?;
            let alone = row.try_get::<i64, _>("in_flight_beside")? <= 1;
            let detail = format!(
                "heartbeat timeout: owner {} last heartbeat {}, timeout {:.1}s, {}, detected by {reaper}",
                task.owner.as_deref().unwrap_or("?"),
                last_beat.map(|t| t.to_rfc3339()).unwrap_or_default(),
                timeout.as_secs_f64(),
                if alone { "ran alone" } else { "ran beside others: suspect, no retry used" },
            );
            // Through the retry queue, after the type's backoff: a task that crashes every
            // worker it lands on does not crash-loop the pool at full speed.
            let (route, budget) = match (alone, task.retries < max_retries) {
                (false, _) => (Requeue::Retry, RetryBudget::Keep),
                (true, true) => (Requeue::Retry, RetryBudget::Consume),
                (true, false) => (Requeue::Remediation, RetryBudget::Consume),
            };
            let step = Step {
                edge: (task.state, RetryClaimed),
                by: Some(reaper),
                detail: &detail,
                route,
                budget,
            };
            let mut requeued = requeue(&mut tx, &task, step).await?;
            requeued.message.suspect = true;
            tasks.push(requeued);
        }
        let ids: Vec<Uuid> = tasks.iter().map(|t| t.message.id).collect();
        sqlx::query("UPDATE tasks SET suspect = true WHERE id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        Ok(Some(PendingRequeue { tx, tasks }))
    }

    /// DEAD_LETTER → QUEUED for a task of `task_type` parked at `attempt`, with a fresh
    /// retry budget. `None` when the task is not (or no longer) dead-lettered at that
    /// attempt, or is of another type: a message body names the task, and a tenant may
    /// write its own queue (issue 33, item 5).
    pub async fn begin_redrive(
        &self,
        id: Uuid,
        attempt: i32,
        task_type: &str,
        by: &str,
    ) -> DbResult<Option<PendingRequeue>> {
        let back = BackToWork {
            from: &[DeadLetter],
            budget: RetryBudget::Reset,
            by: Some(by),
            detail: format!("redriven by {by}"),
        };
        self.begin_back_to_work(id, attempt, task_type, back).await
    }

    /// Locks the task of `task_type` at `attempt` if it is in one of `back.from`, and moves
    /// it on to QUEUED at attempt + 1 with one audit row, ready to publish to the work queue.
    pub(super) async fn begin_back_to_work(
        &self,
        id: Uuid,
        attempt: i32,
        task_type: &str,
        back: BackToWork<'_>,
    ) -> DbResult<Option<PendingRequeue>> {
        let mut tx = self.pool.begin().await?;
        let from: Vec<&str> = back.from.iter().map(|s| s.as_str()).collect();
        let row = sqlx::query(&format!(
            "SELECT {TASK_COLUMNS} FROM tasks
             WHERE id = $1 AND attempt = $2 AND state = ANY($3) AND task_type = $4
             FOR UPDATE"
        ))
        .bind(id)
        .bind(attempt)
        .bind(&from)
        .bind(task_type)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let task = task_from_row(&row)?;
        let (message, retries) = advance(&mut tx, &task, Next::queued(back.budget)).await?;
        append_events(
            &mut tx,
            &[EventRow {
                task_id: task.id,
                task_type: task.task_type.clone(),
                from: task.state,
                to: Queued,
                attempt: message.attempt,
                worker_id: back.by.map(str::to_owned),
                detail: Some(back.detail),
            }],
        )
        .await?;
        Ok(Some(PendingRequeue {
            tx,
            tasks: vec![Requeued {
                message,
                route: Requeue::Main,
                retries,
            }],
        }))
    }
}

/// A task sent back to its work queue from where it waits: which states it may be found in,
/// what becomes of its retries, and what the audit row says.
pub(super) struct BackToWork<'a> {
    pub from: &'a [TaskState],
    pub budget: RetryBudget,
    pub by: Option<&'a str>,
    pub detail: String,
}

/// Whether a re-queue consumes one of the task's retries.
#[derive(Clone, Copy)]
pub(super) enum RetryBudget {
    Consume,
    Keep,
    Reset,
}

/// Locks a task its fence's owner holds at its attempt while PROCESSING.
async fn lock_owned(
    tx: &mut Transaction<'static, Postgres>,
    fence: &Fence,
) -> DbResult<Option<TaskRecord>> {
    let row = sqlx::query(&format!(
        "SELECT {TASK_COLUMNS} FROM tasks
         WHERE id = $1 AND attempt = $2 AND owner = $3 AND state = $4
         FOR UPDATE"
    ))
    .bind(fence.id)
    .bind(fence.attempt)
    .bind(&fence.owner)
    .bind(Processing.as_str())
    .fetch_optional(&mut **tx)
    .await?;
    row.as_ref().map(task_from_row).transpose()
}

/// How a locked task leaves its owner: the edge it takes, who says so and why, where it goes
/// next and what becomes of its retries.
struct Step<'a> {
    edge: (TaskState, TaskState),
    by: Option<&'a str>,
    detail: &'a str,
    route: Requeue,
    budget: RetryBudget,
}

/// Which tasks a reaper takes back: those of `task_type` silent for `timeout`, at most
/// `limit` at once.
#[derive(Debug, Clone, Copy)]
pub struct Reap<'a> {
    pub task_type: &'a str,
    pub timeout: Duration,
    pub max_retries: i32,
    /// Who reaps, for the audit log.
    pub reaper: &'a str,
    pub limit: i64,
}

/// Moves a locked task along `step.edge` and on to QUEUED (bumping the attempt) or
/// DEAD_LETTER.
async fn requeue(
    tx: &mut Transaction<'static, Postgres>,
    task: &TaskRecord,
    step: Step<'_>,
) -> DbResult<Requeued> {
    let Step {
        edge,
        by: worker,
        detail,
        route,
        budget,
    } = step;
    let target = match route {
        Requeue::Main | Requeue::Retry => Queued,
        Requeue::Remediation => DeadLetter,
    };
    let error = (edge.1 == Failed).then_some(detail);
    let next = Next {
        target,
        budget,
        error,
    };
    let (message, retries) = advance(tx, task, next).await?;
    let next_detail = match route {
        Requeue::Main => "re-enqueued".to_owned(),
        Requeue::Retry => format!("retry {retries} after backoff"),
        Requeue::Remediation => format!("retries exhausted after {} retries", task.retries),
    };
    let event = |from, to, attempt, detail: String| EventRow {
        task_id: task.id,
        task_type: task.task_type.clone(),
        from,
        to,
        attempt,
        worker_id: worker.map(str::to_owned),
        detail: Some(detail),
    };
    append_events(
        tx,
        &[
            event(edge.0, edge.1, task.attempt, detail.to_owned()),
            event(edge.1, target, message.attempt, next_detail),
        ],
    )
    .await?;
    Ok(Requeued {
        message,
        route,
        retries,
    })
}

/// Where a locked task goes next: its new state, what becomes of its retries, and the
/// error to keep (a failed attempt's).
pub(super) struct Next<'a> {
    pub target: TaskState,
    pub budget: RetryBudget,
    pub error: Option<&'a str>,
}

impl Next<'_> {
    /// Back to QUEUED without an error.
    pub fn queued(budget: RetryBudget) -> Self {
        Next {
            target: Queued,
            budget,
            error: None,
        }
    }
}

/// Writes the new state of a locked task; returns the message that must carry it and the
/// retries consumed.
pub(super) async fn advance(
    tx: &mut Transaction<'static, Postgres>,
    task: &TaskRecord,
    next: Next<'_>,
) -> DbResult<(TaskMessage, i32)> {
    let Next {
        target,
        budget,
        error,
    } = next;
    // Every return to QUEUED starts a new epoch, so older messages and owners are fenced.
    let attempt = if target == Queued {
        task.attempt + 1
    } else {
        task.attempt
    };
    let retries = match budget {
        RetryBudget::Consume => task.retries + 1,
        RetryBudget::Keep => task.retries,
        RetryBudget::Reset => 0,
    };
    sqlx::query(
        "UPDATE tasks SET state = $2, attempt = $3, retries = $4, owner = NULL,
             heartbeat_at = NULL, error = COALESCE($5, error), progress = NULL, updated_at = now()
         WHERE id = $1",
    )
    .bind(task.id)
    .bind(target.as_str())
    .bind(attempt)
    .bind(retries)
    .bind(error.map(storable))
    .execute(&mut **tx)
    .await?;
    let mut message = task.message();
    message.attempt = attempt;
    Ok((message, retries))
}

/// States as SQL literals, for a statement whose plan must match a partial index's
/// predicate (a bound parameter cannot prove it in a generic plan). Our own state names,
/// never input.
pub(super) fn state_literals(states: &[TaskState]) -> String {
    states
        .iter()
        .map(|s| format!("'{}'", s.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The states of an owned task: tasks_owned's predicate.
fn owned_states() -> String {
    state_literals(&[Claimed, Processing])
}
