//! The gateway's upkeep loop: what must happen on a calendar or after a fault, with no human
//! and no worker of the type alive (invariants 7 and 8, `docs/invariants.md`). Every gateway
//! runs it; the SQL takes rows with `SKIP LOCKED` and the partition function holds an
//! advisory lock, so several gateways share the work instead of repeating it.
//!
//! - the heartbeat reaper for every known task type (a pool scaled to zero after its pod
//!   died mid-task still gets that task back);
//! - the orphan sweeper: probes through each work queue and re-publishes tasks whose
//!   message is gone (decision 0011);
//! - audit partitions made two weeks ahead, rows rescued from the default partition, and
//!   old partitions dropped after the retention period (the history of open tasks kept),
//!   none of it waiting on a long reader of the log (decision 0031), in a task of its own
//!   (decision 0042);
//! - the open tasks of types no TaskType defines any more (decision 0033): reaped and swept
//!   like any while their queues are retained, settled with an audited reason once their
//!   queues are deleted, and listed meanwhile;
//! - settled tasks deleted after their retention, archived first when asked (decision 0034),
//!   and the dead letters of types deleted with their queues (decision 0044);
//! - indexes of `tasks` those deletes left sparse, rebuilt without holding writers
//!   (decision 0037).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use conveyor_core::amqp::{Publisher, QueueObserver};
use conveyor_core::db::{Db, PartitionsOwed};
use conveyor_core::metrics::Metrics;
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::upkeep::{self, SweepSettings, UpkeepError, BATCH};
use conveyor_core::watch_scope::WatchScope;
use tokio_util::sync::CancellationToken;

use crate::registry::Registry;

mod expiry;
mod indexes;
mod retired;

pub use expiry::{TaskRetention, DAY};

/// Settings of the upkeep loop.
#[derive(Debug, Clone)]
pub struct UpkeepConfig {
    /// Between passes over the task types.
    pub interval: Duration,
    pub sweep: SweepSettings,
    /// Between partition upkeeps (the first runs at start).
    pub partitions_every: Duration,
    /// Audit partitions older than this many days are dropped; `None` keeps them all.
    pub retention_days: Option<i32>,
    /// Between looks for the open tasks of types no TaskType defines any more.
    pub retired_every: Duration,
    /// Between passes of the settled tasks' retention.
    pub tasks_every: Duration,
    pub tasks: TaskRetention,
    /// Between looks for sparse indexes of `tasks` (the first is one interval after start).
    pub indexes_every: Duration,
    /// Name recorded as the reaper in audit events.
    pub name: String,
    /// The namespaces whose tasks upkeep may settle or expire by what the table holds
    /// (types no TaskType of this gateway defines): a namespace-scoped gateway leaves the
    /// others' tasks to theirs (decision 0048).
    pub scope: WatchScope,
}

