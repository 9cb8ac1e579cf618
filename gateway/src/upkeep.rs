//! The gateway's upkeep loop: what must happen on a calendar or after a fault, with no human
//! and no worker of the type alive (SPEC invariants 7 and 8). Every gateway runs it; the SQL
//! takes rows with `SKIP LOCKED` and the partition function holds an advisory lock, so
//! several gateways share the work instead of repeating it.
//!
//! - the heartbeat reaper for every known task type (a pool scaled to zero after its pod
//!   died mid-task still gets that task back);
//! - the orphan sweeper: probes through each work queue and re-publishes tasks whose
//!   message is gone (decision 0011);
//! - audit partitions made two weeks ahead, rows rescued from the default partition, and
//!   old partitions dropped after the retention period.

use std::sync::Arc;
use std::time::{Duration, Instant};

use conveyor_core::amqp::Publisher;
use conveyor_core::db::Db;
use conveyor_core::metrics::Metrics;
use conveyor_core::upkeep::{self, SweepSettings, UpkeepError, BATCH};
use tokio_util::sync::CancellationToken;

use crate::registry::Registry;

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
    /// Name recorded as the reaper in audit events.
    pub name: String,
}

/// Runs until `shutdown`.
pub async fn run(
    db: Db,
    publisher: Arc<Publisher>,
    types: Arc<Registry>,
    config: UpkeepConfig,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut partitions_due = Instant::now();
    // The reaper waits until the database has answered for a whole heartbeat timeout: after
    // an outage (or at start) every owner's last beat may be stale through no fault of its.
    let mut reachable_since = Instant::now();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if Instant::now() >= partitions_due {
            match partitions(&db, config.retention_days).await {
                Ok(()) => partitions_due = Instant::now() + config.partitions_every,
                Err(err) => {
                    note_failure(&metrics, "partitions", &err, &mut reachable_since);
                    partitions_due = Instant::now() + Duration::from_secs(10);
                }
            }
        }
        for known in types.snapshot().values() {
            let spec = &known.spec;
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
                upkeep::sweep_once(&db, &publisher, spec, &config.sweep, &metrics).await
            {
                note_failure(&metrics, "sweeper", &err, &mut reachable_since);
            }
        }
    }
}

async fn partitions(db: &Db, retention_days: Option<i32>) -> Result<(), UpkeepError> {
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
    Ok(())
}

fn note_failure(metrics: &Metrics, what: &str, err: &UpkeepError, reachable_since: &mut Instant) {
    if err.is_db_unavailable() {
        *reachable_since = Instant::now();
    }
    metrics.errors.with_label_values(&["upkeep", what]).inc();
    tracing::warn!(what, error = %err, source = ?std::error::Error::source(err), "upkeep pass failed");
}
