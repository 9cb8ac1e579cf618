//! What every reconcile shares: clients, settings, metrics and scaling memory.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use conveyor_core::amqp::Publisher;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource};
use prometheus::{IntCounterVec, Registry};

use crate::autoscale::History;
use crate::build::ConnectionSecret;
use crate::rabbitmq::ManagementApi;

pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub management: ManagementApi,
    /// Declares queues over AMQP (the management API could, but AMQP checks arguments).
    pub publisher: Publisher,
    pub secret: ConnectionSecret,
    pub metrics: OperatorMetrics,
    /// Scale-down stabilization memory per pool (`namespace/name`).
    pub histories: Mutex<HashMap<String, History>>,
    started: Instant,
}

impl Context {
    pub fn new(
        client: Client,
        recorder: Recorder,
        management: ManagementApi,
        publisher: Publisher,
        secret: ConnectionSecret,
        metrics: OperatorMetrics,
    ) -> Self {
        Context {
            client,
            recorder,
            management,
            publisher,
            secret,
            metrics,
            histories: Mutex::default(),
            started: Instant::now(),
        }
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

/// Operator metrics, one registry per process.
#[derive(Clone)]
pub struct OperatorMetrics {
    pub registry: Registry,
    pub reconciles: IntCounterVec,
    pub errors: IntCounterVec,
    pub scaling_decisions: IntCounterVec,
}

impl OperatorMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            conveyor_core::metrics::counter(&registry, name, help, labels)
        };
        OperatorMetrics {
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
            registry,
        }
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
