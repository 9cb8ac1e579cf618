//! `WorkerPool`: a Deployment of `conveyor-worker` consuming some task types, scaled by
//! queue depth or by hand.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Container, EnvFromSource, EnvVar, LocalObjectReference, PodSecurityContext,
    ResourceRequirements, SecurityContext, Toleration, TopologySpreadConstraint, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
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
    /// CPU, memory and ephemeral storage of each worker container. An `ephemeral-storage`
    /// limit counts the container's writes outside its volumes and the pod's emptyDirs (the
    /// operator's `tmp` and `buffer`, and any in `pod.volumes`): a pod past it is evicted
    /// and its tasks run again elsewhere. `pod.tmpSizeLimit` and `pod.bufferSizeLimit`
    /// bound the operator's two scratch directories on their own.
    #[serde(default)]
    pub resources: Option<ResourceRequirements>,
    /// Seconds a worker may finish in-flight tasks after SIGTERM before it releases them.
    #[serde(default = "default_drain_seconds")]
    #[schemars(range(min = 0, max = 3600))]
    pub drain_grace_seconds: u32,
    /// The worker pods' template: metadata, scheduling, volumes, init and sidecar
    /// containers, security contexts and the worker container's extra environment.
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

/// Names the operator gives the worker pods' environment itself.
pub const RESERVED_ENV: [&str; 3] = ["POD_NAME", "CONVEYOR_DATABASE_URL", "CONVEYOR_AMQP_URL"];
/// The operator's own volumes of a worker pod.
pub const RESERVED_VOLUMES: [&str; 4] = ["config", "tmp", "buffer", "tls"];
/// Where the worker container mounts the operator's volumes.
pub const RESERVED_MOUNT_PATHS: [&str; 4] = [
    "/etc/conveyor",
    "/tmp",
    "/var/lib/conveyor",
    "/var/run/conveyor/tls",
];
/// The worker container's name.
pub const WORKER_CONTAINER: &str = "worker";

