//! The faults injected on this machine's processes and services, one per scenario of the
//! table (`scenarios.rs`); the cluster's own are in `cluster.rs`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use nix::sys::signal::Signal;

use crate::broker;
use crate::observe::{Observer, SAMPLE_EVERY};
use crate::oracle;
use crate::scenarios::{Scale, Scenario, BACKLOG_MAX_DEPTH};
use crate::system::{Options, System};

use crate::telemetry::{self, Telemetry};
use conveyor_core::testing::proxy::Proxy;

/// How long a task must have been INGESTED to count as unpublished: twenty times the
/// gateway's settle before it marks a confirmed one QUEUED (decision 0020).
const UNPUBLISHED: Duration = Duration::from_secs(2);

/// Injects the fault on this machine's processes and services; returns when it really
/// healed (the service answering again, not when a script returned), with what went wrong
/// injecting it.
pub async fn inject(
    scenario: Scenario,
    system: &mut System,
    scale: &Scale,
    observer: &mut Observer,
) -> anyhow::Result<(Instant, Vec<String>)> {
    let pause = |seconds: f64| tokio::time::sleep(Duration::from_secs_f64(seconds));
    let heartbeat_timeout = Options::default().heartbeat_timeout_seconds;
    let mut failures = Vec::new();
    let mut healed = None;
    match scenario {
        Scenario::WorkerKill => {
            for round in 0..3 {
                let i = round % system.worker_count();
                system.signal_worker(i, Signal::SIGKILL).await;
                pause(1.0).await;
                system.restart_worker(i)?;
                pause(1.0).await;
            }
        }
        Scenario::WorkerPause => {
            system.signal_worker(0, Signal::SIGSTOP).await;
            pause(heartbeat_timeout + 4.0).await;
            system.signal_worker(0, Signal::SIGCONT).await;
        }
        Scenario::WorkerBrokerSilent => {
            if let Some(proxy) = &system.worker_broker {
                proxy.black_hole();
                pause(scale.outage.as_secs_f64().max(8.0)).await;
                proxy.restore();
            }
        }
        Scenario::GatewayBrokerReset => {
            for _ in 0..3 {
                if let Some(proxy) = &system.gateway_broker {
                    proxy.cut();
                    pause(1.0).await;
                    proxy.restore();
                }
                pause(1.0).await;
            }
        }
        Scenario::RabbitmqKill => {
            // This node's VM only: the cluster's nodes (scripts/cluster-services.sh) may run too.
            as_root("kill -KILL \"$(cat /var/lib/rabbitmq/mnesia/rabbit@localhost.pid)\"")?;
            pause(2.0).await;
            healed = Some(restart_services(observer, system, Service::Broker).await?);
        }
        Scenario::PostgresCrash => {
            as_root(
                "pg_ctlcluster $(ls /etc/postgresql | sort -V | tail -1) main stop -m immediate",
            )?;
            observe_for(observer, system, scale.outage).await;
            healed = Some(restart_services(observer, system, Service::Database).await?);
        }
        Scenario::PostgresSlow => {
            database_link(system)?.delay(Duration::from_millis(300));
            observe_for(observer, system, Duration::from_secs(10)).await;
            database_link(system)?.black_hole();
            observe_for(observer, system, scale.outage.min(Duration::from_secs(20))).await;
            database_link(system)?.restore();
        }
        Scenario::WorkerKillDegraded => {
            database_link(system)?.cut();
            match buffering_worker(observer, system, Duration::from_secs(20)).await {
                Some(i) => {
                    system.signal_worker(i, Signal::SIGKILL).await;
                    pause(1.0).await;
                    system.restart_worker(i)?;
                    // Down past the heartbeat timeout: only the heartbeats of the restarted
                    // worker, for its buffered tasks, keep reapers off them.
                    let hold = Duration::from_secs_f64(heartbeat_timeout + 2.0);
                    observe_for(observer, system, hold).await;
                }
                None => failures.push("no worker buffered an outcome to kill".to_owned()),
            }
            database_link(system)?.restore();
        }
        Scenario::PostgresTerminate => {
            let mut terminated = 0;
            for _ in 0..5 {
                terminated += oracle::terminate_sessions(&system.db, &system.database).await?;
                pause(1.0).await;
            }
            if terminated == 0 {
                failures.push("no session was terminated".to_owned());
            }
        }
        Scenario::CommitReset => {
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                database_link(system)?.reset_after(b"COMMIT");
                observer.sample_system(system).await;
                pause(0.2).await;
            }
            let resets = database_link(system)?.resets();
            eprintln!("chaos: commit-reset reset {resets} connections right after COMMIT");
            if resets == 0 {
                failures.push("no connection was reset at COMMIT".to_owned());
            }
        }
        Scenario::Poison => {}
        Scenario::BrokerAlarm => {
            // A watermark below what the broker uses raises the memory alarm: it blocks
            // every publishing connection until the alarm clears.
            let watermark =
                |w: &str| as_root(&format!("rabbitmqctl -q set_vm_memory_high_watermark {w}"));
            watermark("0.000001")?;
            observe_for(observer, system, scale.outage.min(Duration::from_secs(15))).await;
            watermark("0.4")?;
        }
        Scenario::Backlog => {
            // No workers yet: the queue fills past maxQueueDepth and the gateway refuses (so
            // the backlog stays just above the limit).
            let past = BACKLOG_MAX_DEPTH as i64 + 1;
            let filled = backlog_of(observer, system, past, Duration::from_secs(30)).await;
            if filled < past {
                failures.push(format!("the backlog reached only {filled} tasks"));
            }
            pause(1.0).await;
            system.start_workers()?;
        }
        Scenario::DeliveryLimit => {
            // The pool drains away, so that the rogue consumer is the queue's only one.
            let backlog = backlog_without_workers(observer, system).await;
            let parked = hand_back_deliveries(observer, system, Duration::from_secs(3)).await?;
            eprintln!(
                "chaos: delivery-limit parked {parked} of {backlog} waiting tasks' messages in remediation"
            );
            system.start_workers()?;
            if parked == 0 {
                failures.push("the delivery limit dead-lettered nothing".to_owned());
            }
        }
        Scenario::QueuePurge => {
            backlog_without_workers(observer, system).await;
            let purged = broker::purge(&system.task_type).await?;
            system.start_workers()?;
            observe_for(observer, system, Duration::from_secs(1)).await;
            let purged_again = broker::purge(&system.task_type).await?;
            eprintln!("chaos: queue-purge purged {purged}, then {purged_again} messages");
            if purged == 0 {
                failures.push("the purge found no message to take".to_owned());
            }
        }
        Scenario::QueueDelete => {
            backlog_without_workers(observer, system).await;
            let deleted = broker::delete_and_redeclare(&system.spec()?).await?;
            system.start_workers()?;
            eprintln!("chaos: queue-delete deleted the work queue with {deleted} messages");
            if deleted == 0 {
                failures.push("the deleted queue held no message".to_owned());
            }
        }
        Scenario::GatewayKillUnpublished => {
            // Publishes hang on a silent link while the tasks are recorded; then the node dies.
            system
                .gateway_broker
                .as_ref()
                .context("the gateway's broker link goes through a proxy")?
                .black_hole();
            // Until some submissions are recorded and stuck behind the silent link (however
            // slow the machine), or half a minute.
            let until = Instant::now() + Duration::from_secs(30);
            let mut stranded = 0;
            while stranded == 0 && Instant::now() < until {
                observe_for(observer, system, SAMPLE_EVERY).await;
                stranded = oracle::count_older_in(
                    &system.db,
                    &system.task_type,
                    &["INGESTED"],
                    UNPUBLISHED,
                )
                .await;
            }
            // A moment more, so that the kill catches requests in flight, not only the first.
            observe_for(observer, system, Duration::from_millis(500)).await;
            let stranded = stranded.max(
                oracle::count_older_in(&system.db, &system.task_type, &["INGESTED"], UNPUBLISHED)
                    .await,
            );
            eprintln!("chaos: gateway killed with {stranded} tasks recorded and unpublished");
            system.kill_gateway().await;
            if let Some(proxy) = &system.gateway_broker {
                proxy.restore();
            }
            system.restart_gateway().await?;
            if stranded == 0 {
                failures.push("no task was left INGESTED by the killed gateway".to_owned());
            }
        }
        Scenario::PartitionsMonth => {
            // A month of audit rows beyond the partitions made ahead (as after weeks with
            // nobody making them): they land in the default partition, and the gateway's
            // own upkeep must make their partitions and move them in, under load.
            let written =
                oracle::write_calendar_rows(&system.db, &system.task_type, 20..50).await?;
            let until = Instant::now() + Duration::from_secs(30);
            let mut left = i64::MAX;
            while Instant::now() < until {
                left = oracle::default_partition_rows(&system.db).await;
                if left == 0 {
                    break;
                }
                observer.sample_system(system).await;
                tokio::time::sleep(SAMPLE_EVERY).await;
            }
            let kept = oracle::calendar_rows(&system.db, &system.task_type).await;
            eprintln!("chaos: partitions-month: {written} rows written, {kept} kept, {left} left in the default partition");
            if left != 0 {
                failures.push(format!("{left} audit rows left in the default partition"));
            }
            if kept != written {
                failures.push(format!("{written} calendar rows written, {kept} kept"));
            }
        }
        Scenario::WorkersGone => {
            for i in 0..system.worker_count() {
                system.signal_worker(i, Signal::SIGKILL).await;
            }
            // Nobody consumes this type now: only the gateway's reaper can move the
            // dead workers' tasks on.
            let hold = Duration::from_secs_f64(heartbeat_timeout * 2.0 + 1.0);
            observe_for(observer, system, hold).await;
            let owned =
                oracle::count_in(&system.db, &system.task_type, &["CLAIMED", "PROCESSING"]).await;
            if owned > 0 {
                failures.push(format!("{owned} tasks still owned by dead workers"));
            }
            system.start_workers()?;
        }
        Scenario::RabbitmqLeaderKill
        | Scenario::RabbitmqNodePause
        | Scenario::RabbitmqRollingRestart
        | Scenario::PostgresFailover => {
            anyhow::bail!(
                "{} runs on the replicated services (failover.rs)",
                scenario.name()
            )
        }
        Scenario::PodDelete
        | Scenario::OperatorRestart
        | Scenario::RollingUpdate
        | Scenario::PoolScaledToZero
        | Scenario::BrokerStoppedCluster
        | Scenario::NodeLoss => {
            anyhow::bail!("{} runs in the cluster (cluster.rs)", scenario.name())
        }
        Scenario::TenantDeletesTopology
        | Scenario::TenantFloodsStreamsAndLists
        | Scenario::TenantHoldsTransactions
        | Scenario::TenantPoisonsPayloads => {
            anyhow::bail!("{} is a tenant's act (hostile.rs)", scenario.name())
        }
    }
    Ok((healed.unwrap_or_else(Instant::now), failures))
}

