//! TaskType reconcile: validate (the payload schema compiles) → declare queues → apply
//! policies → read depths → status; Ready is False with the step's category when one fails.
//! A finalizer is added only under `deletionPolicy: Delete`, where deleting the TaskType
//! must delete its queues; under Retain nothing outside the cluster needs cleaning up.

use std::sync::Arc;
use std::time::{Duration, Instant};

use conveyor_core::amqp::{AmqpError, QueueNames};
use conveyor_core::crd::status::conditions::{QUEUES_DECLARED, READY};
use conveyor_core::crd::status::reasons;
use conveyor_core::crd::task_type::{DeletionPolicy, QueueDepths, TaskTypeStatus};
use conveyor_core::crd::TaskType;
use conveyor_core::task_type::{NamedTaskType, MAX_RETRY_TIERS};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::build::FIELD_MANAGER;
use crate::context::{condition, Context};
use crate::error::{Error, Result};
use crate::rabbitmq::{task_type_policy_names, ManagementError};
use crate::shared::lock;

pub const FINALIZER: &str = "conveyor.dev/delete-queues";
/// Depths in the status are refreshed this often while any queue holds messages.
const RESYNC: Duration = Duration::from_secs(15);
/// A type whose queues are all empty is looked at this often, and woken sooner when the
/// broker poller sees its counts change: a thousand idle types need not run four
/// reconciles a minute each.
const RESTING_RESYNC: Duration = Duration::from_secs(60);
/// How long a declaration is trusted while the broker lists the type's queues: declaring
/// again only restores policies edited by hand. Each type waits a further share of up to
/// half of this (by its uid), so types applied together do not all declare again together.
const REDECLARE_EVERY: Duration = Duration::from_secs(30 * 60);
/// Longest the broker may take per queue of a type (connect included) before it counts as
/// unavailable: a quorum queue starts a Raft member, which takes seconds on a busy node.
const DECLARE_TIMEOUT_PER_QUEUE: Duration = Duration::from_secs(10);
/// ... and for a whole type: well inside the controller's 60 s reconcile bound, which would
/// end the reconcile before it writes a status or records the outage for the types waiting.
const DECLARE_TIMEOUT_MAX: Duration = Duration::from_secs(40);

#[tracing::instrument(skip_all, fields(task_type = %task_type.name_any()))]
pub async fn reconcile(task_type: Arc<TaskType>, ctx: Arc<Context>) -> Result<Action> {
    ctx.metrics
        .reconciles
        .with_label_values(&["tasktype"])
        .inc();
    let namespace = task_type.namespace().unwrap_or_default();
    let api: Api<TaskType> = Api::namespaced(ctx.client.clone(), &namespace);
    let has_finalizer = task_type.finalizers().iter().any(|f| f == FINALIZER);

    let spec = NamedTaskType::from(task_type.as_ref());
    if task_type.meta().deletion_timestamp.is_some() {
        if has_finalizer {
            // Only a valid name names queues of the type's own: `foo.retry` would name
            // another type's retry queue.
            match spec.validate_name() {
                Ok(()) => delete_queues(&task_type, &ctx).await?,
                Err(message) => {
                    let why = format!("{message}; no queue is deleted under this name");
                    ctx.event(task_type.as_ref(), true, reasons::INVALID_SPEC, why)
                        .await;
                }
            }
            set_finalizer(&api, &task_type, false).await?;
        }
        lock(&ctx.declared).remove(&declared_key(&task_type));
        lock(&ctx.resting_types).remove(&ObjectRef::from_obj(task_type.as_ref()));
        return Ok(Action::await_change());
    }
    // Validated before a finalizer is added: nothing can be deleted under a bad name.
    if let Err(message) = spec.validate() {
        write_status(
            &api,
            &task_type,
            false,
            reasons::INVALID_SPEC,
            message.clone(),
            None,
        )
        .await?;
        ctx.event(
            task_type.as_ref(),
            true,
            reasons::INVALID_SPEC,
            message.clone(),
        )
        .await;
        return Err(Error::InvalidSpec(message));
    }
    let wants_finalizer = task_type.spec.deletion_policy == DeletionPolicy::Delete;
    if wants_finalizer != has_finalizer {
        set_finalizer(&api, &task_type, wants_finalizer).await?;
    }

    // The broker's answer decides Ready: a type whose queues cannot be declared is not
    // ready, whatever it was before (the gateway would publish into nothing).
    let depths = match declare_unless_current(&task_type, &spec, &ctx).await {
        Ok(Queues::Known(depths)) => depths,
        // Another type's declaration is finding out whether the broker is out: the status
        // stays as it was (neither Ready nor an outage nobody has seen), looked at again soon.
        Ok(Queues::Asking) => return Ok(Action::requeue(crate::declarations::RETRY_AFTER)),
        Err(err) => {
            let message = conveyor_core::with_causes(&err);
            write_status(&api, &task_type, false, err.category(), message, None).await?;
            return Err(err);
        }
    };
    write_status(
        &api,
        &task_type,
        true,
        reasons::QUEUES_DECLARED,
        format!(
            "queues {} (+ retry queues, .remediation) declared with policies",
            QueueNames::of(&spec.name).main
        ),
        depths.clone(),
    )
    .await?;
    let key = ObjectRef::from_obj(task_type.as_ref());
    let resync = resync(depths.as_ref());
    if resync == RESTING_RESYNC {
        lock(&ctx.resting_types).insert(key);
    } else {
        lock(&ctx.resting_types).remove(&key);
    }
    Ok(Action::requeue(resync))
}

