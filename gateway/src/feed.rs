//! One change feed for every task stream of this gateway (`crate::follow`): the rows of all
//! followed tasks are read together, by id, a few times a second, and each stream is woken
//! when its own task changed. A thousand streams cost one indexed read per tick, not a
//! thousand reads a second from the pool every other request shares (issue 33, item 3).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use conveyor_core::db::{Db, DbError};
use conveyor_core::task::TaskRecord;
use conveyor_core::TaskState;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How often the followed rows are read: the most a stream lags behind its task.
pub const TICK: Duration = Duration::from_millis(200);
/// Ids per statement, so that one read's answer stays small however many are followed.
const IDS_PER_READ: usize = 5_000;
/// Reads in a row that may fail (a connection lost, a pool briefly exhausted) before the
/// streams are told and end: five seconds of ticks. Until then they keep what they showed.
const FAILURES_TOLD: u32 = 25;

/// What a stream's task was last seen as.
#[derive(Clone)]
pub enum Seen {
    Task(Arc<TaskRecord>),
    /// Its row is gone (retention deleted it).
    Gone,
    /// Reads failed for [`FAILURES_TOLD`] ticks in a row; the stream says so and ends.
    Failed(Arc<DbError>),
}

/// The followed tasks, each with the streams that follow it.
pub struct Feed {
    db: Db,
    followed: Mutex<HashMap<Uuid, Followed>>,
    first_follower: Notify,
}

struct Followed {
    seen: watch::Sender<Seen>,
    streams: usize,
}

/// One stream's hold on its task's place in the feed; dropping it lets the task go once no
/// other stream follows it.
pub struct Subscription {
    feed: Arc<Feed>,
    id: Uuid,
    pub seen: watch::Receiver<Seen>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut followed = self.feed.lock();
        if let Some(entry) = followed.get_mut(&self.id) {
            entry.streams -= 1;
            if entry.streams == 0 {
                followed.remove(&self.id);
            }
        }
    }
}

impl Feed {
    pub fn new(db: Db) -> Arc<Feed> {
        Arc::new(Feed {
            db,
            followed: Mutex::default(),
            first_follower: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Followed>> {
        self.followed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Follows `task`, as the caller just read it. A task other streams follow already keeps
    /// the feed's (possibly newer) version.
    pub fn follow(self: &Arc<Self>, task: TaskRecord) -> Subscription {
        let id = task.id;
        let mut followed = self.lock();
        let first = followed.is_empty();
        let task = Arc::new(task);
        let entry = followed.entry(id).or_insert_with(|| Followed {
            seen: watch::channel(Seen::Task(task.clone())).0,
            streams: 0,
        });
        // A failure told to the task's other streams is not this one's: it just read the row.
        entry.seen.send_if_modified(|seen| {
            let stale = !matches!(seen, Seen::Task(_));
            if stale {
                *seen = Seen::Task(task);
            }
            stale
        });
        entry.streams += 1;
        let seen = entry.seen.subscribe();
        drop(followed);
        if first {
            self.first_follower.notify_one();
        }
        Subscription {
            feed: self.clone(),
            id,
            seen,
        }
    }

    /// Reads the followed rows every [`TICK`] while there are any, until `stop`; then lets
    /// every task go, which ends their streams.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        tokio::select! {
            () = self.read_until_stopped() => {}
            () = stop.cancelled() => {}
        }
        self.lock().clear();
    }

    async fn read_until_stopped(&self) {
        let mut failures = 0;
        loop {
            let ids: Vec<Uuid> = self.lock().keys().copied().collect();
            if ids.is_empty() {
                self.first_follower.notified().await;
                continue;
            }
            for chunk in ids.chunks(IDS_PER_READ) {
                match self.db.listed_tasks(chunk).await {
                    Ok(rows) => {
                        failures = 0;
                        let mut rows: HashMap<Uuid, TaskRecord> =
                            rows.into_iter().map(|t| (t.id, t)).collect();
                        for id in chunk {
                            self.publish(*id, rows.remove(id).map(Arc::new));
                        }
                    }
                    Err(err) => {
                        failures += 1;
                        tracing::warn!(error = %err, failures, "reading the followed tasks failed");
                        if failures >= FAILURES_TOLD {
                            let err = Arc::new(err);
                            for id in chunk {
                                self.tell(*id, Seen::Failed(err.clone()));
                            }
                        }
                    }
                }
            }
            tokio::time::sleep(TICK).await;
        }
    }

    /// Wakes the task's streams if what they show of it changed.
    fn publish(&self, id: Uuid, row: Option<Arc<TaskRecord>>) {
        let followed = self.lock();
        let Some(entry) = followed.get(&id) else {
            return;
        };
        entry.seen.send_if_modified(|seen| {
            let changed = match (&*seen, &row) {
                (Seen::Task(old), Some(new)) => version(old) != version(new),
                (Seen::Gone, None) => false,
                _ => true,
            };
            if changed {
                *seen = row.clone().map_or(Seen::Gone, Seen::Task);
            }
            changed
        });
    }

    fn tell(&self, id: Uuid, seen: Seen) {
        if let Some(entry) = self.lock().get(&id) {
            entry.seen.send_replace(seen);
        }
    }
}

/// What a stream shows of a task changing: a change in any of it is sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Version {
    state: TaskState,
    attempt: i32,
    updated_at: DateTime<Utc>,
    progress: Option<serde_json::Value>,
    owner: Option<String>,
}

pub fn version(task: &TaskRecord) -> Version {
    Version {
        state: task.state,
        attempt: task.attempt,
        updated_at: task.updated_at,
        progress: task.progress.clone(),
        owner: task.owner.clone(),
    }
}
