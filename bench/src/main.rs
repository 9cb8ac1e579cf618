//! `make bench`: in one run, the raw floor of this machine and Conveyor end to end (submit →
//! COMPLETED with the full audit log), with the CPU split, PostgreSQL's work and peak memory
//! per process; writes `docs/benchmarks.md` and appends a JSON line per run.
//!
//! Nothing here asserts a time: figures are written down and compared as ratios to the floor
//! measured in the same run. A run fails only when the system did not do what its clients
//! were told (a task accepted and not completed once with its full audit chain).

mod floor;
mod listing;
mod load;
mod report;
mod system;
mod usage;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::testing;

use crate::report::{Phase, Run};
use crate::system::{Settings, System};

#[derive(Debug, Parser)]
#[command(name = "conveyor-bench", version)]
struct Args {
    /// A few seconds of each phase: proves the command works (`make test` runs it), measures
    /// nothing worth writing down.
    #[arg(long)]
    short: bool,
    /// Tasks in the batch-submit phase.
    #[arg(long, default_value_t = 60_000)]
    batch_tasks: usize,
    /// Tasks per batch request.
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Concurrent batch submitters.
    #[arg(long, default_value_t = 4)]
    batch_clients: usize,
    /// Tasks in the single-submit phase.
    #[arg(long, default_value_t = 30_000)]
    single_tasks: usize,
    /// Keep-alive connections of the single-submit phases: one phase per count, since
    /// concurrent requests share statements (group commit).
    #[arg(long, value_delimiter = ',', default_values_t = [32, 128])]
    connections: Vec<usize>,
    /// Offered rate of the latency phase, tasks per second.
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// Length of the latency phase, in seconds.
    #[arg(long, default_value_t = 20)]
    rate_seconds: u64,
    /// Messages through the raw broker floor.
    #[arg(long, default_value_t = 100_000)]
    floor_messages: usize,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Where the measured `conveyor-gateway` and `conveyor-worker` are (default: beside
    /// this binary), to measure an older build against the same floor.
    #[arg(long)]
    binaries: Option<PathBuf>,
    #[arg(long, default_value_t = 64)]
    concurrency: u16,
    /// The gateway's and workers' `--publish-channels` (default: theirs).
    #[arg(long)]
    publish_channels: Option<u16>,
    /// The Markdown report (a .jsonl with one line per run goes beside it).
    #[arg(long, default_value = "target/bench/report.md")]
    report: PathBuf,
    /// Process logs.
    #[arg(long, default_value = "target/bench/logs")]
    logs: PathBuf,
}

impl Args {
    fn shortened(mut self) -> Args {
        if self.short {
            self.batch_tasks = 2_000;
            self.single_tasks = 500;
            self.rate = 100;
            self.rate_seconds = 2;
            self.floor_messages = 2_000;
        }
        self
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse().shortened();
    let binaries = args
        .binaries
        .clone()
        .unwrap_or_else(system::default_binaries);
    let mut run = Run::describe(args.short, binaries.clone()).await;
    let admin = Db::connect(&DbOptions::new(testing::admin_database_url()))?;

    run.floor_samples
        .push(broker_floor(args.floor_messages).await?);

    let settings = Settings {
        workers: args.workers,
        concurrency: args.concurrency,
        publish_channels: args.publish_channels,
        binaries,
    };
    let system = System::start(&settings, &args.logs).await?;
    let db = Db::connect(&DbOptions::new(&system.db_url))?;
    let audit_rows = if args.short { 10_000 } else { 300_000 };
    run.floor_audit_rows = floor::audit_inserts(db.pool(), audit_rows, 1000).await?;
    eprintln!("bench: {:.0} audit rows/s batched", run.floor_audit_rows);
    run.settings = serde_json::json!({
        "workers": args.workers, "concurrency": args.concurrency,
        "batch_size": args.batch_size, "batch_clients": args.batch_clients,
        "connections": &args.connections, "offered_rate": args.rate,
        "publish_channels": args.publish_channels
            .map_or(conveyor_core::amqp::DEFAULT_PUBLISH_CHANNELS, usize::from),
    });
    run.services = system::service_settings(admin.pool()).await;

    let measured = phases(&args, &system, &admin, db.pool(), &mut run).await;
    run.floor_broker = report::median(&run.floor_samples);
    run.peak_rss_mib = system.processes().peak_rss_mib();
    run.statements = usage::statement_costs(admin.pool(), &system.database).await;
    system.stop().await;
    measured?;

    run.print();
    run.write(&args.report)
        .with_context(|| format!("write {}", args.report.display()))?;
    eprintln!("bench: wrote {}", args.report.display());
    let failures = run.failures();
    anyhow::ensure!(failures.is_empty(), "{}", failures.join("; "));
    Ok(())
}

async fn phases(
    args: &Args,
    system: &System,
    admin: &Db,
    pool: &sqlx::PgPool,
    run: &mut Run,
) -> anyhow::Result<()> {
    let limit = Duration::from_secs(600);
    // Connections opened, caches warm: not measured.
    let warm = args.batch_size.min(args.batch_tasks);
    load::watched(
        system,
        warm,
        limit,
        load::batches(system, warm, warm, 1, false),
    )
    .await?;

    // Unlabelled, then labelled: the second pays for the labels' GIN index (issue 16).
    for (name, with_labels) in [("batch submits", false), ("labelled batch submits", true)] {
        let floor = broker_floor(args.floor_messages).await?;
        let phase = Phase::begin(name.to_owned(), system, admin).await?;
        eprintln!(
            "bench: {} tasks in batches of {} ({name})",
            args.batch_tasks, args.batch_size
        );
        let load = load::batches(
            system,
            args.batch_tasks,
            args.batch_size,
            args.batch_clients,
            with_labels,
        );
        let (accepted, timeline) = load::watched(system, args.batch_tasks, limit, load).await?;
        run.push(
            phase.end(system, admin, pool, &accepted, &timeline).await?,
            floor,
        );
    }

    for &connections in &args.connections {
        let name = format!("single submits, {connections} connections");
        let floor = broker_floor(args.floor_messages).await?;
        let phase = Phase::begin(name, system, admin).await?;
        eprintln!(
            "bench: {} single submits over {connections} connections",
            args.single_tasks
        );
        let load = load::singles(system, args.single_tasks, connections);
        let (accepted, timeline) = load::watched(system, args.single_tasks, limit, load).await?;
        run.push(
            phase.end(system, admin, pool, &accepted, &timeline).await?,
            floor,
        );
    }

    let floor = broker_floor(args.floor_messages).await?;
    let phase = Phase::begin("fixed rate".to_owned(), system, admin).await?;
    let total = args.rate as usize * args.rate_seconds as usize;
    eprintln!("bench: {}/s offered for {} s", args.rate, args.rate_seconds);
    let refused = std::sync::atomic::AtomicUsize::new(0);
    let load = load::fixed_rate(system, args.rate, args.rate_seconds, &refused);
    let (accepted, timeline) = load::watched(system, total, limit, load).await?;
    let mut result = phase.end(system, admin, pool, &accepted, &timeline).await?;
    result.refused = refused.into_inner();
    run.push(result, floor);

    eprintln!("bench: listing and search");
    // Older builds (`--binaries`) may not list at all: their runs simply have no figures.
    match listing::measure(system, pool).await {
        Ok(listing) => run.listing = Some(listing),
        Err(err) => eprintln!("bench: listing not measured: {err:#}"),
    }
    Ok(())
}

/// The raw broker floor, measured now: once before the system starts and again right
/// before each phase, since this machine's floor moves by half within minutes (a ratio to a
/// floor measured minutes earlier measures the drift as much as Conveyor).
async fn broker_floor(messages: usize) -> anyhow::Result<f64> {
    eprintln!("bench: raw broker floor ({messages} messages)");
    let url = testing::amqp_url();
    let rate = tokio::time::timeout(Duration::from_secs(300), floor::broker(&url, messages))
        .await
        .context("the broker floor took over 5 minutes")??;
    eprintln!("bench: {rate:.0} msg/s");
    Ok(rate)
}
