//! Ownership on the hot path: claims, heartbeats and completions, each one statement for
//! any number of tasks (a worker's concurrent deliveries share it: `crate::batch`). Rows are
//! locked in id order, so two such statements never deadlock; each row is still fenced by
//! its attempt (and its owner), exactly as a statement for one task would be.

use std::collections::HashSet;

use sqlx::Row;
use uuid::Uuid;

use super::audit::edges;
use super::{Db, DbResult};
use crate::lifecycle::{self, TaskState::*};

/// A delivery's claim: the task, at the attempt its message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Claim {
    pub id: Uuid,
    pub attempt: i32,
}

/// Who holds a task at which attempt: what every write of an owner is fenced by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fence {
    pub id: Uuid,
    pub attempt: i32,
    pub owner: String,
}

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// The task is this worker's now, at the delivery's attempt.
    Won,
    /// The task is done, owned by someone else, or at another attempt: the delivery is a
    /// redundant copy.
    Redundant,
    /// No row of this id is visible to this connection: row-level security hides it (the
    /// worker holds another namespace's credentials) or it does not exist. Never a copy to
    /// drop silently.
    Unseen,
}

impl Claimed {
    pub fn won(self) -> bool {
        self == Claimed::Won
    }
}

/// A finished attempt's result, for [`Db::complete_all`].
#[derive(Debug, Clone)]
pub struct Completion {
    pub fence: Fence,
    pub result: serde_json::Value,
}

