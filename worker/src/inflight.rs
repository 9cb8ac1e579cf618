//! The tasks this worker owns right now, and the heartbeat that keeps its claims alive.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_core::db::Db;
use conveyor_core::metrics::Metrics;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Owned tasks by id, each with the token that stops its handler when the drain runs out.
#[derive(Clone, Default)]
pub struct InFlight {
    tasks: Arc<Mutex<HashMap<Uuid, CancellationToken>>>,
}

impl InFlight {
    pub fn insert(&self, id: Uuid) -> CancellationToken {
        let token = CancellationToken::new();
        self.lock().insert(id, token.clone());
        token
    }

    pub fn remove(&self, id: Uuid) {
        self.lock().remove(&id);
    }

    pub fn ids(&self) -> Vec<Uuid> {
        self.lock().keys().copied().collect()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tells every running handler to stop; their tasks are released for another worker.
    pub fn cancel_all(&self) {
        for token in self.lock().values() {
            token.cancel();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, CancellationToken>> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Heartbeats every owned task each `interval`, in one statement, until `stop`.
pub async fn heartbeat_loop(
    db: Db,
    worker_id: String,
    in_flight: InFlight,
    interval: Duration,
    metrics: Metrics,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let ids = in_flight.ids();
        if let Err(err) = db.heartbeat(&worker_id, &ids).await {
            metrics
                .errors
                .with_label_values(&["database", err.category()])
                .inc();
            tracing::warn!(error = %err, tasks = ids.len(), "heartbeat failed");
        }
    }
}