/// The worker pods' template: a curated part of a PodSpec (decision 0028). The operator
/// owns the worker container's command, probes, ports and its own volumes; everything here
/// is added to them, and the security contexts are merged over its restricted defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.env) || self.env.all(e, !(e.name in ['POD_NAME', 'CONVEYOR_DATABASE_URL', 'CONVEYOR_AMQP_URL']))",
     "message": "spec.pod.env must not set POD_NAME, CONVEYOR_DATABASE_URL or CONVEYOR_AMQP_URL: the operator sets them (the connections come from its Secret)"},
    {"rule": "!has(self.volumes) || self.volumes.all(v, !(v.name in ['config', 'tmp', 'buffer', 'tls']))",
     "message": "spec.pod.volumes must not be named config, tmp, buffer or tls: those are the operator's own volumes"},
    {"rule": "!has(self.volumes) || self.volumes.all(v, self.volumes.exists_one(w, w.name == v.name))",
     "message": "spec.pod.volumes names must be unique"},
    {"rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in ['/etc/conveyor', '/etc/conveyor/', '/tmp', '/tmp/', '/var/lib/conveyor', '/var/lib/conveyor/', '/var/run/conveyor/tls', '/var/run/conveyor/tls/']))",
     "message": "spec.pod.volumeMounts must not mount at /etc/conveyor, /tmp, /var/lib/conveyor or /var/run/conveyor/tls: the operator mounts its own volumes there"},
    {"rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, self.volumeMounts.exists_one(n, n.mountPath == m.mountPath))",
     "message": "spec.pod.volumeMounts mountPaths must be unique"},
    {"rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, m.name in ['config', 'tmp', 'buffer', 'tls'] || (has(self.volumes) && self.volumes.exists(v, v.name == m.name)))",
     "message": "each of spec.pod.volumeMounts must name a volume of spec.pod.volumes (or the operator's config, tmp, buffer or tls)"},
    {"rule": "(!has(self.initContainers) || self.initContainers.all(c, c.name != 'worker' && self.initContainers.exists_one(d, d.name == c.name) && (!has(self.sidecars) || !self.sidecars.exists(d, d.name == c.name)))) && (!has(self.sidecars) || self.sidecars.all(c, c.name != 'worker' && self.sidecars.exists_one(d, d.name == c.name)))",
     "message": "spec.pod.initContainers and spec.pod.sidecars names must be unique among them and not worker (the worker container's name)"},
    {"rule": "!has(self.initContainers) || self.initContainers.all(c, (has(c.restartPolicy) && c.restartPolicy == 'Always') || !(has(c.lifecycle) || has(c.livenessProbe) || has(c.readinessProbe) || has(c.startupProbe)))",
     "message": "spec.pod.initContainers run to completion and may not have lifecycle hooks or probes: put a container that keeps running in spec.pod.sidecars"},
    {"rule": "!has(self.sidecars) || self.sidecars.all(c, !has(c.restartPolicy) || c.restartPolicy == 'Always')",
     "message": "spec.pod.sidecars always restart: leave their restartPolicy unset (or Always); a container that runs once belongs in spec.pod.initContainers"}
]))]
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
    /// Extra environment variables for the worker container. POD_NAME,
    /// CONVEYOR_DATABASE_URL and CONVEYOR_AMQP_URL are the operator's.
    #[serde(default)]
    #[schemars(length(max = 128), transform = bounded_env_names)]
    pub env: Vec<EnvVar>,
    /// Sources of environment variables (ConfigMaps, Secrets) for the worker container;
    /// a variable of `env` wins over one of these.
    #[serde(default)]
    #[schemars(length(max = 32))]
    pub env_from: Vec<EnvFromSource>,
    /// Service account of the pods.
    #[serde(default)]
    pub service_account_name: Option<String>,
    /// Priority class of the pods.
    #[serde(default)]
    pub priority_class_name: Option<String>,
    /// Runtime class of the pods, e.g. `nvidia` for a pool that encodes on GPUs.
    #[serde(default)]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub runtime_class_name: Option<String>,
    /// Secrets to pull the pool's images (the worker's, init containers' and sidecars').
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// Extra volumes of the pods, after the operator's own: `config`, `tmp`, `buffer` and
    /// `tls` (names those cannot take). Mount them with `volumeMounts` (the worker) or in an
    /// init or sidecar container's own `volumeMounts`.
    #[serde(default)]
    #[schemars(length(max = 64), transform = dns_label_names, transform = terse_items)]
    pub volumes: Vec<Volume>,
    /// Extra mounts of the worker container, after the operator's own at /etc/conveyor,
    /// /tmp, /var/lib/conveyor and /var/run/conveyor/tls (paths these cannot take). Each
    /// names a volume of `volumes` (or one of the operator's).
    #[serde(default)]
    #[schemars(length(max = 64), transform = bounded_mounts)]
    pub volume_mounts: Vec<VolumeMount>,
    /// Containers run to completion, in order, before the worker and the sidecars start
    /// (fetching models, warming a cache). Each gets the restricted container security
    /// context below its own `securityContext`, as the worker does.
    #[serde(default)]
    #[schemars(length(max = 16), transform = dns_label_names_with_image, transform = terse_items)]
    pub init_containers: Vec<Container>,
    /// Containers that run beside the worker for the pod's life (an HTTP handler the
    /// worker POSTs to, a log shipper): Kubernetes' native sidecars, emitted as init
    /// containers with `restartPolicy: Always` after `initContainers`, so that they start
    /// once the one-shot init containers are done, are started before the worker, and stop
    /// after it. Each gets the restricted container security context below its own.
    #[serde(default)]
    #[schemars(length(max = 16), transform = dns_label_names_with_image, transform = terse_items)]
    pub sidecars: Vec<Container>,
    /// The pods' security context, merged field by field over the operator's default
    /// (runAsNonRoot, runAsUser, runAsGroup and fsGroup 65532, seccomp RuntimeDefault):
    /// `runAsUser: 1000` keeps the rest; a list given (supplementalGroups, sysctls)
    /// replaces the default's.
    #[serde(default)]
    pub security_context: Option<PodSecurityContext>,
    /// The worker container's security context, merged field by field over the operator's
    /// default (no privilege escalation, a read-only root filesystem, runAsNonRoot, every
    /// capability dropped, seccomp RuntimeDefault): `readOnlyRootFilesystem: false` keeps
    /// the rest; `capabilities.add` is added beside the default's `drop: [ALL]`.
    #[serde(default)]
    pub container_security_context: Option<SecurityContext>,
    /// How the pods spread over the cluster. When given, these replace the operator's
    /// default (a soft spread over `kubernetes.io/hostname`); a constraint without a
    /// `labelSelector` gets the pool's (`conveyor.dev/pool: <pool>`).
    #[serde(default)]
    #[schemars(length(max = 8))]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Size limit of the worker's `/tmp` (an emptyDir); unset: bounded only by the node
    /// and the container's ephemeral-storage limit.
    #[serde(default)]
    pub tmp_size_limit: Option<Quantity>,
    /// Size limit of the worker's degraded-mode buffer at /var/lib/conveyor (an emptyDir
    /// that outlives a container restart); unset: bounded only by the node and the
    /// container's ephemeral-storage limit.
    #[serde(default)]
    pub buffer_size_limit: Option<Quantity>,
}

