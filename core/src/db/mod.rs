//! The Postgres layer: every SQL statement Conveyor runs is in this module.
//!
//! Audit events are ordered by `(at, seq)`; events written by one statement share `at`, so
//! they are inserted from an ordered subquery, which makes `seq` follow the lifecycle order
//! (a plain `INSERT ... SELECT ... ORDER BY` draws the sequence before sorting).
//!
//! Writes that change `tasks.state` append their audit events in the same statement or
//! transaction, so the current row and its history never disagree. Hot-path writes (insert,
//! mark queued, claim, complete) are single statements over arrays, so that a batch of tasks
//! costs one round trip. Re-queues keep their transaction open while the caller publishes
//! the next message ([`PendingRequeue`]): a consumer of that message blocks on the row lock
//! until the commit, and a crash before it rolls the row back for the reaper to find.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{PgPool, Postgres, Row, Transaction};
use uuid::Uuid;

use crate::lifecycle::{self, TaskState};
use crate::task::{NewTask, TaskEvent, TaskRecord};

use TaskState::*;

mod error;
mod grants;
mod partitions;
mod reads;
mod requeue;
mod sweep;
mod tenancy;

pub use error::{DbError, DbResult};
pub use grants::{ComponentRole, TenantRole, DEFAULT_GATEWAY_ROLE};
use requeue::{advance, BackToWork, RetryBudget};
pub use requeue::{PendingRequeue, Requeued};
pub use sweep::{OrphanRule, ProbePolicy, MAX_PROBES_ON_THE_WAY};

/// Outcome of recording one submitted task.
#[derive(Debug, Clone)]
pub enum Recorded {
    /// A new task.
    Created(TaskRecord),
    /// The idempotency key was known: the task recorded earlier.
    Existing(TaskRecord),
}

impl Recorded {
    pub fn task(&self) -> &TaskRecord {
        match self {
            Recorded::Created(task) | Recorded::Existing(task) => task,
        }
    }
}

/// An audit event to append.
#[derive(Debug, Clone)]
struct EventRow {
    task_id: Uuid,
    task_type: String,
    from: TaskState,
    to: TaskState,
    attempt: i32,
    worker_id: Option<String>,
    detail: Option<String>,
}

/// How far ahead audit partitions are made; the upkeep loop renews them hourly.
pub const PARTITION_DAYS_AHEAD: i32 = 14;

const TASK_COLUMNS: &str = "id, tenant, idempotency_key, task_type, state, attempt, retries, \
                            owner, payload, result, error, created_at, updated_at, suspect";

/// Connection settings for [`Db::connect`].
#[derive(Debug, Clone)]
pub struct DbOptions {
    pub url: String,
    pub max_connections: u32,
    pub acquire_timeout: Duration,
    /// The server cancels a statement that runs longer (`statement_timeout`). Set it at or
    /// below the caller's own timeout: a call the client gave up on must not commit later.
    pub statement_timeout: Option<Duration>,
}

impl DbOptions {
    pub fn new(url: impl Into<String>) -> Self {
        DbOptions {
            url: url.into(),
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Some(Duration::from_secs(30)),
        }
    }
}

/// libpq's `sslmode`s below `verify-ca` do not check the server's certificate (`prefer`,
/// the default, even falls back to plaintext). Honoured, since a URL is the operator's
/// choice, but never silently.
fn warn_if_unverified(url: &str) {
    let mode = crate::urls::query_param(url, "sslmode").unwrap_or_else(|| "prefer".to_owned());
    if !matches!(mode.as_str(), "verify-full" | "verify-ca") {
        tracing::warn!(
            sslmode = mode,
            "the database's certificate is not verified: use sslmode=verify-full"
        );
    }
}

/// The task database.
#[derive(Clone)]
pub struct Db {
    pool: PgPool,
    /// One connection, opened on use, without the statement timeout: a migration or a
    /// partition's rescue may legitimately run long on a big table.
    maintenance: PgPool,
}

impl Db {
    /// Connects lazily: the pool opens connections on first use, so a process can start (and
    /// report not-ready) while the database is down.
    pub fn connect(options: &DbOptions) -> DbResult<Db> {
        // sqlx reads `sslrootcert` only at the first connection, and reports a missing file
        // without its name: check it here, at start.
        crate::tls::url_ca(&options.url, "sslrootcert").map_err(DbError::Tls)?;
        warn_if_unverified(&options.url);
        // A session stuck between BEGIN and COMMIT (a worker frozen mid re-queue) must not
        // hold its row locks forever.
        let base = PgConnectOptions::from_str(&options.url)
            .map_err(DbError::Url)?
            .options([("idle_in_transaction_session_timeout", "30s")]);
        let connect = match options.statement_timeout {
            Some(timeout) => {
                let millis = timeout.as_millis().max(1).to_string() + "ms";
                base.clone()
                    .options([("statement_timeout", millis.as_str())])
            }
            None => base.clone(),
        };
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            .connect_lazy_with(connect);
        let maintenance = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .idle_timeout(Duration::from_secs(60))
            .acquire_timeout(options.acquire_timeout)
            .connect_lazy_with(base.options([("statement_timeout", "0")]));
        Ok(Db { pool, maintenance })
    }

