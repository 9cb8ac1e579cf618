//! Taking tasks in: one statement records a whole batch as INGESTED (with its audit rows),
//! and one marks the confirmed ones QUEUED.

use std::collections::{HashMap, HashSet};

use sqlx::Row;
use uuid::Uuid;

use super::rows::{task_from_row, TASK_COLUMNS};
use super::{Db, DbError, DbResult};
use crate::lifecycle::{self, TaskState::*};
use crate::task::{NewTask, TaskRecord};

/// What [`Db::mark_queued`] does with a row another transaction holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Locked {
    /// Leave it: its holder moves it on (the writer's rounds; never waits on a claim).
    Skip,
    /// Wait for its holder's commit (a reader's own task: the read must follow the mark).
    Wait,
}

/// Outcome of recording one submitted task.
#[derive(Debug, Clone)]
pub enum Recorded {
    /// A new task.
    Created(TaskRecord),
    /// The idempotency key was known: the task recorded earlier.
    Existing(TaskRecord),
}

impl Recorded {
    pub fn task(&self) -> &TaskRecord {
        match self {
            Recorded::Created(task) | Recorded::Existing(task) => task,
        }
    }
}

impl Db {
    /// Records submitted tasks as INGESTED in one statement. A key its tenant already used
    /// yields the task recorded before, in input order (keys are unique per tenant).
    pub async fn record_tasks(&self, tasks: &[NewTask]) -> DbResult<Vec<Recorded>> {
        if tasks.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = tasks.iter().map(|t| t.id).collect();
        let tenants: Vec<&str> = tasks.iter().map(|t| t.tenant.as_str()).collect();
        let keys: Vec<Uuid> = tasks.iter().map(|t| t.idempotency_key).collect();
        let types: Vec<&str> = tasks.iter().map(|t| t.task_type.as_str()).collect();
        let payloads: Vec<serde_json::Value> = tasks.iter().map(|t| t.payload.clone()).collect();
        // Most tasks carry none: NULL keeps the column's default without building `{}`.
        let labels: Vec<Option<serde_json::Value>> = tasks
            .iter()
            .map(|t| (!t.labels.is_empty()).then(|| serde_json::json!(t.labels)))
            .collect();
        let details: Vec<Option<String>> = tasks
            .iter()
            .map(|t| t.trace_id.as_ref().map(|id| format!("trace {id}")))
            .collect();
        // Only what the database adds (the time) comes back: the rest is the input, and a
        // payload sent back and decoded again would cost both sides for nothing.
        let inserted = sqlx::query(
            "WITH input AS (
                 SELECT * FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::text[], $5::jsonb[], $7::text[], $8::jsonb[])
                     AS i(id, tenant, idempotency_key, task_type, payload, detail, labels)
             ), inserted AS (
                 INSERT INTO tasks (id, tenant, idempotency_key, task_type, state, payload, labels)
                 SELECT id, tenant, idempotency_key, task_type, $6, payload, coalesce(labels, '{}') FROM input
                 -- Key order: two statements inserting the same keys never wait on each other crosswise.
                 ORDER BY tenant, idempotency_key
                 ON CONFLICT (tenant, idempotency_key) DO NOTHING
                 RETURNING id, task_type, created_at
             ), events AS (
                 INSERT INTO task_events (task_id, task_type, to_state, attempt, detail)
                 SELECT inserted.id, inserted.task_type, $6, 0, input.detail
                 FROM inserted JOIN input USING (id)
             )
             SELECT id, created_at FROM inserted",
        )
        .bind(&ids)
        .bind(&tenants)
        .bind(&keys)
        .bind(&types)
        .bind(&payloads)
        .bind(Ingested.as_str())
        .bind(&details)
        .bind(&labels)
        .fetch_all(&self.hot)
        .await?;
        let by_id: HashMap<Uuid, &NewTask> = tasks.iter().map(|t| (t.id, t)).collect();
        let mut records: HashMap<(String, Uuid), TaskRecord> = HashMap::with_capacity(tasks.len());
        for row in &inserted {
            let id: Uuid = row.try_get("id")?;
            let task = by_id
                .get(&id)
                .ok_or_else(|| DbError::Corrupt(format!("inserted task {id} was not submitted")))?;
            let record = TaskRecord::ingested(task, row.try_get("created_at")?);
            records.insert((record.tenant.clone(), record.idempotency_key), record);
        }
        let created: HashSet<Uuid> = records.values().map(|r| r.id).collect();
        // Only known keys need a second look: the common case is one round trip.
        let (known_tenants, known_keys): (Vec<&str>, Vec<Uuid>) = tasks
            .iter()
            .filter(|t| !records.contains_key(&(t.tenant.clone(), t.idempotency_key)))
            .map(|t| (t.tenant.as_str(), t.idempotency_key))
            .unzip();
        if !known_keys.is_empty() {
            let rows = sqlx::query(&format!(
                "SELECT {TASK_COLUMNS} FROM tasks
                 WHERE (tenant, idempotency_key) IN (SELECT * FROM unnest($1::text[], $2::uuid[]))"
            ))
            .bind(&known_tenants)
            .bind(&known_keys)
            .fetch_all(&self.hot)
            .await?;
            for row in &rows {
                let record = task_from_row(row)?;
                records.insert((record.tenant.clone(), record.idempotency_key), record);
            }
        }
        tasks
            .iter()
            .map(|task| {
                let key = (task.tenant.clone(), task.idempotency_key);
                let record = records.get(&key).cloned().ok_or_else(|| {
                    DbError::Corrupt(format!("task with key {} vanished", task.idempotency_key))
                })?;
                Ok(if record.id == task.id && created.contains(&task.id) {
                    Recorded::Created(record)
                } else {
                    Recorded::Existing(record)
                })
            })
            .collect()
    }

    /// INGESTED → QUEUED for tasks the broker confirmed. Tasks a worker already claimed are
    /// left alone: the claim wrote the QUEUED event itself.
    pub async fn mark_queued(&self, ids: &[Uuid], locked: Locked) -> DbResult<()> {
        lifecycle::check(Ingested, Queued)?;
        // Locked in id order, as claims are. `Skip`: a row locked right now is skipped, since
        // whoever holds it (a claim, the sweeper) moves it on and writes QUEUED itself if need
        // be. `Wait`: its holder's commit is waited for, and the state compared after it.
        let lock = match locked {
            Locked::Skip => "FOR UPDATE SKIP LOCKED",
            Locked::Wait => "FOR UPDATE",
        };
        sqlx::query(&format!(
            "WITH locked AS MATERIALIZED (
                 SELECT id FROM tasks WHERE id = ANY($1) AND state = $2
                 ORDER BY id {lock}
             ), updated AS (
                 UPDATE tasks t SET state = $3, updated_at = now()
                 FROM locked WHERE t.id = locked.id AND t.state = $2
                 RETURNING t.id, t.task_type, t.attempt
             )
             INSERT INTO task_events (task_id, task_type, from_state, to_state, attempt)
             SELECT * FROM (SELECT id, task_type, $2, $3, attempt FROM updated ORDER BY id) ordered",
        ))
        .bind(ids)
        .bind(Ingested.as_str())
        .bind(Queued.as_str())
        .execute(&self.hot)
        .await?;
        Ok(())
    }
}
