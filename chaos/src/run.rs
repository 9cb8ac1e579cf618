//! The one run loop, for both targets (this machine's processes, or the local cluster):
//! start the target → load → a third of the way in, the fault → heal → quiet → oracle.

use std::path::Path;
use std::time::{Duration, Instant};

use conveyor_core::db::Db;
use nix::sys::signal::Signal;
use tokio::sync::mpsc;

use crate::cluster::ClusterTarget;
use crate::failover;
use crate::faults;
use crate::hostile;
use crate::load;
use crate::observe::{self, Observer, SAMPLE_EVERY};
use crate::oracle;
use crate::scenarios::{Row, Scale, Scenario};
use crate::sidecar::Sidecar;
use crate::system::{self, System};
use crate::telemetry::Telemetry;

/// How long a hostile tenant acts (`hostile.rs`).
const HOSTILE_WINDOW: Duration = Duration::from_secs(20);

/// Longest wait for every accepted task to settle after the load ends.
const QUIET_WITHIN: Duration = Duration::from_secs(120);

/// What a scenario runs against.
enum Target {
    Processes(Box<System>),
    Cluster(Box<ClusterTarget>),
}

impl Target {
    fn db(&self) -> &Db {
        match self {
            Target::Processes(system) => &system.db,
            Target::Cluster(cluster) => &cluster.stack.db,
        }
    }

    fn task_type(&self) -> &str {
        match self {
            Target::Processes(system) => &system.task_type,
            Target::Cluster(cluster) => &cluster.task_type,
        }
    }

    /// The database name whose sessions the oracle inspects.
    fn database(&self) -> &str {
        match self {
            Target::Processes(system) => &system.database,
            Target::Cluster(_) => "conveyor",
        }
    }

    /// The load's client: in the cluster, the TaskType by its name in its namespace.
    fn client(&self) -> load::Client {
        match self {
            Target::Processes(system) => load::Client {
                gateway: system.gateway_url.clone(),
                token: system::TOKEN.to_owned(),
                task_type: system.task_type.clone(),
                namespace: None,
            },
            Target::Cluster(cluster) => load::Client {
                gateway: cluster.stack.gateway.clone(),
                token: cluster.stack.token.clone(),
                task_type: cluster.name.clone(),
                namespace: Some(cluster.stack.namespace.clone()),
            },
        }
    }

    /// The most tasks the workers can own at once (every slot of every worker).
    fn capacity(&self) -> usize {
        match self {
            Target::Processes(system) => system.capacity(),
            Target::Cluster(_) => 0,
        }
    }

    async fn sample(&self, observer: &mut Observer) {
        match self {
            Target::Processes(system) => observer.sample_system(system).await,
            Target::Cluster(cluster) => {
                observer.sample(&cluster.stack.db, &cluster.task_type).await
            }
        }
    }

    /// A poison task asked for its worker to die (only processes are killed this way).
    async fn crash_owner(&mut self, task: uuid::Uuid) -> anyhow::Result<()> {
        let Target::Processes(system) = self else {
            return Ok(());
        };
        let owner = oracle::owner(&system.db, task).await?;
        if let Some(i) = owner.as_deref().and_then(System::worker_of) {
            system.signal_worker(i, Signal::SIGKILL).await;
            system.restart_worker(i)?;
        }
        Ok(())
    }

    /// Injects the fault; returns when it healed and what went wrong. What a fault saw on
    /// its way (a new leader's election, a lost node's steps) goes to `notes`.
    async fn inject(
        &mut self,
        scenario: Scenario,
        scale: &Scale,
        observer: &mut Observer,
        notes: &mut Vec<String>,
    ) -> anyhow::Result<(Instant, Vec<String>)> {
        match self {
            Target::Processes(system) if scenario.replicated() => {
                failover::inject(scenario, system, scale, observer, notes).await
            }
            Target::Processes(system) if hostile::is_hostile(scenario) => {
                let act = hostile::act(scenario, system, HOSTILE_WINDOW);
                let system = &**system;
                let acted =
                    observe::sampling(act, async || observer.sample_system(system).await).await;
                // An act that could not go on is this scenario's failure; the calm tenant is
                // still judged and the system stopped, and the run goes on.
                let failures = match acted {
                    Ok(acted) => {
                        notes.extend(acted);
                        Vec::new()
                    }
                    Err(err) => vec![format!("the hostile tenant's act failed: {err:#}")],
                };
                Ok((Instant::now(), failures))
            }
            Target::Processes(system) => faults::inject(scenario, system, scale, observer).await,
            // Faults through Kubernetes take up to minutes (a node lost three times).
            Target::Cluster(cluster) => {
                let (db, task_type) = (&cluster.stack.db, &cluster.task_type);
                let work = cluster.inject(scenario, notes);
                Ok(observe::sampling(work, async || observer.sample(db, task_type).await).await)
            }
        }
    }

