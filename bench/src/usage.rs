//! What each process spent, read from outside: CPU seconds and peak resident memory from
//! `/proc`, and PostgreSQL's own counters (commits, statements, WAL bytes).

use std::collections::BTreeMap;

use anyhow::Context as _;
use conveyor_core::testing::proc_status_mib;
use serde::Serialize;
use sqlx::PgPool;

/// The processes a figure is split by.
#[derive(Debug, Clone)]
pub struct Processes {
    pub gateway: u32,
    pub workers: Vec<u32>,
}

/// CPU seconds so far, by group.
pub type CpuSeconds = BTreeMap<&'static str, f64>;

/// Kernel clock ticks per second (`getconf CLK_TCK`; 100 on Linux everywhere we run).
fn ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(100.0)
}

/// utime + stime (and, with `children`, the reaped children's), in ticks.
fn ticks(pid: u32, children: bool) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: fields are counted after its closing parenthesis.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let own = field(14)? + field(15)?;
    Some(if children {
        own + field(16)? + field(17)?
    } else {
        own
    })
}

fn comm(pid: u32) -> Option<String> {
    Some(
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .ok()?
            .trim()
            .to_owned(),
    )
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The service processes: PostgreSQL's (its backends come and go; a reaped backend's time
/// is in the postmaster's children's time) and RabbitMQ's Erlang VM with its helpers.
fn service_pids() -> (Vec<u32>, Vec<u32>) {
    let mut postgres = Vec::new();
    let mut rabbitmq = Vec::new();
    for pid in all_pids() {
        match comm(pid).as_deref() {
            Some("postgres") => postgres.push(pid),
            Some("beam.smp" | "erl_child_setup" | "epmd" | "inet_gethost") => rabbitmq.push(pid),
            _ => {}
        }
    }
    (postgres, rabbitmq)
}

impl Processes {
    pub fn cpu(&self) -> CpuSeconds {
        let hz = ticks_per_second();
        let sum = |pids: &[u32], children: bool| {
            pids.iter()
                .filter_map(|&pid| ticks(pid, children))
                .sum::<u64>() as f64
                / hz
        };
        let (postgres, rabbitmq) = service_pids();
        let mut cpu = CpuSeconds::new();
        cpu.insert("postgresql", sum(&postgres, true));
        cpu.insert("rabbitmq", sum(&rabbitmq, true));
        cpu.insert("gateway", sum(&[self.gateway], false));
        cpu.insert("workers", sum(&self.workers, false));
        cpu.insert("load generator", sum(&[std::process::id()], false));
        cpu
    }

    /// Peak resident memory (VmHWM) in MiB: the gateway, each worker, the broker's VM, and
    /// the largest PostgreSQL process (shared buffers it touched included).
    pub fn peak_rss_mib(&self) -> BTreeMap<String, f64> {
        let mut peaks = BTreeMap::new();
        peaks.insert("gateway".to_owned(), peak_rss(self.gateway).unwrap_or(0.0));
        for (i, &pid) in self.workers.iter().enumerate() {
            peaks.insert(format!("worker {i}"), peak_rss(pid).unwrap_or(0.0));
        }
        let (postgres, rabbitmq) = service_pids();
        let largest = |pids: &[u32]| pids.iter().filter_map(|&p| peak_rss(p)).fold(0.0, f64::max);
        peaks.insert("rabbitmq".to_owned(), largest(&rabbitmq));
        peaks.insert(
            "postgresql (largest process)".to_owned(),
            largest(&postgres),
        );
        peaks
    }
}

/// PostgreSQL's counters for one database (WAL is the whole cluster's: the bench runs on a
/// quiet machine).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PgCounters {
    pub commits: i64,
    /// Statements executed (pg_stat_statements; `None` where it is not loaded).
    pub statements: Option<i64>,
    pub wal_bytes: i64,
}

pub async fn pg_counters(admin: &PgPool, database: &str) -> anyhow::Result<PgCounters> {
    // A fresh snapshot: statistics are otherwise cached for the transaction.
    let (commits, wal_bytes): (i64, i64) = sqlx::query_as(
        "SELECT xact_commit, pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint
         FROM pg_stat_database WHERE datname = $1",
    )
    .bind(database)
    .fetch_one(admin)
    .await
    .context("read pg_stat_database")?;
    let statements: Option<i64> = sqlx::query_scalar(
        "SELECT sum(calls)::bigint FROM pg_stat_statements s
         JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1",
    )
    .bind(database)
    .fetch_one(admin)
    .await
    .ok()
    .flatten();
    Ok(PgCounters {
        commits,
        statements,
        wal_bytes,
    })
}

impl PgCounters {
    pub fn since(self, before: PgCounters) -> PgCounters {
        PgCounters {
            commits: self.commits - before.commits,
            statements: self.statements.zip(before.statements).map(|(a, b)| a - b),
            wal_bytes: self.wal_bytes - before.wal_bytes,
        }
    }
}

/// One statement's share of the database's time over the whole run (pg_stat_statements).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct StatementCost {
    pub query: String,
    pub calls: i64,
    pub mean_ms: f64,
    pub rows_per_call: f64,
    pub total_seconds: f64,
    /// Plannings and their mean time (0 unless pg_stat_statements.track_planning is on).
    #[serde(default)]
    pub plans: i64,
    #[serde(default)]
    pub mean_plan_ms: f64,
}

/// The statements that took the most time in `database` (a fresh database per run, so its
/// statistics are this run's). Empty where pg_stat_statements is not loaded.
pub async fn statement_costs(admin: &PgPool, database: &str) -> Vec<StatementCost> {
    let rows: Vec<(String, i64, f64, i64, f64, i64, f64)> = sqlx::query_as(
        "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 120), calls,
                total_exec_time / greatest(calls, 1), rows, total_exec_time / 1000, plans,
                mean_plan_time
         FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
         WHERE d.datname = $1 ORDER BY total_exec_time DESC LIMIT 10",
    )
    .bind(database)
    .fetch_all(admin)
    .await
    .unwrap_or_default();
    rows.into_iter()
        .map(
            |(query, calls, mean_ms, rows, total_seconds, plans, mean_plan_ms)| StatementCost {
                query,
                calls,
                mean_ms,
                rows_per_call: rows as f64 / calls.max(1) as f64,
                total_seconds,
                plans,
                mean_plan_ms,
            },
        )
        .collect()
}

/// Peak resident memory (VmHWM), in MiB.
fn peak_rss(pid: u32) -> Option<f64> {
    proc_status_mib(pid, "VmHWM")
}
