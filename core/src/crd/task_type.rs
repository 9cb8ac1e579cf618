//! `TaskType`: what a task of one type may contain and how it is retried.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A kind of task (transcode, thumbnail, ...): its payload schema, limits and retry policy.
/// Conveyor declares its queues `conveyor.<namespace>.<name>`, one retry queue per retry
/// number (`.retry`, `.retry.1`, ...) and `.remediation`. The name may not contain a dot.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "conveyor.dev",
    version = "v1alpha1",
    kind = "TaskType",
    plural = "tasktypes",
    shortname = "tt",
    namespaced,
    status = "TaskTypeStatus",
    doc = "A kind of task (transcode, thumbnail, ...): its payload schema, limits and retry policy. The operator declares its queues and policies and reports their depths; the gateway accepts tasks of this type once it is Ready.",
    printcolumn = r#"{"name":"Ready", "type":"string", "description":"Queues declared and the schema compiles", "jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Queued", "type":"integer", "description":"Ready messages in the work queue", "jsonPath":".status.depths.ready"}"#,
    printcolumn = r#"{"name":"In-Flight", "type":"integer", "description":"Delivered, not yet acknowledged", "jsonPath":".status.depths.inFlight"}"#,
    printcolumn = r#"{"name":"Retry", "type":"integer", "description":"Waiting for their backoff", "jsonPath":".status.depths.retry"}"#,
    printcolumn = r#"{"name":"Remediation", "type":"integer", "description":"Dead-lettered", "jsonPath":".status.depths.remediation"}"#,
    printcolumn = r#"{"name":"Age", "type":"date", "jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct TaskTypeSpec {
    /// JSON schema every payload must satisfy; absent means any JSON object.
    #[serde(default)]
    #[schemars(schema_with = "super::any_json")]
    pub schema: Option<serde_json::Value>,
    /// Largest accepted payload, serialized, in bytes.
    #[serde(default = "defaults::max_payload_bytes")]
    #[schemars(range(min = 1, max = 16_777_216))]
    pub max_payload_bytes: usize,
    /// Retries after the first attempt before a task is dead-lettered.
    #[serde(default = "defaults::max_retries")]
    #[schemars(range(max = 100))]
    pub max_retries: u32,
    /// Delay before each retry: exponential with jitter.
    #[serde(default)]
    pub backoff: Backoff,
    /// Longest a handler may run for one attempt, in seconds.
    #[serde(default = "defaults::timeout_seconds")]
    #[schemars(range(min = 0.001))]
    pub timeout_seconds: f64,
    /// A task whose worker has not heartbeated for this many seconds is re-queued.
    #[serde(default = "defaults::heartbeat_timeout_seconds")]
    #[schemars(range(min = 0.5))]
    pub heartbeat_timeout_seconds: f64,
    /// Above this many ready tasks the gateway answers 429 with Retry-After.
    #[serde(default = "defaults::max_queue_depth")]
    #[schemars(range(min = 1))]
    pub max_queue_depth: u64,
    /// Submissions per second accepted for this type from each client.
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
    /// What happens to the queues when the TaskType is deleted: Retain (default) keeps them
    /// and their messages, and the tasks wait for the type to come back; Delete removes
    /// them, and the gateway then cancels the waiting tasks and dead-letters those whose
    /// worker went silent.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
    /// Days a COMPLETED or CANCELLED task is kept after it settled, and with it its
    /// idempotency key; absent means the gateway's `--task-retention-days`, 0 keeps them for
    /// ever. Expired tasks are written to the gateway's `--task-archive-dir` (when set)
    /// before they are deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 36500))]
    pub settled_retention_days: Option<u32>,
}

/// Exponential backoff with jitter: `initialSeconds * multiplier^retry`, capped at `maxSeconds`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.initialSeconds <= self.maxSeconds",
    "message": "initialSeconds must not exceed maxSeconds"
}]))]
pub struct Backoff {
    /// Delay before the first retry, in seconds.
    #[schemars(range(min = 0.001))]
    pub initial_seconds: f64,
    /// Upper bound of any delay, in seconds.
    #[schemars(range(min = 0.001))]
    pub max_seconds: f64,
    /// Growth factor per retry (at least 1).
    #[schemars(range(min = 1.0))]
    pub multiplier: f64,
}

/// A token bucket: `perSecond` refill, up to `burst` at once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RateLimit {
    /// Sustained tasks per second.
    #[schemars(range(min = 0.001))]
    pub per_second: f64,
    /// Largest burst; defaults to one second's worth.
    #[serde(default)]
    pub burst: Option<f64>,
}

/// What deleting a TaskType does to its queues.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DeletionPolicy {
    /// Keep the queues and the tasks in them.
    #[default]
    Retain,
    /// Delete the three queues (and any tasks still in them).
    Delete,
}

/// What the operator last saw of the TaskType's queues.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TaskTypeStatus {
    /// The generation the status describes.
    #[serde(default)]
    pub observed_generation: Option<i64>,
    /// Ready, QueuesDeclared.
    #[serde(default)]
    #[schemars(schema_with = "super::condition_list")]
    pub conditions: Vec<Condition>,
    /// Messages in each queue.
    #[serde(default)]
    pub depths: Option<QueueDepths>,
}

/// Messages per queue of a task type.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueueDepths {
    /// Ready in the work queue.
    pub ready: u64,
    /// Delivered to workers, not yet acknowledged.
    pub in_flight: u64,
    /// Waiting in the retry queue.
    pub retry: u64,
    /// Parked in the remediation queue.
    pub remediation: u64,
}

pub(crate) mod defaults {
    pub fn max_payload_bytes() -> usize {
        256 * 1024
    }
    pub fn max_retries() -> u32 {
        3
    }
    pub fn timeout_seconds() -> f64 {
        3600.0
    }
    pub fn heartbeat_timeout_seconds() -> f64 {
        30.0
    }
    pub fn max_queue_depth() -> u64 {
        100_000
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial_seconds: 1.0,
            max_seconds: 300.0,
            multiplier: 2.0,
        }
    }
}

impl Default for TaskTypeSpec {
    fn default() -> Self {
        TaskTypeSpec {
            schema: None,
            max_payload_bytes: defaults::max_payload_bytes(),
            max_retries: defaults::max_retries(),
            backoff: Backoff::default(),
            timeout_seconds: defaults::timeout_seconds(),
            heartbeat_timeout_seconds: defaults::heartbeat_timeout_seconds(),
            max_queue_depth: defaults::max_queue_depth(),
            rate_limit: None,
            deletion_policy: DeletionPolicy::Retain,
            settled_retention_days: None,
        }
    }
}