/// Runs until `shutdown`.
pub async fn run(
    db: Db,
    publisher: Arc<Publisher>,
    observer: Arc<QueueObserver>,
    types: Arc<Registry>,
    config: UpkeepConfig,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    // Partition upkeep may take long (a day's drop first copies the history of its open
    // tasks, however much a tenant wrote): a task of its own, so reaping and sweeping go on.
    tokio::spawn(partitions_loop(
        db.clone(),
        config.retention_days,
        config.partitions_every,
        metrics.clone(),
        shutdown.clone(),
    ));
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The reaper waits until the database has answered for a whole heartbeat timeout: after
    // an outage (or at start) every owner's last beat may be stale through no fault of its.
    let mut reachable_since = Instant::now();
    let mut retired_due = Instant::now();
    let mut tasks_due = Instant::now();
    // Retired types whose queues are still there: reaped and swept like the known ones.
    let mut retained: Vec<NamedTaskType> = Vec::new();
    let mut looks = retired::Looks::default();
    let mut rebuilds = indexes::Rebuilds::new(config.indexes_every);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if Instant::now() >= tasks_due {
            tasks_due = Instant::now() + config.tasks_every;
            match expiry::pass(
                &db,
                &types,
                &config.tasks,
                &config.scope,
                looks.gone(),
                &metrics,
            )
            .await
            {
                Ok(0) => {}
                Ok(deleted) => {
                    tracing::info!(deleted, "settled tasks past their retention deleted")
                }
                Err(err) => note_failure(&metrics, "task_retention", &err, &mut reachable_since),
            }
        }
        rebuilds.poll(&db, &metrics);
        if Instant::now() >= retired_due {
            retired_due = Instant::now() + config.retired_every;
            let reachable_for = reachable_since.elapsed();
            match retired::look(
                &db,
                &observer,
                &types,
                &config.scope,
                &metrics,
                reachable_for,
                &mut looks,
            )
            .await
            {
                Ok(kept) => retained = kept,
                Err(err) => note_failure(&metrics, "retired", &err, &mut reachable_since),
            }
        }
        let known = types.snapshot();
        // A retained type applied again since the last look goes by its own spec only.
        let names: HashSet<&str> = known.values().map(|k| k.spec.name.as_str()).collect();
        let retained = retained.iter().filter(|s| !names.contains(s.name.as_str()));
        let specs = known.values().map(|k| &k.spec).chain(retained);
        for spec in specs {
            if reachable_since.elapsed() >= spec.heartbeat_timeout() {
                loop {
                    match upkeep::reap_once(&db, &publisher, spec, &config.name, &metrics).await {
                        Ok(n) if n as i64 == BATCH => continue,
                        Ok(_) => break,
                        Err(err) => {
                            note_failure(&metrics, "reaper", &err, &mut reachable_since);
                            break;
                        }
                    }
                }
            }
            if let Err(err) =
                upkeep::sweep_once(&db, &publisher, &observer, spec, &config.sweep, &metrics).await
            {
                note_failure(&metrics, "sweeper", &err, &mut reachable_since);
            }
        }
    }
}

/// How soon partition upkeep comes back while it owes work.
const PARTITIONS_OWED_RETRY: Duration = Duration::from_secs(60);

/// Partition passes until `shutdown`: every `every`, sooner while work is owed (a long
/// reader of the log held it back) or after a failure.
async fn partitions_loop(
    db: Db,
    retention_days: Option<i32>,
    every: Duration,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    loop {
        let pause = match partitions(&db, retention_days, &metrics).await {
            Ok(owed) if owed.any() => every.min(PARTITIONS_OWED_RETRY),
            Ok(_) => every,
            Err(err) => {
                count_failure(&metrics, "partitions", &err);
                Duration::from_secs(10)
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// One partition pass; returns what is still owed (each step waits at most 100 ms for a
/// lock, so a long reader of the log can hold some of it back).
async fn partitions(
    db: &Db,
    retention_days: Option<i32>,
    metrics: &Metrics,
) -> Result<PartitionsOwed, UpkeepError> {
    db.ensure_partitions().await?;
    if let Some(days) = retention_days {
        for dropped in db.drop_partitions(days).await? {
            tracing::info!(
                partition = dropped,
                "audit partition past retention dropped"
            );
        }
    }
    // Probe records are only needed until their sweep; a day is plenty.
    db.prune_probes(Duration::from_secs(86_400)).await?;
    let owed = db.partitions_owed(retention_days, None).await?;
    metrics
        .audit_partition_days_ahead
        .set(i64::from(owed.days_ahead));
    metrics
        .audit_partitions_overdue
        .set(i64::from(owed.overdue));
    if owed.any() {
        tracing::info!(
            days_ahead = owed.days_ahead,
            overdue = owed.overdue,
            "audit partition upkeep held back by a lock; trying again soon"
        );
    }
    Ok(owed)
}

/// Counts and logs a failed pass; an unavailable database also restarts the time it has
/// answered for (the reaper waits for a whole heartbeat timeout of it).
fn note_failure(metrics: &Metrics, what: &str, err: &UpkeepError, reachable_since: &mut Instant) {
    if err.is_db_unavailable() {
        *reachable_since = Instant::now();
    }
    count_failure(metrics, what, err);
}

fn count_failure(metrics: &Metrics, what: &str, err: &UpkeepError) {
    metrics.errors.with_label_values(&["upkeep", what]).inc();
    tracing::warn!(what, error = %err, source = ?std::error::Error::source(err), "upkeep pass failed");
}