    fn failures_of_its_own(&self, scenario: Scenario, telemetry: &Telemetry) -> Vec<String> {
        match self {
            Target::Processes(system) => faults::degraded_failures(scenario, system, telemetry),
            Target::Cluster(_) => Vec::new(),
        }
    }

    async fn stop(self, keep_database: bool) {
        match self {
            Target::Processes(system) => (*system).stop(keep_database).await,
            Target::Cluster(cluster) => (*cluster).finish().await,
        }
    }
}

/// Runs one scenario end to end.
pub async fn run(scenario: Scenario, scale: &Scale, logs: &Path) -> anyhow::Result<Row> {
    let (sidecar, mut crashes) = Sidecar::start().await?;
    let mut target = if scenario.in_cluster() {
        Target::Cluster(Box::new(
            ClusterTarget::start(scenario, &sidecar.url).await?,
        ))
    } else {
        let system = System::start(scenario.name(), scenario.options(), &sidecar.url, logs);
        Target::Processes(Box::new(system.await?))
    };
    if let Target::Processes(system) = &target {
        hostile::prepare(scenario, system).await?;
    }
    let plan = scenario.plan(scale);
    let over = plan.over;
    let load_started = Instant::now();
    let load = tokio::spawn(load::run(target.client(), plan));
    let mut observer = Observer::default();
    let fault_at = Instant::now() + over / 3;
    while Instant::now() < fault_at {
        tick(&mut target, &mut observer, &mut crashes).await?;
    }
    let fault = Instant::now();
    observer.telemetry.fault_starts();
    sidecar.mark();
    let mut notes = Vec::new();
    let (healed, fault_failures) = target
        .inject(scenario, scale, &mut observer, &mut notes)
        .await?;
    // Effects under way while the fault struck (up to a heartbeat timeout after it healed,
    // when the reapers hand abandoned tasks on).
    let bound_until = healed + Duration::from_secs(4);
    let mut peak = sidecar.peak_in_flight();
    // Never cancel a tick midway (it may be between killing and restarting a worker).
    while !load.is_finished() {
        if Instant::now() < bound_until {
            peak = sidecar.peak_in_flight();
        }
        tick(&mut target, &mut observer, &mut crashes).await?;
    }
    let outcome = load.await?;
    let quiet_by = Instant::now() + QUIET_WITHIN;
    while Instant::now() < quiet_by {
        let open = oracle::open_tasks(target.db(), target.task_type(), &outcome).await;
        if open == Some(0) {
            break;
        }
        tick(&mut target, &mut observer, &mut crashes).await?;
    }
    target.sample(&mut observer).await;
    // Let late acks and releases settle before sessions are counted.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut verdict = oracle::judge(
        target.db(),
        target.database(),
        target.task_type(),
        &outcome,
        &sidecar,
    )
    .await?;
    verdict.recovery_seconds = observer.recovery(fault, healed);
    // A fault that keeps the workers from heartbeating past the timeout lets the reapers take
    // back every task they own, whether running or finished and buffered; the in-flight peak
    // sees only the running ones.
    let caught = if scenario.silences_heartbeats() {
        peak.max(target.capacity())
    } else {
        peak
    };
    verdict.rerun_bound = scenario.rounds().map(|rounds| caught * rounds);
    let telemetry = observer.telemetry.clone();
    let mut failures = verdict.failures();
    failures.extend(fault_failures);
    failures.extend(target.failures_of_its_own(scenario, &telemetry));
    if scenario == Scenario::Backlog && outcome.refusals.get(&429).copied().unwrap_or(0) == 0 {
        failures.push("the gateway never answered 429 past maxQueueDepth".to_owned());
    }
    // Judged by the sidecar, not the database: the tasks the lost nodes held ran again.
    if scenario == Scenario::NodeLoss && verdict.reruns == 0 {
        failures.push("no task ran again after its node was lost".to_owned());
    }
    if scenario == Scenario::PostgresFailover
        && outcome.refusals.get(&503).copied().unwrap_or(0) == 0
    {
        failures.push("the gateway never answered 503 while the database was gone".to_owned());
    }
    if hostile::is_hostile(scenario) {
        let (calm_failures, note) =
            hostile::compare(&outcome.requests, load_started, fault, healed);
        failures.extend(calm_failures);
        notes.push(note);
    }
    if outcome.missing_retry_after > 0 {
        failures.push(format!(
            "{} refusals without Retry-After",
            outcome.missing_retry_after
        ));
    }
    target.stop(!failures.is_empty()).await;
    Ok(Row {
        scenario: scenario.name(),
        verdict,
        failures,
        telemetry,
        notes,
    })
}

/// One sampling step, handling a poison crash if one is asked for meanwhile.
async fn tick(
    target: &mut Target,
    observer: &mut Observer,
    crashes: &mut mpsc::UnboundedReceiver<uuid::Uuid>,
) -> anyhow::Result<()> {
    target.sample(observer).await;
    tokio::select! {
        Some(task) = crashes.recv() => target.crash_owner(task).await?,
        () = tokio::time::sleep(SAMPLE_EVERY) => {}
    }
    Ok(())
}
