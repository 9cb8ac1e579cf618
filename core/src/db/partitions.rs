//! The audit log's daily partitions: made ahead of time, rescued from the default
//! partition, dropped after the retention period with the history of open tasks kept (SQL
//! functions in `migrations/`). None of it waits more than 100 ms for a lock (decision
//! 0031): work a long reader of the log holds back is left for a later pass, which
//! [`Db::partitions_owed`] tells the caller to make sooner.

use chrono::NaiveDate;

use super::{Db, DbResult, PARTITION_DAYS_AHEAD};

/// Calls of a partition function per round, at most: a year and a bit of days.
const MAX_CALLS: usize = 400;

impl Db {
    /// Creates the audit log's partitions from the day before `today` (UTC; `None`: now) to
    /// `days_ahead` days after, and for every day whose rows wait in the default partition
    /// (moving them in). Returns the partitions it created.
    pub async fn ensure_partitions_around(
        &self,
        days_ahead: i32,
        today: Option<NaiveDate>,
    ) -> DbResult<Vec<String>> {
        // A call ends after a rescue, to let go of its locks: call again until one makes
        // nothing (a lock not granted in time ends the round too).
        self.call_until_done(
            "SELECT conveyor_ensure_event_partitions($1, $2)",
            days_ahead,
            today,
        )
        .await
    }

    /// Drops the audit partitions of days before `today - keep_days` (UTC; `None`: now),
    /// keeping the events of tasks not yet COMPLETED or CANCELLED (copied into
    /// `task_events_kept` before the drop locks the log), and lets go of kept events whose
    /// task has settled since.
    pub async fn drop_partitions_before(
        &self,
        keep_days: i32,
        today: Option<NaiveDate>,
    ) -> DbResult<Vec<String>> {
        // One day per call, oldest first, each its own transaction (a DROP's lock lasts
        // until its statement ends); the first day that cannot go now ends the round.
        self.call_until_done(
            "SELECT conveyor_drop_event_partitions($1, $2)",
            keep_days,
            today,
        )
        .await
    }

    /// Calls a partition function (each call a transaction of its own) until a call does
    /// nothing; returns the partitions all calls named.
    async fn call_until_done(
        &self,
        call: &'static str,
        days: i32,
        today: Option<NaiveDate>,
    ) -> DbResult<Vec<String>> {
        let mut done = Vec::new();
        for _ in 0..MAX_CALLS {
            let step: Vec<String> = sqlx::query_scalar(call)
                .bind(days)
                .bind(today)
                .fetch_all(&self.maintenance)
                .await?;
            if step.is_empty() {
                break;
            }
            done.extend(step);
        }
        Ok(done)
    }

    /// What partition upkeep still owes as of `today` (UTC; `None`: now).
    pub async fn partitions_owed(
        &self,
        keep_days: Option<i32>,
        today: Option<NaiveDate>,
    ) -> DbResult<PartitionsOwed> {
        let (days_ahead, overdue): (i32, i32) = sqlx::query_as(
            "SELECT days_ahead, overdue FROM conveyor_event_partitions_owed($1, $2)",
        )
        .bind(keep_days.unwrap_or(0))
        .bind(today)
        .fetch_one(&self.maintenance)
        .await?;
        Ok(PartitionsOwed {
            days_ahead,
            overdue,
        })
    }
}

/// What partition upkeep has left to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionsOwed {
    /// Days from today on whose partitions exist, without a gap: an audit row of a later
    /// day would land in the default partition.
    pub days_ahead: i32,
    /// Partitions past the retention period, not dropped yet.
    pub overdue: i32,
}

impl PartitionsOwed {
    /// Whether a day ahead is missing or a day is overdue: work a lock held back.
    pub fn any(&self) -> bool {
        self.days_ahead <= PARTITION_DAYS_AHEAD || self.overdue > 0
    }
}
