//! The soak's report: what held (the verdict, the stalls, flatness from the first quarter
//! of the run to the last, bounded tables) and the samples over time, as Markdown, with a
//! JSON line per run beside it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::calendar::Boundary;
use crate::fleet::Operator;
use crate::judge::Verdict;
use crate::load::{Told, Window};
use crate::observe::{Database, Latency, MemoryParts};

mod memory;
mod tables;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    pub elapsed_s: f64,
    pub day: u32,
    pub window: Window,
    /// Completions per second over the window.
    pub throughput: f64,
    pub latency: Latency,
    pub database: Database,
    pub memory_mib: BTreeMap<String, f64>,
    /// What the services' memory is made of (absent from runs before it was sampled).
    #[serde(default)]
    pub memory_parts: MemoryParts,
    /// The local stack's operator, when it runs.
    pub operator: Option<Operator>,
}

#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Run {
    pub started: String,
    pub commit: String,
    pub short: bool,
    pub settings: serde_json::Value,
    pub samples: Vec<Sample>,
    pub boundaries: Vec<Boundary>,
    pub restarts: Vec<String>,
    pub verdict: Verdict,
    pub refusals: BTreeMap<u16, usize>,
    pub slowest_submit_ms: u64,
    pub submits_over_one_second: usize,
    pub longest_gap_ms: u64,
    /// Tasks still open when the wait for quiet ended.
    pub open_after_quiet: i64,
    /// From when the first settled tasks have expired (their retention and one pass).
    pub retention_reached_s: f64,
    /// When the fleet last grew (0: it never did, or does not run).
    pub fleet_steady_s: f64,
    /// The operator once the load stopped.
    pub operator_end: Option<Operator>,
    /// The commit whose report code judged these figures again (`--rejudge`), if any.
    #[serde(skip)]
    pub rejudged_by: Option<String>,
}

impl Run {
    pub fn told(&mut self, told: &Told) {
        self.refusals = told.refusals.clone();
        self.slowest_submit_ms = told.slowest_ms;
        self.submits_over_one_second = told.over_one_second;
        self.longest_gap_ms = told.longest_gap_ms;
    }

