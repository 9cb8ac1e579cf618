//! `WorkerPool`: a Deployment of `conveyor-worker` consuming some task types, scaled by
//! queue depth or by hand.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, EnvVar, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Annotation that pauses a pool's autoscaler at its current count while `"true"` (for an
/// incident or a migration); the pool follows its policy again once removed.
pub const AUTOSCALING_PAUSED: &str = "conveyor.dev/autoscaling-paused";

/// A pool of workers: which task types they consume, what they run, and how many of them.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "conveyor.dev",
    version = "v1alpha1",
    kind = "WorkerPool",
    plural = "workerpools",
    shortname = "wp",
    shortname = "taskpool",
    shortname = "taskpools",
    namespaced,
    status = "WorkerPoolStatus",
    doc = "A pool of conveyor-worker pods consuming some TaskTypes: what they run per task, how many tasks each runs at once, and how many workers there are (spec.replicas, /scale, or queue-depth autoscaling).",
    scale = r#"{"specReplicasPath":".spec.replicas", "statusReplicasPath":".status.replicas", "labelSelectorPath":".status.selector"}"#,
    printcolumn = r#"{"name":"Task-Types", "type":"string", "jsonPath":".spec.taskTypes"}"#,
    printcolumn = r#"{"name":"Ready", "type":"integer", "description":"Ready workers", "jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Desired", "type":"integer", "description":"Workers wanted", "jsonPath":".status.desiredReplicas"}"#,
    printcolumn = r#"{"name":"Queued", "type":"integer", "description":"Ready tasks in the pool's queues", "jsonPath":".status.queued"}"#,
    printcolumn = r#"{"name":"In-Flight", "type":"integer", "description":"Tasks being processed", "jsonPath":".status.inFlight"}"#,
    printcolumn = r#"{"name":"Dead-Lettered", "type":"integer", "description":"Tasks in remediation", "jsonPath":".status.deadLettered"}"#,
    printcolumn = r#"{"name":"Status", "type":"string", "jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Age", "type":"date", "jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.autoscaling) || !has(self.replicas) || self.replicas >= 0",
     "message": "replicas must be >= 0"},
    // Two scalers would fight; `kubectl scale` (or an HPA) on an autoscaled pool is refused
    // here rather than silently ignored.
    {"rule": "!has(self.autoscaling) || !has(self.replicas)",
     "message": "replicas and autoscaling are exclusive: spec.autoscaling decides the count of this pool; remove it and set spec.replicas to scale by hand, with kubectl scale, or with an HPA or KEDA on /scale"}
]))]
pub struct WorkerPoolSpec {
    /// Names of the TaskTypes (in this namespace) the pool consumes.
    #[schemars(length(min = 1, max = 16))]
    pub task_types: Vec<String>,
    /// Container image with conveyor-worker and whatever the handler runs (ffmpeg, ...).
    #[schemars(length(min = 1))]
    pub image: String,
    /// What each worker runs per task.
    pub handler: HandlerSpec,
    /// Tasks each worker runs at once; also its prefetch.
    #[serde(default = "default_concurrency")]
    #[schemars(range(min = 1, max = 1000))]
    pub concurrency: u16,
    /// Workers wanted when `autoscaling` is absent (1 when unset); `kubectl scale`, an HPA
    /// or KEDA set it through `/scale`. Not allowed together with `autoscaling`.
    #[serde(default)]
    pub replicas: Option<i32>,
    /// Queue-depth autoscaling; when present it decides the replica count.
    #[serde(default)]
    pub autoscaling: Option<Autoscaling>,
    /// CPU and memory of each worker container.
    #[serde(default)]
    pub resources: Option<ResourceRequirements>,
    /// Seconds a worker may finish in-flight tasks after SIGTERM before it releases them.
    #[serde(default = "default_drain_seconds")]
    #[schemars(range(min = 0, max = 3600))]
    pub drain_grace_seconds: u32,
    /// Scheduling and metadata overrides for the worker pods.
    #[serde(default)]
    pub pod: Option<PodOverrides>,
}

/// The handler a pool's workers run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.type != 'exec' || (has(self.command) && size(self.command) > 0)",
     "message": "the exec handler needs a command"},
    {"rule": "self.type != 'http' || has(self.url)",
     "message": "the http handler needs a url"}
]))]
pub struct HandlerSpec {
    /// exec (run a command per task), http (POST to a sidecar), or a built-in for tests
    /// and benchmarks: noop, sleep, fail, crash.
    #[serde(rename = "type")]
    pub kind: HandlerKind,
    /// For exec: the command and its arguments; the payload arrives on stdin.
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// For http: the sidecar URL tasks are POSTed to.
    #[serde(default)]
    pub url: Option<String>,
}

/// The handlers a worker knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum HandlerKind {
    Exec,
    Http,
    Noop,
    Sleep,
    Fail,
    Crash,
}

impl HandlerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            HandlerKind::Exec => "exec",
            HandlerKind::Http => "http",
            HandlerKind::Noop => "noop",
            HandlerKind::Sleep => "sleep",
            HandlerKind::Fail => "fail",
            HandlerKind::Crash => "crash",
        }
    }
}

