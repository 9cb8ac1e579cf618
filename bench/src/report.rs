//! One run's figures: measured per phase, printed, written as Markdown (the latest run in
//! full, earlier runs as a table) and appended as a JSON line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use conveyor_core::db::Db;
use serde::{Deserialize, Serialize};

use crate::load::{self, Accepted, Timeline};
use crate::system::System;
use crate::usage::{pg_counters, CpuSeconds, PgCounters, StatementCost};

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Run {
    pub date: String,
    pub commit: String,
    pub short: bool,
    pub machine: String,
    pub versions: BTreeMap<String, String>,
    pub settings: serde_json::Value,
    /// PostgreSQL's and RabbitMQ's settings during the run.
    #[serde(default)]
    pub services: BTreeMap<String, String>,
    /// Messages/s: confirmed publish + consume + ack on a quorum queue, no application; the
    /// median of `floor_samples`.
    pub floor_broker: f64,
    /// Every floor measured in this run: before the system started, then before each phase.
    #[serde(default)]
    pub floor_samples: Vec<f64>,
    /// Audit-shaped rows/s, 1000 per statement.
    pub floor_audit_rows: f64,
    pub phases: Vec<PhaseResult>,
    pub peak_rss_mib: BTreeMap<String, f64>,
    /// Where the database's time went, over the whole run.
    #[serde(default)]
    pub statements: Vec<StatementCost>,
    /// Pages of `GET /v1/tasks` over everything the run submitted.
    #[serde(default)]
    pub listing: Option<crate::listing::Listing>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct PhaseResult {
    pub name: String,
    pub accepted: usize,
    /// Submissions answered 429 or 503 (the fixed-rate phase only: the others stop at one).
    #[serde(default)]
    pub refused: usize,
    pub completed_once: usize,
    pub full_chains: usize,
    pub duplicate_completions: usize,
    /// Tasks that ran more than once (allowed: at least once), with a valid longer chain.
    #[serde(default)]
    pub reruns: usize,
    pub seconds: f64,
    /// Tasks/s from the first submit to the last completion.
    pub overall_rate: f64,
    /// Tasks/s between 10 % and 90 % of the completions.
    pub steady_rate: f64,
    pub latency_ms: BTreeMap<String, f64>,
    pub cpu_ms_per_task: BTreeMap<String, f64>,
    pub commits_per_task: f64,
    pub statements_per_task: Option<f64>,
    pub wal_bytes_per_task: f64,
    /// The raw broker floor measured right before this phase (older runs: none, the run's).
    #[serde(default)]
    pub floor_broker: Option<f64>,
}

impl PhaseResult {
    /// The steady rate as a share of the floor measured right before the phase.
    pub fn ratio(&self, run_floor: f64) -> f64 {
        self.steady_rate / self.floor_broker.unwrap_or(run_floor)
    }
}

/// The middle of `samples` (0 for none).
pub fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Counters at the start of a phase.
pub struct Phase {
    name: String,
    cpu: CpuSeconds,
    pg: PgCounters,
}

impl Phase {
    pub async fn begin(name: String, system: &System, admin: &Db) -> anyhow::Result<Phase> {
        Ok(Phase {
            name,
            cpu: system.processes().cpu(),
            pg: pg_counters(admin.pool(), &system.database).await?,
        })
    }

    pub async fn end(
        self,
        system: &System,
        admin: &Db,
        pool: &sqlx::PgPool,
        accepted: &Accepted,
        timeline: &Timeline,
    ) -> anyhow::Result<PhaseResult> {
        let cpu = system.processes().cpu();
        let pg = pg_counters(admin.pool(), &system.database)
            .await?
            .since(self.pg);
        let verdict = load::verify(pool, accepted).await?;
        let n = accepted.len().max(1) as f64;
        let latencies = load::latencies_ms(accepted, &verdict);
        let latency_ms = [("p50", 50.0), ("p99", 99.0), ("max", 100.0)]
            .into_iter()
            .map(|(name, p)| (name.to_owned(), load::percentile(&latencies, p)))
            .collect();
        let cpu_ms_per_task = cpu
            .iter()
            .map(|(group, seconds)| {
                let before = self.cpu.get(group).copied().unwrap_or(0.0);
                ((*group).to_owned(), (seconds - before) * 1000.0 / n)
            })
            .collect();
        let seconds = timeline.seconds();
        Ok(PhaseResult {
            name: self.name,
            accepted: accepted.len(),
            refused: 0,
            completed_once: verdict.completed_once,
            full_chains: verdict.full_chains,
            duplicate_completions: verdict.duplicate_completions,
            reruns: verdict.reruns,
            seconds,
            overall_rate: accepted.len() as f64 / seconds.max(f64::EPSILON),
            steady_rate: timeline.steady_rate(accepted.len() as f64),
            latency_ms,
            cpu_ms_per_task,
            commits_per_task: pg.commits as f64 / n,
            statements_per_task: pg.statements.map(|s| s as f64 / n),
            wal_bytes_per_task: pg.wal_bytes as f64 / n,
            floor_broker: None,
        })
    }
}

fn command(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

impl Run {
    /// A phase's result, with the floor measured right before it.
    pub fn push(&mut self, mut phase: PhaseResult, floor: f64) {
        phase.floor_broker = Some(floor);
        self.floor_samples.push(floor);
        self.phases.push(phase);
    }

    pub async fn describe(short: bool, binaries: PathBuf) -> Run {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
                    .map(|(_, model)| model.trim().to_owned())
            })
            .unwrap_or_default();
        let memory = command("sh", &["-c", "free -g | awk '/Mem:/ {print $2}'"]);
        let mut versions = BTreeMap::new();
        versions.insert("postgresql".to_owned(), command("psql", &["--version"]));
        versions.insert(
            "rabbitmq".to_owned(),
            command(
                "sh",
                &["-c", "dpkg-query -W -f '${Version}' rabbitmq-server"],
            ),
        );
        versions.insert(
            "erlang".to_owned(),
            command("sh", &["-c", "dpkg-query -W -f '${Version}' erlang-base"]),
        );
        versions.insert("rustc".to_owned(), command("rustc", &["--version"]));
        versions.insert("binaries".to_owned(), binaries.display().to_string());
        let head = command("git", &["rev-parse", "--short", "HEAD"]);
        // A run of other binaries (`--binaries`) is not a run of this commit's code.
        let commit = if binaries == crate::system::default_binaries() {
            head
        } else {
            format!("{head} bench, binaries of {}", binaries.display())
        };
        Run {
            date: chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string(),
            commit,
            short,
            machine: format!("{} cores, {memory} GiB, {cpu}", command("nproc", &[])),
            versions,
            ..Run::default()
        }
    }

    fn phase(&self, name: &str) -> Option<&PhaseResult> {
        self.phases.iter().find(|p| p.name.starts_with(name))
    }

    /// What the clients were told that the database contradicts.
    pub fn failures(&self) -> Vec<String> {
        self.phases
            .iter()
            .filter(|p| {
                p.completed_once != p.accepted
                    || p.full_chains != p.accepted
                    || p.duplicate_completions > 0
            })
            .map(|p| {
                format!(
                    "{}: {} accepted, {} completed once, {} full audit chains, {} completed twice",
                    p.name, p.accepted, p.completed_once, p.full_chains, p.duplicate_completions
                )
            })
            .collect()
    }

    pub fn print(&self) {
        eprintln!("{}", self.summary());
    }

    /// The headline: each end-to-end rate beside the floor.
    fn summary(&self) -> String {
        let mut lines = vec![format!(
            "raw broker floor {:.0} msg/s (median of {}: {}); batched audit inserts {:.0} rows/s",
            self.floor_broker,
            self.floor_samples.len(),
            self.floor_samples
                .iter()
                .map(|f| format!("{f:.0}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.floor_audit_rows
        )];
        for p in &self.phases {
            lines.push(format!(
                "{}: {:.0} tasks/s steady ({:.2} of the floor of {:.0} msg/s), p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
                p.name,
                p.steady_rate,
                p.ratio(self.floor_broker),
                p.floor_broker.unwrap_or(self.floor_broker),
                p.latency_ms["p50"],
                p.latency_ms["p99"],
                p.latency_ms["max"]
            ));
        }
        if let Some(listing) = &self.listing {
            let worst = listing
                .timings
                .iter()
                .map(|t| t.ms["p99"])
                .fold(0.0, f64::max);
            lines.push(format!(
                "list and search over {} tasks: {} queries, worst p99 {worst:.1} ms per page",
                listing.tasks,
                listing.timings.len()
            ));
        }
        lines.join("\n")
    }

    /// Writes the Markdown report and appends this run to the JSON lines beside it.
    pub fn write(&self, report: &Path) -> anyhow::Result<()> {
        if let Some(dir) = report.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let jsonl = report.with_extension("jsonl");
        let mut history = std::fs::read_to_string(&jsonl).unwrap_or_default();
        history.push_str(&serde_json::to_string(self)?);
        history.push('\n');
        std::fs::write(&jsonl, &history)?;
        let runs: Vec<Run> = history
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        std::fs::write(report, crate::report::markdown(self, &runs))?;
        Ok(())
    }
}

fn markdown(run: &Run, runs: &[Run]) -> String {
    let mut md = String::new();
    md.push_str("# Benchmarks\n\nWritten by `make bench` (`bench/`); do not edit by hand. ");
    md.push_str(
        "Every figure of one run is measured in that run, on one machine with PostgreSQL and \
         RabbitMQ on it: compare runs by their ratios to the floor, not by absolute rates \
         (this machine's speed varies from day to day, and by half within minutes: the floor \
         is measured again right before each phase, and each phase's ratio is to that \
         floor).\n\n",
    );
    md.push_str(&format!(
        "## Latest run: {} (commit {}){}\n\n",
        run.date,
        run.commit,
        if run.short { ", short" } else { "" }
    ));
    md.push_str(&format!("Machine: {}.  \n", run.machine));
    let versions: Vec<String> = run
        .versions
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    md.push_str(&format!("Versions: {}.  \n", versions.join(", ")));
    md.push_str(&format!("Settings: `{}`.  \n", run.settings));
    let services: Vec<String> = run
        .services
        .iter()
        .map(|(k, v)| format!("{k} `{v}`"))
        .collect();
    md.push_str(&format!("Services: {}.\n\n", services.join(", ")));
    md.push_str("```\n");
    md.push_str(&run.summary());
    md.push_str("\n```\n\n");
    md.push_str("| phase | accepted | refused | completed once, full audit chain | re-runs | steady tasks/s | floor before it, msg/s | ratio to that floor | p50 ms | p99 ms | max ms | commits/task | statements/task | WAL bytes/task |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for p in &run.phases {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.0} | {:.0} | {:.3} | {:.1} | {:.1} | {:.1} | {:.2} | {} | {:.0} |\n",
            p.name,
            p.accepted,
            p.refused,
            p.full_chains.min(p.completed_once),
            p.reruns,
            p.steady_rate,
            p.floor_broker.unwrap_or(run.floor_broker),
            p.ratio(run.floor_broker),
            p.latency_ms["p50"],
            p.latency_ms["p99"],
            p.latency_ms["max"],
            p.commits_per_task,
            p.statements_per_task
                .map_or("n/a".to_owned(), |s| format!("{s:.2}")),
            p.wal_bytes_per_task
        ));
    }
    md.push_str("\nCPU milliseconds per task, by process:\n\n| phase |");
    let groups: Vec<&String> = run
        .phases
        .first()
        .map(|p| p.cpu_ms_per_task.keys().collect())
        .unwrap_or_default();
    for g in &groups {
        md.push_str(&format!(" {g} |"));
    }
    md.push_str("\n|---|");
    md.push_str(&"---|".repeat(groups.len()));
    md.push('\n');
    for p in &run.phases {
        md.push_str(&format!("| {} |", p.name));
        for g in &groups {
            md.push_str(&format!(" {:.3} |", p.cpu_ms_per_task[*g]));
        }
        md.push('\n');
    }
    if let Some(listing) = &run.listing {
        md.push_str(&format!(
            "\nList and search (`GET /v1/tasks`, timed by the client, {} times each) over {} \
             tasks:\n\n| query | tasks on the page | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|\n",
            30, listing.tasks
        ));
        for t in &listing.timings {
            md.push_str(&format!(
                "| `{}` | {} | {:.1} | {:.1} | {:.1} |\n",
                t.query.replace('|', "\\|"),
                t.page,
                t.ms["p50"],
                t.ms["p99"],
                t.ms["max"]
            ));
        }
    }
    md.push_str("\nPeak resident memory (VmHWM), MiB:\n\n");
    for (process, mib) in &run.peak_rss_mib {
        md.push_str(&format!("- {process}: {mib:.1}\n"));
    }
    md.push_str("\nStatements by database time, whole run (pg_stat_statements):\n\n| calls | mean ms | rows/call | total s | plans | mean plan ms | statement |\n|---|---|---|---|---|---|---|\n");
    // Without track_planning, pg_stat_statements' zeros would read as measurements.
    let plannings_counted = run
        .services
        .get(&crate::system::postgres_key(crate::system::TRACK_PLANNING))
        .is_some_and(|v| v == "on");
    for st in &run.statements {
        let (plans, mean_plan_ms) = if plannings_counted {
            (st.plans.to_string(), format!("{:.3}", st.mean_plan_ms))
        } else {
            ("—".to_owned(), "—".to_owned())
        };
        md.push_str(&format!(
            "| {} | {:.3} | {:.1} | {:.1} | {plans} | {mean_plan_ms} | `{}` |\n",
            st.calls,
            st.mean_ms,
            st.rows_per_call,
            st.total_seconds,
            st.query.replace('|', "\\|")
        ));
    }
    md.push_str(
        "\nLatency is from the client's send to the COMPLETED audit row's time (same clock). \
         Completions are counted from the workers' /metrics while a phase runs; the database \
         is read once per phase, after it, to check that every accepted task completed once \
         with its whole audit chain.\n\n## All runs\n\n",
    );
    md.push_str("| date | commit | short | floor msg/s (median of the run's) | batch tasks/s (ratio) | labelled batch tasks/s (ratio) | single tasks/s (ratio), first count | p99 ms at fixed rate |\n|---|---|---|---|---|---|---|---|\n");
    for r in runs.iter().rev() {
        let rate = |name: &str| {
            r.phase(name).map_or("-".to_owned(), |p| {
                format!("{:.0} ({:.3})", p.steady_rate, p.ratio(r.floor_broker))
            })
        };
        let p99 = r
            .phase("fixed rate")
            .map_or("-".to_owned(), |p| format!("{:.1}", p.latency_ms["p99"]));
        md.push_str(&format!(
            "| {} | {} | {} | {:.0} | {} | {} | {} | {} |\n",
            r.date,
            r.commit,
            r.short,
            r.floor_broker,
            rate("batch submits"),
            rate("labelled batch submits"),
            rate("single submits"),
            p99
        ));
    }
    md
}
