//! `make chaos`: runs the scenarios and writes the report.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use conveyor_chaos::report;
use conveyor_chaos::scenarios::{self, Row, Scale, Scenario};

#[derive(Debug, Parser)]
#[command(name = "conveyor-chaos", version)]
struct Args {
    /// Scenarios to run, comma-separated (when absent: every scenario on the single services
    /// and the local cluster, or with --replicated every cluster-scale one).
    #[arg(long, value_delimiter = ',')]
    scenarios: Vec<String>,
    /// The cluster-scale scenarios, against a three-node RabbitMQ cluster and a PostgreSQL
    /// pair (scripts/cluster-services.sh, brought up as they start).
    #[arg(long)]
    replicated: bool,
    /// Tasks per scenario.
    #[arg(long, default_value_t = 1500)]
    tasks: usize,
    /// How long PostgreSQL stays down and a link stays silent, in seconds.
    #[arg(long, default_value_t = 30)]
    outage_seconds: u64,
    /// Where the Markdown report goes (a .jsonl with one line per scenario goes beside it).
    #[arg(long, default_value = "target/chaos/report.md")]
    report: PathBuf,
    /// Process logs, per scenario.
    #[arg(long, default_value = "target/chaos/logs")]
    logs: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Taken before the run: the tree may change while it runs.
    let code = code_version();
    let chosen: Vec<Scenario> = if args.scenarios.is_empty() && args.replicated {
        scenarios::REPLICATED.to_vec()
    } else if args.scenarios.is_empty() {
        scenarios::ALL.to_vec()
    } else {
        args.scenarios
            .iter()
            .map(|name| {
                Scenario::parse(name).with_context(|| {
                    let known: Vec<_> = scenarios::known().map(Scenario::name).collect();
                    format!("unknown scenario {name:?}; known: {}", known.join(", "))
                })
            })
            .collect::<anyhow::Result<_>>()?
    };
    // The report's part: cluster-scale or not (one run is one or the other).
    let replicated = chosen.iter().all(|s| s.replicated());
    anyhow::ensure!(
        replicated || chosen.iter().all(|s| !s.replicated()),
        "run the cluster-scale scenarios apart from the others (they make their own part of the report)"
    );
    let scale = Scale {
        tasks: args.tasks,
        outage: Duration::from_secs(args.outage_seconds),
    };
    let mut rows = Vec::new();
    for scenario in chosen {
        let tasks = scenario.plan(&scale).tasks;
        eprintln!("chaos: {} ({tasks} tasks)", scenario.name());
        // A scenario that could not run to its end is a failed row, not the end of the run:
        // the other scenarios' results are still reported.
        let row = match conveyor_chaos::run::run(scenario, &scale, &args.logs).await {
            Ok(row) => row,
            Err(err) => Row {
                scenario: scenario.name(),
                verdict: Default::default(),
                failures: vec![format!("did not run to its end: {err:#}")],
                telemetry: Default::default(),
                notes: Vec::new(),
            },
        };
        eprintln!("chaos: {} → {:?}", row.scenario, row.failures);
        rows.push(row);
    }
    let command = format!(
        "`conveyor-chaos{} --tasks {} --outage-seconds {}`, {} UTC, code at {}",
        if replicated { " --replicated" } else { "" },
        args.tasks,
        args.outage_seconds,
        chrono_free_now(),
        code
    );
    let header = if replicated {
        format!(
            "{}\n\nAgainst a three-node RabbitMQ cluster and a PostgreSQL primary with a \
             synchronous standby (scripts/cluster-services.sh); recovery counts from the fault \
             (a rolling restart: from its last node's stop).\n\n{command}",
            report::REPLICATED_HEADING
        )
    } else {
        format!("# Chaos report\n\n{command}")
    };
    let table = report::markdown(&rows, &header);
    if let Some(dir) = args.report.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // Each kind of run keeps the other's last results beside its own.
    let existing = std::fs::read_to_string(&args.report).unwrap_or_default();
    std::fs::write(&args.report, report::merged(&existing, &table, replicated))?;
    let lines = args.report.with_extension("jsonl");
    let existing = std::fs::read_to_string(&lines).unwrap_or_default();
    std::fs::write(&lines, report::merged_lines(&existing, &rows, replicated))?;
    println!("{table}");
    let failed: Vec<_> = rows
        .iter()
        .filter(|r| !r.failures.is_empty())
        .map(|r| r.scenario)
        .collect();
    anyhow::ensure!(failed.is_empty(), "scenarios failed: {}", failed.join(", "));
    Ok(())
}

/// The commit the suite ran from (`+changes` when the tree differed from it), so that a
/// report says which code it judged.
fn code_version() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    // The report itself is about to change: it does not count.
    let changed = git(&["status", "--porcelain", "--", ".", ":!docs/chaos-report.*"])
        .is_some_and(|s| !s.is_empty());
    if changed {
        format!("{commit}+changes")
    } else {
        commit
    }
}

/// `date -u` without a date crate.
fn chrono_free_now() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}
