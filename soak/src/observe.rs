//! What the soak samples while it runs, all from outside the product's processes: their
//! memory from `/proc`, PostgreSQL's view of the tables (sizes, dead tuples, autovacuum),
//! what the services' memory is made of (PostgreSQL's processes, RabbitMQ's own breakdown),
//! and the latency of the tasks that completed since the last sample. All the soak's SQL is
//! here.

use std::collections::BTreeMap;

use conveyor_core::db::Db;
use std::time::Duration;

use conveyor_core::testing::{management_url, proc_file_fields_mib, proc_status_mib};

/// Sizes and upkeep of one table (with its partitions), in MiB.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Table {
    pub data_mib: f64,
    pub index_mib: f64,
    pub rows: i64,
    pub dead_rows: i64,
    /// Autovacuum and autoanalyze runs so far.
    pub autovacuums: i64,
    pub autoanalyzes: i64,
}

#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct Database {
    pub tasks: Table,
    pub task_events: Table,
    /// The history of open tasks that retention kept past their day (decision 0042).
    #[serde(default)]
    pub task_events_kept: Table,
    /// Partitions of the audit log, the default one included.
    pub partitions: i64,
    /// Tasks neither COMPLETED, CANCELLED nor DEAD_LETTER that were created over a minute
    /// ago (a healthy one is done within a second here).
    pub open_over_a_minute: i64,
    /// Each index of `tasks`, in MiB: which of them grows, if the table does.
    pub tasks_indexes: BTreeMap<String, f64>,
}

/// Submit → COMPLETED of the tasks completed in a window, in milliseconds.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Latency {
    pub completed: i64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

pub async fn database(db: &Db) -> anyhow::Result<Database> {
    let mut tasks = table(db, "tasks").await?;
    let mut task_events = table(db, "task_events").await?;
    let mut task_events_kept = table(db, "task_events_kept").await?;
    // Counted, not estimated: the statistics lag behind by an autovacuum.
    (tasks.rows, task_events.rows, task_events_kept.rows) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM tasks), (SELECT count(*) FROM task_events),
                (SELECT count(*) FROM task_events_kept)",
    )
    .fetch_one(db.pool())
    .await?;
    let partitions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_partition_tree('task_events') WHERE isleaf")
            .fetch_one(db.pool())
            .await?;
    let open_over_a_minute: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tasks
         WHERE state NOT IN ('COMPLETED', 'CANCELLED', 'DEAD_LETTER')
           AND created_at < now() - interval '1 minute'",
    )
    .fetch_one(db.pool())
    .await?;
    Ok(Database {
        tasks,
        task_events,
        task_events_kept,
        partitions,
        open_over_a_minute,
        tasks_indexes: indexes(db, "tasks").await?,
    })
}

/// The size of each index of a plain table and of its TOAST table, in MiB.
async fn indexes(db: &Db, table: &str) -> anyhow::Result<BTreeMap<String, f64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)
         FROM pg_index WHERE indisvalid AND indrelid IN (SELECT oid FROM pg_class WHERE oid = $1::regclass
                                          UNION ALL
                                          SELECT reltoastrelid FROM pg_class WHERE oid = $1::regclass)",
    )
    .bind(table)
    .fetch_all(db.pool())
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, bytes)| (name, bytes as f64 / (1024.0 * 1024.0)))
        .collect())
}

/// A table with every partition it has.
async fn table(db: &Db, name: &str) -> anyhow::Result<Table> {
    let (data, index, dead, vacuums, analyzes): (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(pg_table_size(t.relid)), 0)::int8,
                    coalesce(sum(pg_indexes_size(t.relid)), 0)::int8,
                    coalesce(sum(s.n_dead_tup), 0)::int8,
                    coalesce(sum(s.autovacuum_count), 0)::int8,
                    coalesce(sum(s.autoanalyze_count), 0)::int8
             FROM (SELECT relid FROM pg_partition_tree($1::regclass) WHERE isleaf
                   UNION  -- a plain table has no tree: it is its own leaf
                   SELECT oid FROM pg_class WHERE oid = $1::regclass AND relkind = 'r') t
             LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid",
    )
    .bind(name)
    .fetch_one(db.pool())
    .await?;
    let mib = |bytes: i64| bytes as f64 / (1024.0 * 1024.0);
    Ok(Table {
        data_mib: mib(data),
        index_mib: mib(index),
        rows: 0,
        dead_rows: dead,
        autovacuums: vacuums,
        autoanalyzes: analyzes,
    })
}

