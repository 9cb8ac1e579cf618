//! `make soak`: months compressed into hours against the real gateway and workers, the real
//! RabbitMQ and PostgreSQL. A steady load runs for the whole soak while a compressed
//! calendar turns a simulated day every `--day-seconds`: settled tasks expire after days of
//! that length (the gateway's `--retention-day-seconds`), the audit log's partitions are
//! made and dropped for each simulated date while a dump and a slow query read the log,
//! and a worker is rolled every few days. Samples over time go to the report; the verdict
//! is judged from outside (what clients were told, what the handler did, where each task
//! ended). Times are written down, never asserted.

mod calendar;
mod fleet;
mod judge;
mod load;
mod observe;
mod report;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use conveyor_chaos::sidecar::Sidecar;
use conveyor_chaos::system::{Options, System, TOKEN};

use crate::calendar::Calendar;
use crate::fleet::Fleet;
use crate::report::{Run, Sample};

#[derive(Debug, Parser)]
#[command(name = "conveyor-soak", version)]
struct Args {
    /// 45 s, four simulated days (one operator restart, one failover): proves the command works (`make test` runs
    /// it); measures nothing worth writing down.
    #[arg(long)]
    short: bool,
    /// How long the load runs.
    #[arg(long, default_value_t = 3600)]
    seconds: u64,
    /// Real seconds in a simulated day.
    #[arg(long, default_value_t = 300)]
    day_seconds: u64,
    /// Offered tasks per second.
    #[arg(long, default_value_t = 40.0)]
    rate: f64,
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Audit partitions older than this many simulated days are dropped.
    #[arg(long, default_value_t = 3)]
    audit_retention_days: i32,
    /// Settled tasks are expired (archived, then deleted) after this many simulated days.
    #[arg(long, default_value_t = 2)]
    task_retention_days: u32,
    /// The last worker is rolled (drained with SIGTERM, started again) every this many days.
    #[arg(long, default_value_t = 3)]
    roll_every_days: u32,
    /// Namespaces added every simulated day, each with a TaskType and a WorkerPool, for the
    /// local stack's operator (none when the stack does not run).
    #[arg(long, default_value_t = 40)]
    fleet_per_day: usize,
    /// The fleet grows on the first this many simulated days, then holds: memory that
    /// follows the fleet (the broker's, the operator's) is judged flat once it holds.
    #[arg(long, default_value_t = 6)]
    fleet_grow_days: u32,
    /// The operator is restarted, or failed over to a standby (in turn), every this many
    /// simulated days (0: never).
    #[arg(long, default_value_t = 2)]
    operator_every_days: u32,
    #[arg(long, default_value_t = 60)]
    sample_seconds: u64,
    /// The Markdown report (a .jsonl with one line per run goes beside it).
    #[arg(long, default_value = "target/soak/report.md")]
    report: PathBuf,
    #[arg(long, default_value = "target/soak/logs")]
    logs: PathBuf,
    /// Runs nothing: writes the report of the last run in the .jsonl beside `--report`
    /// again, judged by this build's report code.
    #[arg(long)]
    rejudge: bool,
}

