//! WorkerPool reconcile, in steps: observe (the pool's task types, its queues' load, its
//! Deployment) → decide the count (`autoscale.rs`, or `spec.replicas`) → settle it
//! (`scale_down.rs`: workers leave only once drained) → apply the objects (pure `build.rs`,
//! server-side apply) → announce a change (an Event of its own) → report (status).

use std::sync::Arc;
use std::time::Duration;

use conveyor_core::crd::status::reasons;
use conveyor_core::crd::worker_pool::AUTOSCALING_PAUSED;
use conveyor_core::crd::{TaskType, WorkerPool};
use conveyor_core::task_type::NamedTaskType;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStatus};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde::Serialize;

use crate::autoscale::{
    desired_replicas, statistics_read, without_statistics, Decision, Observation,
};
use crate::build::{self, FIELD_MANAGER};
use crate::context::{Applied, Context};
use crate::error::{Error, Result};
use crate::scale_down;
use crate::shared::{lock, synced};

mod applied;
pub mod owned;
mod status;
use owned::Kind;
use status::{last_scale, report, write_status, Status};

/// How often an autoscaled pool is looked at again.
const AUTOSCALE_PERIOD: Duration = Duration::from_secs(10);
const RESYNC: Duration = Duration::from_secs(60);
/// How often a pool with workers draining is looked at again, to remove each once idle.
const DRAIN_POLL: Duration = Duration::from_secs(2);

/// What the pool's queues hold now.
#[derive(Debug, Default, Clone, Copy)]
struct Load {
    ready: u64,
    in_flight: u64,
    retrying: u64,
    dead_lettered: u64,
    /// Acknowledgements per second over the pool's types; `None` until the broker measured.
    rate: Option<f64>,
    /// Publishes per second into the pool's work queues; `None` until the broker measured.
    arrival: Option<f64>,
}

/// What one reconcile saw of the pool before deciding.
struct Seen {
    task_types: Vec<NamedTaskType>,
    load: Result<Load, Error>,
    /// The Deployment's count now, and how many of its workers are ready.
    current: i32,
    ready_replicas: i32,
    /// Its generation (`None`: no Deployment; another writer's edit changes it) and the
    /// fingerprint it carries.
    deployment: applied::Live,
}

#[tracing::instrument(skip_all, fields(pool = %pool.name_any()))]
pub async fn reconcile(pool: Arc<WorkerPool>, ctx: Arc<Context>) -> Result<Action> {
    ctx.metrics
        .reconciles
        .with_label_values(&["workerpool"])
        .inc();
    // Being deleted (in the foreground): its objects go with it, and applying them again
    // would fight the garbage collector.
    if pool.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let seen = observe(&pool, &ctx).await?;
    let (wanted, mut reason) = decide(&pool, &seen.load, seen.current, &ctx);
    // Workers leave only once drained (scale_down.rs): the Deployment shrinks as they do.
    let settled = scale_down::settle(&pool, &ctx, seen.current, wanted).await;
    if let Some(note) = &settled.note {
        reason = format!("{reason}; {note}");
    }
    apply_objects(&pool, &ctx, &seen, settled.replicas).await?;
    announce(&pool, &ctx, seen.current, settled.replicas, &reason).await;
    let unknown = seen.load.is_err();
    let at_rest = at_rest(&pool, &seen, wanted, settled.waiting);
    let key = ObjectRef::from_obj(pool.as_ref());
    if at_rest {
        lock(&ctx.resting).insert(key);
    } else {
        lock(&ctx.resting).remove(&key);
    }
    report(&pool, &ctx, seen, wanted, &settled, reason).await?;
    Ok(Action::requeue(if settled.waiting > 0 {
        DRAIN_POLL
    } else if (pool.spec.autoscaling.is_some() && !at_rest) || unknown {
        // Unknown counts (a broker outage, or a poller that has not listed yet) are looked
        // at again soon, so that the status shows them once they are known.
        AUTOSCALE_PERIOD
    } else {
        RESYNC
    }))
}

