//! The compressed calendar: every `day` of real time, the audit log's partition upkeep
//! runs for the next simulated date (made two weeks ahead, dropped after the retention),
//! as the partition tests move dates forward in steps. Each day boundary first starts two
//! long readers of the log, as a nightly dump and an analytics query would: `pg_dump` of
//! `task_events`, and a transaction that reads it and stays open for a third of a day.
//!
//! Simulated dates run in the past, ending before today: the partitions made and dropped
//! under load are the calendar's, never the one the live rows go to.

use std::time::{Duration, Instant};

use chrono::{Days, NaiveDate, Utc};
use conveyor_core::db::{Db, PARTITION_DAYS_AHEAD};
use tokio::process::Command;

/// One simulated day's boundary, as measured.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Boundary {
    pub day: u32,
    pub date: NaiveDate,
    pub made: usize,
    pub dropped: usize,
    /// From the first try of the partition upkeep to nothing owed (readers holding the
    /// log hold some steps back), and how many tries that took.
    pub upkeep_ms: u64,
    pub tries: u32,
    /// Nothing owed before the day ended.
    pub done: bool,
    /// How long the dump of the log took, and whether it succeeded.
    pub dump_ms: u64,
    pub dump_ok: bool,
}

pub struct Calendar {
    pub first: NaiveDate,
    pub keep_days: i32,
}

impl Calendar {
    /// A calendar of `days` simulated days ending before today, keeping `keep_days`.
    pub fn new(days: u32, keep_days: i32) -> Calendar {
        let today = Utc::now().date_naive();
        let back = u64::from(days) + u64::try_from(PARTITION_DAYS_AHEAD).unwrap_or(14) + 2;
        Calendar {
            first: today - Days::new(back),
            keep_days,
        }
    }

    pub fn date(&self, day: u32) -> NaiveDate {
        self.first + Days::new(u64::from(day))
    }

    /// Day `day`'s boundary: readers started, then the partition upkeep for its date while
    /// they read, tried again until done or `patience` has passed; returns once the upkeep
    /// and the dump are done (the slow reader's transaction reads for `reading`).
    pub async fn boundary(
        &self,
        db: &Db,
        database_url: &str,
        day: u32,
        reading: Duration,
        patience: Duration,
    ) -> anyhow::Result<Boundary> {
        let date = self.date(day);
        let reader = tokio::spawn(slow_reader(db.clone(), reading));
        let dump = tokio::spawn(dump(database_url.to_owned()));
        // The readers hold their locks before the upkeep asks for its own.
        tokio::time::sleep(Duration::from_millis(500)).await;
        // As the gateway's upkeep does: a step a reader holds back (100 ms at most per
        // lock) is tried again, here every second, until nothing is owed or the day ends.
        let started = Instant::now();
        let (mut made, mut dropped, mut tries) = (0, 0, 0u32);
        let done = loop {
            tries += 1;
            made += db
                .ensure_partitions_around(PARTITION_DAYS_AHEAD, Some(date))
                .await?
                .len();
            dropped += db
                .drop_partitions_before(self.keep_days, Some(date))
                .await?
                .len();
            let owed = db.partitions_owed(Some(self.keep_days), Some(date)).await?;
            if !owed.any() {
                break true;
            }
            if started.elapsed() > patience {
                break false;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        };
        let upkeep_ms = millis(started.elapsed());
        let (dump_ms, dump_ok) = dump.await.unwrap_or((0, false));
        // Ended in the background: the next boundary does not wait for it.
        drop(reader);
        Ok(Boundary {
            day,
            date,
            made,
            dropped,
            upkeep_ms,
            tries,
            done,
            dump_ms,
            dump_ok,
        })
    }
}

/// A transaction that reads the whole log, then stays open for `reading`.
async fn slow_reader(db: Db, reading: Duration) {
    let read = async {
        let mut tx = db.pool().begin().await?;
        // As long as an analyst's query runs: no statement timeout of the suite's own.
        sqlx::query("SET LOCAL statement_timeout = 0")
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT count(*) FROM task_events")
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_sleep($1)")
            .bind(reading.as_secs_f64())
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    };
    if let Err(err) = read.await {
        eprintln!("soak: the slow reader failed: {err}");
    }
}

/// `pg_dump` of the audit log (data only) to nowhere; (milliseconds, succeeded).
async fn dump(database_url: String) -> (u64, bool) {
    let started = Instant::now();
    let status = Command::new("pg_dump")
        .args([
            "--data-only",
            "--table",
            "task_events*",
            "--file",
            "/dev/null",
        ])
        .arg(&database_url)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .status()
        .await;
    let ok = status.as_ref().is_ok_and(|s| s.success());
    if !ok {
        eprintln!("soak: pg_dump of task_events failed ({status:?})");
    }
    (millis(started.elapsed()), ok)
}

pub fn millis(took: Duration) -> u64 {
    u64::try_from(took.as_millis()).unwrap_or(u64::MAX)
}

/// Whether `pg_dump` is here (it comes with PostgreSQL's client package).
pub fn pg_dump_available() -> bool {
    std::process::Command::new("pg_dump")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}