/// When to look again: soon while messages are queued (or the counts are unknown), at
/// [`RESTING_RESYNC`] when every queue is empty (a count change wakes the type sooner).
fn resync(depths: Option<&QueueDepths>) -> Duration {
    match depths {
        Some(d) if d.ready + d.in_flight + d.retry + d.remediation == 0 => RESTING_RESYNC,
        _ => RESYNC,
    }
}

/// Declares again only when needed: the spec changed, the poller's queue list misses one of
/// the type's queues or its exchange (deleted by hand, or a broker that lost them), the poller has had no
/// list for [`crate::broker_stats::STALE_AFTER`] (a broker stopped or hung: one declaration
/// at a time finds it out, see [`Next`]), or [`REDECLARE_EVERY`] passed (policies edited by
/// hand). A thousand types must not mean a thousand declarations and policy writes every
/// resync, nor after a restart.
async fn declare_unless_current(
    task_type: &TaskType,
    spec: &NamedTaskType,
    ctx: &Context,
) -> Result<Queues> {
    let key = declared_key(task_type);
    let generation = task_type.meta().generation;
    let listed = ctx.broker.declared(spec);
    let declared = lock(&ctx.declared).get(&key).copied();
    let ready = ready_at(task_type, generation);
    match next(declared, &key, generation, ready, &listed, || {
        ctx.declarations.probe_due()
    }) {
        Next::Keep => {
            if declared.is_none() {
                // Trusted from the status: due again like any declaration of now.
                lock(&ctx.declared).insert(key, (generation, Instant::now()));
            }
            return Ok(Queues::Known(listed.ok()));
        }
        Next::AskOutage => {
            ctx.declarations.not_out()?;
            return Ok(Queues::Asking);
        }
        Next::Declare => {}
    }
    // Declaring again what this spec already declared, with every queue listed: a slow
    // answer is a busy broker, not a lost one, and the type stays as it was.
    let refresh = listed.is_ok() && (declared.is_some_and(|(seen, _)| seen == generation) || ready);
    match declare(spec, ctx, refresh).await {
        Ok(depths) => {
            lock(&ctx.declared).insert(key, (generation, Instant::now()));
            Ok(Queues::Known(depths))
        }
        Err(err @ Error::Amqp(AmqpError::DeclareTimeout(_))) if refresh => {
            tracing::info!(error = %err, "declaring again timed out; the broker lists every queue, so the type stays ready");
            lock(&ctx.declared).insert(key, (generation, Instant::now()));
            Ok(Queues::Known(listed.ok()))
        }
        Err(err) => Err(err),
    }
}

