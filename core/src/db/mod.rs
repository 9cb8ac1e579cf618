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

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

mod audit;
mod claims;
mod error;
mod expiry;
mod grants;
mod grouped;
mod index_rebuilds;
mod ingest;
mod listing;
mod partitions;
mod progress;
mod queued_marks;
mod reads;
mod remedies;
mod requeue;
mod retired;
mod rows;
mod sweep;
mod tenancy;

pub use claims::{Claim, Claimed, Completion, Fence};
pub use error::{DbError, DbResult};
pub use expiry::PendingExpiry;
pub use grants::{ComponentRole, TenantRole, DEFAULT_GATEWAY_ROLE};
pub use grouped::{IngestWrites, OwnerWrites};
pub use index_rebuilds::{IndexSize, IndexUpkeep};
pub use ingest::{Locked, Recorded};
pub use listing::{TaskFilter, TaskPage, SCAN_BOUND};
pub use partitions::PartitionsOwed;
pub use queued_marks::QueuedMarks;
pub use remedies::CancelOutcome;
pub use requeue::{PendingRequeue, Reap, Requeued};
pub use retired::{RetiredType, Settled};
pub use sweep::{OrphanRule, ProbePolicy, MAX_PROBES_ON_THE_WAY};

/// How far ahead audit partitions are made; the upkeep loop renews them hourly.
pub const PARTITION_DAYS_AHEAD: i32 = 14;

/// Connection settings for [`Db::connect`].
#[derive(Debug, Clone)]
pub struct DbOptions {
    pub url: String,
    pub max_connections: u32,
    pub acquire_timeout: Duration,
    /// The server cancels a statement that runs longer (`statement_timeout`). Set it at or
    /// below the caller's own timeout: a call the client gave up on must not commit later.
    pub statement_timeout: Option<Duration>,
    /// A connection unused this long is closed: a process at rest (an idle tenant's workers)
    /// holds none, so the server's connections follow the work, not the fleet.
    pub idle_timeout: Duration,
    /// A connection is closed (when next idle) once this old. The pool hands out its idle
    /// connections first in, first out, so a trickle of work (the upkeep loops, heartbeats)
    /// touches every one in turn and none is ever idle long enough to close: without an age
    /// limit, a process kept all the connections of its busiest moment.
    pub max_lifetime: Duration,
    /// The server gives up waiting for a lock after this long (`lock_timeout`), on the main
    /// pool only: a request must not hold a connection while another session (a tenant's own
    /// open transaction) holds the row it wants. `None` waits as long as the statement may.
    pub lock_timeout: Option<Duration>,
    /// What the pools are for, before their own names in `application_name`
    /// (`conveyor-gateway upkeep main`); `None` for a process's main pools.
    pub purpose: Option<&'static str>,
}

impl DbOptions {
    pub fn new(url: impl Into<String>) -> Self {
        DbOptions {
            url: url.into(),
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Some(Duration::from_secs(30)),
            idle_timeout: Duration::from_secs(30),
            max_lifetime: Duration::from_secs(5 * 60),
            lock_timeout: None,
            purpose: None,
        }
    }

    /// The same database for pools of their own, of `max_connections` each: work that must
    /// not wait behind the process's other work for a connection.
    pub fn for_purpose(&self, purpose: &'static str, max_connections: u32) -> Self {
        DbOptions {
            purpose: Some(purpose),
            max_connections,
            lock_timeout: None,
            ..self.clone()
        }
    }
}

/// libpq's `sslmode`s below `verify-ca` do not check the server's certificate (`prefer`,
/// the default, even falls back to plaintext). Honoured, since a URL is the operator's
/// choice, but never silently.
fn warn_if_unverified(url: &str) {
    if !verifies_server(url) {
        let mode = sslmode(url);
        tracing::warn!(
            sslmode = mode,
            "the database's certificate is not verified: use sslmode=verify-full"
        );
    }
}

fn sslmode(url: &str) -> String {
    crate::urls::query_param(url, "sslmode").unwrap_or_else(|| "prefer".to_owned())
}

/// Whether a database URL checks the server's certificate (`sslmode` `verify-full` or
/// `verify-ca`).
pub fn verifies_server(url: &str) -> bool {
    matches!(sslmode(url).as_str(), "verify-full" | "verify-ca")
}

