//! The faults, each injected on this machine while tasks flow, and the run of one scenario:
//! start the system → load → fault → heal → quiet → oracle.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use nix::sys::signal::Signal;

use crate::load::{self, Plan};
use crate::oracle::{self, Throughput, Verdict};
use crate::sidecar::Sidecar;
use crate::system::{Options, System};
use crate::telemetry::{self, Telemetry};
use conveyor_core::testing::proxy::Proxy;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// 1. Workers `kill -9`ed mid-task, one after another, and replaced.
    WorkerKill,
    /// 2. A worker SIGSTOPped past the heartbeat timeout, then SIGCONTed: its late results
    ///    are fenced.
    WorkerPause,
    /// 3. A worker's broker link goes silent (no reset): heartbeats notice, tasks re-run.
    WorkerBrokerSilent,
    /// 4. The gateway's broker connection reset while it publishes, three times.
    GatewayBrokerReset,
    /// 5. RabbitMQ `kill -9`ed and restarted.
    RabbitmqKill,
    /// 6. PostgreSQL crashed (`stop -m immediate`) and down for the outage: workers go
    ///    degraded (breaker open, outcomes buffered) and replay when it returns.
    PostgresCrash,
    /// 7. The workers' PostgreSQL link slow (latency), then silent (packets dropped): the
    ///    breaker opens and half-opens, buffers and memory stay bounded.
    PostgresSlow,
    /// 8. A worker killed while its buffer holds outcomes, restarted on the same buffer.
    WorkerKillDegraded,
    /// 9. `pg_terminate_backend` of every gateway and worker session, five times.
    PostgresTerminate,
    /// 9. Worker connections reset right after they send COMMIT, again and again.
    CommitReset,
    /// 10. Poison: tasks that fail every try and tasks that crash their worker every try.
    Poison,
    /// 11. A backlog past maxQueueDepth with no workers: 429 + Retry-After, then drained.
    Backlog,
    /// 11. A RabbitMQ memory alarm: publishers blocked for the outage, then released.
    BrokerAlarm,
    /// 12. In the local cluster: worker pods deleted mid-task (drained, then forced).
    PodDelete,
    /// 12. In the local cluster: the operator killed right after a scale-up was asked for.
    OperatorRestart,
    /// 12. In the local cluster: a rolling update of the WorkerPool.
    RollingUpdate,
}

pub const ALL: [Scenario; 16] = [
    Scenario::WorkerKill,
    Scenario::WorkerPause,
    Scenario::WorkerBrokerSilent,
    Scenario::GatewayBrokerReset,
    Scenario::RabbitmqKill,
    Scenario::PostgresCrash,
    Scenario::PostgresSlow,
    Scenario::WorkerKillDegraded,
    Scenario::PostgresTerminate,
    Scenario::CommitReset,
    Scenario::Poison,
    Scenario::Backlog,
    Scenario::BrokerAlarm,
    Scenario::PodDelete,
    Scenario::OperatorRestart,
    Scenario::RollingUpdate,
];

/// Those that leave the shared RabbitMQ and PostgreSQL alone (fit to run in `make test`).
pub const SHORT: [Scenario; 7] = [
    Scenario::WorkerKill,
    Scenario::WorkerPause,
    Scenario::WorkerKillDegraded,
    Scenario::PostgresTerminate,
    Scenario::CommitReset,
    Scenario::Poison,
    Scenario::Backlog,
];

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::WorkerKill => "worker-kill",
            Scenario::WorkerPause => "worker-pause",
            Scenario::WorkerBrokerSilent => "worker-broker-silent",
            Scenario::GatewayBrokerReset => "gateway-broker-reset",
            Scenario::RabbitmqKill => "rabbitmq-kill",
            Scenario::PostgresCrash => "postgres-crash",
            Scenario::PostgresSlow => "postgres-slow",
            Scenario::WorkerKillDegraded => "worker-kill-degraded",
            Scenario::PostgresTerminate => "postgres-terminate",
            Scenario::CommitReset => "commit-reset",
            Scenario::Poison => "poison",
            Scenario::Backlog => "backlog",
            Scenario::BrokerAlarm => "broker-alarm",
            Scenario::PodDelete => "pod-delete",
            Scenario::OperatorRestart => "operator-restart",
            Scenario::RollingUpdate => "rolling-update",
        }
    }

    pub fn parse(name: &str) -> Option<Scenario> {
        ALL.into_iter().find(|s| s.name() == name)
    }

    fn options(self) -> Options {
        let defaults = Options::default();
        match self {
            Scenario::WorkerBrokerSilent => Options {
                worker_broker_proxy: true,
                ..defaults
            },
            Scenario::GatewayBrokerReset => Options {
                gateway_broker_proxy: true,
                ..defaults
            },
            Scenario::PostgresSlow | Scenario::WorkerKillDegraded | Scenario::CommitReset => {
                Options {
                    worker_database_proxy: true,
                    ..defaults
                }
            }
            Scenario::Poison => Options {
                workers: 2,
                ..defaults
            },
            Scenario::Backlog => Options {
                max_queue_depth: 100,
                start_workers: false,
                ..defaults
            },
            _ => defaults,
        }
    }

    fn plan(self, scale: &Scale) -> Plan {
        let plan = Plan {
            tasks: scale.tasks,
            over: Duration::from_secs_f64((scale.tasks as f64 / 100.0).clamp(3.0, 20.0)),
            sleep_ms: 100,
            poison_error_every: None,
            poison_crash: 0,
            flaky_every: None,
            give_up_after: Duration::from_secs(90) + scale.outage,
        };
        match self {
            Scenario::Poison => Plan {
                poison_error_every: Some(50),
                poison_crash: 2,
                ..plan
            },
            // Failures go through re-queue transactions: COMMITs to reset.
            Scenario::CommitReset => Plan {
                flaky_every: Some(3),
                ..plan
            },
            // Longer tasks: more of them in flight when the link goes or the pod dies.
            Scenario::PostgresSlow | Scenario::WorkerKillDegraded | Scenario::PodDelete => Plan {
                sleep_ms: 400,
                ..plan
            },
            _ => plan,
        }
    }
}

