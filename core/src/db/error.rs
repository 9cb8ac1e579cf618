//! The database layer's errors, classified for retries and degraded mode.

use std::time::Duration;

use crate::lifecycle::InvalidTransition;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("invalid database URL: {0}")]
    Url(sqlx::Error),
    #[error("database unavailable: {0}")]
    Unavailable(sqlx::Error),
    /// The URL's `sslrootcert` cannot be used.
    #[error("database TLS settings: {0}")]
    Tls(crate::tls::TlsError),
    #[error("database query failed")]
    Query(#[source] sqlx::Error),
    #[error("database migration failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// The schema lacks migrations this build needs; its owner applies them.
    #[error(
        "the database schema is at migration {applied:?}, this build needs {needed}: run \
         `conveyorctl migrate` as the database's owner"
    )]
    SchemaBehind { applied: Option<i64>, needed: i64 },
    #[error(transparent)]
    Lifecycle(#[from] InvalidTransition),
    #[error("unexpected row in the database: {0}")]
    Corrupt(String),
    /// The call got no answer in time (a slow or silent link); it may still have committed.
    #[error("database call timed out after {0:?}")]
    TimedOut(Duration),
    /// The server gave up on the statement (its `statement_timeout`, a lock timeout) or
    /// chose it as a deadlock or serialization victim: nothing was written; try again.
    #[error("the database gave up on the statement")]
    Cancelled(#[source] sqlx::Error),
    /// One statement written for several callers failed: each of them gets this.
    #[error(transparent)]
    Shared(std::sync::Arc<DbError>),
    /// The statement's group-commit flushers are gone (the process is shutting down).
    #[error("the database writer stopped")]
    Stopped,
}

impl DbError {
    /// Stable label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            DbError::Shared(err) => err.category(),
            DbError::Stopped => "unavailable",
            DbError::Url(_) | DbError::Tls(_) => "config",
            DbError::Unavailable(_) => "unavailable",
            DbError::Query(_) => "query",
            DbError::Migrate(_) | DbError::SchemaBehind { .. } => "migrate",
            DbError::Lifecycle(_) => "lifecycle",
            DbError::Corrupt(_) => "corrupt",
            DbError::TimedOut(_) => "timeout",
            DbError::Cancelled(_) => "cancelled",
        }
    }

    /// The database could not be reached or dropped the connection: worth retrying later.
    pub fn is_unavailable(&self) -> bool {
        match self {
            DbError::Shared(err) => err.is_unavailable(),
            err => matches!(
                err,
                DbError::Unavailable(_)
                    | DbError::TimedOut(_)
                    | DbError::Cancelled(_)
                    | DbError::Stopped
            ),
        }
    }

    /// The one error of a statement written for `n` callers, for each of them.
    pub fn share(self, n: usize) -> Vec<DbError> {
        let shared = std::sync::Arc::new(self);
        (0..n).map(|_| DbError::Shared(shared.clone())).collect()
    }

    /// The error itself, whether or not several callers share it.
    fn own(&self) -> &DbError {
        match self {
            DbError::Shared(err) => err.own(),
            err => err,
        }
    }

    /// The same write will never succeed: the database refused the value or the step
    /// itself (a data or integrity error, a transition outside the lifecycle).
    pub fn is_permanent(&self) -> bool {
        let this = self.own();
        this.is_data_rejected()
            || this.is_integrity_violation()
            || matches!(this, DbError::Lifecycle(_) | DbError::Corrupt(_))
    }

    /// The role may not do this (SQLSTATE 42501): a role that owns nothing, migrating.
    pub fn is_permission_denied(&self) -> bool {
        use sqlx::migrate::MigrateError;
        let err = match self.own() {
            DbError::Query(err)
            | DbError::Migrate(MigrateError::Execute(err))
            | DbError::Migrate(MigrateError::ExecuteMigration(err, _)) => err,
            _ => return false,
        };
        matches!(err, sqlx::Error::Database(db) if db.code().as_deref() == Some("42501"))
    }

    fn is_integrity_violation(&self) -> bool {
        match self.own() {
            DbError::Query(sqlx::Error::Database(db)) => {
                db.code().is_some_and(|code| code.starts_with("23"))
            }
            _ => false,
        }
    }

    /// The database refused a value itself (SQLSTATE class 22, "data exception": a NUL
    /// character in JSON, say): the same write will never succeed.
    pub fn is_data_rejected(&self) -> bool {
        match self.own() {
            DbError::Query(sqlx::Error::Database(db)) => {
                db.code().is_some_and(|code| code.starts_with("22"))
            }
            _ => false,
        }
    }
}

impl From<sqlx::Error> for DbError {
    fn from(err: sqlx::Error) -> Self {
        match &err {
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_) => DbError::Unavailable(err),
            sqlx::Error::Database(db)
                if db.code().is_some_and(|c| {
                    // admin shutdown, crash shutdown, cannot connect now, too many clients;
                    // a write that reached a standby (a failed-over primary behind an
                    // address not yet moved): the writable server is elsewhere
                    c.starts_with("08")
                        || c == "25006"
                        || c == "57P01"
                        || c == "57P02"
                        || c == "57P03"
                        || c == "53300"
                }) =>
            {
                DbError::Unavailable(err)
            }
            sqlx::Error::Database(db)
                if db.code().is_some_and(|c| {
                    // query cancelled (statement_timeout), lock not available, deadlock,
                    // serialization failure
                    c == "57014" || c == "55P03" || c == "40P01" || c == "40001"
                }) =>
            {
                DbError::Cancelled(err)
            }
            _ => DbError::Query(err),
        }
    }
}

pub type DbResult<T> = Result<T, DbError>;
