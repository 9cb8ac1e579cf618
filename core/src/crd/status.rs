//! The words of the resources' status: condition types, reasons and phases, as constants so
//! that the operator, its tests and the docs agree (`kubectl wait --for=condition=Ready`
//! and GitOps health checks read them).

/// Condition types.
pub mod conditions {
    /// TaskType: queues declared and schema compiled. WorkerPool: serving (not degraded, a
    /// worker ready or none wanted); a scaling step does not make it False.
    pub const READY: &str = "Ready";
    pub const QUEUES_DECLARED: &str = "QueuesDeclared";
    /// A pool's count is changing, or workers are draining before their removal.
    pub const SCALING: &str = "Scaling";
    /// Whether the autoscaler could read the queues' statistics (unknown is not zero).
    pub const METRICS_AVAILABLE: &str = "MetricsAvailable";
}

/// Condition reasons and Event reasons. Failures carry their error's category instead
/// (`operator/src/error.rs`), one of the `*_UNAVAILABLE`, `INVALID_SPEC`, ... below.
pub mod reasons {
    pub const STABLE: &str = "Stable";
    pub const SCALING: &str = "Scaling";
    /// Event: the worker count changed.
    pub const SCALED: &str = "Scaled";
    pub const QUEUES_READ: &str = "QueuesRead";
    pub const QUEUES_DECLARED: &str = "QueuesDeclared";
    pub const QUEUES_DELETED: &str = "QueuesDeleted";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const KUBERNETES_API: &str = "KubernetesApi";
    pub const RABBITMQ_UNAVAILABLE: &str = "RabbitMQUnavailable";
    pub const QUEUE_ARGUMENTS_MISMATCH: &str = "QueueArgumentsMismatch";
    pub const TLS_SETTINGS: &str = "TLSSettings";
    pub const METRICS_UNAVAILABLE: &str = "MetricsUnavailable";
    pub const RABBITMQ_CLIENT: &str = "RabbitMQClient";
    pub const RABBITMQ_REFUSED: &str = "RabbitMQRefused";
    /// A TaskType's queue is not in the broker yet (not declared, or deleted).
    pub const QUEUE_MISSING: &str = "QueueMissing";
    /// A TaskType's exchange is not in the broker (deleted by hand, say): declared again.
    pub const EXCHANGE_MISSING: &str = "ExchangeMissing";
    /// The operator's own RabbitMQ settings are incomplete (no broker URL).
    pub const RABBITMQ_SETTINGS: &str = "RabbitMQSettings";
    pub const INVALID_OBJECT: &str = "InvalidObject";
    pub const UNKNOWN_TASK_TYPE: &str = "UnknownTaskType";
    pub const BUILD_FAILED: &str = "BuildFailed";
    /// A pool's pod template cannot run: an init or sidecar container mounts a volume the
    /// pod does not have, or the apiserver refused the Deployment built from it.
    pub const INVALID_POD_TEMPLATE: &str = "InvalidPodTemplate";
    pub const RECONCILE_TIMEOUT: &str = "ReconcileTimeout";
}

/// A WorkerPool's `status.phase`.
pub mod phases {
    pub const READY: &str = "Ready";
    pub const SCALING: &str = "Scaling";
    /// Its objects could not be built or applied; the Deployment keeps its count.
    pub const DEGRADED: &str = "Degraded";
}
