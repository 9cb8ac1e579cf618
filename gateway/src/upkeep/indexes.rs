//! Indexes of `tasks` that expiry left sparse, rebuilt in the background (decision 0037).
//! A rebuild may wait minutes for a long reader's snapshot; it runs in a task of its own,
//! so reaping, sweeping and partition upkeep go on meanwhile, and a look starts only when
//! the one before has ended.

use std::time::{Duration, Instant};

use conveyor_core::db::{Db, DbError, IndexSize};
use conveyor_core::metrics::Metrics;
use tokio::task::JoinHandle;

/// When the next look is due, and the one running now.
pub(super) struct Rebuilds {
    every: Duration,
    due: Instant,
    running: Option<JoinHandle<()>>,
}

impl Rebuilds {
    /// The first look is one interval after the start: a fresh process has nothing to win.
    pub(super) fn new(every: Duration) -> Rebuilds {
        Rebuilds {
            every,
            due: Instant::now() + every,
            running: None,
        }
    }

    /// Starts a look when one is due and none runs; never waits for it.
    pub(super) fn poll(&mut self, db: &Db, metrics: &Metrics) {
        if self
            .running
            .as_ref()
            .is_some_and(|look| !look.is_finished())
        {
            return;
        }
        if Instant::now() < self.due {
            return;
        }
        self.due = Instant::now() + self.every;
        let (db, metrics) = (db.clone(), metrics.clone());
        self.running = Some(tokio::spawn(async move {
            if let Err(err) = look(&db, &metrics).await {
                metrics
                    .errors
                    .with_label_values(&["upkeep", "index_rebuild"])
                    .inc();
                tracing::warn!(error = %err, source = ?std::error::Error::source(&err), "index upkeep failed");
            }
        }));
    }
}

impl Drop for Rebuilds {
    /// The server cancels a rebuild whose connection closed (within a second); the invalid
    /// copy it leaves is dropped by the next look.
    fn drop(&mut self) {
        if let Some(look) = self.running.take() {
            look.abort();
        }
    }
}

/// Measures every B-tree index of `tasks`, and rebuilds the sparse ones, one at a time.
async fn look(db: &Db, metrics: &Metrics) -> Result<(), DbError> {
    let started = Instant::now();
    let Some(look) = db.upkeep_task_indexes().await? else {
        tracing::debug!("another process is looking after the indexes of tasks");
        return Ok(());
    };
    let density = |index: &IndexSize| {
        if let Some(density) = index.density_percent() {
            metrics
                .task_index_density
                .with_label_values(&[index.name.as_str()])
                .set(density);
        }
    };
    look.measured.iter().for_each(density);
    for leftover in &look.leftovers_dropped {
        tracing::info!(index = leftover, "a cut-short rebuild's copy dropped");
    }
    for (before, after) in &look.rebuilt {
        density(after);
        metrics
            .task_index_rebuilds
            .with_label_values(&[before.name.as_str()])
            .inc();
        tracing::info!(
            index = before.name,
            bytes_before = before.bytes,
            bytes_after = after.bytes,
            seconds = started.elapsed().as_secs_f64(),
            "sparse index of tasks rebuilt"
        );
    }
    for index in &look.denied {
        // A least-privilege gateway (decision 0015) does not own the table.
        tracing::warn!(
            index = index.name,
            bytes = index.bytes,
            packed_bytes = index.packed_bytes,
            "an index of tasks is sparse and only the table's owner may rebuild it: \
             run `REINDEX INDEX CONCURRENTLY {}` as the owner",
            index.name
        );
    }
    Ok(())
}