    /// What failed: what the clients were told did not happen. Times are reported, never
    /// asserted (this machine is noisy); they are judged in the report's table.
    pub fn failures(&self) -> Vec<String> {
        let mut failures = self.verdict.failures();
        let expired_by_now = self
            .samples
            .last()
            .is_some_and(|s| s.elapsed_s >= self.retention_reached_s);
        if expired_by_now && self.verdict.archived == 0 {
            failures.push("no settled task expired into the archive (a gateway without --retention-day-seconds?)".to_owned());
        }
        failures
    }

    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, self.markdown())?;
        let mut line = serde_json::to_string(self)?;
        line.push('\n');
        let jsonl = path.with_extension("jsonl");
        let mut old = std::fs::read_to_string(&jsonl).unwrap_or_default();
        old.push_str(&line);
        std::fs::write(jsonl, old)?;
        Ok(())
    }

    /// Writes the report of the last run in `jsonl` to `path` again, judged by this build's
    /// report code (the figures are the run's own).
    pub fn rejudge(jsonl: &Path, path: &Path, by: String) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let text = std::fs::read_to_string(jsonl).with_context(|| format!("read {jsonl:?}"))?;
        let last = text
            .lines()
            .last()
            .with_context(|| format!("no run in {jsonl:?}"))?;
        let mut run: Run = serde_json::from_str(last).context("a run's line")?;
        run.rejudged_by = Some(by);
        std::fs::write(path, run.markdown())?;
        Ok(())
    }

    fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "# Soak report\n");
        let _ = writeln!(
            md,
            "Written by `make soak` (`conveyor-soak`) on {}, commit {}{}{}. Settings: `{}`.\n",
            self.started,
            self.commit,
            if self.short { ", short variant" } else { "" },
            self.rejudged_by
                .as_ref()
                .map(|by| format!("; judged again by the report code of commit {by} (`--rejudge`)"))
                .unwrap_or_default(),
            self.settings
        );
        let v = &self.verdict;
        let _ = writeln!(md, "## Verdict\n");
        let _ = writeln!(md, "| submitted | accepted | healthy COMPLETED | failing ones DEAD_LETTER | archived (expired) | lost | stranded | healthy dead-lettered | failing COMPLETED | completed without effect | duplicate effects | re-runs |");
        let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        let figures = [
            v.submitted,
            v.accepted,
            v.completed,
            v.poison_dead_lettered,
            v.archived,
            v.lost,
            v.stranded,
            v.dead_lettered,
            v.poison_completed,
            v.completed_without_effect,
            v.duplicate_side_effects,
            v.reruns,
        ];
        let figures: Vec<String> = figures.iter().map(ToString::to_string).collect();
        let _ = writeln!(md, "| {} |\n", figures.join(" | "));
        let _ = writeln!(md, "## What held\n");
        let _ = writeln!(md, "| criterion | measured | holds |");
        let _ = writeln!(md, "|---|---|---|");
        let row = |md: &mut String, what: &str, measured: String, holds: bool| {
            let _ = writeln!(
                md,
                "| {what} | {measured} | {} |",
                if holds { "yes" } else { "**no**" }
            );
        };
        row(
            &mut md,
            "0 lost, 0 stranded",
            format!("{} lost, {} stranded", v.lost, v.stranded),
            v.lost == 0 && v.stranded == 0,
        );
        row(
            &mut md,
            "no window where submissions stop for longer than a second",
            format!(
                "slowest answer {} ms, {} answers over 1 s, longest gap between acceptances {} ms",
                self.slowest_submit_ms, self.submits_over_one_second, self.longest_gap_ms
            ),
            self.submits_over_one_second == 0 && self.longest_gap_ms <= 1000,
        );
        let (first, last) = self.quarters();
        // Windows in which nothing completed have no latency: left out, not counted as 0.
        let p99 = |s: &[&Sample]| {
            mean(
                s.iter()
                    .filter(|s| s.latency.completed > 0)
                    .map(|s| s.latency.p99_ms),
            )
        };
        flat(
            &mut md,
            "p99 submit → COMPLETED (mean of the windows' p99)",
            "ms",
            p99(&first),
            p99(&last),
        );
        if let (Some(_), Some(b)) = (first.first(), last.last()) {
            // The broker's memory, the gateway's and the operator's follow the fleet (queues,
            // each type's compiled schema and limits, objects): judged on the part of the run
            // after the fleet stopped growing.
            let (steady_first, steady_last) = self.steady_quarters();
            // PostgreSQL's shared buffers are fixed in size (`shared_buffers`) and touched as
            // the data grows: shown over time below, not a leak they could show.
            for name in b.memory_mib.keys().filter(|name| *name != SHARED_BUFFERS) {
                let rss =
                    |s: &[&Sample]| mean(s.iter().filter_map(|s| s.memory_mib.get(name).copied()));
                let (over, early, late) = match FOLLOWS_THE_FLEET.contains(&name.as_str()) {
                    true => (STEADY, &steady_first, &steady_last),
                    false => (WHOLE_RUN, &first, &last),
                };
                flat_over(
                    &mut md,
                    &format!("memory of {name}"),
                    over,
                    "MiB",
                    rss(early),
                    rss(late),
                );
            }
            let operator = |s: &[&Sample]| {
                mean(
                    s.iter()
                        .filter_map(|s| s.operator.as_ref())
                        .map(|o| o.rss_mib)
                        .filter(|mib| *mib > 0.0),
                )
            };
            if b.operator.is_some() {
                flat_over(
                    &mut md,
                    "memory of the operator",
                    STEADY,
                    "MiB",
                    operator(&steady_first),
                    operator(&steady_last),
                );
            }
            let size = |s: &Sample| s.database.tasks.data_mib + s.database.tasks.index_mib;
            let reached = self
                .samples
                .iter()
                .find(|s| s.elapsed_s >= self.retention_reached_s);
            let Some(a) = reached.filter(|a| a.elapsed_s < b.elapsed_s) else {
                row(
                    &mut md,
                    "`tasks` bounded by the settled-task retention",
                    "retention not reached in this run".to_owned(),
                    false,
                );
                return self.rest(md);
            };
            // Index rebuilds make the size a sawtooth: the peak of each simulated day after
            // the retention was reached, and the trend of those peaks (least squares) over
            // the run, which a slow growth cannot hide from.
            let mut peaks: BTreeMap<u32, (f64, i64)> = BTreeMap::new();
            for s in self.samples.iter().filter(|s| s.elapsed_s >= a.elapsed_s) {
                let peak = peaks.entry(s.day).or_insert((0.0, 0));
                peak.0 = peak.0.max(size(s));
                peak.1 = peak.1.max(s.database.tasks.rows);
            }
            let days: Vec<(f64, f64)> = peaks.iter().map(|(d, p)| (f64::from(*d), p.0)).collect();
            let rows: Vec<(f64, f64)> = peaks
                .iter()
                .map(|(d, p)| (f64::from(*d), p.1 as f64))
                .collect();
            let span = days.last().map_or(0.0, |l| l.0) - days.first().map_or(0.0, |f| f.0);
            let growth = |points: &[(f64, f64)]| {
                let mean_size = mean(points.iter().map(|p| p.1));
                let over_run = slope(points) * span;
                (
                    over_run,
                    over_run / mean_size.max(f64::MIN_POSITIVE) * 100.0,
                )
            };
            let (mib, percent) = growth(&days);
            let (_, rows_percent) = growth(&rows);
            row(
                &mut md,
                "`tasks` (rows and indexes) bounded by the settled-task retention: the trend of each day's peak size after it was reached, over the run, within 20 %",
                format!(
                    "{:.1} MiB, {} rows → {:.1} MiB, {} rows; daily peaks {}; trend {mib:+.1} MiB ({percent:+.0} %) over {span:.0} days, rows {rows_percent:+.0} %",
                    size(a),
                    a.database.tasks.rows,
                    size(b),
                    b.database.tasks.rows,
                    days.iter()
                        .map(|(_, mib)| format!("{mib:.1}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                ),
                days.len() >= 3 && percent.abs() <= 20.0 && rows_percent.abs() <= 20.0,
            );
        }
        self.rest(md)
    }

    /// The report after its table of what held.
    fn rest(&self, mut md: String) -> String {
        let _ = writeln!(
            md,
            "\nRefusals by status (retried with the same key): {:?}.\n",
            self.refusals
        );
        let _ = writeln!(md, "## Day boundaries\n");
        let _ = writeln!(md, "A dump and a transaction reading the log for a third of a day start half a second before each boundary's partition upkeep, which waits at most 100 ms per lock and tries again every second.\n");
        let _ = writeln!(md, "| day | date | partitions made | dropped | upkeep done after ms (tries) | pg_dump ms |");
        let _ = writeln!(md, "|---|---|---|---|---|---|");
        for b in &self.boundaries {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {}{} ({}) | {}{} |",
                b.day,
                b.date,
                b.made,
                b.dropped,
                b.upkeep_ms,
                if b.done {
                    ""
                } else {
                    ", **not done by the day's end**"
                },
                b.tries,
                b.dump_ms,
                if b.dump_ok { "" } else { " (failed)" }
            );
        }
        let _ = writeln!(
            md,
            "\nRestarts: {}.\n",
            if self.restarts.is_empty() {
                "none".to_owned()
            } else {
                self.restarts.join("; ")
            }
        );
        self.index_table(&mut md);
        self.operator_table(&mut md);
        self.memory_parts_table(&mut md);
        let _ = writeln!(md, "## Over time\n");
        let names: Vec<&String> = self
            .samples
            .last()
            .map(|s| s.memory_mib.keys().collect())
            .unwrap_or_default();
        let _ = write!(md, "| s | day | done/s | p50 ms | p99 ms | slowest submit ms | tasks MiB (rows) | task_events MiB (rows) | kept MiB (rows) | dead tuples tasks / events | autovacuums | partitions | open > 1 min |");
        for name in &names {
            let _ = write!(md, " {name} MiB |");
        }
        let _ = writeln!(md);
        let _ = writeln!(md, "|{}", "---|".repeat(13 + names.len()));
        for s in &self.samples {
            let d = &s.database;
            let _ = write!(
                md,
                "| {:.0} | {} | {:.1} | {:.0} | {:.0} | {} | {:.1} ({}) | {:.1} ({}) | {:.1} ({}) | {} / {} | {} | {} | {} |",
                s.elapsed_s, s.day, s.throughput, s.latency.p50_ms, s.latency.p99_ms,
                s.window.slowest_ms,
                d.tasks.data_mib + d.tasks.index_mib, d.tasks.rows,
                d.task_events.data_mib + d.task_events.index_mib, d.task_events.rows,
                d.task_events_kept.data_mib + d.task_events_kept.index_mib, d.task_events_kept.rows,
                d.tasks.dead_rows, d.task_events.dead_rows,
                d.tasks.autovacuums + d.task_events.autovacuums, d.partitions, d.open_over_a_minute
            );
            for name in &names {
                let _ = write!(
                    md,
                    " {:.1} |",
                    s.memory_mib.get(*name).copied().unwrap_or(0.0)
                );
            }
            let _ = writeln!(md);
        }
        md
    }

    /// The samples of the first and the last quarter of the run, the first sample (warm-up)
    /// left out.
    fn quarters(&self) -> (Vec<&Sample>, Vec<&Sample>) {
        let measured: Vec<&Sample> = self.samples.iter().skip(1).collect();
        first_and_last_quarter(measured)
    }

    /// The first and last quarters of the samples taken after the fleet last grew (a
    /// sample later, for the new objects to settle); the whole run's when it never grew.
    fn steady_quarters(&self) -> (Vec<&Sample>, Vec<&Sample>) {
        if self.fleet_steady_s <= 0.0 {
            return self.quarters();
        }
        let steady: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.elapsed_s >= self.fleet_steady_s)
            .skip(1)
            .collect();
        first_and_last_quarter(steady)
    }
}

