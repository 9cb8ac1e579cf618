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
//! task whose mark is not committed writes that mark first ([`QueuedMarks::settle`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use uuid::Uuid;

use super::ingest::Locked;
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
///
/// Memory: a confirmed id waits at most one settle plus one statement; ids come only from
/// inserts that committed, so while the database is away none are added.
#[derive(Clone)]
pub struct QueuedMarks {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    metrics: Metrics,
    ids: Mutex<Marks>,
    full: Notify,
}

#[derive(Default)]
struct Marks {
    /// Confirmed, not taken by the writer yet.
    pending: HashSet<Uuid>,
    /// In the writer's statement right now.
    writing: HashSet<Uuid>,
}

impl QueuedMarks {
    /// Starts the writer, which marks what waited every `settle`. Needs a Tokio runtime.
    pub fn spawn(db: Db, metrics: Metrics, settle: Duration) -> QueuedMarks {
        let inner = Arc::new(Inner {
            db,
            metrics,
            ids: Mutex::new(Marks::default()),
            full: Notify::new(),
        });
        tokio::spawn(write_every(Arc::downgrade(&inner), settle));
        QueuedMarks { inner }
    }

    /// The broker confirmed these tasks: each is marked QUEUED within `settle`, unless a
    /// claim wrote it first.
    pub fn confirmed(&self, ids: impl IntoIterator<Item = Uuid>) {
        let mut marks = self.inner.lock();
        marks.pending.extend(ids);
        if marks.pending.len() >= MAX_PENDING {
            self.inner.full.notify_one();
        }
    }

    /// Whether `id` was confirmed and its mark is not committed yet (its row may still read
    /// INGESTED, and its message is in the queue).
    pub fn is_pending(&self, id: Uuid) -> bool {
        let marks = self.inner.lock();
        marks.pending.contains(&id) || marks.writing.contains(&id)
    }

    /// Writes `id`'s mark now if it is not committed yet, so that a read that follows sees
    /// QUEUED, as the answer said; `true` if it did. Unlike the writer's rounds it waits for
    /// a row lock (a claim holding the row moves it on itself), and the id stays pending
    /// until the mark committed, so a read that fails or is dropped loses nothing.
    pub async fn settle(&self, id: Uuid) -> DbResult<bool> {
        if !self.is_pending(id) {
            return Ok(false);
        }
        self.inner.db.mark_queued(&[id], Locked::Wait).await?;
        self.inner.lock().pending.remove(&id);
        Ok(true)
    }

    /// Writes every waiting mark now (on shutdown).
    pub async fn flush(&self) {
        self.inner.write_pending().await;
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Marks> {
        // A panic while holding it left sets of ids, still valid.
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn write_pending(&self) {
        let ids: Vec<Uuid> = {
            let mut marks = self.lock();
            let taken: Vec<Uuid> = marks.pending.drain().collect();
            marks.writing.extend(taken.iter().copied());
            taken
        };
        for chunk in ids.chunks(MAX_IDS) {
            // Rows locked right now are skipped: their holder (a claim, the sweeper) moves
            // them on and writes QUEUED itself.
            if let Err(err) = self.db.mark_queued(chunk, Locked::Skip).await {
                // Not retried: each of these is claimed as INGESTED (the claim writes the
                // QUEUED event) or re-published by the sweeper, as after a gateway crash.
                self.metrics
                    .errors
                    .with_label_values(&["database", err.category()])
                    .inc();
                tracing::warn!(error = %err, tasks = chunk.len(), "cannot mark confirmed tasks QUEUED");
            }
            let mut marks = self.lock();
            for id in chunk {
                marks.writing.remove(id);
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
