//! The custom resources: `TaskType`, `WorkerPool` and `ClientToken` (group `conveyor.dev`,
//! `v1alpha1`).
//! Types only; the operator reconciles them. Every spec field's doc comment becomes the
//! description `kubectl explain` shows.

pub mod client_token;
pub mod status;
pub mod task_type;
pub mod worker_pool;

use kube::CustomResourceExt;

pub use client_token::{ClientToken, ClientTokenSpec};
pub use status::conditions;
pub use task_type::{TaskType, TaskTypeSpec, TaskTypeStatus};
pub use worker_pool::{WorkerPool, WorkerPoolSpec, WorkerPoolStatus};

pub const GROUP: &str = "conveyor.dev";
pub const VERSION: &str = "v1alpha1";

/// The CRDs as YAML documents, in the order `crds/` stores them.
pub fn crd_documents() -> Vec<(&'static str, String)> {
    let yaml = |crd| serde_yaml::to_string(&crd).unwrap_or_default();
    vec![
        ("tasktypes.yaml", yaml(TaskType::crd())),
        ("workerpools.yaml", yaml(WorkerPool::crd())),
        ("clienttokens.yaml", yaml(ClientToken::crd())),
    ]
}

/// Schema for a field that holds any JSON (a payload schema, say): kept as is by the
/// apiserver instead of pruned.
pub(crate) fn any_json(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// Schema of a `conditions` list: a list-map keyed by type, as Kubernetes conventions ask.
pub(crate) fn condition_list(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "properties": {
                "lastTransitionTime": { "format": "date-time", "type": "string" },
                "message": { "type": "string" },
                "observedGeneration": { "type": "integer", "format": "int64" },
                "reason": { "type": "string" },
                "status": { "type": "string" },
                "type": { "type": "string" }
            },
            "required": ["lastTransitionTime", "message", "reason", "status", "type"]
        }
    })
}
