//! The two controllers and what wakes them. Each reconciles on a change of its object's
//! spec (its generation: status writes, its own or the depths', do not wake it), on its
//! periodic requeue, and: a WorkerPool when its Deployment, ConfigMap, Service or
//! PodDisruptionBudget changes (watched once for all pools) or when a TaskType it
//! consumes is created or edited (a pool applied before its type starts at once, not at its
//! next requeue), and a pool at rest when its queues' counts change. Failures retry per object with exponential backoff and jitter
//! ([`crate::backoff`]); at most [`CONCURRENCY`] reconciles of each kind run at once. One
//! poller reads the broker's queue statistics for both ([`crate::broker_stats`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use conveyor_core::crd::{TaskType, WorkerPool};
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::PartialObjectMeta;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::utils::Predicate;
use kube::runtime::{predicates, watcher, WatchStreamExt};
use kube::{Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use conveyor_core::watch_scope::Watched;

use crate::backoff::Backoff;
use crate::build::POOL_LABEL;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::shared::{lock, without_managed_fields};
use crate::worker_pools::owned::Kind;
use crate::{gauges, task_types, worker_pools};

/// Reconciles of one kind under way at once: thousands of objects must not open thousands
/// of broker and API requests together.
pub const CONCURRENCY: u16 = 16;
/// Longest one reconcile may run.
const RECONCILE_TIMEOUT: Duration = Duration::from_secs(60);
/// An invalid spec waits for an edit (which wakes it anyway).
const INVALID_SPEC_RETRY: Duration = Duration::from_secs(300);

/// Runs both controllers until `stop`.
pub async fn run(ctx: Arc<Context>, stop: CancellationToken) {
    let client = ctx.client.clone();
    let config = controller::Config::default().concurrency(CONCURRENCY);
    // One list before the first reconciles, so that they do not all report the queues'
    // statistics unknown (bounded by the management client's timeout).
    if let Err(err) = ctx.broker.refresh(&ctx.management).await {
        tracing::warn!(error = %err, "cannot read the broker's queue statistics yet");
    }
    let poller = ctx.clone();
    let poll_stop = stop.clone();
    let (pools_told, changes) = tokio::sync::mpsc::unbounded_channel();
    let (types_told, type_count_changes) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let listeners = vec![pools_told, types_told];
        poller
            .broker
            .poll(&poller.management, listeners, poll_stop)
            .await;
    });

    // One watch of TaskTypes feeds both controllers: each TaskType it hands the TaskType
    // controller is passed on to wake the pools that consume it (a second watch would hold
    // a second copy of every TaskType).
    let (types, types_writer) = reflector::store::<TaskType>();
    let (to_pools, types_for_pools) = tokio::sync::mpsc::unbounded_channel();
    let type_changes = edits(
        ctx.scope
            .watch::<TaskType>(&client, watcher::Config::default(), without_managed_fields)
            .reflect(types_writer)
            .inspect_ok(move |event| {
                // Every TaskType the watch reports; on the pools' side `edits` passes on those
                // created or edited.
                if let watcher::Event::Apply(task_type)
                | watcher::Event::InitApply(task_type)
                | watcher::Event::Delete(task_type) = event
                {
                    let _ = to_pools.send(task_type.clone());
                }
            })
            .applied_objects(),
    );
    let _ = ctx.task_types.set(types.clone());
    let types_for_gauges = types.clone();
    // Types at rest (empty queues) are looked at when their counts change, not every period.
    let (store, wake) = (types.clone(), ctx.clone());
    let woken_types = received(type_count_changes).flat_map(move |keys| {
        let resting = lock(&wake.resting_types);
        let woken: Vec<_> = store
            .state()
            .iter()
            .map(|t| ObjectRef::from_obj(t.as_ref()))
            .filter(|t| resting.contains(t) && keys.contains(&type_key(t)))
            .collect();
        futures_util::stream::iter(woken)
    });
    let task_type_controller = Controller::for_stream(type_changes, types)
        .reconcile_on(woken_types)
        .with_config(config.clone())
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(
            |task_type, ctx| forget_failures_on_success(task_type, ctx, task_types::reconcile),
            error_policy,
            ctx.clone(),
        )
        .for_each(|_| async {});

    // The pools' pods, for scale-down: one watch instead of a list per pool per minute.
    let (pods, pods_writer) = reflector::store::<Pod>();
    let _ = ctx.pods.set(pods);
    let pod_watch = ctx
        .scope
        .watch::<Pod>(
            &client,
            watcher::Config::default().labels(POOL_LABEL),
            crate::scale_down::slim,
        )
        .reflect(pods_writer)
        .take_until(stop.clone().cancelled_owned())
        .for_each(|_| async {});

    let (pools, pools_writer) = reflector::store::<WorkerPool>();
    let pool_changes = pool_spec_changes(&client, pools_writer, &ctx);
    let gauges = gauges::export(ctx.clone(), pools.clone(), types_for_gauges, stop.clone());
    let consumers = pools.clone();
    // A TaskType's own status writes (its depths, every poll) wake no pool: the same
    // filter as the pools' (its annotations carry nothing a pool reads, so an edit of them
    // costs one look).
    let type_edits = edits(
        futures_util::stream::unfold(types_for_pools, |mut received| async move {
            received.recv().await.map(|t| (t, received))
        })
        .map(Ok),
    );
    // Pools at rest are looked at when their queues' counts change, not every period.
    let (store, wake) = (pools.clone(), ctx.clone());
    let count_changes = received(changes).flat_map(move |keys| {
        let resting = lock(&wake.resting);
        let woken: Vec<_> = pools_of_types(&store, &keys)
            .into_iter()
            .filter(|pool| resting.contains(pool))
            .collect();
        futures_util::stream::iter(woken)
    });
    // The pools' Deployments, watched once: a change wakes the pool, and its reconcile
    // reads the copy kept here instead of asking the apiserver every period.
    let (deployments, deployments_writer) = reflector::store::<Deployment>();
    let _ = ctx.deployments.set(deployments);
    let deployment_changes = ctx
        .scope
        .watch::<Deployment>(
            &client,
            watcher::Config::default().labels(POOL_LABEL),
            worker_pools::slim_deployment,
        )
        .reflect(deployments_writer)
        .touched_objects();
    let pool_controller = Controller::for_stream(pool_changes, pools)
        .owns_stream(deployment_changes)
        .owns_stream(owned_changes::<ConfigMap>(&client, &ctx, Kind::ConfigMap))
        .owns_stream(owned_changes::<Service>(&client, &ctx, Kind::Service))
        .owns_stream(owned_changes::<PodDisruptionBudget>(
            &client,
            &ctx,
            Kind::PodDisruptionBudget,
        ))
        .watches_stream(type_edits, move |task_type| {
            pools_consuming(&consumers, &task_type)
        })
        .reconcile_on(count_changes)
        .with_config(config)
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(
            |pool, ctx| forget_failures_on_success(pool, ctx, worker_pools::reconcile),
            error_policy,
            ctx,
        )
        .for_each(|_| async {});
    tracing::info!("reconciling TaskTypes and WorkerPools");
    tokio::join!(task_type_controller, pool_controller, pod_watch, gauges);
}