    pub async fn migrate(&self) -> DbResult<()> {
        sqlx::migrate!("../migrations")
            .run(&self.maintenance)
            .await
            .map_err(DbError::Migrate)?;
        self.ensure_partitions().await
    }

    /// Migrates where this role owns the schema. A role that owns nothing (decision 0015)
    /// is refused; then the schema must already hold every migration, applied by its owner.
    pub async fn migrate_or_check(&self) -> DbResult<()> {
        match self.migrate().await {
            Err(err) if err.is_permission_denied() => {
                tracing::info!("this role may not migrate; checking the schema instead");
                self.check_schema().await
            }
            migrated => migrated,
        }
    }

    /// For a process that does not migrate: the schema must hold every migration this
    /// build knows.
    pub async fn check_schema(&self) -> DbResult<()> {
        let needed = sqlx::migrate!("../migrations")
            .iter()
            .map(|migration| migration.version)
            .max()
            .unwrap_or(0);
        let applied: Option<i64> =
            sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
                .fetch_one(&self.pool)
                .await?;
        match applied {
            Some(version) if version >= needed => Ok(()),
            applied => Err(DbError::SchemaBehind { applied, needed }),
        }
    }

    /// Creates the audit log's upcoming daily partitions (two weeks ahead) and rescues rows
    /// that landed in the default partition.
    pub async fn ensure_partitions(&self) -> DbResult<()> {
        self.ensure_partitions_around(PARTITION_DAYS_AHEAD, None)
            .await
            .map(drop)
    }

    /// Drops audit partitions older than `keep_days`; returns their names.
    pub async fn drop_partitions(&self, keep_days: i32) -> DbResult<Vec<String>> {
        self.drop_partitions_before(keep_days, None).await
    }