/// How big a run is.
#[derive(Debug, Clone)]
pub struct Scale {
    /// Tasks per scenario.
    pub tasks: usize,
    /// How long a service stays down (PostgreSQL crash, silent links).
    pub outage: Duration,
}

/// The result of one scenario.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub scenario: &'static str,
    #[serde(flatten)]
    pub verdict: Verdict,
    pub failures: Vec<String>,
    #[serde(flatten)]
    pub telemetry: Telemetry,
}

/// Samples taken all through a scenario: throughput (for the recovery time) and what the
/// workers report.
struct Observer {
    throughput: Throughput,
    telemetry: Telemetry,
    http: reqwest::Client,
}

impl Observer {
    async fn sample(&mut self, system: &System) {
        self.throughput.sample(&system.db, &system.task_type).await;
        self.telemetry.sample(system, &self.http).await;
    }
}

impl Scenario {
    /// Goes through Kubernetes (the stack of `scripts/stack.sh up`): `cluster.rs`.
    pub fn in_cluster(self) -> bool {
        matches!(
            self,
            Scenario::PodDelete | Scenario::OperatorRestart | Scenario::RollingUpdate
        )
    }
}

/// Runs one scenario end to end.
pub async fn run(scenario: Scenario, scale: &Scale, logs: &Path) -> anyhow::Result<Row> {
    if scenario.in_cluster() {
        return crate::cluster::run(scenario, scenario.plan(scale)).await;
    }
    let (sidecar, mut crashes) = Sidecar::start().await?;
    let mut system = System::start(scenario.name(), scenario.options(), &sidecar.url, logs).await?;
    let plan = scenario.plan(scale);
    let over = plan.over;
    let load = tokio::spawn(load::run(
        system.gateway_url.clone(),
        crate::system::TOKEN.to_owned(),
        system.task_type.clone(),
        plan,
    ));

    // Sampled throughout; the fault comes a third of the way in.
    let mut observer = Observer {
        throughput: Throughput::default(),
        telemetry: Telemetry::default(),
        http: reqwest::Client::new(),
    };
    let fault_at = Instant::now() + over / 3;
    while Instant::now() < fault_at {
        observer.sample(&system).await;
        tokio::select! {
            Some(task) = crashes.recv() => crash_owner(&mut system, task).await?,
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
    let fault = Instant::now();
    observer.telemetry.fault_starts();
    let fault_failures = inject(scenario, &mut system, scale, &mut observer).await?;
    let healed = Instant::now();

    // Poison crashes: the worker running such a task is killed and replaced, every time.
    let mut load = load;
    let outcome = loop {
        observer.sample(&system).await;
        tokio::select! {
            done = &mut load => break done?,
            Some(task) = crashes.recv() => crash_owner(&mut system, task).await?,
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    };
    // Quiet: every accepted task COMPLETED or DEAD_LETTER (or two minutes passed).
    let quiet_by = Instant::now() + Duration::from_secs(120);
    while Instant::now() < quiet_by {
        observer.sample(&system).await;
        if oracle::open_tasks(&system.db, &system.task_type, &outcome).await == Some(0) {
            break;
        }
        tokio::select! {
            Some(task) = crashes.recv() => crash_owner(&mut system, task).await?,
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
    observer.sample(&system).await;
    // Let late acks and releases settle before sessions are counted.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut verdict = oracle::judge(
        &system.db,
        &system.database,
        &system.task_type,
        &outcome,
        sidecar.counts(),
    )
    .await?;
    verdict.recovery_seconds = observer.throughput.recovery(fault, healed);
    let telemetry = observer.telemetry;
    let mut failures = verdict.failures();
    failures.extend(fault_failures);
    failures.extend(degraded_failures(scenario, &system, &telemetry));
    if scenario == Scenario::Backlog && outcome.refusals.get(&429).copied().unwrap_or(0) == 0 {
        failures.push("the gateway never answered 429 past maxQueueDepth".to_owned());
    }
    if outcome.missing_retry_after > 0 {
        failures.push(format!(
            "{} refusals without Retry-After",
            outcome.missing_retry_after
        ));
    }
    system.stop(!failures.is_empty()).await;
    Ok(Row {
        scenario: scenario.name(),
        verdict,
        failures,
        telemetry,
    })
}

async fn crash_owner(system: &mut System, task: uuid::Uuid) -> anyhow::Result<()> {
    let owner = oracle::owner(&system.db, task).await?;
    if let Some(i) = owner.as_deref().and_then(System::worker_of) {
        system.signal_worker(i, Signal::SIGKILL).await;
        system.restart_worker(i)?;
    }
    Ok(())
}

/// Injects the fault and returns once it has healed, with what went wrong injecting it.
async fn inject(
    scenario: Scenario,
    system: &mut System,
    scale: &Scale,
    observer: &mut Observer,
) -> anyhow::Result<Vec<String>> {
    let pause = |seconds: f64| tokio::time::sleep(Duration::from_secs_f64(seconds));
    let heartbeat_timeout = Options::default().heartbeat_timeout_seconds;
    let mut failures = Vec::new();
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
            sh("pkill -KILL -f '[b]eam.smp.*rabbit'")?;
            pause(2.0).await;
            services_up()?;
        }
        Scenario::PostgresCrash => {
            sh("pg_ctlcluster $(ls /etc/postgresql | sort -V | tail -1) main stop -m immediate")?;
            observe_for(observer, system, scale.outage).await;
            services_up()?;
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
            for _ in 0..5 {
                oracle::terminate_sessions(&system.db, &system.database).await?;
                pause(1.0).await;
            }
        }
        Scenario::CommitReset => {
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                database_link(system)?.reset_after(b"COMMIT");
                observer.sample(system).await;
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
                |w: &str| sh(&format!("rabbitmqctl -q set_vm_memory_high_watermark {w}"));
            watermark("0.000001")?;
            observe_for(observer, system, scale.outage.min(Duration::from_secs(15))).await;
            watermark("0.4")?;
        }
        Scenario::Backlog => {
            // No workers yet: the queue fills past maxQueueDepth and the gateway refuses.
            pause(3.0).await;
            system.start_workers()?;
        }
        Scenario::PodDelete | Scenario::OperatorRestart | Scenario::RollingUpdate => {
            anyhow::bail!("{} runs in the cluster (cluster.rs)", scenario.name())
        }
    }
    Ok(failures)
}

/// Samples every half second for `how_long`.
async fn observe_for(observer: &mut Observer, system: &System, how_long: Duration) {
    let until = Instant::now() + how_long;
    while Instant::now() < until {
        observer.sample(system).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
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
        observer.sample(system).await;
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
fn degraded_failures(scenario: Scenario, system: &System, t: &Telemetry) -> Vec<String> {
    let mut failures = Vec::new();
    let takes_database = matches!(
        scenario,
        Scenario::PostgresCrash | Scenario::PostgresSlow | Scenario::WorkerKillDegraded
    );
    if takes_database && t.breaker_opens == 0 {
        failures.push("no worker's breaker opened".to_owned());
    }
    if matches!(
        scenario,
        Scenario::PostgresCrash | Scenario::WorkerKillDegraded
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
        let bound = system.worker_count() as u64 * u64::from(Options::default().concurrency);
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

fn sh(command: &str) -> anyhow::Result<()> {
    let status = Command::new("sh").args(["-c", command]).status()?;
    anyhow::ensure!(status.success(), "`{command}` failed: {status}");
    Ok(())
}

/// Restarts whatever service is down (`scripts/services.sh up`, idempotent).
fn services_up() -> anyhow::Result<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/services.sh");
    let status = Command::new(&script)
        .arg("up")
        .status()
        .with_context(|| format!("run {}", script.display()))?;
    anyhow::ensure!(status.success(), "{} up failed", script.display());
    Ok(())
}