/// An autoscaled pool with nothing queued, retrying or in flight, at its minimum, with no
/// drain under way: nothing the period would change. The broker poller wakes it when its
/// queues' counts change (`controllers.rs`), so a thousand idle pools cost a reconcile a
/// minute each, not six.
fn at_rest(pool: &WorkerPool, seen: &Seen, wanted: i32, waiting: usize) -> bool {
    let Some(policy) = &pool.spec.autoscaling else {
        return false;
    };
    let idle = seen
        .load
        .as_ref()
        .is_ok_and(|l| l.ready + l.in_flight + l.retrying == 0);
    idle && waiting == 0 && seen.current == wanted && wanted == policy.min_replicas
}

/// The pool's task types, its queues' load and its Deployment's counts.
async fn observe(pool: &WorkerPool, ctx: &Context) -> Result<Seen> {
    let task_types = namespace_task_types(pool, ctx).await?;
    let load = read_load(pool, &task_types, ctx).await;
    let deployment = live_deployment(pool, ctx).await?;
    let current = deployment
        .as_ref()
        .and_then(|d| d.spec.as_ref())
        .and_then(|s| s.replicas)
        .unwrap_or(0);
    let ready_replicas = deployment
        .as_ref()
        .and_then(|d| d.status.as_ref())
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    Ok(Seen {
        task_types,
        load,
        current,
        ready_replicas,
        deployment: applied::Live::of(deployment.as_deref()),
    })
}

/// What the Deployment watch keeps of each pool's Deployment: what [`observe`] reads (its
/// counts, generation, annotations, who wrote it when) and its owner, not its pod template
/// nor which fields each writer owns.
pub fn slim_deployment(deployment: &mut Deployment) {
    // Who wrote when (`applied::Live`), not which fields.
    for entry in deployment.metadata.managed_fields.iter_mut().flatten() {
        entry.fields_v1 = None;
    }
    deployment.spec = deployment.spec.take().map(|spec| DeploymentSpec {
        replicas: spec.replicas,
        ..DeploymentSpec::default()
    });
    deployment.status = deployment.status.take().map(|status| DeploymentStatus {
        ready_replicas: status.ready_replicas,
        ..DeploymentStatus::default()
    });
}

/// The pool's Deployment: the Deployment watch's copy once it has synced, unless it is
/// older than what this operator last applied or missing though applied or running (the
/// watch has not caught up, or someone deleted it); then, and before the watch synced, the
/// apiserver's.
/// A pool at rest thus reads nothing from the apiserver.
async fn live_deployment(pool: &WorkerPool, ctx: &Context) -> Result<Option<Arc<Deployment>>> {
    let namespace = pool.namespace().unwrap_or_default();
    let name = format!("{}-worker", pool.name_any());
    let applied = lock(&ctx.applied)
        .get(&pool.uid().unwrap_or_default())
        .map(|a| a.generation);
    if let Some(store) = synced(&ctx.deployments).await {
        let cached = store.get(&ObjectRef::new(&name).within(&namespace));
        match (cached, applied) {
            (Some(copy), Some(generation)) if copy.metadata.generation >= generation => {
                return Ok(Some(copy))
            }
            (Some(copy), None) => return Ok(Some(copy)),
            // None watched and none applied: none, unless the pool's status says it runs
            // workers (a Deployment someone took the pool's label off).
            (None, None) if pool.status.as_ref().is_none_or(|s| s.replicas == 0) => {
                return Ok(None)
            }
            _ => {}
        }
    }
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);
    Ok(deployments.get_opt(&name).await?.map(Arc::new))
}

