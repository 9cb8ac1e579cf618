//! What the API answers, as types: each is serialized as it is and described in the
//! OpenAPI document (`crate::openapi`) from the same definition, so the two cannot differ.
//!
//! A client sees a task's type by the name it submitted with and its tenant as `namespace`.

use chrono::{DateTime, Utc};
use conveyor_core::labels::Labels;
use conveyor_core::task::{TaskEvent, TaskRecord};
use conveyor_core::task_type::local_name;
use conveyor_core::TaskState;
use serde::Serialize;
use utoipa::openapi::{ObjectBuilder, RefOr, Schema, Type};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::error::ApiError;

/// `TaskState` lives in the core crate, which knows nothing of OpenAPI: its schema is
/// built here from the same list of states the lifecycle table uses.
pub fn task_state_schema() -> impl Into<RefOr<Schema>> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(TaskState::ALL.map(|s| s.as_str())))
        .description(Some(
            "Where a task is in its life; COMPLETED, DEAD_LETTER and \
             CANCELLED are where it rests.",
        ))
}

/// Labels: a map of strings with Kubernetes' rules (`core/src/labels.rs`).
pub fn labels_schema() -> impl Into<RefOr<Schema>> {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .additional_properties(Some(ObjectBuilder::new().schema_type(Type::String)))
        .max_properties(Some(conveyor_core::labels::MAX_LABELS))
        .description(Some(
            "Up to 16 labels. A key is a name or prefix/name (a name: 1 to 63 letters, digits, \
             '-', '_' or '.', starting and ending with a letter or digit; a prefix: a DNS \
             subdomain); a value is empty or a name.",
        ))
}

/// A task in a list: everything but its payload and result, which can be large.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TaskSummary {
    pub id: Uuid,
    pub namespace: String,
    /// The TaskType's name in its namespace.
    pub task_type: String,
    pub idempotency_key: Uuid,
    #[schema(schema_with = task_state_schema)]
    pub state: TaskState,
    /// The fencing epoch: one more each time the task goes back to a queue.
    pub attempt: i32,
    /// Retries used since submission or the last retry/redrive.
    pub retries: i32,
    /// The worker that holds it, while one does.
    pub owner: Option<String>,
    #[schema(schema_with = labels_schema)]
    pub labels: Labels,
    /// The handler's latest progress report (exec: a line written on descriptor 3; http: a
    /// POST to `X-Conveyor-Progress-Url`).
    pub progress: Option<serde_json::Value>,
    /// The last failure's message.
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// Taken back from a worker that died beside other tasks: runs alone next time.
    pub suspect: bool,
}

/// A task with its payload and result.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TaskView {
    #[serde(flatten)]
    pub summary: TaskSummary,
    pub payload: serde_json::Value,
    /// What the handler returned, once COMPLETED.
    pub result: Option<serde_json::Value>,
}

impl From<&TaskRecord> for TaskSummary {
    fn from(task: &TaskRecord) -> Self {
        TaskSummary {
            id: task.id,
            namespace: task.tenant.clone(),
            task_type: local_name(&task.task_type, &task.tenant).to_owned(),
            idempotency_key: task.idempotency_key,
            state: task.state,
            attempt: task.attempt,
            retries: task.retries,
            owner: task.owner.clone(),
            labels: task.labels.clone(),
            progress: task.progress.clone(),
            error: task.error.clone(),
            created_at: task.created_at,
            updated_at: task.updated_at,
            suspect: task.suspect,
        }
    }
}

impl From<&TaskRecord> for TaskView {
    fn from(task: &TaskRecord) -> Self {
        TaskView {
            summary: task.into(),
            payload: task.payload.clone(),
            result: task.result.clone(),
        }
    }
}

/// A page of `GET /v1/tasks`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TaskPage {
    pub tasks: Vec<TaskSummary>,
    /// Pass as `cursor` for the next page; absent on the last one.
    pub next_cursor: Option<String>,
}

/// One step of a task's audit timeline.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventView {
    pub seq: i64,
    pub task_id: Uuid,
    pub task_type: String,
    /// Absent on the first event (INGESTED).
    #[schema(schema_with = task_state_schema)]
    pub from_state: Option<TaskState>,
    #[schema(schema_with = task_state_schema)]
    pub to_state: TaskState,
    pub attempt: i32,
    /// The worker that made the step (who retried or cancelled it is in `detail`).
    pub worker_id: Option<String>,
    pub detail: Option<String>,
    pub at: DateTime<Utc>,
}

impl EventView {
    pub fn of(event: &TaskEvent, tenant: &str) -> EventView {
        EventView {
            seq: event.seq,
            task_id: event.task_id,
            task_type: local_name(&event.task_type, tenant).to_owned(),
            from_state: event.from_state,
            to_state: event.to_state,
            attempt: event.attempt,
            worker_id: event.worker_id.clone(),
            detail: event.detail.clone(),
            at: event.at,
        }
    }
}

/// A task's timeline, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventList {
    pub events: Vec<EventView>,
}

/// One entry of a batch's answer, in the order submitted: accepted (201 new, 200 known
/// key) or refused with its own error.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum BatchAnswer {
    Accepted {
        status: u16,
        id: Uuid,
        #[schema(schema_with = task_state_schema)]
        state: TaskState,
        #[serde(rename = "idempotencyKey")]
        idempotency_key: Uuid,
    },
    Refused {
        status: u16,
        error: ApiError,
    },
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BatchResults {
    pub results: Vec<BatchAnswer>,
}

/// What `POST /v1/tasks:redrive` did.
#[derive(Debug, Serialize, ToSchema)]
pub struct RedriveAnswer {
    /// Dead letters sent back to work (DEAD_LETTER → QUEUED).
    pub redriven: u32,
    /// Selected but no longer dead-lettered when their turn came (retried meanwhile).
    pub skipped: u32,
    /// Whether more dead letters match: send the request again.
    pub more: bool,
    /// Why it stopped early, when it did; what was redriven stays redriven.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
}

/// One task type at a glance, for dashboards and the console.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TypeOverview {
    pub name: String,
    pub namespace: String,
    /// Messages waiting in its work and retry queues at the gateway's last reading (every
    /// few hundred milliseconds); absent before the first.
    pub backlog: Option<u64>,
    /// Messages taken from its queues per second, smoothed over the last readings.
    pub taken_per_second: Option<f64>,
    /// Tasks waiting in DEAD_LETTER for a retry or redrive.
    pub dead_letters: i64,
    pub max_queue_depth: u64,
    pub max_retries: u32,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TypeOverviews {
    pub task_types: Vec<TypeOverview>,
}