/// Changes of the pools' objects of one kind beside the Deployment, metadata only (kept
/// nowhere): each is noted in [`Context::owned`] and wakes the pool that controls it, which
/// applies its objects again if someone else edited or deleted one.
fn owned_changes<K: Watched>(
    client: &kube::Client,
    ctx: &Arc<Context>,
    kind: Kind,
) -> impl futures_util::Stream<Item = Result<PartialObjectMeta<K>, watcher::Error>> {
    let ctx = ctx.clone();
    // A watch of `PartialObjectMeta` lists and watches metadata only.
    ctx.scope
        .watch::<PartialObjectMeta<K>>(
            client,
            watcher::Config::default().labels(POOL_LABEL),
            |_| {},
        )
        .inspect_ok(move |event| ctx.owned.observe(kind, event))
        .touched_objects()
}

/// The changed task types (`<namespace>.<name>`) of each poll, as a stream.
fn received(
    changes: tokio::sync::mpsc::UnboundedReceiver<std::collections::BTreeSet<String>>,
) -> impl futures_util::Stream<Item = std::collections::BTreeSet<String>> {
    futures_util::stream::unfold(changes, |mut changes| async move {
        changes.recv().await.map(|keys| (keys, changes))
    })
}

/// A TaskType's key in the broker's queue names.
fn type_key(task_type: &ObjectRef<TaskType>) -> String {
    format!(
        "{}.{}",
        task_type.namespace.as_deref().unwrap_or_default(),
        task_type.name
    )
}

