//! The SQL of the orphan sweeper (decision 0011): probes through the work queues, and the
//! re-publish of tasks whose message was lost.

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::audit::{append_events, EventRow};
use super::requeue::{advance, state_literals, BackToWork, Next, RetryBudget};
use super::rows::{task_from_row, TASK_COLUMNS};
use super::{Db, DbResult, PendingRequeue, Requeued};
use crate::lifecycle::TaskState::*;
use crate::task::Requeue;

/// When probes are sent and how long they may take (all from the sweeper's settings).
#[derive(Debug, Clone, Copy)]
pub struct ProbePolicy {
    /// A task that has waited unclaimed this long makes a probe worth sending.
    pub min_wait: Duration,
    /// At most one probe per type this often.
    pub interval: Duration,
    /// An unseen probe younger than this may still be on its way (behind a backlog); an
    /// older one is presumed lost (purged with its queue, dead-lettered by the delivery
    /// limit) and no longer counts against [`MAX_PROBES_ON_THE_WAY`].
    pub timeout: Duration,
}

/// Unseen probes per type at once: a lost probe costs one probe interval, not a timeout,
/// and a long backlog holds at most this many markers.
pub const MAX_PROBES_ON_THE_WAY: i64 = 5;

/// Which waiting tasks count as having lost their message.
#[derive(Debug, Clone, Copy)]
pub struct OrphanRule {
    /// A probe counts once it was seen this long ago: deliveries handed out just before it
    /// get this long to be claimed.
    pub grace: Duration,
    /// A task must have been waiting this long before the probe was sent: covers a
    /// gateway's publish still in flight for an INGESTED task (the confirm timeout).
    pub margin: Duration,
    /// Longest a retry-queue message waits before it reaches the work queue (the retry
    /// queue's TTL cap): a re-queued task is not expected there sooner.
    pub retry_delay_cap: Duration,
}

impl Db {
    /// Records a probe for `task_type` when one is due: some task has waited longer than
    /// `policy.min_wait`, no probe was sent in the last `policy.interval`, and fewer than
    /// [`MAX_PROBES_ON_THE_WAY`] younger than `policy.timeout` are still unseen. Returns its
    /// id (publish it next).
    pub async fn record_probe_if_due(
        &self,
        task_type: &str,
        policy: &ProbePolicy,
    ) -> DbResult<Option<Uuid>> {
        let id = Uuid::new_v4();
        let waiting = waiting_states();
        let row = sqlx::query(&format!(
            "INSERT INTO queue_probes (id, task_type)
             SELECT $1, $2
             WHERE EXISTS (
                     SELECT 1 FROM tasks WHERE task_type = $2 AND state IN ({waiting})
                       AND updated_at < now() - make_interval(secs => $3))
               AND NOT EXISTS (
                     SELECT 1 FROM queue_probes p WHERE p.task_type = $2
                       AND p.sent_at > now() - make_interval(secs => $4))
               AND (SELECT count(*) FROM queue_probes p WHERE p.task_type = $2
                       AND p.seen_at IS NULL
                       AND p.sent_at > now() - make_interval(secs => $5)) < $6
             RETURNING id"
        ))
        .bind(id)
        .bind(task_type)
        .bind(policy.min_wait.as_secs_f64())
        .bind(policy.interval.as_secs_f64())
        .bind(policy.timeout.as_secs_f64())
        .bind(MAX_PROBES_ON_THE_WAY)
        .fetch_optional(self.pool())
        .await?;
        Ok(row.map(|_| id))
    }

