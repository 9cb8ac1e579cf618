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
    /// 6. PostgreSQL crashed (`stop -m immediate`) and down for the outage.
    PostgresCrash,
    /// 9. `pg_terminate_backend` of every gateway and worker session, five times.
    PostgresTerminate,
    /// 10. Poison: tasks that fail every try and tasks that crash their worker every try.
    Poison,
    /// 11. A backlog past maxQueueDepth with no workers: 429 + Retry-After, then drained.
    Backlog,
    /// 11. A RabbitMQ memory alarm: publishers blocked for the outage, then released.
    BrokerAlarm,
}

pub const ALL: [Scenario; 10] = [
    Scenario::WorkerKill,
    Scenario::WorkerPause,
    Scenario::WorkerBrokerSilent,
    Scenario::GatewayBrokerReset,
    Scenario::RabbitmqKill,
    Scenario::PostgresCrash,
    Scenario::PostgresTerminate,
    Scenario::Poison,
    Scenario::Backlog,
    Scenario::BrokerAlarm,
];

/// Those that leave the shared RabbitMQ and PostgreSQL alone (fit to run in `make test`).
pub const SHORT: [Scenario; 5] = [
    Scenario::WorkerKill,
    Scenario::WorkerPause,
    Scenario::PostgresTerminate,
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
            Scenario::PostgresTerminate => "postgres-terminate",
            Scenario::Poison => "poison",
            Scenario::Backlog => "backlog",
            Scenario::BrokerAlarm => "broker-alarm",
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
            give_up_after: Duration::from_secs(90) + scale.outage,
        };
        match self {
            Scenario::Poison => Plan {
                poison_error_every: Some(50),
                poison_crash: 2,
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
}

/// Runs one scenario end to end.
pub async fn run(scenario: Scenario, scale: &Scale, logs: &Path) -> anyhow::Result<Row> {
    let (sidecar, mut crashes) = Sidecar::start().await?;
    let mut system = System::start(scenario.name(), scenario.options(), &sidecar.url, logs).await?;
    let plan = scenario.plan(scale);
    let over = plan.over;
    let load = tokio::spawn(load::run(
        system.gateway_url.clone(),
        system.task_type.clone(),
        plan,
    ));

    // Throughput is sampled throughout; the fault comes a third of the way in.
    let mut throughput = Throughput::default();
    let fault_at = Instant::now() + over / 3;
    while Instant::now() < fault_at {
        throughput.sample(&system.db, &system.task_type).await;
        tokio::select! {
            Some(task) = crashes.recv() => crash_owner(&mut system, task).await?,
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
    let fault = Instant::now();
    inject(scenario, &mut system, scale, &mut throughput).await?;
    let healed = Instant::now();

    // Poison crashes: the worker running such a task is killed and replaced, every time.
    let mut load = load;
    let outcome = loop {
        throughput.sample(&system.db, &system.task_type).await;
        tokio::select! {
            done = &mut load => break done?,
            Some(task) = crashes.recv() => crash_owner(&mut system, task).await?,
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    };
    // Quiet: every accepted task COMPLETED or DEAD_LETTER (or two minutes passed).
    let quiet_by = Instant::now() + Duration::from_secs(120);
    while Instant::now() < quiet_by {
        throughput.sample(&system.db, &system.task_type).await;
        if oracle::open_tasks(&system.db, &system.task_type, &outcome).await == Some(0) {
            break;
        }
        tokio::select! {
            Some(task) = crashes.recv() => crash_owner(&mut system, task).await?,
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
    throughput.sample(&system.db, &system.task_type).await;
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
    verdict.recovery_seconds = throughput.recovery(fault, healed);
    let mut failures = verdict.failures();
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

/// Injects the fault and returns once it has healed.
async fn inject(
    scenario: Scenario,
    system: &mut System,
    scale: &Scale,
    throughput: &mut Throughput,
) -> anyhow::Result<()> {
    let pause = |seconds: f64| tokio::time::sleep(Duration::from_secs_f64(seconds));
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
            pause(Options::default().heartbeat_timeout_seconds + 4.0).await;
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
            let until = Instant::now() + scale.outage;
            while Instant::now() < until {
                throughput.sample(&system.db, &system.task_type).await;
                pause(0.5).await;
            }
            services_up()?;
        }
        Scenario::PostgresTerminate => {
            for _ in 0..5 {
                oracle::terminate_sessions(&system.db, &system.database).await?;
                pause(1.0).await;
            }
        }
        Scenario::Poison => {}
        Scenario::BrokerAlarm => {
            // A watermark below what the broker uses raises the memory alarm: it blocks
            // every publishing connection until the alarm clears.
            let watermark =
                |w: &str| sh(&format!("rabbitmqctl -q set_vm_memory_high_watermark {w}"));
            watermark("0.000001")?;
            let until = Instant::now() + scale.outage.min(Duration::from_secs(15));
            while Instant::now() < until {
                throughput.sample(&system.db, &system.task_type).await;
                pause(0.5).await;
            }
            watermark("0.4")?;
        }
        Scenario::Backlog => {
            // No workers yet: the queue fills past maxQueueDepth and the gateway refuses.
            pause(3.0).await;
            system.start_workers()?;
        }
    }
    Ok(())
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