/// A DNS-1123 label: what Kubernetes requires of volume and container names.
const DNS_LABEL: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";

/// The `name` of a list's items: a DNS-1123 label of at most 63 characters. The length
/// bound also keeps the CEL rules' estimated cost within the apiserver's budget.
fn dns_label_names(schema: &mut schemars::Schema) {
    if let Some(name) = schema.pointer_mut("/items/properties/name") {
        name["maxLength"] = 63.into();
        name["pattern"] = DNS_LABEL.into();
    }
}

/// [`dns_label_names`], and an image required: a container of the pool's has no default.
fn dns_label_names_with_image(schema: &mut schemars::Schema) {
    dns_label_names(schema);
    if let Some(serde_json::Value::Array(required)) = schema.pointer_mut("/items/required") {
        required.push("image".into());
    }
}

/// Mounts: a volume name (a DNS-1123 label) and a path of at most 4096 characters, so that
/// the CEL rules comparing them have a bounded cost.
fn bounded_mounts(schema: &mut schemars::Schema) {
    if let Some(name) = schema.pointer_mut("/items/properties/name") {
        name["maxLength"] = 63.into();
    }
    if let Some(path) = schema.pointer_mut("/items/properties/mountPath") {
        path["maxLength"] = 4096.into();
    }
}

/// Drops the descriptions inside a list's items: Kubernetes' own text for every field of a
/// Container or Volume (`kubectl explain pod.spec` has it) would make the CRD larger than
/// the 256 KiB annotation a client-side `kubectl apply` keeps of it.
fn terse_items(schema: &mut schemars::Schema) {
    fn strip(value: &mut serde_json::Value) {
        let serde_json::Value::Object(map) = value else {
            if let serde_json::Value::Array(items) = value {
                items.iter_mut().for_each(strip);
            }
            return;
        };
        map.remove("description");
        for (key, child) in map.iter_mut() {
            match (key.as_str(), child) {
                // A map of property names: a property may be called `description`.
                ("properties", serde_json::Value::Object(properties)) => {
                    properties.values_mut().for_each(strip)
                }
                (_, child) => strip(child),
            }
        }
    }
    if let Some(items) = schema.get_mut("items") {
        strip(items);
    }
}

/// Environment variable names of at most 1024 characters, for the CEL rules' cost.
fn bounded_env_names(schema: &mut schemars::Schema) {
    if let Some(name) = schema.pointer_mut("/items/properties/name") {
        name["maxLength"] = 1024.into();
    }
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