/// What each pool calls itself to the server (`pg_stat_activity.application_name`), so that
/// whoever reads the server's connections can tell whose they are: the process and the
/// pool, `conveyor-gateway hot`. A name in the URL is the operator's choice and is kept.
fn named(connect: PgConnectOptions, options: &DbOptions, pool: &str) -> PgConnectOptions {
    if crate::urls::query_param(&options.url, "application_name").is_some() {
        return connect;
    }
    let pool = match options.purpose {
        Some(purpose) => format!("{purpose} {pool}"),
        None => pool.to_owned(),
    };
    let process = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.file_stem()?.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "conveyor".to_owned());
    // The server cuts a longer name to 63 bytes itself.
    connect.application_name(&format!("{process} {pool}"))
}

/// The task database.
#[derive(Clone)]
pub struct Db {
    pool: PgPool,
    /// For the group-committed statements by id (`claims.rs`, `ingest.rs`): generic plans.
    hot: PgPool,
    /// One connection, opened on use, without the statement timeout: a migration or a
    /// partition's rescue may legitimately run long on a big table.
    maintenance: PgPool,
    /// One connection, opened on use, without the statement timeout, for index rebuilds,
    /// which may wait minutes for a long reader: partition upkeep keeps its own meanwhile.
    rebuilds: PgPool,
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
        // No ping before each checkout (sqlx's default): it doubles the round trips of the hot
        // path. A connection that died is found by its next statement, whose error the
        // callers handle as any unavailability (a retry, the breaker, a 503), and sqlx then
        // drops it from the pool.
        let pooled = || {
            PgPoolOptions::new()
                .test_before_acquire(false)
                .max_connections(options.max_connections)
                .min_connections(0)
                .idle_timeout(options.idle_timeout)
                .max_lifetime(options.max_lifetime)
                .acquire_timeout(options.acquire_timeout)
        };
        // The hot path's array statements look up rows by id only. Planned afresh per call
        // (PostgreSQL keeps custom plans when a small array makes them look cheaper), they
        // spent half a millisecond each on planning; a generic plan is planned once per
        // connection. Not for the other statements: a generic plan cannot prove a partial
        // index's state predicate from a parameter (the reaper's and sweeper's indexes).
        // And no sequential scan: a plan made while `tasks` was small (a fresh database, the
        // first minutes after a start) scanned the whole table for every claim and completion
        // long after it had grown (make bench: 3,252 scans reading 27 M rows in 10 s); by id,
        // the primary key is always the way.
        let hot = pooled().connect_lazy_with(named(
            connect.clone().options([
                ("plan_cache_mode", "force_generic_plan"),
                ("enable_seqscan", "off"),
            ]),
            options,
            "hot",
        ));
        let main = match options.lock_timeout {
            Some(timeout) => {
                let millis = timeout.as_millis().max(1).to_string() + "ms";
                connect.options([("lock_timeout", millis.as_str())])
            }
            None => connect,
        };
        let pool = pooled().connect_lazy_with(named(main, options, "main"));
        // One connection each, opened on use, without the statement timeout.
        let single = |connect: PgConnectOptions| {
            PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .idle_timeout(Duration::from_secs(60))
                .acquire_timeout(options.acquire_timeout)
                .connect_lazy_with(connect.options([("statement_timeout", "0")]))
        };
        let maintenance = single(named(base.clone(), options, "maintenance"));
        // A rebuild whose gateway stopped (a rolling upgrade) is cancelled by the server
        // within a second, not left holding its lock; the next look drops its copy.
        let rebuilds = single(named(
            base.options([("client_connection_check_interval", "1000")]),
            options,
            "rebuilds",
        ));
        Ok(Db {
            pool,
            hot,
            maintenance,
            rebuilds,
        })
    }

    pub async fn migrate(&self) -> DbResult<()> {
        // Held on the rebuilds' connection while the migrations run on their own (at start,
        // before this process's first index look).
        let mut held = self.rebuilds.acquire().await?;
        index_rebuilds::hold_rebuilds(&mut held).await?;
        let migrated = sqlx::migrate!("../migrations")
            .run(&self.maintenance)
            .await
            .map_err(DbError::Migrate);
        index_rebuilds::release_rebuilds(&mut held).await;
        drop(held);
        migrated?;
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

    /// Closes every connection (before a database is dropped, say).
    pub async fn close(&self) {
        self.pool.close().await;
        self.hot.close().await;
        self.maintenance.close().await;
        self.rebuilds.close().await;
    }
}