/// What [`declare_unless_current`] found out about a type's queues.
enum Queues {
    /// Declared (now or before), with their depths when the broker counted them.
    Known(Option<QueueDepths>),
    /// Not known yet: another type's declaration is finding out whether the broker is out.
    Asking,
}

/// What a reconcile does about a type's queues.
#[derive(Debug, PartialEq)]
enum Next {
    /// They are as declared: nothing to send.
    Keep,
    /// Declare (and put the policies).
    Declare,
    /// No recent queue list, and another type's declaration is finding out why: report the
    /// outage it found, if any, else leave the status as it is.
    AskOutage,
}

/// Decides [`Next`]. A type is current when this process declared its generation less than
/// [`redeclare_after`] ago or, with no memory of it (a restarted or newly elected operator),
/// when its status says this generation is Ready: a restart re-declares nothing that did not
/// change. A queue missing from the list is declared whatever the memory says. Without a
/// recent list, a current type declares only when [`Declarations::probe_due`] says it is the
/// one to find out (`probe`).
///
/// [`Declarations::probe_due`]: crate::declarations::Declarations::probe_due
fn next(
    declared: Option<(Option<i64>, Instant)>,
    key: &str,
    generation: Option<i64>,
    ready: bool,
    listed: &std::result::Result<QueueDepths, ManagementError>,
    probe: impl FnOnce() -> bool,
) -> Next {
    let current = match declared {
        Some((seen, at)) => seen == generation && at.elapsed() < redeclare_after(key),
        None => ready,
    };
    match listed {
        Err(ManagementError::QueueMissing { .. } | ManagementError::ExchangeMissing { .. }) => {
            Next::Declare
        }
        _ if !current => Next::Declare,
        Err(err) if err.says_broker_out() => {
            if probe() {
                Next::Declare
            } else {
                Next::AskOutage
            }
        }
        _ => Next::Keep,
    }
}

/// When a declaration of `key` is due again: [`REDECLARE_EVERY`] plus the key's own share
/// of half of it.
fn redeclare_after(key: &str) -> Duration {
    crate::shared::spread(key, REDECLARE_EVERY)
}

/// Whether the status says this generation's queues were declared (an operator that
/// restarted has no memory of its own declarations).
fn ready_at(task_type: &TaskType, generation: Option<i64>) -> bool {
    task_type.status.as_ref().is_some_and(|status| {
        status.observed_generation == generation
            && status
                .conditions
                .iter()
                .any(|c| c.type_ == READY && c.status == "True")
    })
}

/// By uid: a TaskType deleted and created again under the same name is another object,
/// declared afresh.
fn declared_key(task_type: &TaskType) -> String {
    task_type.uid().unwrap_or_else(|| {
        format!(
            "{}/{}",
            task_type.namespace().unwrap_or_default(),
            task_type.name_any()
        )
    })
}

/// Declares the queues (bounded by [`DECLARE_TIMEOUT_PER_QUEUE`] and [`DECLARE_TIMEOUT_MAX`]:
/// a hung broker must not hold the reconcile), puts the policies, drops drained tiers and
/// reads the depths. Depths the broker has not counted yet are unknown (`None`), which does
/// not make the type unready.
/// A `refresh` that times out says nothing about an outage (the broker lists the queues).
async fn declare(
    spec: &NamedTaskType,
    ctx: &Context,
    refresh: bool,
) -> Result<Option<QueueDepths>> {
    // A few at a time (each on a channel of its own), and the timeout counts only the
    // broker's own time, not the wait for a turn.
    let turn = ctx.declarations.turn().await?;
    ctx.metrics
        .broker_requests
        .with_label_values(&["amqp"])
        .inc();
    let queues = spec.retry_tiers() + 2; // work, retry tiers, remediation
    let declared = ctx
        .publisher
        .declare_task_type(
            spec,
            (DECLARE_TIMEOUT_PER_QUEUE * queues).min(DECLARE_TIMEOUT_MAX),
        )
        .await
        .map_err(Error::Amqp);
    match &declared {
        Err(Error::Amqp(AmqpError::DeclareTimeout(_))) if refresh => {}
        Err(
            err @ Error::Amqp(
                AmqpError::Unavailable(_)
                | AmqpError::ConnectTimeout(_)
                | AmqpError::DeclareTimeout(_),
            ),
        ) => ctx
            .declarations
            .found(Some(conveyor_core::with_causes(err))),
        _ => ctx.declarations.found(None),
    }
    drop(turn);
    declared?;
    ctx.management.put_task_type_policies(spec).await?;
    delete_drained_tiers(spec, ctx).await?;
    // From the shared poller: a type declared a moment ago is not in its list yet.
    Ok(ctx.broker.depths(spec).ok())
}