/// Samples for `how_long`.
async fn observe_for(observer: &mut Observer, system: &System, how_long: Duration) {
    let until = Instant::now() + how_long;
    while Instant::now() < until {
        observer.sample_system(system).await;
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
}

/// The first worker seen holding buffered outcomes, within `within`.
async fn buffering_worker(
    observer: &mut Observer,
    system: &System,
    within: Duration,
) -> Option<usize> {
    let until = Instant::now() + within;
    while Instant::now() < until {
        observer.sample_system(system).await;
        for (i, _, listen) in system.running_workers() {
            if telemetry::buffered(&observer.http, listen).await > 0.0 {
                return Some(i);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

fn database_link(system: &System) -> anyhow::Result<&Proxy> {
    system
        .worker_database
        .as_ref()
        .context("this scenario's workers reach PostgreSQL through a proxy")
}

/// Degraded mode must have been at work where a scenario takes the database away, and
/// must have stayed within its bounds.
pub fn degraded_failures(scenario: Scenario, system: &System, t: &Telemetry) -> Vec<String> {
    let mut failures = Vec::new();
    let takes_database = matches!(
        scenario,
        Scenario::PostgresCrash
            | Scenario::PostgresSlow
            | Scenario::WorkerKillDegraded
            | Scenario::PostgresFailover
    );
    if takes_database && t.breaker_opens == 0 {
        failures.push("no worker's breaker opened".to_owned());
    }
    if matches!(
        scenario,
        Scenario::PostgresCrash | Scenario::WorkerKillDegraded | Scenario::PostgresFailover
    ) && (t.buffered_max == 0 || t.replayed == 0)
    {
        failures.push(format!(
            "degraded mode unused: {} buffered, {} replayed",
            t.buffered_max, t.replayed
        ));
    }
    if scenario == Scenario::PostgresSlow {
        if t.breaker_half_opens == 0 {
            failures.push("no worker's breaker half-opened".to_owned());
        }
        // A degraded worker takes no new work, so it buffers at most what it was running.
        let bound = system.capacity() as u64;
        if t.buffered_max > bound {
            failures.push(format!(
                "{} outcomes buffered, past {bound}",
                t.buffered_max
            ));
        }
        let growth = t.worker_rss_max_mib - t.rss_before_fault_mib;
        if growth > 64.0 {
            failures.push(format!(
                "worker memory grew {growth:.0} MiB during the fault"
            ));
        }
    }
    failures
}

/// Runs `command` as root: at once when this is root, else through sudo (as the scripts do,
/// `scripts/lib/tools.sh`), since the services run as their own users.
pub(crate) fn as_root(command: &str) -> anyhow::Result<()> {
    let status = Command::new("sh")
        .args([
            "-c",
            r#"if [ "$(id -u)" -eq 0 ]; then sh -c "$1"; else sudo sh -c "$1"; fi"#,
            "as_root",
            command,
        ])
        .status()?;
    anyhow::ensure!(status.success(), "`{command}` failed: {status}");
    Ok(())
}

#[derive(Clone, Copy)]
enum Service {
    Broker,
    Database,
}

/// Restarts whatever service is down (`scripts/services.sh up`, idempotent) and returns the
/// moment `service` answered again, sampled while the script still runs.
async fn restart_services(
    observer: &mut Observer,
    system: &System,
    service: Service,
) -> anyhow::Result<Instant> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/services.sh");
    let mut up = tokio::process::Command::new(&script)
        .arg("up")
        .spawn()
        .with_context(|| format!("run {}", script.display()))?;
    let mut healed = None;
    let status = loop {
        if healed.is_none() && answers(system, service).await {
            healed = Some(Instant::now());
        }
        observer.sample_system(system).await;
        tokio::select! {
            status = up.wait() => break status?,
            () = tokio::time::sleep(SAMPLE_EVERY) => {}
        }
    };
    anyhow::ensure!(status.success(), "{} up failed", script.display());
    while healed.is_none() {
        if answers(system, service).await {
            healed = Some(Instant::now());
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    Ok(healed.unwrap_or_else(Instant::now))
}

async fn answers(system: &System, service: Service) -> bool {
    match service {
        Service::Database => system.db.ping().await.is_ok(),
        Service::Broker => broker::reachable().await,
    }
}

/// Drains the workers away and lets the load build a backlog for a moment; returns its
/// size (tasks waiting in the database).
async fn backlog_without_workers(observer: &mut Observer, system: &mut System) -> i64 {
    system.drain_workers().await;
    backlog_of(observer, system, 50, Duration::from_secs(20)).await
}

/// Waits (sampling) until at least `tasks` wait in the database, or `within` passed;
/// returns how many wait.
async fn backlog_of(observer: &mut Observer, system: &System, tasks: i64, within: Duration) -> i64 {
    let until = Instant::now() + within;
    loop {
        let waiting =
            oracle::count_in(&system.db, &system.task_type, &["INGESTED", "QUEUED"]).await;
        if waiting >= tasks || Instant::now() >= until {
            return waiting;
        }
        observer.sample_system(system).await;
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
}

/// A rogue consumer on the work queue that hands every delivery back with a requeue for
/// `how_long`, as a worker that releases what it will not run does. Each hand-back counts
/// against the delivery limit. Returns how many messages the limit parked in remediation.
async fn hand_back_deliveries(
    observer: &mut Observer,
    system: &System,
    how_long: Duration,
) -> anyhow::Result<u32> {
    let rogue = broker::Rogue::start(&system.task_type).await?;
    observe_for(observer, system, how_long).await;
    rogue.stop().await;
    broker::remediation_depth(&system.task_type).await
}
