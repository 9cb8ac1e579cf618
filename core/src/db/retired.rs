//! Tasks whose TaskType is gone (decision 0033). Deleting a TaskType, or an edit the
//! gateway refuses, takes the type out of every pass that goes by known types; its open
//! tasks are found here instead, by what the table holds.

use std::time::Duration;

use sqlx::Row;
use uuid::Uuid;

use super::audit::{append_events, EventRow};
use super::expiry::TYPES_IN_TABLE;
use super::requeue::state_literals;
use super::rows::parse_state;
use super::{Db, DbResult};
use crate::lifecycle::TaskState::{self, *};

/// Where an open task rests (FAILED and RETRY_CLAIMED never outlast the transaction that
/// re-queues): waiting, found by type through `tasks_waiting`...
const WAITING: [TaskState; 2] = [Ingested, Queued];
/// ... or owned, through `tasks_owned`.
const OWNED: [TaskState; 2] = [Claimed, Processing];

/// A task type with open or dead-lettered tasks that no TaskType defines any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetiredType {
    pub task_type: String,
    pub tenant: String,
}

/// What one pass of [`Db::settle_retired`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Waiting tasks withdrawn (INGESTED or QUEUED → CANCELLED).
    pub cancelled: usize,
    /// Tasks whose owner went silent, parked (→ DEAD_LETTER): they have nowhere to be
    /// re-queued to.
    pub dead_lettered: usize,
}

impl Db {
    /// Every task type with open or dead-lettered tasks that is not among `known`, with its
    /// tenant. A few index probes per task type in the table (a skip scan of
    /// `tasks_listed`, then the partial indexes of waiting, owned and parked tasks), never a
    /// pass over the tasks.
    pub async fn retired_types(&self, known: &[String]) -> DbResult<Vec<RetiredType>> {
        let rows = sqlx::query(&format!(
            "{TYPES_IN_TABLE}
             SELECT types.task_type,
                    (SELECT tenant FROM tasks t WHERE t.task_type = types.task_type LIMIT 1)
                        AS tenant
             FROM types
             WHERE types.task_type IS NOT NULL AND types.task_type <> ALL($1)
               AND (EXISTS (SELECT FROM tasks t
                            WHERE t.task_type = types.task_type AND t.state IN ({waiting}))
                    OR EXISTS (SELECT FROM tasks t
                               WHERE t.task_type = types.task_type AND t.state IN ({owned}))
                    OR EXISTS (SELECT FROM tasks t
                               WHERE t.task_type = types.task_type AND t.state = {parked}))
             ORDER BY types.task_type",
            waiting = state_literals(&WAITING),
            owned = state_literals(&OWNED),
            parked = state_literals(&[DeadLetter]),
        ))
        .bind(known)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(RetiredType {
                    task_type: row.try_get("task_type")?,
                    tenant: row.try_get("tenant")?,
                })
            })
            .collect()
    }

    /// Settles up to `limit` waiting and `limit` owned tasks of a type whose queues are
    /// gone with it: waiting ones are cancelled, and those whose owner has been silent for
    /// `owner_silent_for` are dead-lettered, each with `why` in its audit row. Tasks still
    /// heartbeated are left to their owner: its outcome is recorded as usual. Rows locked
    /// right now are skipped for the next pass.
    pub async fn settle_retired(
        &self,
        task_type: &str,
        why: &str,
        owner_silent_for: Duration,
        limit: i64,
    ) -> DbResult<Settled> {
        let mut tx = self.pool.begin().await?;
        // Two statements, so that each is served by its partial index.
        let mut rows = sqlx::query(&format!(
            "SELECT id, state, attempt, owner FROM tasks
             WHERE task_type = $1 AND state IN ({waiting})
             LIMIT $2 FOR UPDATE SKIP LOCKED",
            waiting = state_literals(&WAITING),
        ))
        .bind(task_type)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        rows.extend(
            sqlx::query(&format!(
                "SELECT id, state, attempt, owner FROM tasks
                 WHERE task_type = $1 AND state IN ({owned})
                   AND heartbeat_at < now() - make_interval(secs => $2)
                 LIMIT $3 FOR UPDATE SKIP LOCKED",
                owned = state_literals(&OWNED),
            ))
            .bind(task_type)
            .bind(owner_silent_for.as_secs_f64())
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?,
        );
        let mut settled = Settled::default();
        let (mut ids, mut targets, mut events) = (Vec::new(), Vec::new(), Vec::new());
        for row in &rows {
            let id: Uuid = row.try_get("id")?;
            let state = parse_state(row.try_get("state")?)?;
            let attempt: i32 = row.try_get("attempt")?;
            let owner: Option<String> = row.try_get("owner")?;
            let event = |from, to, detail: String| EventRow {
                task_id: id,
                task_type: task_type.to_owned(),
                from,
                to,
                attempt,
                worker_id: None,
                detail: Some(detail),
            };
            let target = match state {
                Ingested | Queued => {
                    settled.cancelled += 1;
                    events.push(event(state, Cancelled, why.to_owned()));
                    Cancelled
                }
                _ => {
                    let silent = format!(
                        "owner {} silent for {owner_silent_for:?}",
                        owner.as_deref().unwrap_or("?")
                    );
                    events.push(event(state, RetryClaimed, silent));
                    events.push(event(RetryClaimed, DeadLetter, why.to_owned()));
                    settled.dead_lettered += 1;
                    DeadLetter
                }
            };
            ids.push(id);
            targets.push(target.as_str());
        }
        if ids.is_empty() {
            return Ok(settled);
        }
        sqlx::query(
            "UPDATE tasks t SET state = s.state, owner = NULL, heartbeat_at = NULL,
                 error = CASE WHEN s.state = $3 THEN $4 ELSE t.error END, progress = NULL,
                 updated_at = now()
             FROM unnest($1::uuid[], $2::text[]) AS s(id, state) WHERE t.id = s.id",
        )
        .bind(&ids)
        .bind(&targets)
        .bind(DeadLetter.as_str())
        .bind(super::audit::storable(why))
        .execute(&mut *tx)
        .await?;
        append_events(&mut tx, &events).await?;
        tx.commit().await?;
        Ok(settled)
    }
}