/// Submit → COMPLETED of the tasks that completed in the last `seconds`, from the rows'
/// own times (created at the gateway's insert, updated by the completion).
pub async fn latency(db: &Db, seconds: f64) -> anyhow::Result<Latency> {
    let (completed, p50, p99): (i64, Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY ms),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)
         FROM (SELECT extract(epoch FROM updated_at - created_at) * 1000 AS ms FROM tasks
               WHERE state = 'COMPLETED'
                 AND updated_at > now() - make_interval(secs => $1)) done",
    )
    .bind(seconds)
    .fetch_one(db.pool())
    .await?;
    Ok(Latency {
        completed,
        p50_ms: p50.unwrap_or(0.0),
        p99_ms: p99.unwrap_or(0.0),
    })
}

/// Resident memory by process, in MiB: each of Conveyor's by name, and PostgreSQL's and
/// RabbitMQ's as their proportional share (shared memory counted once across processes).
/// PostgreSQL's shared buffers are apart from the rest of its memory: they fill as the data
/// is touched, up to their configured size, and would hide a leak in the backends.
pub fn memory(conveyor: &[(String, u32)]) -> BTreeMap<String, f64> {
    let mut mib: BTreeMap<String, f64> = conveyor
        .iter()
        .map(|(name, pid)| (name.clone(), proc_status_mib(*pid, "VmRSS").unwrap_or(0.0)))
        .collect();
    // Both fields of a process from one read, so that a backend that ends between two reads
    // cannot make the rest come out negative.
    let (mut pss, mut shared) = (0.0, 0.0);
    for pid in pids_named(&["postgres"]) {
        if let (Some(all), Some(shmem)) = pss_and_shmem_mib(pid) {
            pss += all;
            shared += shmem;
        }
    }
    mib.insert(crate::report::POSTGRES_ASIDE.to_owned(), pss - shared);
    mib.insert(crate::report::SHARED_BUFFERS.to_owned(), shared);
    let rabbitmq = pids_named(&["beam.smp", "epmd", "erl_child_setup", "inet_gethost"]);
    let broker = rabbitmq
        .into_iter()
        .filter_map(|pid| pss_and_shmem_mib(pid).0);
    mib.insert("rabbitmq".to_owned(), broker.sum());
    mib
}

/// What PostgreSQL's and RabbitMQ's memory is made of, so that a growth can be placed: the
/// count of PostgreSQL's processes (a backend per open connection, beside its own few) and
/// RabbitMQ's own breakdown by category, in MiB.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct MemoryParts {
    pub postgresql_processes: usize,
    /// The server's connections by who opened them (`application_name`, which each of
    /// Conveyor's pools sets to its process and role; else the backend's type): which client
    /// the processes above belong to.
    #[serde(default)]
    pub postgresql_connections: BTreeMap<String, i64>,
    /// Empty when the management API did not answer.
    pub rabbitmq_mib: BTreeMap<String, f64>,
}

pub async fn memory_parts(db: &Db, http: &reqwest::Client) -> MemoryParts {
    let connections = sqlx::query_as(
        "SELECT coalesce(nullif(application_name, ''), backend_type, 'the server''s own or hidden'), count(*)
           FROM pg_stat_activity GROUP BY 1",
    )
    .fetch_all(db.pool())
    .await;
    MemoryParts {
        postgresql_processes: pids_named(&["postgres"]).len(),
        postgresql_connections: connections.unwrap_or_default().into_iter().collect(),
        rabbitmq_mib: rabbitmq_breakdown(http).await.unwrap_or_default(),
    }
}

/// The node's memory by category (`rabbitmq-diagnostics memory_breakdown`), from the
/// management API: the node's name from the overview, then its breakdown in bytes.
async fn rabbitmq_breakdown(http: &reqwest::Client) -> Option<BTreeMap<String, f64>> {
    let get = |path: String| async move {
        let url = format!("{}{path}", management_url());
        let answer = http.get(url).timeout(Duration::from_secs(5)).send().await;
        answer
            .ok()?
            .error_for_status()
            .ok()?
            .json::<serde_json::Value>()
            .await
            .ok()
    };
    let overview = get("/api/overview?columns=node".to_owned()).await?;
    let node = overview.get("node")?.as_str()?.to_owned();
    let memory = get(format!("/api/nodes/{node}/memory")).await?;
    // Categories are numbers; `total` (an object of three measures) and `strategy` are not.
    let categories = memory.get("memory")?.as_object()?;
    Some(
        categories
            .iter()
            .filter_map(|(name, bytes)| Some((name.clone(), bytes.as_f64()? / MIB)))
            .collect(),
    )
}

const MIB: f64 = 1024.0 * 1024.0;

fn pids_named(comms: &[&str]) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| comms.contains(&c.trim()))
        })
        .collect()
}

/// `Pss` and `Pss_Shmem` of `/proc/<pid>/smaps_rollup`, in MiB, from one read.
fn pss_and_shmem_mib(pid: u32) -> (Option<f64>, Option<f64>) {
    match proc_file_fields_mib(pid, "smaps_rollup", &["Pss", "Pss_Shmem"]).as_deref() {
        Some([pss, shmem]) => (*pss, *shmem),
        _ => (None, None),
    }
}