    pub async fn ping(&self) -> DbResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Records submitted tasks as INGESTED in one statement. A key its tenant already used
    /// yields the task recorded before, in input order (keys are unique per tenant).
    pub async fn record_tasks(&self, tasks: &[NewTask]) -> DbResult<Vec<Recorded>> {
        if tasks.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = tasks.iter().map(|t| t.id).collect();
        let tenants: Vec<&str> = tasks.iter().map(|t| t.tenant.as_str()).collect();
        let keys: Vec<Uuid> = tasks.iter().map(|t| t.idempotency_key).collect();
        let types: Vec<&str> = tasks.iter().map(|t| t.task_type.as_str()).collect();
        let payloads: Vec<serde_json::Value> = tasks.iter().map(|t| t.payload.clone()).collect();
        let inserted = sqlx::query(&format!(
            "WITH input AS (
                 SELECT * FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::text[], $5::jsonb[])
                     AS i(id, tenant, idempotency_key, task_type, payload)
             ), inserted AS (
                 INSERT INTO tasks (id, tenant, idempotency_key, task_type, state, payload)
                 SELECT id, tenant, idempotency_key, task_type, $6, payload FROM input
                 ON CONFLICT (tenant, idempotency_key) DO NOTHING
                 RETURNING {TASK_COLUMNS}
             ), events AS (
                 INSERT INTO task_events (task_id, task_type, to_state, attempt)
                 SELECT id, task_type, $6, 0 FROM inserted
             )
             SELECT * FROM inserted"
        ))
        .bind(&ids)
        .bind(&tenants)
        .bind(&keys)
        .bind(&types)
        .bind(&payloads)
        .bind(Ingested.as_str())
        .fetch_all(&self.pool)
        .await?;
        let mut records: HashMap<(String, Uuid), TaskRecord> = HashMap::with_capacity(tasks.len());
        for row in &inserted {
            let record = task_from_row(row)?;
            records.insert((record.tenant.clone(), record.idempotency_key), record);
        }
        let created: HashSet<Uuid> = records.values().map(|r| r.id).collect();
        // Only known keys need a second look: the common case is one round trip.
        let (known_tenants, known_keys): (Vec<&str>, Vec<Uuid>) = tasks
            .iter()
            .filter(|t| !records.contains_key(&(t.tenant.clone(), t.idempotency_key)))
            .map(|t| (t.tenant.as_str(), t.idempotency_key))
            .unzip();
        if !known_keys.is_empty() {
            let rows = sqlx::query(&format!(
                "SELECT {TASK_COLUMNS} FROM tasks
                 WHERE (tenant, idempotency_key) IN (SELECT * FROM unnest($1::text[], $2::uuid[]))"
            ))
            .bind(&known_tenants)
            .bind(&known_keys)
            .fetch_all(&self.pool)
            .await?;
            for row in &rows {
                let record = task_from_row(row)?;
                records.insert((record.tenant.clone(), record.idempotency_key), record);
            }
        }
        tasks
            .iter()
            .map(|task| {
                let key = (task.tenant.clone(), task.idempotency_key);
                let record = records.get(&key).cloned().ok_or_else(|| {
                    DbError::Corrupt(format!("task with key {} vanished", task.idempotency_key))
                })?;
                Ok(if record.id == task.id && created.contains(&task.id) {
                    Recorded::Created(record)
                } else {
                    Recorded::Existing(record)
                })
            })
            .collect()
    }

    /// INGESTED → QUEUED for tasks the broker confirmed. Tasks a worker already claimed are
    /// left alone: the claim wrote the QUEUED event itself.
    pub async fn mark_queued(&self, ids: &[Uuid]) -> DbResult<()> {
        lifecycle::check(Ingested, Queued)?;
        sqlx::query(
            "WITH updated AS (
                 UPDATE tasks SET state = $3, updated_at = now()
                 WHERE id = ANY($1) AND state = $2
                 RETURNING id, task_type, attempt
             )
             INSERT INTO task_events (task_id, task_type, from_state, to_state, attempt)
             SELECT id, task_type, $2, $3, attempt FROM updated",
        )
        .bind(ids)
        .bind(Ingested.as_str())
        .bind(Queued.as_str())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The compare-and-set claim: QUEUED (or still INGESTED, when the delivery beat the
    /// gateway's own update) at exactly `attempt` → CLAIMED → PROCESSING, owned by `worker`.
    /// `false` means another delivery or owner has it, or the message is stale.
    ///
    /// The row is locked by id alone, and only then compared: a re-queue publishes its
    /// message before it commits, and a delivery that arrives in between must wait for that
    /// commit. Had the lock carried `attempt = $2`, PostgreSQL would have tested it against
    /// the version before the re-queue, skipped the row without waiting, and the claim would
    /// have dropped the only message of the task (found by the chaos suite's worker-pause).
    pub async fn claim(&self, id: Uuid, attempt: i32, worker: &str) -> DbResult<bool> {
        let path = edges(&[(Ingested, Queued), (Queued, Claimed), (Claimed, Processing)])?;
        let events = sqlx::query(
            "WITH current AS (
                 SELECT id, state, attempt FROM tasks WHERE id = $1 FOR UPDATE
             ), claimed AS (
                 UPDATE tasks t SET state = $8, owner = $3, heartbeat_at = now(), updated_at = now()
                 FROM current
                 WHERE t.id = current.id AND current.attempt = $2 AND current.state IN ($6, $7)
                 RETURNING t.id, t.task_type, t.attempt, current.state AS prior
             )
             INSERT INTO task_events (task_id, task_type, from_state, to_state, attempt, worker_id)
             SELECT * FROM (
                 SELECT c.id, c.task_type, p.from_state, p.to_state, c.attempt, $3
                 FROM claimed c, unnest($4::text[], $5::text[]) WITH ORDINALITY
                     AS p(from_state, to_state, ord)
                 WHERE p.ord > 1 OR c.prior = $6
                 ORDER BY p.ord
             ) ordered",
        )
        .bind(id)
        .bind(attempt)
        .bind(worker)
        .bind(&path.0)
        .bind(&path.1)
        .bind(Ingested.as_str())
        .bind(Queued.as_str())
        .bind(Processing.as_str())
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(events > 0)
    }

    /// Keeps claims alive: task `ids[i]` at `attempts[i]` owned by `owners[i]` (a worker
    /// heartbeats its own tasks and those its previous process left in the degraded-mode
    /// buffer). The attempt fences a beat for an older claim of a task off its newer one.
    /// Returns how many are still owned.
    pub async fn heartbeat(
        &self,
        ids: &[Uuid],
        attempts: &[i32],
        owners: &[String],
    ) -> DbResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        Ok(sqlx::query(
            "UPDATE tasks t SET heartbeat_at = now()
             FROM unnest($1::uuid[], $2::int[], $3::text[]) AS c(id, attempt, owner)
             WHERE t.id = c.id AND t.attempt = c.attempt AND t.owner = c.owner
               AND t.state IN ($4, $5)",
        )
        .bind(ids)
        .bind(attempts)
        .bind(owners)
        .bind(Claimed.as_str())
        .bind(Processing.as_str())
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// PROCESSING → COMPLETED, fenced by owner and attempt. `false`: this worker no longer
    /// owns the task (it was re-queued after a heartbeat timeout), and its result is void.
    pub async fn complete(
        &self,
        id: Uuid,
        attempt: i32,
        worker: &str,
        result: &serde_json::Value,
    ) -> DbResult<bool> {
        lifecycle::check(Processing, Completed)?;
        let events = sqlx::query(
            "WITH done AS (
                 UPDATE tasks SET state = $6, result = $4, heartbeat_at = NULL, updated_at = now()
                 WHERE id = $1 AND attempt = $2 AND owner = $3 AND state = $5
                 RETURNING id, task_type, attempt
             )
             INSERT INTO task_events (task_id, task_type, from_state, to_state, attempt, worker_id)
             SELECT id, task_type, $5, $6, attempt, $3 FROM done",
        )
        .bind(id)
        .bind(attempt)
        .bind(worker)
        .bind(result)
        .bind(Processing.as_str())
        .bind(Completed.as_str())
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(events > 0)
    }
}

