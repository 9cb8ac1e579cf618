//! What every reconcile shares: clients, settings, metrics and scaling memory.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use conveyor_core::amqp::Publisher;
use conveyor_core::crd::status::reasons;
use conveyor_core::crd::WorkerPool;
use conveyor_core::metrics;
use k8s_openapi::api::events::v1::Event as EventObject;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, ObjectMeta, Time};
use kube::api::{Api, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use prometheus::{HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use crate::autoscale::History;
use crate::backoff::Backoff;
use crate::broker_stats::BrokerStats;
use crate::build::ConnectionSecret;
use crate::declarations::Declarations;
use crate::rabbitmq::ManagementApi;
use crate::shared::lock;

pub struct Context {
    pub client: Client,
    /// The namespaces watched: all, or those of a namespace-scoped install.
    pub scope: conveyor_core::watch_scope::WatchScope,
    /// The operator runs with `--require-tls`: so do the workers it starts.
    pub require_tls: bool,
    /// See [`Context::with_admin_key`].
    admin_key: Option<Vec<u8>>,
    pub recorder: Recorder,
    reporter: Reporter,
    pub management: ManagementApi,
    /// Declares queues over AMQP (the management API could, but AMQP checks arguments).
    pub publisher: Publisher,
    pub secret: ConnectionSecret,
    pub metrics: OperatorMetrics,
    /// Scale-down stabilization memory per pool (`namespace/name`).
    pub histories: Mutex<HashMap<String, History>>,
    /// The last scaling record written per pool (uid): the watch may hand a reconcile the
    /// pool as it was before that write, and the status apply would drop the record.
    pub last_scales: Mutex<HashMap<String, conveyor_core::crd::worker_pool::ScaleRecord>>,
    /// Pools (`namespace/name`) at rest: only these are woken by changed queue counts (the
    /// others are looked at every period anyway).
    pub resting: Mutex<std::collections::HashSet<ObjectRef<WorkerPool>>>,
    /// TaskTypes at rest (every queue empty), woken likewise.
    pub resting_types: Mutex<std::collections::HashSet<ObjectRef<conveyor_core::crd::TaskType>>>,
    /// What was last applied for each pool (uid), so unchanged objects are not re-applied.
    pub applied: Mutex<HashMap<String, Applied>>,
    /// Consecutive reconcile failures per object, for retry delays.
    pub backoff: Backoff,
    /// The broker's queue statistics, polled once for every reconcile to read.
    pub broker: BrokerStats,
    /// Turns to declare queues over the operator's AMQP channel, and the last outage.
    pub declarations: Declarations,
    /// Every TaskType as the TaskType controller's watch sees it (set by
    /// `controllers::run`); pool reconciles read it instead of listing the API each time.
    pub task_types:
        std::sync::OnceLock<kube::runtime::reflector::Store<conveyor_core::crd::TaskType>>,
    /// Every pool's pods as a watch sees them (set by `controllers::run`): a scale-down reads
    /// them here instead of listing each pool's pods every minute.
    pub pods: std::sync::OnceLock<kube::runtime::reflector::Store<k8s_openapi::api::core::v1::Pod>>,
    /// Every pool's Deployment as a watch sees it (set by `controllers::run`), slimmed to
    /// what a reconcile reads: a pool at rest reads its count here, not from the apiserver.
    pub deployments: std::sync::OnceLock<
        kube::runtime::reflector::Store<k8s_openapi::api::apps::v1::Deployment>,
    >,
    /// Which pools' ConfigMap, Service or PodDisruptionBudget someone else touched.
    pub owned: crate::worker_pools::owned::Owned,
    /// Drains seen and pools looked at, for safe scale-down.
    pub drains: crate::scale_down::memory::Memory,
    /// TaskTypes (by uid) declared: at which generation, and when.
    pub declared: Mutex<HashMap<String, (Option<i64>, Instant)>>,
    started: Instant,
}

/// A pool's objects as this process last applied them.
pub struct Applied {
    /// A hash of the four objects.
    pub fingerprint: u64,
    /// The Deployment's generation that apply answered.
    pub generation: Option<i64>,
    /// The latest write by someone else to the Deployment that this apply answered.
    pub edited: Option<k8s_openapi::jiff::Timestamp>,
}

impl Context {
    /// The key each pool's worker admin token is derived from
    /// ([`conveyor_core::drain::pool_token`]); without one the workers' `/drain` is open.
    /// Starts every pool's workers with `--require-tls` too.
    pub fn with_require_tls(mut self, required: bool) -> Self {
        self.require_tls = required;
        self
    }

    /// Watches only `scope`'s namespaces (the cluster's by default).
    pub fn with_scope(mut self, scope: conveyor_core::watch_scope::WatchScope) -> Self {
        self.scope = scope;
        self
    }

    pub fn with_admin_key(mut self, key: Option<&str>) -> Self {
        self.admin_key = key.filter(|k| !k.is_empty()).map(|k| k.as_bytes().to_vec());
        self
    }

    /// The admin token of `pool`'s workers, when this operator has a key.
    pub fn admin_token(&self, pool: &WorkerPool) -> Option<String> {
        let key = self.admin_key.as_ref()?;
        Some(conveyor_core::drain::pool_token(
            key,
            &pool.namespace().unwrap_or_default(),
            &pool.name_any(),
        ))
    }

    pub fn new(
        client: Client,
        reporter: Reporter,
        management: ManagementApi,
        publisher: Publisher,
        secret: ConnectionSecret,
        metrics: OperatorMetrics,
    ) -> Self {
        Context {
            recorder: Recorder::new(client.clone(), reporter.clone()),
            reporter,
            client,
            management,
            publisher,
            secret,
            metrics,
            histories: Mutex::default(),
            last_scales: Mutex::default(),
            applied: Mutex::default(),
            resting: Mutex::default(),
            resting_types: Mutex::default(),
            backoff: Backoff::default(),
            broker: BrokerStats::default(),
            task_types: std::sync::OnceLock::new(),
            pods: std::sync::OnceLock::new(),
            deployments: std::sync::OnceLock::new(),
            owned: Default::default(),
            declared: Mutex::default(),
            drains: Default::default(),
            declarations: Declarations::default(),
            started: Instant::now(),
            admin_key: None,
            scope: Default::default(),
            require_tls: false,
        }
    }

    /// A deleted pool's memories (keyed by its uid), which nothing else would remove.
    pub fn forget_pool(&self, uid: &str) {
        lock(&self.applied).remove(uid);
        self.owned.forget(uid);
    }

    /// Seconds since start, the clock of the scaling histories.
    pub fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Publishes a Kubernetes Event about `object`; failing to is logged, never fatal.
    pub async fn event<K: Resource<DynamicType = ()>>(
        &self,
        object: &K,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        let event = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.to_owned(),
            note: Some(note),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        if let Err(err) = self.recorder.publish(&event, &object.object_ref(&())).await {
            tracing::warn!(error = %err, reason, "cannot publish Event");
        }
    }
}

impl Context {
    /// Publishes a Normal Event that stands on its own. The recorder folds events of the
    /// same reason into one series that keeps the first note (`Scaled (x12)` with the
    /// oldest reason); a scaling decision's explanation must stay readable.
    pub async fn event_each<K: Resource<DynamicType = ()>>(
        &self,
        object: &K,
        reason: &str,
        note: String,
    ) {
        let namespace = object.namespace().unwrap_or_else(|| "default".to_owned());
        let event = EventObject {
            metadata: ObjectMeta {
                // The apiserver validates the prefix as a name with one trailing dash
                // allowed: `pool.` is refused, `pool.scaled-` is not.
                generate_name: Some(format!(
                    "{}.{}-",
                    object.name_any(),
                    reason.to_ascii_lowercase()
                )),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(jiff_now())),
            type_: Some("Normal".to_owned()),
            reason: Some(reason.to_owned()),
            action: Some("Reconcile".to_owned()),
            // The API refuses notes past 1 kB.
            note: Some(note.chars().take(1000).collect()),
            regarding: Some(object.object_ref(&())),
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            ..EventObject::default()
        };
        let events: Api<EventObject> = Api::namespaced(self.client.clone(), &namespace);
        if let Err(err) = events.create(&PostParams::default(), &event).await {
            tracing::warn!(error = %err, reason, "cannot publish Event");
        }
    }
}

/// Operator metrics, one registry per process.
#[derive(Clone)]
pub struct OperatorMetrics {
    pub registry: Registry,
    pub reconciles: IntCounterVec,
    pub errors: IntCounterVec,
    pub scaling_decisions: IntCounterVec,
    /// Requests to RabbitMQ by API (`management`, `amqp` declarations).
    pub broker_requests: IntCounterVec,
    /// Reconcile run time by controller.
    pub reconcile_seconds: HistogramVec,
    /// 1 while this process leads (and exports the state gauges below).
    pub leader: IntGauge,
    /// Workers per pool by state (`gauges.rs`).
    pub pool_replicas: IntGaugeVec,
    /// Messages per task type by queue (`gauges.rs`).
    pub queue_depth: IntGaugeVec,
    /// Consumers of each task type's work queue (`gauges.rs`).
    pub queue_consumers: IntGaugeVec,
}

impl OperatorMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            metrics::counter(&registry, name, help, labels)
        };
        let operator = OperatorMetrics {
            reconciles: counter(
                "operator_reconciles_total",
                "Reconciles by controller",
                &["controller"],
            ),
            errors: counter(
                "operator_errors_total",
                "Reconcile errors by controller and category",
                &["controller", "category"],
            ),
            scaling_decisions: counter(
                "operator_scaling_decisions_total",
                "Replica changes by direction",
                &["direction"],
            ),
            broker_requests: counter(
                "operator_broker_requests_total",
                "Requests to RabbitMQ by API (management, amqp)",
                &["api"],
            ),
            reconcile_seconds: metrics::histogram(
                &registry,
                "operator_reconcile_duration_seconds",
                "Reconcile run time by controller",
                &["controller"],
                metrics::REQUEST_SECONDS_BUCKETS,
            ),
            leader: metrics::gauge(
                &registry,
                "operator_leader",
                "1 while this operator process holds the lease",
            ),
            pool_replicas: metrics::gauge_vec(
                &registry,
                "pool_replicas",
                "Workers per pool: desired, current, ready, draining",
                &["namespace", "pool", "state"],
            ),
            queue_depth: metrics::gauge_vec(
                &registry,
                "queue_depth",
                "Messages per task type: ready, in_flight, retry, remediation (absent while unknown)",
                &["namespace", "task_type", "queue"],
            ),
            queue_consumers: metrics::gauge_vec(
                &registry,
                "queue_consumers",
                "Consumers of each task type's work queue (absent while unknown)",
                &["namespace", "task_type"],
            ),
            registry,
        };
        // Zero series for what may happen, so that a rate reads 0 before the first error
        // or scaling step rather than nothing (and dashboards' queries find the names).
        for controller in ["tasktype", "workerpool"] {
            for category in [
                reasons::KUBERNETES_API,
                reasons::RABBITMQ_UNAVAILABLE,
                reasons::RABBITMQ_REFUSED,
                reasons::INVALID_SPEC,
                reasons::RECONCILE_TIMEOUT,
            ] {
                operator.errors.with_label_values(&[controller, category]);
            }
        }
        for direction in ["up", "down"] {
            operator.scaling_decisions.with_label_values(&[direction]);
        }
        operator
    }
}

impl Default for OperatorMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// A condition with `lastTransitionTime` kept when its status did not change.
pub fn condition(
    previous: &[Condition],
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let since = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(jiff_now()));
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

fn jiff_now() -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::now()
}