/// The memory that is PostgreSQL's shared buffers (its proportional share, by process).
pub const SHARED_BUFFERS: &str = "postgresql shared buffers";
/// The rest of PostgreSQL's memory: its processes' own (their proportional share).
pub const POSTGRES_ASIDE: &str = "postgresql, shared buffers aside";
/// Processes whose memory follows the fleet's size.
const FOLLOWS_THE_FLEET: &[&str] = &["rabbitmq", "gateway"];
const STEADY: &str = "first quarter → last, after the fleet stopped growing";
const WHOLE_RUN: &str = "first quarter → last";

/// Empty (not measured) with fewer than eight samples: two a window at least, and never
/// one sample compared with itself.
fn first_and_last_quarter(measured: Vec<&Sample>) -> (Vec<&Sample>, Vec<&Sample>) {
    if measured.len() < 8 {
        return (Vec::new(), Vec::new());
    }
    let quarter = measured.len() / 4;
    let first = measured.iter().take(quarter).copied().collect();
    let last = measured.iter().rev().take(quarter).rev().copied().collect();
    (first, last)
}

/// The least-squares slope of `points` (x, y); 0 for fewer than two distinct x.
fn slope(points: &[(f64, f64)]) -> f64 {
    let mx = mean(points.iter().map(|p| p.0));
    let my = mean(points.iter().map(|p| p.1));
    let (num, den) = points.iter().fold((0.0, 0.0), |(num, den), (x, y)| {
        (num + (x - mx) * (y - my), den + (x - mx) * (x - mx))
    });
    if den == 0.0 {
        0.0
    } else {
        num / den
    }
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        0.0
    } else {
        sum / f64::from(n)
    }
}

/// A row of the table of what held: `what` flat within 20 % from the first quarter of the
/// run to the last (not measured, a zero or an unreadable figure, holds nothing).
fn flat(md: &mut String, what: &str, unit: &str, first: f64, last: f64) {
    flat_over(md, what, WHOLE_RUN, unit, first, last);
}

/// [`flat`] over the windows `over` names.
fn flat_over(md: &mut String, what: &str, over: &str, unit: &str, first: f64, last: f64) {
    let (measured, holds) = if first > 0.0 && last > 0.0 {
        let change = (last - first) / first * 100.0;
        let measured = format!("{first:.1} {unit} → {last:.1} {unit} ({change:+.0} %)");
        (measured, change.abs() <= 20.0)
    } else {
        ("not measured".to_owned(), false)
    };
    let holds = if holds { "yes" } else { "**no**" };
    let _ = writeln!(
        md,
        "| {what} flat within 20 % ({over}) | {measured} | {holds} |"
    );
}