impl Db {
    /// The compare-and-set claim, for each of `claims`: QUEUED (or still INGESTED, when the
    /// delivery beat the gateway's own update) at exactly its attempt → CLAIMED →
    /// PROCESSING, owned by `worker`. [`Claimed::Redundant`]: another delivery or owner has
    /// it, or the message is stale; of two equal claims in one call only the first can win.
    /// [`Claimed::Unseen`]: this connection sees no such row.
    ///
    /// Rows are locked by id alone, and only then compared: a re-queue publishes its
    /// message before it commits, and a delivery that arrives in between must wait for that
    /// commit. Had the lock carried the attempt, PostgreSQL would have tested it against the
    /// version before the re-queue, skipped the row without waiting, and the claim would
    /// have dropped the only message of the task (found by the chaos suite's worker-pause).
    pub async fn claim_all(&self, claims: &[Claim], worker: &str) -> DbResult<Vec<Claimed>> {
        let path = edges(&[(Ingested, Queued), (Queued, Claimed), (Claimed, Processing)])?;
        let ids: Vec<Uuid> = claims.iter().map(|c| c.id).collect();
        let attempts: Vec<i32> = claims.iter().map(|c| c.attempt).collect();
        let rows = sqlx::query(
            "WITH input AS (
                 SELECT DISTINCT * FROM unnest($1::uuid[], $2::int[]) AS i(id, attempt)
             ), current AS MATERIALIZED (
                 SELECT id, state, attempt FROM tasks WHERE id IN (SELECT id FROM input)
                 ORDER BY id FOR UPDATE
             ), claimed AS (
                 UPDATE tasks t SET state = $8, owner = $3, heartbeat_at = now(), updated_at = now()
                 FROM current JOIN input ON input.id = current.id AND input.attempt = current.attempt
                 WHERE t.id = current.id AND current.state IN ($6, $7)
                 RETURNING t.id, t.task_type, t.attempt, current.state AS prior
             ), events AS (
                 INSERT INTO task_events (task_id, task_type, from_state, to_state, attempt, worker_id)
                 SELECT * FROM (
                     SELECT c.id, c.task_type, p.from_state, p.to_state, c.attempt, $3
                     FROM claimed c, unnest($4::text[], $5::text[]) WITH ORDINALITY
                         AS p(from_state, to_state, ord)
                     WHERE p.ord > 1 OR c.prior = $6
                     ORDER BY c.id, p.ord
                 ) ordered
             )
             SELECT c.id, w.attempt AS won_attempt
             FROM current c LEFT JOIN claimed w ON w.id = c.id",
        )
        .bind(&ids)
        .bind(&attempts)
        .bind(worker)
        .bind(&path.0)
        .bind(&path.1)
        .bind(Ingested.as_str())
        .bind(Queued.as_str())
        .bind(Processing.as_str())
        .fetch_all(&self.hot)
        .await?;
        let mut seen = HashSet::with_capacity(rows.len());
        let mut won = HashSet::with_capacity(rows.len());
        for row in &rows {
            let id: Uuid = row.try_get("id")?;
            seen.insert(id);
            if let Some(attempt) = row.try_get::<Option<i32>, _>("won_attempt")? {
                won.insert(Claim { id, attempt });
            }
        }
        // `remove`: a second equal claim in the same call is the duplicate.
        Ok(claims
            .iter()
            .map(
                |claim| match (won.remove(claim), seen.contains(&claim.id)) {
                    (true, _) => Claimed::Won,
                    (false, true) => Claimed::Redundant,
                    (false, false) => Claimed::Unseen,
                },
            )
            .collect())
    }

    /// [`Db::claim_all`] for one delivery.
    pub async fn claim(&self, id: Uuid, attempt: i32, worker: &str) -> DbResult<Claimed> {
        let claimed = self.claim_all(&[Claim { id, attempt }], worker).await?;
        Ok(claimed.first().copied().unwrap_or(Claimed::Unseen))
    }

    /// Keeps claims alive (a worker heartbeats its own tasks and those its previous process
    /// left in the degraded-mode buffer). The attempt fences a beat for an older claim of a
    /// task off its newer one. A row locked right now is skipped, not waited for: whoever
    /// holds it is changing it, and the next beat comes within a third of the timeout.
    /// Returns how many were beaten.
    pub async fn heartbeat(&self, owned: &[Fence]) -> DbResult<u64> {
        if owned.is_empty() {
            return Ok(0);
        }
        let ids: Vec<Uuid> = owned.iter().map(|f| f.id).collect();
        let attempts: Vec<i32> = owned.iter().map(|f| f.attempt).collect();
        let owners: Vec<&str> = owned.iter().map(|f| f.owner.as_str()).collect();
        Ok(sqlx::query(
            "WITH owned AS (
                 SELECT t.id FROM tasks t
                 JOIN unnest($1::uuid[], $2::int[], $3::text[]) AS c(id, attempt, owner)
                     ON t.id = c.id AND t.attempt = c.attempt AND t.owner = c.owner
                 WHERE t.state IN ($4, $5)
                 ORDER BY t.id FOR UPDATE OF t SKIP LOCKED
             )
             UPDATE tasks SET heartbeat_at = now() WHERE id IN (SELECT id FROM owned)",
        )
        .bind(&ids)
        .bind(&attempts)
        .bind(&owners)
        .bind(Claimed.as_str())
        .bind(Processing.as_str())
        .execute(&self.hot)
        .await?
        .rows_affected())
    }

    /// PROCESSING → COMPLETED for each of `completions`, fenced by owner and attempt.
    /// `false`: that owner no longer holds the task (it was re-queued after a heartbeat
    /// timeout, or this very completion landed before), and its result is void.
    pub async fn complete_all(&self, completions: &[Completion]) -> DbResult<Vec<bool>> {
        lifecycle::check(Processing, Completed)?;
        let ids: Vec<Uuid> = completions.iter().map(|c| c.fence.id).collect();
        let attempts: Vec<i32> = completions.iter().map(|c| c.fence.attempt).collect();
        let owners: Vec<&str> = completions.iter().map(|c| c.fence.owner.as_str()).collect();
        let results: Vec<&serde_json::Value> = completions.iter().map(|c| &c.result).collect();
        let rows = sqlx::query(
            "WITH input AS (
                 SELECT DISTINCT ON (id, attempt, owner) *
                 FROM unnest($1::uuid[], $2::int[], $3::text[], $4::jsonb[])
                     AS i(id, attempt, owner, result)
             ), current AS MATERIALIZED (
                 SELECT id, state, attempt, owner FROM tasks WHERE id IN (SELECT id FROM input)
                 ORDER BY id FOR UPDATE
             ), done AS (
                 UPDATE tasks t SET state = $6, result = i.result, heartbeat_at = NULL,
                     updated_at = now()
                 FROM current c JOIN input i
                     ON i.id = c.id AND i.attempt = c.attempt AND i.owner = c.owner
                 WHERE t.id = c.id AND c.state = $5
                 RETURNING t.id, t.task_type, t.attempt, t.owner
             ), events AS (
                 INSERT INTO task_events (task_id, task_type, from_state, to_state, attempt, worker_id)
                 SELECT * FROM (
                     SELECT id, task_type, $5, $6, attempt, owner FROM done ORDER BY id
                 ) ordered
             )
             SELECT id, attempt, owner FROM done",
        )
        .bind(&ids)
        .bind(&attempts)
        .bind(&owners)
        .bind(&results)
        .bind(Processing.as_str())
        .bind(Completed.as_str())
        .fetch_all(&self.hot)
        .await?;
        let mut done = HashSet::with_capacity(rows.len());
        for row in &rows {
            let fence = Fence {
                id: row.try_get("id")?,
                attempt: row.try_get("attempt")?,
                owner: row.try_get("owner")?,
            };
            done.insert(fence);
        }
        Ok(completions.iter().map(|c| done.remove(&c.fence)).collect())
    }

    /// [`Db::complete_all`] for one task.
    pub async fn complete(
        &self,
        id: Uuid,
        attempt: i32,
        worker: &str,
        result: &serde_json::Value,
    ) -> DbResult<bool> {
        let completion = Completion {
            fence: Fence {
                id,
                attempt,
                owner: worker.to_owned(),
            },
            result: result.clone(),
        };
        let done = self.complete_all(&[completion]).await?;
        Ok(done.first().copied().unwrap_or(false))
    }
}
