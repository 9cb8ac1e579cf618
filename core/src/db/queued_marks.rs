//! INGESTED → QUEUED off the answer path (decision 0020).
//!
//! The gateway answers once the broker confirmed; the QUEUED row that records it is written
//! a moment later, for every confirmed task of that moment in one statement. Most tasks are
//! claimed within that moment, and the claim writes the same INGESTED → QUEUED event itself
//! (`Db::claim_all`), so the statement then only finds them moved on: a task costs one
//! tuple version and one statement share less, and no claim waits on the gateway's lock.
//!
//! Nothing depends on the mark for safety: a task left INGESTED (a gateway that died before
//! its mark) is claimed the same way, and the orphan sweeper treats INGESTED and QUEUED
//! alike. What the mark keeps true is what a reader sees: a read through this gateway of a
//! task whose mark still waits writes that mark first ([`QueuedMarks::settle`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use uuid::Uuid;

use super::{Db, DbResult};
use crate::metrics::Metrics;

/// How long a confirmed task's mark waits for a claim to make it unnecessary: a few claim
/// round trips at any load this machine sustains, and short enough that another gateway
/// replica's reader rarely sees INGESTED after the answer.
pub const SETTLE: Duration = Duration::from_millis(100);
/// Marks waiting beyond which they are written at once (memory stays bounded).
const MAX_PENDING: usize = 50_000;
/// Most ids in one statement.
const MAX_IDS: usize = 4_096;

/// A gateway's confirmed tasks whose QUEUED mark is not written yet. Cheap to clone; the
/// writer stops when the last handle is dropped.
#[derive(Clone)]
pub struct QueuedMarks {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    metrics: Metrics,
    pending: Mutex<HashSet<Uuid>>,
    /// Held while a statement runs: a reader whose id is in it waits for its commit.
    writing: tokio::sync::Mutex<()>,
    full: Notify,
}

impl QueuedMarks {
    /// Starts the writer, which marks what waited every `settle`. Needs a Tokio runtime.
    pub fn spawn(db: Db, metrics: Metrics, settle: Duration) -> QueuedMarks {
        let inner = Arc::new(Inner {
            db,
            metrics,
            pending: Mutex::new(HashSet::new()),
            writing: tokio::sync::Mutex::new(()),
            full: Notify::new(),
        });
        tokio::spawn(write_every(Arc::downgrade(&inner), settle));
        QueuedMarks { inner }
    }

    /// The broker confirmed these tasks: each is marked QUEUED within `settle`, unless a
    /// claim wrote it first.
    pub fn confirmed(&self, ids: impl IntoIterator<Item = Uuid>) {
        let mut pending = self.inner.lock_pending();
        pending.extend(ids);
        if pending.len() >= MAX_PENDING {
            self.inner.full.notify_one();
        }
    }

    /// Whether `id` was confirmed and its mark is not written yet (its row may still read
    /// INGESTED).
    pub fn is_pending(&self, id: Uuid) -> bool {
        self.inner.lock_pending().contains(&id)
    }

    /// Writes `id`'s mark now if it still waits (or waits for the statement writing it), so
    /// that a read that follows sees QUEUED, as the answer said.
    pub async fn settle(&self, id: Uuid) -> DbResult<()> {
        let waiting = self.inner.lock_pending().remove(&id);
        let _writing = self.inner.writing.lock().await;
        if waiting {
            self.inner.db.mark_queued(&[id]).await?;
        }
        Ok(())
    }

    /// Writes every waiting mark now (on shutdown).
    pub async fn flush(&self) {
        self.inner.write_pending().await;
    }
}

impl Inner {
    fn lock_pending(&self) -> std::sync::MutexGuard<'_, HashSet<Uuid>> {
        // A panic while holding it left a set of ids, still valid.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn write_pending(&self) {
        let _writing = self.writing.lock().await;
        let ids: Vec<Uuid> = self.lock_pending().drain().collect();
        for chunk in ids.chunks(MAX_IDS) {
            if let Err(err) = self.db.mark_queued(chunk).await {
                // Not retried: each of these is claimed as INGESTED (the claim writes the
                // QUEUED event) or re-published by the sweeper, as after a gateway crash.
                self.metrics
                    .errors
                    .with_label_values(&["database", err.category()])
                    .inc();
                tracing::warn!(error = %err, tasks = chunk.len(), "cannot mark confirmed tasks QUEUED");
            }
        }
    }
}

async fn write_every(inner: Weak<Inner>, settle: Duration) {
    loop {
        let Some(inner) = inner.upgrade() else {
            return;
        };
        tokio::select! {
            () = tokio::time::sleep(settle) => {}
            () = inner.full.notified() => {}
        }
        inner.write_pending().await;
    }
}