/// Appends audit events in one statement, refusing any step outside the lifecycle.
async fn append_events(tx: &mut Transaction<'static, Postgres>, rows: &[EventRow]) -> DbResult<()> {
    for row in rows {
        lifecycle::check(row.from, row.to)?;
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.task_id).collect();
    let types: Vec<&str> = rows.iter().map(|r| r.task_type.as_str()).collect();
    let froms: Vec<&str> = rows.iter().map(|r| r.from.as_str()).collect();
    let tos: Vec<&str> = rows.iter().map(|r| r.to.as_str()).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempt).collect();
    let workers: Vec<Option<String>> = rows.iter().map(|r| r.worker_id.clone()).collect();
    let details: Vec<Option<String>> = rows
        .iter()
        .map(|r| r.detail.as_deref().map(storable))
        .collect();
    sqlx::query(
        "INSERT INTO task_events (task_id, task_type, from_state, to_state, attempt, worker_id, detail)
         SELECT task_id, task_type, from_state, to_state, attempt, worker_id, detail FROM (
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[],
                                  $6::text[], $7::text[]) WITH ORDINALITY
                 AS e(task_id, task_type, from_state, to_state, attempt, worker_id, detail, ord)
             ORDER BY ord
         ) ordered",
    )
    .bind(&ids)
    .bind(&types)
    .bind(&froms)
    .bind(&tos)
    .bind(&attempts)
    .bind(&workers)
    .bind(&details)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A path of lifecycle edges as the two text arrays the SQL takes, checked against the table.
fn edges(path: &[(TaskState, TaskState)]) -> DbResult<(Vec<&'static str>, Vec<&'static str>)> {
    for &(from, to) in path {
        lifecycle::check(from, to)?;
    }
    Ok(path.iter().map(|(f, t)| (f.as_str(), t.as_str())).unzip())
}

/// Text as PostgreSQL stores it: a NUL character (which a handler's stderr may hold) is
/// refused in `text`, so it is replaced rather than losing the whole write.
fn storable(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

fn parse_state(name: String) -> DbResult<TaskState> {
    name.parse()
        .map_err(|e: lifecycle::UnknownState| DbError::Corrupt(e.to_string()))
}

fn task_from_row(row: &PgRow) -> DbResult<TaskRecord> {
    Ok(TaskRecord {
        id: row.try_get("id")?,
        tenant: row.try_get("tenant")?,
        idempotency_key: row.try_get("idempotency_key")?,
        task_type: row.try_get("task_type")?,
        state: parse_state(row.try_get("state")?)?,
        attempt: row.try_get("attempt")?,
        retries: row.try_get("retries")?,
        owner: row.try_get("owner")?,
        payload: row.try_get("payload")?,
        result: row.try_get("result")?,
        error: row.try_get("error")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        suspect: row.try_get("suspect")?,
    })
}

fn event_from_row(row: &PgRow) -> DbResult<TaskEvent> {
    let from: Option<String> = row.try_get("from_state")?;
    Ok(TaskEvent {
        seq: row.try_get("seq")?,
        task_id: row.try_get("task_id")?,
        task_type: row.try_get("task_type")?,
        from_state: from.map(parse_state).transpose()?,
        to_state: parse_state(row.try_get("to_state")?)?,
        attempt: row.try_get("attempt")?,
        worker_id: row.try_get("worker_id")?,
        detail: row.try_get("detail")?,
        at: row.try_get("at")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_written_here_is_in_the_lifecycle() {
        assert!(edges(&[(Ingested, Queued), (Queued, Claimed), (Claimed, Processing)]).is_ok());
        assert!(edges(&[(Queued, Processing)]).is_err());
    }
}
