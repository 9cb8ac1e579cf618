//! The open tasks of types no TaskType defines any more (decision 0033): a TaskType deleted
//! under `deletionPolicy: Retain` leaves its queues and tasks to wait for it to come back;
//! one deleted under `Delete` takes its queues, and its tasks have nowhere left to go.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use conveyor_core::amqp::{AmqpError, QueueNames, QueueObserver};
use conveyor_core::db::{Db, RetiredType};
use conveyor_core::metrics::Metrics;
use conveyor_core::task_type::{NamedTaskType, TaskTypeSpec};
use conveyor_core::upkeep::UpkeepError;
use conveyor_core::watch_scope::WatchScope;

use crate::registry::Registry;

/// Open tasks settled per retired type and pass.
const SETTLE_BATCH: i64 = 1000;
/// An owner silence no heartbeat is that old.
const NEVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A retired type this process never knew gets this heartbeat timeout: its workers, if
/// any still run, may beat as rarely as their type allowed, and a healthy task reaped
/// would run twice. An hour covers all but the rarest.
const UNKNOWN_HEARTBEAT_TIMEOUT_SECONDS: f64 = 3600.0;

/// What one look remembers for the next.
#[derive(Default)]
pub(super) struct Looks {
    /// Retired types found without queues: settled only when the next look finds the same,
    /// so that a replica whose list of TaskTypes lags, or a queue being declared, is not
    /// taken for a deletion.
    missing_queues: HashSet<String>,
    /// Retired types found without queues at the last two looks: deleted with them.
    gone: HashSet<String>,
}

impl Looks {
    /// Types whose TaskType was deleted with its queues, as far as the last two looks saw.
    pub(super) fn gone(&self) -> &HashSet<String> {
        &self.gone
    }
}

/// Finds the retired types of `scope`'s namespaces, lists them in the registry, and settles the open tasks of those
/// whose queues are gone (at the second look in a row that finds them gone). Returns the
/// others, to be reaped and swept like known types, with their last spec when this process
/// knew it (see [`UNKNOWN_HEARTBEAT_TIMEOUT_SECONDS`] otherwise).
///
/// `reachable_for`: how long the database has answered. Owners are judged silent only
/// once that covers a heartbeat timeout, as the reaper does.
pub(super) async fn look(
    db: &Db,
    observer: &QueueObserver,
    types: &Registry,
    scope: &WatchScope,
    metrics: &Metrics,
    reachable_for: Duration,
    looks: &mut Looks,
) -> Result<Vec<NamedTaskType>, UpkeepError> {
    let since = Instant::now();
    let mut found = db.retired_types(&types.names()).await?;
    // Another install's namespace: its types are not retired, only not this gateway's.
    found.retain(|retired| scope.covers(&retired.tenant));
    let mut listed = Vec::with_capacity(found.len());
    let mut retained = Vec::new();
    let mut missing_queues = HashSet::new();
    let mut gone = HashSet::new();
    for RetiredType { task_type, tenant } in found {
        let spec = types.departed(&task_type).unwrap_or_else(|| {
            let mut spec = NamedTaskType {
                name: task_type,
                tenant,
                spec: TaskTypeSpec::default(),
            };
            spec.heartbeat_timeout_seconds = UNKNOWN_HEARTBEAT_TIMEOUT_SECONDS;
            spec
        });
        // Rows only the gateway wrote, under names it checked; still, no name that could
        // be another type's queue is published to.
        if let Err(err) = spec.validate_name() {
            tracing::warn!(
                task_type = spec.name,
                error = err,
                "retired type left alone"
            );
            continue;
        }
        listed.push(spec.clone());
        let main = QueueNames::of(&spec.name).main;
        match observer.counts(&main).await {
            Ok(_) => retained.push(spec),
            Err(AmqpError::NoQueue { .. }) => {
                if looks.missing_queues.contains(&spec.name) {
                    settle(db, &spec, metrics, reachable_for).await?;
                    gone.insert(spec.name.clone());
                }
                missing_queues.insert(spec.name.clone());
            }
            Err(source) => {
                return Err(UpkeepError::QueueRead {
                    queue: main,
                    source,
                })
            }
        }
    }
    looks.missing_queues = missing_queues;
    looks.gone = gone;
    types.set_retired(listed, since);
    Ok(retained)
}

async fn settle(
    db: &Db,
    spec: &NamedTaskType,
    metrics: &Metrics,
    reachable_for: Duration,
) -> Result<(), UpkeepError> {
    let why = format!(
        "its TaskType {} was deleted with its queues (deletionPolicy: Delete)",
        spec.name
    );
    let timeout = spec.heartbeat_timeout();
    // Until then, an owner's old beat may be the database's fault: owners wait.
    let silent_for = if reachable_for >= timeout {
        timeout
    } else {
        NEVER
    };
    let settled = db
        .settle_retired(&spec.name, &why, silent_for, SETTLE_BATCH)
        .await?;
    if settled.cancelled + settled.dead_lettered > 0 {
        metrics
            .retired_settled
            .with_label_values(&[spec.name.as_str(), "cancelled"])
            .inc_by(settled.cancelled as u64);
        metrics
            .retired_settled
            .with_label_values(&[spec.name.as_str(), "dead_lettered"])
            .inc_by(settled.dead_lettered as u64);
        tracing::info!(
            task_type = spec.name,
            cancelled = settled.cancelled,
            dead_lettered = settled.dead_lettered,
            "open tasks of a deleted TaskType settled"
        );
    }
    Ok(())
}