impl Args {
    fn shortened(mut self) -> Args {
        if self.short {
            self.seconds = 45;
            self.day_seconds = 10;
            self.sample_seconds = 5;
            self.rate = 20.0;
            self.workers = 2;
            self.roll_every_days = 2;
            self.task_retention_days = 1;
            self.fleet_per_day = 2;
            self.fleet_grow_days = 2;
            self.operator_every_days = 2;
        }
        self
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse().shortened();
    if args.rejudge {
        let jsonl = args.report.with_extension("jsonl");
        Run::rejudge(&jsonl, &args.report, git_head())?;
        eprintln!(
            "soak: wrote {} from {}",
            args.report.display(),
            jsonl.display()
        );
        return Ok(());
    }
    anyhow::ensure!(
        calendar::pg_dump_available(),
        "pg_dump is missing (it comes with postgresql-client; `scripts/services.sh up` installs it)"
    );
    let day = Duration::from_secs(args.day_seconds.max(1));
    let logs = args.logs.clone();
    // Absolute: the gateway writes it.
    let archive = std::path::absolute(logs.join("archive"))?;
    let _ = std::fs::remove_dir_all(&archive);
    // Expiry looks four times a simulated day.
    let expiry_every = (args.day_seconds / 4).max(1);
    let options = Options {
        workers: args.workers,
        concurrency: 8,
        max_queue_depth: 10_000_000,
        heartbeat_timeout_seconds: 10.0,
        gateway_env: vec![
            env("CONVEYOR_RETENTION_DAY_SECONDS", args.day_seconds),
            env("CONVEYOR_TASK_RETENTION_DAYS", args.task_retention_days),
            env("CONVEYOR_TASK_RETENTION_EVERY_SECONDS", expiry_every),
            // Indexes measured (and sparse ones rebuilt) twice a simulated day.
            env(
                "CONVEYOR_INDEX_UPKEEP_EVERY_SECONDS",
                (args.day_seconds / 2).max(1),
            ),
            (
                "CONVEYOR_TASK_ARCHIVE_DIR".to_owned(),
                archive.display().to_string(),
            ),
        ],
        ..Options::default()
    };
    let (sidecar, _crashes) = Sidecar::start().await?;
    let mut system = System::start("soak", options, &sidecar.url, &logs)
        .await
        .context("start the system (is `scripts/services.sh up` done and `cargo build --bins`?)")?;
    let days = u32::try_from(args.seconds / args.day_seconds.max(1)).unwrap_or(u32::MAX);
    let calendar = Arc::new(Calendar::new(days + 1, args.audit_retention_days));
    let mut run = Run {
        started: chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string(),
        commit: git_head(),
        short: args.short,
        settings: serde_json::json!({
            "seconds": args.seconds, "day_seconds": args.day_seconds, "rate": args.rate,
            "workers": args.workers, "audit_retention_days": args.audit_retention_days,
            "task_retention_days": args.task_retention_days,
            "roll_every_days": args.roll_every_days, "sample_seconds": args.sample_seconds,
            "fleet_per_day": args.fleet_per_day, "fleet_grow_days": args.fleet_grow_days,
        }),
        retention_reached_s: (u64::from(args.task_retention_days) * args.day_seconds
            + expiry_every
            + args.sample_seconds) as f64,
        ..Run::default()
    };
    let target = load::Target {
        gateway: system.gateway_url.clone(),
        token: TOKEN.to_owned(),
        task_type: system.task_type.clone(),
    };
    let soaked = soak(&args, day, &calendar, &mut system, target, &mut run).await;
    let verdict = match soaked {
        Ok(told) => {
            run.told(&told);
            run.open_after_quiet =
                judge::quiet(&system.db, &system.task_type, Duration::from_secs(300)).await?;
            judge::judge(&system.db, &system.task_type, &archive, &told, &sidecar).await
        }
        Err(err) => Err(err),
    };
    let failures = match verdict {
        Ok(verdict) => {
            run.verdict = verdict;
            run.failures()
        }
        Err(err) => vec![format!("{err:#}")],
    };
    system.stop(!failures.is_empty()).await;
    run.write(&args.report)
        .with_context(|| format!("write {}", args.report.display()))?;
    eprintln!("soak: wrote {}", args.report.display());
    anyhow::ensure!(failures.is_empty(), "{}", failures.join("; "));
    Ok(())
}

/// The load, the calendar and the samples, for `args.seconds`; returns what the clients
/// were told.
async fn soak(
    args: &Args,
    day: Duration,
    calendar: &Arc<Calendar>,
    system: &mut System,
    target: load::Target,
    run: &mut Run,
) -> anyhow::Result<load::Told> {
    let fleet = Fleet::available().then(|| Arc::new(Fleet::new()));
    if fleet.is_none() {
        eprintln!("soak: the local stack does not run; no operator in this soak");
    }
    let load = load::Load::start(target, args.rate)?;
    let started = Instant::now();
    let end = started + Duration::from_secs(args.seconds);
    let every = Duration::from_secs(args.sample_seconds.max(1));
    let (mut next_sample, mut next_day, mut today) = (started + every, started + day, 0u32);
    let mut last_sample = started;
    let mut boundaries = vec![start_boundary(calendar, system, 0, day)];
    let mut operator_events = Vec::new();
    let mut operator_busy: Option<tokio::task::JoinHandle<anyhow::Result<String>>> = None;
    if let Some(fleet) = &fleet {
        fleet.grow(args.fleet_per_day).await?;
    }
    // The last worker is the one rolled: the others live through the whole soak, so that
    // their memory over time is one process's.
    let rolled = system.worker_count() - 1;
    let management = conveyor_core::testing::http_client();
    while Instant::now() < end {
        tokio::time::sleep_until(next_sample.min(next_day).min(end).into()).await;
        if Instant::now() >= next_sample {
            next_sample += every;
            // Over the time since the last sample, however late this one is.
            let window = last_sample.elapsed();
            last_sample = Instant::now();
            let mut sample = sample(system, &load, &management, started, today, window).await?;
            if let Some(fleet) = &fleet {
                sample.operator = Some(fleet.sample().await);
            }
            eprintln!(
                "soak: {:.0}s day {today}: {:.1} done/s, p99 {:.0} ms, tasks {} rows",
                sample.elapsed_s,
                sample.throughput,
                sample.latency.p99_ms,
                sample.database.tasks.rows
            );
            run.samples.push(sample);
        }
        if Instant::now() >= next_day {
            next_day += day;
            today += 1;
            boundaries.push(start_boundary(calendar, system, today, day));
            if args.roll_every_days > 0 && today % args.roll_every_days == 0 {
                system.drain_worker(rolled).await;
                system.restart_worker(rolled)?;
                run.restarts
                    .push(format!("worker {rolled} rolled on day {today}"));
            }
            let Some(fleet) = &fleet else { continue };
            if today <= args.fleet_grow_days {
                fleet.grow(args.fleet_per_day).await?;
                run.fleet_steady_s = started.elapsed().as_secs_f64();
            }
            let due = args.operator_every_days > 0 && today % args.operator_every_days == 0;
            // One operator event at a time; a day whose turn finds one under way skips its own.
            if due && operator_busy.as_ref().is_none_or(|e| e.is_finished()) {
                if let Some(done) = operator_busy.take() {
                    operator_events.push(done);
                }
                let failover = (today / args.operator_every_days).is_multiple_of(2);
                let (fleet, watch) = (fleet.clone(), day.min(Duration::from_secs(30)));
                operator_busy = Some(tokio::spawn(async move {
                    let what = match failover {
                        true => fleet.failover().await?,
                        false => fleet.restart(watch).await?,
                    };
                    anyhow::Ok(format!("{what} (day {today})"))
                }));
            }
        }
    }
    let told = load.stop().await;
    operator_events.extend(operator_busy);
    for event in operator_events {
        run.restarts.push(event.await??);
    }
    for boundary in boundaries {
        run.boundaries.push(boundary.await??);
    }
    if let Some(fleet) = &fleet {
        run.operator_end = Some(fleet.sample().await);
    }
    Ok(told)
}

/// A day boundary, run beside the load.
fn start_boundary(
    calendar: &Arc<Calendar>,
    system: &System,
    day: u32,
    length: Duration,
) -> tokio::task::JoinHandle<anyhow::Result<calendar::Boundary>> {
    let (calendar, db, url) = (calendar.clone(), system.db.clone(), system.database_url());
    tokio::spawn(async move { calendar.boundary(&db, &url, day, length / 3, length).await })
}

async fn sample(
    system: &System,
    load: &load::Load,
    management: &reqwest::Client,
    started: Instant,
    day: u32,
    window: Duration,
) -> anyhow::Result<Sample> {
    let latency = observe::latency(&system.db, window.as_secs_f64()).await?;
    let mut processes = vec![("gateway".to_owned(), system.gateway_pid().unwrap_or(0))];
    for (i, pid, _) in system.running_workers() {
        processes.push((format!("worker {i}"), pid));
    }
    Ok(Sample {
        elapsed_s: started.elapsed().as_secs_f64(),
        day,
        window: load.take_window(),
        throughput: latency.completed as f64 / window.as_secs_f64(),
        latency,
        database: observe::database(&system.db).await?,
        memory_mib: observe::memory(&processes),
        memory_parts: observe::memory_parts(&system.db, management).await,
        operator: None,
    })
}

fn env(name: &str, value: impl ToString) -> (String, String) {
    (name.to_owned(), value.to_string())
}

fn git_head() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}