/// Retry queues beyond the type's tiers now (it was edited to fewer retries or a flatter
/// backoff) go once they are empty; until then they still release retries to the work queue.
async fn delete_drained_tiers(spec: &NamedTaskType, ctx: &Context) -> Result<()> {
    let queues = QueueNames::of(&spec.name);
    for tier in spec.retry_tiers()..MAX_RETRY_TIERS {
        let queue = queues.retry_tier(tier);
        // The poller's list says which tiers exist: no request for the many that never did.
        if ctx.broker.lists(&queue) == Some(false) {
            continue;
        }
        ctx.management.delete_queue_if_empty(&queue).await?;
    }
    Ok(())
}

async fn delete_queues(task_type: &TaskType, ctx: &Context) -> Result<()> {
    let spec = NamedTaskType::from(task_type);
    for name in task_type_policy_names(&spec) {
        ctx.management.delete_policy(&name).await?;
    }
    let queues = QueueNames::of(&spec.name);
    // Every retry queue the type may have had, whatever its retries are now.
    for queue in queues.all(MAX_RETRY_TIERS) {
        ctx.management.delete_queue(&queue).await?;
    }
    ctx.management.delete_exchange(queues.exchange()).await?;
    ctx.event(
        task_type,
        false,
        reasons::QUEUES_DELETED,
        format!(
            "deletionPolicy Delete: removed {} and its retry and remediation queues",
            queues.main
        ),
    )
    .await;
    Ok(())
}

