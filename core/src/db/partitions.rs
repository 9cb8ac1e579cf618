//! The audit log's daily partitions: made ahead of time, rescued from the default
//! partition, dropped after the retention period (SQL functions in `migrations/`).

use chrono::NaiveDate;

use super::{Db, DbResult};

impl Db {
    /// Creates the audit log's partitions from the day before `today` (UTC; `None`: now) to
    /// `days_ahead` days after, and for every day whose rows wait in the default partition
    /// (moving them in). Returns the partitions it created.
    pub async fn ensure_partitions_around(
        &self,
        days_ahead: i32,
        today: Option<NaiveDate>,
    ) -> DbResult<Vec<String>> {
        Ok(
            sqlx::query_scalar("SELECT conveyor_ensure_event_partitions($1, $2)")
                .bind(days_ahead)
                .bind(today)
                .fetch_all(&self.maintenance)
                .await?,
        )
    }

    /// Drops the audit partitions of days before `today - keep_days` (UTC; `None`: now).
    pub async fn drop_partitions_before(
        &self,
        keep_days: i32,
        today: Option<NaiveDate>,
    ) -> DbResult<Vec<String>> {
        Ok(
            sqlx::query_scalar("SELECT conveyor_drop_event_partitions($1, $2)")
                .bind(keep_days)
                .bind(today)
                .fetch_all(&self.maintenance)
                .await?,
        )
    }
}