    /// A worker took probe `id` off its work queue.
    pub async fn probe_seen(&self, id: Uuid) -> DbResult<()> {
        sqlx::query(
            "UPDATE queue_probes SET seen_at = clock_timestamp() WHERE id = $1 AND seen_at IS NULL",
        )
        .bind(id)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// A probe that could not be published will never be seen: forget it, so that it does
    /// not hold the next one back.
    pub async fn forget_probe(&self, id: Uuid) -> DbResult<()> {
        sqlx::query("DELETE FROM queue_probes WHERE id = $1")
            .bind(id)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Drops probe records older than `age`, in batches, skipping locked rows; returns
    /// how many.
    pub async fn prune_probes(&self, age: Duration) -> DbResult<u64> {
        const BATCH: u64 = 10_000;
        let mut pruned = 0;
        // Up to a million a pass: an hour of probes of some thousands of busy types.
        for _ in 0..100 {
            // Rows someone holds (a tenant may lock its own probes) are left for a later
            // pass rather than waited for: the upkeep loop serves every tenant.
            let gone = sqlx::query(
                "DELETE FROM queue_probes WHERE id IN (
                     SELECT id FROM queue_probes
                     WHERE sent_at < now() - make_interval(secs => $1)
                     LIMIT $2 FOR UPDATE SKIP LOCKED)",
            )
            .bind(age.as_secs_f64())
            .bind(BATCH as i64)
            .execute(self.pool())
            .await?
            .rows_affected();
            pruned += gone;
            if gone < BATCH {
                break;
            }
        }
        Ok(pruned)
    }

    /// Re-queues, with attempt + 1, up to `limit` tasks of `task_type` that still wait
    /// unclaimed although the newest probe seen (at least `rule.grace` ago) was sent after
    /// they were queued (by `rule.margin`, and by the retry delay cap for re-queued tasks).
    /// Such a task's message is gone: dead-lettered by the delivery limit, purged, deleted
    /// with its queue, lost with the broker's disk, or never published. The bump fences any
    /// copy that might still turn up. Publish the messages, then commit.
    pub async fn begin_republish(
        &self,
        task_type: &str,
        rule: &OrphanRule,
        limit: i64,
    ) -> DbResult<Option<PendingRequeue>> {
        let mut tx = self.pool().begin().await?;
        let waiting = waiting_states();
        // The probe first, on its own: its send time then bounds the range of
        // tasks_waiting the second statement reads. Joined in one statement, the planner
        // walked the type's whole waiting backlog in updated_at order on every pass.
        let probe = sqlx::query_as::<_, (Uuid, DateTime<Utc>, DateTime<Utc>)>(
            "SELECT id, sent_at, seen_at FROM queue_probes
             WHERE task_type = $1 AND seen_at < now() - make_interval(secs => $2)
               AND sent_at <= seen_at
             ORDER BY sent_at DESC LIMIT 1",
        )
        .bind(task_type)
        .bind(rule.grace.as_secs_f64())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((probe, sent, seen)) = probe else {
            return Ok(None);
        };
        let rows = sqlx::query(&format!(
            "SELECT {TASK_COLUMNS} FROM tasks
             WHERE task_type = $1 AND state IN ({waiting})
               AND updated_at < $2 - make_interval(secs => $3)
               AND updated_at + CASE WHEN attempt > 0
                       THEN make_interval(secs => $4) ELSE interval '0' END
                   < $2 - make_interval(secs => $3)
             ORDER BY updated_at
             LIMIT $5
             FOR UPDATE SKIP LOCKED"
        ))
        .bind(task_type)
        .bind(sent)
        .bind(rule.margin.as_secs_f64())
        .bind(rule.retry_delay_cap.as_secs_f64())
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut tasks = Vec::with_capacity(rows.len());
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            let task = task_from_row(row)?;
            let (message, retries) =
                advance(&mut tx, &task, Next::queued(RetryBudget::Keep)).await?;
            events.push(EventRow {
                task_id: task.id,
                task_type: task.task_type.clone(),
                from: task.state,
                to: Queued,
                attempt: message.attempt,
                worker_id: Some("sweeper".to_owned()),
                detail: Some(format!(
                    "message lost: waiting since {} at attempt {}, but probe {probe} sent {} \
                     was delivered {}; re-published",
                    task.updated_at.to_rfc3339(),
                    task.attempt,
                    sent.to_rfc3339(),
                    seen.to_rfc3339()
                )),
            });
            tasks.push(Requeued {
                message,
                route: Requeue::Main,
                retries,
            });
        }
        append_events(&mut tx, &events).await?;
        Ok(Some(PendingRequeue { tx, tasks }))
    }

    /// The message in hand (for example in the remediation queue) is the live copy of a task
    /// that is still waiting for a worker at `attempt`: re-queue it with attempt + 1 so that
    /// it can be published to the work queue. `None` if the task is anywhere else, or of
    /// another type than `task_type`.
    pub async fn begin_return(
        &self,
        id: Uuid,
        attempt: i32,
        task_type: &str,
        why: &str,
    ) -> DbResult<Option<PendingRequeue>> {
        let back = BackToWork {
            from: &[Ingested, Queued],
            budget: RetryBudget::Keep,
            by: None,
            detail: why.to_owned(),
        };
        self.begin_back_to_work(id, attempt, task_type, back).await
    }
}

/// The states of a waiting task, as literals: tasks_waiting's predicate, which a generic
/// plan can match only when it is written into the statement.
fn waiting_states() -> String {
    state_literals(&[Ingested, Queued])
}
