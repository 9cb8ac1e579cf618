//! The tasks this worker owns right now, and the heartbeat that keeps its claims alive.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::outcome::Recorder;

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

/// Heartbeats every owned task each `interval`, in one statement, until `stop`: the tasks
/// running here and those whose outcome waits in the degraded-mode buffer (possibly left by
/// a previous process of this pod), so that no reaper re-runs a task whose outcome is safe.
pub async fn heartbeat_loop(
    recorder: Recorder,
    worker_id: String,
    in_flight: InFlight,
    interval: Duration,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let mut ids = in_flight.ids();
        let mut owners = vec![worker_id.clone(); ids.len()];
        for (id, owner) in recorder.buffer.claims() {
            ids.push(id);
            owners.push(owner);
        }
        let beat = recorder.db.heartbeat(&ids, &owners);
        if let Err(err) = recorder.breaker.call(beat).await {
            recorder
                .metrics
                .errors
                .with_label_values(&["database", err.category()])
                .inc();
            tracing::warn!(error = %err, tasks = ids.len(), "heartbeat failed");
        }
    }
}
