//! The task as it travels (the AMQP message body) and as it is recorded.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::labels::Labels;
use crate::lifecycle::TaskState;

/// The body of every task message. `attempt` is the fencing epoch: a delivery may claim the
/// task only while the database holds the same attempt, so stale copies fall away.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskMessage {
    pub id: Uuid,
    pub task_type: String,
    pub attempt: i32,
    pub idempotency_key: Uuid,
    pub payload: serde_json::Value,
    /// When the gateway accepted the task; the worker measures end-to-end latency from it.
    pub submitted_at: DateTime<Utc>,
    /// Reaped from a dead worker beside other tasks: the next try runs alone on its worker.
    #[serde(default)]
    pub suspect: bool,
    /// The W3C trace context its processing continues (`crate::trace`); also sent as the
    /// message's `traceparent` header. Absent on messages re-published from the database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// A new task, as the gateway records it.
#[derive(Debug, Clone)]
pub struct NewTask {
    pub id: Uuid,
    /// Who submitted it: the task type's tenant (`docs/security.md`).
    pub tenant: String,
    pub idempotency_key: Uuid,
    pub task_type: String,
    pub payload: serde_json::Value,
    /// Checked by [`crate::labels::check`] before it gets here.
    pub labels: Labels,
    /// The trace its submission opened, written in the INGESTED audit row's detail.
    pub trace_id: Option<String>,
}

/// The current row of a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskRecord {
    pub id: Uuid,
    /// The tenant it belongs to; `task_type` is its type's key (`<namespace>.<name>` in a
    /// cluster).
    pub tenant: String,
    pub idempotency_key: Uuid,
    pub task_type: String,
    pub state: TaskState,
    pub attempt: i32,
    pub retries: i32,
    pub owner: Option<String>,
    pub payload: serde_json::Value,
    /// Given at submission, never changed.
    pub labels: Labels,
    /// The handler's latest progress report, if it made any.
    pub progress: Option<serde_json::Value>,
    pub result: Option<serde_json::Value>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// Reaped beside other tasks from a dead worker: runs alone next time (decision 0008).
    pub suspect: bool,
}

impl TaskRecord {
    /// A submitted task as its insert recorded it, at `created_at`.
    pub fn ingested(task: &NewTask, created_at: DateTime<Utc>) -> TaskRecord {
        TaskRecord {
            id: task.id,
            tenant: task.tenant.clone(),
            idempotency_key: task.idempotency_key,
            task_type: task.task_type.clone(),
            state: TaskState::Ingested,
            attempt: 0,
            retries: 0,
            owner: None,
            payload: task.payload.clone(),
            labels: task.labels.clone(),
            progress: None,
            result: None,
            error: None,
            created_at,
            updated_at: created_at,
            suspect: false,
        }
    }

    /// The message that carries this task at its current attempt.
    pub fn message(&self) -> TaskMessage {
        TaskMessage {
            id: self.id,
            task_type: self.task_type.clone(),
            attempt: self.attempt,
            idempotency_key: self.idempotency_key,
            payload: self.payload.clone(),
            submitted_at: self.created_at,
            suspect: self.suspect,
            traceparent: None,
        }
    }
}

/// One row of the audit log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskEvent {
    pub seq: i64,
    pub task_id: Uuid,
    pub task_type: String,
    pub from_state: Option<TaskState>,
    pub to_state: TaskState,
    pub attempt: i32,
    pub worker_id: Option<String>,
    pub detail: Option<String>,
    pub at: DateTime<Utc>,
}

/// Where to send a task after its owner gave it up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeue {
    /// Back to the main queue now (heartbeat timeout, drained worker, redrive).
    Main,
    /// To the retry queue, to come back after the backoff.
    Retry,
    /// Retries exhausted: to the remediation queue.
    Remediation,
}