async fn set_finalizer(api: &Api<TaskType>, task_type: &TaskType, present: bool) -> Result<()> {
    let mut finalizers: Vec<String> = task_type
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    if present {
        finalizers.push(FINALIZER.to_owned());
    }
    // resourceVersion makes this a compare-and-set against concurrent finalizer edits.
    let patch = json!({
        "metadata": {
            "finalizers": finalizers,
            "resourceVersion": task_type.resource_version(),
        }
    });
    api.patch(
        &task_type.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(())
}

async fn write_status(
    api: &Api<TaskType>,
    task_type: &TaskType,
    ok: bool,
    reason: &str,
    message: String,
    depths: Option<QueueDepths>,
) -> Result<()> {
    let previous = task_type
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let generation = task_type.meta().generation;
    let status = TaskTypeStatus {
        observed_generation: generation,
        conditions: vec![
            condition(&previous, READY, ok, reason, message.clone(), generation),
            condition(&previous, QUEUES_DECLARED, ok, reason, message, generation),
        ],
        depths,
    };
    // Unchanged (the usual resync of an idle type): no write.
    if task_type.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let patch = json!({
        "apiVersion": TaskType::api_version(&()),
        "kind": TaskType::kind(&()),
        "status": status,
    });
    api.patch_status(
        &task_type.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_type_rests_and_a_busy_or_unknown_one_is_looked_at_soon() {
        let empty = QueueDepths::default();
        assert_eq!(resync(Some(&empty)), RESTING_RESYNC);
        let retrying = QueueDepths {
            retry: 1,
            ..QueueDepths::default()
        };
        assert_eq!(resync(Some(&retrying)), RESYNC);
        assert_eq!(resync(None), RESYNC, "unknown counts are not at rest");
    }

    #[test]
    fn types_declared_together_declare_again_spread_out() {
        let due: Vec<Duration> = (0..100)
            .map(|i| redeclare_after(&format!("uid-{i}")))
            .collect();
        assert!(due
            .iter()
            .all(|d| *d >= REDECLARE_EVERY && *d < REDECLARE_EVERY * 3 / 2));
        let earliest = due.iter().min().unwrap();
        let latest = due.iter().max().unwrap();
        assert!(
            *latest - *earliest > REDECLARE_EVERY / 4,
            "{earliest:?}..{latest:?}"
        );
        assert_eq!(
            redeclare_after("uid-7"),
            due[7],
            "the same key, the same turn"
        );
    }

    #[test]
    fn a_restart_declares_nothing_that_did_not_change() {
        let listed = Ok(QueueDepths::default());
        let never = || -> bool { panic!("no probe while the list is fresh") };
        assert_eq!(next(None, "k", Some(2), true, &listed, never), Next::Keep);
        assert_eq!(
            next(None, "k", Some(2), false, &listed, never),
            Next::Declare,
            "not Ready at this generation"
        );
        let missing = Err(ManagementError::QueueMissing {
            queue: "conveyor.ns.t".into(),
        });
        assert_eq!(
            next(None, "k", Some(2), true, &missing, never),
            Next::Declare
        );
        let exchange_gone = Err(ManagementError::ExchangeMissing {
            exchange: "conveyor.ns.t".into(),
        });
        let just_declared = Some((Some(2), Instant::now()));
        assert_eq!(
            next(just_declared, "k", Some(2), true, &exchange_gone, never),
            Next::Declare,
            "an exchange deleted by hand is declared again at once"
        );
        let no_list_yet = Err(ManagementError::Stale { age: None });
        assert_eq!(
            next(None, "k", Some(2), true, &no_list_yet, never),
            Next::Keep
        );
        let long_ago = Instant::now().checked_sub(REDECLARE_EVERY * 2);
        if let Some(at) = long_ago {
            assert_eq!(
                next(Some((Some(2), at)), "k", Some(2), true, &listed, never),
                Next::Declare
            );
        }
        let now = Some((Some(1), Instant::now()));
        assert_eq!(
            next(now, "k", Some(2), true, &listed, never),
            Next::Declare,
            "edited"
        );
    }

    #[test]
    fn without_a_list_only_the_probing_type_declares() {
        let stale = Err(ManagementError::Stale {
            age: Some(Duration::from_secs(40)),
        });
        let now = Some((Some(1), Instant::now()));
        assert_eq!(
            next(now, "k", Some(1), true, &stale, || true),
            Next::Declare
        );
        assert_eq!(
            next(now, "k", Some(1), true, &stale, || false),
            Next::AskOutage
        );
        assert_eq!(
            next(now, "k", Some(2), true, &stale, || false),
            Next::Declare,
            "an edit is declared whatever the list"
        );
    }

    #[test]
    fn only_a_ready_status_of_this_generation_counts_as_declared() {
        let with = |status: &str, observed: i64| {
            let mut task_type = TaskType::new("t", serde_json::from_value(json!({})).unwrap());
            task_type.status = Some(TaskTypeStatus {
                observed_generation: Some(observed),
                conditions: vec![condition(
                    &[],
                    READY,
                    status == "True",
                    "R",
                    String::new(),
                    Some(observed),
                )],
                depths: None,
            });
            task_type
        };
        assert!(ready_at(&with("True", 3), Some(3)));
        assert!(
            !ready_at(&with("True", 2), Some(3)),
            "an older spec's queues"
        );
        assert!(!ready_at(&with("False", 3), Some(3)));
        assert!(!ready_at(
            &TaskType::new("t", serde_json::from_value(json!({})).unwrap()),
            Some(1)
        ));
    }
}