/// Every pool in the cluster, kept in `writer`'s store; yields those whose spec
/// (generation) or annotations changed (a pause annotation applies at once, not at the next
/// period), so that status writes wake nothing. A deleted pool is forgotten by the context
/// (what was applied for it, its objects' versions).
fn pool_spec_changes(
    client: &kube::Client,
    writer: reflector::store::Writer<WorkerPool>,
    ctx: &Arc<Context>,
) -> impl futures_util::Stream<Item = Result<WorkerPool, watcher::Error>> {
    let ctx = ctx.clone();
    let objects = ctx
        .scope
        .watch::<WorkerPool>(client, watcher::Config::default(), without_managed_fields)
        .reflect(writer)
        .inspect_ok(move |event| {
            if let watcher::Event::Delete(pool) = event {
                ctx.forget_pool(&pool.uid().unwrap_or_default());
            }
        })
        .applied_objects();
    edits(objects)
}

/// The objects of `objects` whose generation or annotations differ from the last seen of
/// each: a status write (the operator's own, every depth change) passes nothing on. Both
/// the pools' own changes and the TaskType edits that wake pools go through it.
fn edits<K, S>(objects: S) -> impl futures_util::Stream<Item = Result<K, watcher::Error>>
where
    K: Resource<DynamicType = ()> + 'static,
    S: futures_util::Stream<Item = Result<K, watcher::Error>>,
{
    objects.predicate_filter(
        predicates::generation.combine(predicates::annotations),
        Default::default(),
    )
}

/// The pools in `task_type`'s namespace that consume it.
pub fn pools_consuming(
    pools: &Store<WorkerPool>,
    task_type: &TaskType,
) -> Vec<ObjectRef<WorkerPool>> {
    let namespace = task_type.namespace();
    let name = task_type.name_any();
    pools
        .state()
        .iter()
        .filter(|pool| pool.namespace() == namespace && pool.spec.task_types.contains(&name))
        .map(|pool| ObjectRef::from_obj(pool.as_ref()))
        .collect()
}

/// The pools that consume any of the task types `keys` (`<namespace>.<name>`).
fn pools_of_types(
    pools: &Store<WorkerPool>,
    keys: &std::collections::BTreeSet<String>,
) -> Vec<ObjectRef<WorkerPool>> {
    pools
        .state()
        .iter()
        .filter(|pool| {
            let namespace = pool.namespace().unwrap_or_default();
            pool.spec
                .task_types
                .iter()
                .any(|t| keys.contains(&format!("{namespace}.{t}")))
        })
        .map(|pool| ObjectRef::from_obj(pool.as_ref()))
        .collect()
}

fn key<K: Resource<DynamicType = ()>>(object: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        object.namespace().unwrap_or_default(),
        object.name_any()
    )
}

async fn forget_failures_on_success<K, F>(
    object: Arc<K>,
    ctx: Arc<Context>,
    reconcile: impl FnOnce(Arc<K>, Arc<Context>) -> F,
) -> Result<Action>
where
    K: Resource<DynamicType = ()>,
    F: Future<Output = Result<Action>>,
{
    let key = key(object.as_ref());
    let started = std::time::Instant::now();
    // A reconcile that never returns would hold one of the CONCURRENCY slots for good
    // (16 stuck ones stop the controller): bounded, it fails and is retried with backoff.
    let result = match tokio::time::timeout(RECONCILE_TIMEOUT, reconcile(object, ctx.clone())).await
    {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(object = key, "reconcile timed out");
            Err(Error::ReconcileTimeout(RECONCILE_TIMEOUT))
        }
    };
    ctx.metrics
        .reconcile_seconds
        .with_label_values(&[&K::kind(&()).to_lowercase()])
        .observe(started.elapsed().as_secs_f64());
    if result.is_ok() {
        ctx.backoff.succeeded(&key);
    }
    result
}

/// Counts the error and retries after [`retry_after`].
fn error_policy<K: Resource<DynamicType = ()>>(
    object: Arc<K>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    let kind = K::kind(&()).to_lowercase();
    ctx.metrics
        .errors
        .with_label_values(&[&kind, error.category()])
        .inc();
    let retry = retry_after(error, &ctx.backoff, &key(object.as_ref()));
    tracing::warn!(
        controller = kind,
        error = conveyor_core::with_causes(error),
        category = error.category(),
        ?retry,
        "reconcile failed"
    );
    Action::requeue(retry)
}