/// Builds the pool's objects with `replicas` workers and applies them; when they cannot be
/// built, the pool is Degraded and the Deployment keeps its count.
async fn apply_objects(pool: &WorkerPool, ctx: &Context, seen: &Seen, replicas: i32) -> Result<()> {
    let mut objects = match build::pool_objects(pool, &seen.task_types, replicas, &ctx.secret) {
        Ok(objects) => objects,
        Err(err) => return Err(degrade(pool, ctx, seen, err.into()).await),
    };
    if let Some(token) = ctx.admin_token(pool) {
        build::set_admin_token(&mut objects.deployment, &token);
    }
    if ctx.require_tls {
        build::require_tls(&mut objects.deployment);
    }
    // Unchanged objects are not applied again on every period: four writes per pool every
    // 10 s were most of the apiserver's load with a thousand pools (`applied.rs`).
    let fingerprint = applied::stamp(&mut objects);
    let key = pool.uid().unwrap_or_default();
    // Objects someone else edited or deleted since are applied again (`owned.rs`).
    let look = ctx.owned.look(&key);
    {
        let mut memories = lock(&ctx.applied);
        let mut memory = memories.remove(&key);
        let unchanged = applied::unchanged(&mut memory, seen.deployment, fingerprint);
        if let Some(memory) = memory {
            memories.insert(key.clone(), memory);
        }
        if unchanged && !look.touched {
            return Ok(());
        }
    }
    let namespace = pool.namespace().unwrap_or_default();
    let config_map = apply(&ctx.client, &namespace, &objects.config_map).await?;
    let service = apply(&ctx.client, &namespace, &objects.service).await?;
    let budget = apply(&ctx.client, &namespace, &objects.pod_disruption_budget).await?;
    ctx.owned.applied(
        &key,
        &look,
        [
            (Kind::ConfigMap, &config_map.metadata),
            (Kind::Service, &service.metadata),
            (Kind::PodDisruptionBudget, &budget.metadata),
        ],
    );
    let deployment = match apply(&ctx.client, &namespace, &objects.deployment).await {
        Ok(deployment) => deployment,
        // A pod template the apiserver refuses does not become valid by retrying: the pool
        // says so in its status and an Event, and is tried again after an edit.
        Err(Error::Kube(err @ kube::Error::Api(_))) if invalid(&err) => {
            return Err(degrade(pool, ctx, seen, Error::DeploymentRefused(err)).await);
        }
        Err(err) => return Err(err),
    };
    let applied = Applied {
        fingerprint,
        generation: deployment.metadata.generation,
        edited: seen.deployment.edited,
    };
    lock(&ctx.applied).insert(key, applied);
    Ok(())
}

/// Reports `err` (the pool's objects could not be built, or were refused) as an Event and
/// a Degraded status; the Deployment keeps its count. Returns `err`, or the failure to
/// write the status.
async fn degrade(pool: &WorkerPool, ctx: &Context, seen: &Seen, err: Error) -> Error {
    let message = err.to_string();
    ctx.event(pool, true, err.category(), message.clone()).await;
    let degraded = Status::degraded(err.category(), message, seen.current, seen.ready_replicas);
    let written = write_status(
        pool,
        ctx,
        Status {
            last_scale: last_scale(pool, ctx),
            // Drains under way stay known: the next round takes them up again.
            draining: pool
                .status
                .as_ref()
                .map_or(0, |s| usize::try_from(s.draining).unwrap_or(0)),
            ..degraded
        },
    )
    .await;
    match written {
        Ok(()) => err,
        Err(write) => write,
    }
}

/// A refusal of the object itself (422 Invalid, or 400 for a body the apiserver cannot
/// read), not of the request's circumstances.
fn invalid(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 422 || status.code == 400)
}

/// A change of the worker count: counted, and an Event of its own (the recorder's series
/// would keep the first note).
async fn announce(pool: &WorkerPool, ctx: &Context, current: i32, replicas: i32, reason: &str) {
    if replicas == current {
        return;
    }
    let direction = if replicas > current { "up" } else { "down" };
    ctx.metrics
        .scaling_decisions
        .with_label_values(&[direction])
        .inc();
    ctx.event_each(
        pool,
        reasons::SCALED,
        format!("{current} → {replicas} workers: {reason}"),
    )
    .await;
}

/// The namespace's TaskTypes: from the TaskType controller's cache once it has synced (a
/// thousand pools must not list a thousand types each, every 10 s), from the API when the
/// cache lacks one the pool consumes (it may lag the watch that woke this reconcile).
async fn namespace_task_types(pool: &WorkerPool, ctx: &Context) -> Result<Vec<NamedTaskType>> {
    let namespace = pool.namespace().unwrap_or_default();
    if let Some(store) = synced(&ctx.task_types).await {
        let cached: Vec<NamedTaskType> = store
            .state()
            .iter()
            .filter(|t| t.namespace().as_deref() == Some(namespace.as_str()))
            .map(|t| NamedTaskType::from(t.as_ref()))
            .collect();
        let complete = pool
            .spec
            .task_types
            .iter()
            .all(|wanted| cached.iter().any(|t| t.local_name() == wanted));
        if complete {
            return Ok(cached);
        }
    }
    Ok(Api::<TaskType>::namespaced(ctx.client.clone(), &namespace)
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(NamedTaskType::from)
        .collect())
}