/// Queue-depth autoscaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.minReplicas <= self.maxReplicas",
    "message": "minReplicas must not exceed maxReplicas"
}]))]
pub struct Autoscaling {
    /// Fewest workers; 0 lets an idle pool scale to zero (never while work is in flight).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub min_replicas: i32,
    /// Most workers.
    #[schemars(range(min = 1, max = 1000))]
    pub max_replicas: i32,
    /// Ready plus in-flight tasks one worker should carry.
    #[serde(default = "default_backlog_per_replica")]
    #[schemars(range(min = 1))]
    pub target_backlog_per_replica: u32,
    /// Seconds the pool waits, seeing lower desired counts throughout, before it shrinks.
    #[serde(default = "default_stabilization")]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_down_stabilization_seconds: u32,
    /// Ready tasks a pool at zero workers must see before it starts one (0: the first task
    /// starts it), so that a trickle does not keep waking an idle pool.
    #[serde(default)]
    pub activation_backlog: u32,
    /// Keep the tasks in flight at about this percent of the workers' slots (workers ×
    /// concurrency), beside the backlog term; for long tasks, where a backlog per worker
    /// says little. Unset: backlog and rates only.
    #[serde(default)]
    #[schemars(range(min = 1, max = 100))]
    pub target_utilization_percent: Option<u32>,
    /// Most of the pool one decision may remove, in percent (at least one worker).
    #[serde(default = "default_scale_down_percent")]
    #[schemars(range(min = 1, max = 100))]
    pub scale_down_max_percent: u32,
    /// What to run while the queue statistics cannot be read; unset: hold the current count
    /// (within min and max).
    #[serde(default)]
    pub fallback: Option<Fallback>,
}

/// Workers to run once the queue statistics have been unreadable for a while.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Fallback {
    /// Workers to run (within minReplicas and maxReplicas).
    #[schemars(range(min = 0))]
    pub replicas: i32,
    /// Seconds without statistics before the fallback applies; until then the pool holds.
    #[serde(default = "default_fallback_after")]
    #[schemars(range(min = 0, max = 3600))]
    pub after_seconds: u32,
}

/// Overrides for the worker pods.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodOverrides {
    /// Extra labels on the pods.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Extra annotations on the pods.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Node selector.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// Affinity.
    #[serde(default)]
    pub affinity: Option<Affinity>,
    /// Extra environment variables for the worker container.
    #[serde(default)]
    pub env: Vec<EnvVar>,
    /// Service account of the pods.
    #[serde(default)]
    pub service_account_name: Option<String>,
    /// Priority class of the pods.
    #[serde(default)]
    pub priority_class_name: Option<String>,
}

/// What the operator last saw and decided.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerPoolStatus {
    /// The generation the status describes.
    #[serde(default)]
    pub observed_generation: Option<i64>,
    /// Workers that exist (the scale subresource's status.replicas).
    #[serde(default)]
    pub replicas: i32,
    /// Workers ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Workers wanted now.
    #[serde(default)]
    pub desired_replicas: i32,
    /// Workers asked to stop taking tasks, removed as each becomes idle (or its drain
    /// grace ends).
    #[serde(default)]
    pub draining: i32,
    /// Label selector of the workers, for the scale subresource.
    #[serde(default)]
    pub selector: Option<String>,
    /// Ready tasks in the pool's work queues; absent while the broker cannot be read
    /// (unknown, not zero).
    #[serde(default)]
    pub queued: Option<u64>,
    /// Tasks being processed; absent while unknown.
    #[serde(default)]
    pub in_flight: Option<u64>,
    /// Tasks in the remediation queues; absent while unknown.
    #[serde(default)]
    pub dead_lettered: Option<u64>,
    /// The last change of the worker count: when, from what to what, why, and what the
    /// operator saw.
    #[serde(default)]
    pub last_scale: Option<ScaleRecord>,
    /// Ready, Scaling or Degraded.
    #[serde(default)]
    pub phase: Option<String>,
    /// Ready, Scaling.
    #[serde(default)]
    #[schemars(schema_with = "super::condition_list")]
    pub conditions: Vec<Condition>,
}

/// One scaling decision that changed the worker count, with its inputs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScaleRecord {
    /// When (RFC 3339).
    pub time: String,
    pub from: i32,
    pub to: i32,
    pub reason: String,
    /// Ready tasks in the pool's work queues (absent: the broker could not be read).
    #[serde(default)]
    pub ready: Option<u64>,
    #[serde(default)]
    pub in_flight: Option<u64>,
    /// Failed attempts waiting out their backoff.
    #[serde(default)]
    pub retrying: Option<u64>,
    /// Tasks per second finished and arriving, when the broker had measured them.
    #[serde(default)]
    pub processing_rate: Option<f64>,
    #[serde(default)]
    pub arrival_rate: Option<f64>,
}

fn default_concurrency() -> u16 {
    16
}
fn default_drain_seconds() -> u32 {
    25
}
fn default_backlog_per_replica() -> u32 {
    100
}
fn default_stabilization() -> u32 {
    300
}
fn default_scale_down_percent() -> u32 {
    50
}
fn default_fallback_after() -> u32 {
    60
}