/// When an object whose reconcile failed with `error` is tried again: an invalid spec after
/// an edit (or slowly); a type that did not try because another declaration found the
/// broker out moments ago once that wait has passed, spread over twice it, without counting
/// a failure of its own (else a thousand types behind one timeout would all back off for
/// minutes after the broker is back); anything else after the object's own backoff.
fn retry_after(error: &Error, backoff: &Backoff, key: &str) -> Duration {
    match error {
        Error::InvalidSpec(_) | Error::Build(_) | Error::DeploymentRefused(_) => INVALID_SPEC_RETRY,
        Error::BrokerDown { .. } => {
            crate::declarations::RETRY_AFTER.mul_f64(1.0 + rand::random::<f64>())
        }
        _ => backoff.failed(key),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_that_did_not_try_during_an_outage_do_not_back_off_for_it() {
        let backoff = Backoff::default();
        let down = Error::BrokerDown {
            ago: Duration::from_secs(1),
            cause: "RabbitMQ did not answer within 10s".to_owned(),
        };
        for _ in 0..6 {
            let retry = retry_after(&down, &backoff, "tasktype/video/t");
            assert!(retry >= crate::declarations::RETRY_AFTER, "{retry:?}");
            assert!(retry < crate::declarations::RETRY_AFTER * 2, "{retry:?}");
        }
        // Its own first failure still starts at the first step.
        let timeout = Error::Amqp(conveyor_core::amqp::AmqpError::DeclareTimeout(
            Duration::from_secs(10),
        ));
        let retry = retry_after(&timeout, &backoff, "tasktype/video/t");
        assert!(retry < crate::backoff::FIRST * 3 / 2, "{retry:?}");
    }

    #[test]
    fn a_type_is_named_as_its_queues_name_it() {
        let t = ObjectRef::<TaskType>::new("transcode").within("video");
        assert_eq!(type_key(&t), "video.transcode");
    }

    fn pool(namespace: &str, name: &str, types: &[&str]) -> WorkerPool {
        types
            .iter()
            .fold(
                WorkerPool::test().named(name).in_namespace(namespace),
                |p, t| p.consumes(t),
            )
            .build()
    }

    #[tokio::test]
    async fn a_status_write_wakes_no_reconcile_and_an_edit_or_annotation_does() {
        let at = |generation: i64, status_queued: Option<u64>, paused: bool| {
            let mut p = WorkerPool::test().named("transcode").build();
            p.metadata.generation = Some(generation);
            if paused {
                p.metadata.annotations = Some(
                    [(
                        conveyor_core::crd::worker_pool::AUTOSCALING_PAUSED.to_owned(),
                        "true".to_owned(),
                    )]
                    .into(),
                );
            }
            p.status =
                status_queued.map(|queued| conveyor_core::crd::worker_pool::WorkerPoolStatus {
                    queued: Some(queued),
                    ..Default::default()
                });
            Ok(p)
        };
        let seen: Vec<WorkerPool> = edits(futures_util::stream::iter([
            at(1, None, false),
            at(1, Some(5), false),
            at(1, Some(9), false),
            at(2, Some(9), false),
            at(2, Some(9), true),
        ]))
        .map(Result::unwrap)
        .collect()
        .await;
        let woke: Vec<_> = seen
            .iter()
            .map(|p| (p.metadata.generation, p.metadata.annotations.is_some()))
            .collect();
        assert_eq!(woke, [(Some(1), false), (Some(2), false), (Some(2), true)]);
    }

    #[test]
    fn a_task_type_wakes_the_pools_of_its_namespace_that_consume_it() {
        let (store, mut writer) = reflector::store::<WorkerPool>();
        for p in [
            pool("video", "transcode", &["transcode", "thumbnail"]),
            pool("video", "meta", &["metadata"]),
            pool("other", "transcode", &["transcode"]),
        ] {
            writer.apply_watcher_event(&watcher::Event::Apply(p));
        }
        let task_type = TaskType::test("transcode").build();
        let woken = pools_consuming(&store, &task_type);
        assert_eq!(woken.len(), 1, "{woken:?}");
        assert_eq!(woken[0].name, "transcode");
        assert_eq!(woken[0].namespace.as_deref(), Some("video"));
    }
}