/// The replica count and why: the autoscaler's decision, the count held within bounds when
/// the queues cannot be read, or `spec.replicas`.
fn decide(
    pool: &WorkerPool,
    load: &Result<Load, Error>,
    current: i32,
    ctx: &Context,
) -> (i32, String) {
    let Some(policy) = &pool.spec.autoscaling else {
        let wanted = pool.spec.replicas.unwrap_or(1).max(0);
        return (wanted, format!("spec.replicas is {wanted}"));
    };
    let key = format!(
        "{}/{}",
        pool.namespace().unwrap_or_default(),
        pool.name_any()
    );
    let mut histories = lock(&ctx.histories);
    let history = histories.entry(key).or_default();
    let paused = pool
        .annotations()
        .get(AUTOSCALING_PAUSED)
        .map(String::as_str)
        == Some("true");
    let now = ctx.now();
    let decision = match load {
        _ if paused => {
            let decision = Decision {
                replicas: current,
                reason: format!("holding at {current}: {AUTOSCALING_PAUSED} is \"true\""),
            };
            // What is held counts as recommended: the first reading after a pause does not
            // shrink the pool at once.
            let window = f64::from(policy.scale_down_stabilization_seconds);
            history.held(now, decision.replicas, window);
            decision
        }
        Ok(load) => {
            statistics_read(history);
            let observation = Observation {
                ready: load.ready,
                in_flight: load.in_flight,
                retrying: load.retrying,
                processing_rate: load.rate,
                arrival_rate: load.arrival,
                current_replicas: current,
                concurrency: u32::from(pool.spec.concurrency),
            };
            desired_replicas(&observation, policy, history, now)
        }
        // Unknown is not zero: hold (or take the pool's fallback) rather than guess; a pool
        // whose queues are not declared yet has no work to scale for.
        Err(err) => without_statistics(current, policy, history, now, &err.to_string()),
    };
    into_pair(decision)
}

fn into_pair(decision: Decision) -> (i32, String) {
    (decision.replicas, decision.reason)
}

async fn read_load(
    pool: &WorkerPool,
    task_types: &[NamedTaskType],
    ctx: &Context,
) -> Result<Load, Error> {
    let mut load = Load::default();
    let namespace = pool.namespace().unwrap_or_default();
    for task_type in &pool.spec.task_types {
        // A type not applied yet has no queues: its depth read fails and the pool holds.
        let spec = task_types
            .iter()
            .find(|t| t.local_name() == task_type)
            .cloned()
            .unwrap_or_else(|| {
                NamedTaskType::in_namespace(&namespace, task_type, Default::default())
            });
        let depths = ctx.broker.depths(&spec)?;
        load.ready += depths.ready;
        load.in_flight += depths.in_flight;
        load.retrying += depths.retry;
        load.dead_lettered += depths.remediation;
        let rates = ctx.broker.rates(&spec.name)?;
        load.rate = add(load.rate, rates.acks);
        load.arrival = add(load.arrival, rates.publishes);
    }
    Ok(load)
}

/// A sum of rates, measured as soon as one of them is.
fn add(sum: Option<f64>, rate: Option<f64>) -> Option<f64> {
    match (sum, rate) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
    }
}

/// Server-side apply under the operator's one field manager; drift is overwritten.
async fn apply<K>(client: &kube::Client, namespace: &str, object: &K) -> Result<K>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    let name = object.meta().name.clone().unwrap_or_default();
    let mut body = serde_json::to_value(object).map_err(|e| Error::InvalidSpec(e.to_string()))?;
    body["apiVersion"] = K::api_version(&()).into();
    body["kind"] = K::kind(&()).into();
    Ok(api
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?)
}
