//! The tasks this worker owns right now, and the heartbeat that keeps its claims alive.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_core::db::Fence;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::outcome::Recorder;

/// Owned tasks by (id, attempt), each with the token that stops its handler when the drain
/// runs out. The attempt is part of the key: an old attempt of a task finishing here (its
/// owner was presumed dead and the task re-queued) must not end a newer attempt's claim.
#[derive(Clone, Default)]
pub struct InFlight {
    tasks: Arc<Mutex<HashMap<(Uuid, i32), CancellationToken>>>,
}

/// One owned (task, attempt), heartbeated until this is dropped: however its processing
/// ends, a panic included, the worker stops keeping the claim alive, so the reaper can give
/// the task to another worker.
pub struct Owned {
    set: InFlight,
    key: (Uuid, i32),
    token: CancellationToken,
}

impl Owned {
    /// Fires when the drain runs out and the task is to be released.
    pub fn cancelled(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.token.cancelled()
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        self.set.lock().remove(&self.key);
    }
}

impl InFlight {
    pub fn insert(&self, id: Uuid, attempt: i32) -> Owned {
        let token = CancellationToken::new();
        self.lock().insert((id, attempt), token.clone());
        Owned {
            set: self.clone(),
            key: (id, attempt),
            token,
        }
    }

    /// Every owned (task, attempt).
    pub fn claims(&self) -> Vec<(Uuid, i32)> {
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

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(Uuid, i32), CancellationToken>> {
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
        let mine = in_flight.claims().into_iter().map(|(id, attempt)| Fence {
            id,
            attempt,
            owner: worker_id.clone(),
        });
        let buffered = recorder
            .buffer
            .claims()
            .into_iter()
            .map(|(id, attempt, owner)| Fence { id, attempt, owner });
        let owned: Vec<Fence> = mine.chain(buffered).collect();
        let beat = recorder.db.heartbeat(&owned);
        if let Err(err) = recorder.breaker.call(beat).await {
            recorder
                .metrics
                .errors
                .with_label_values(&["database", err.category()])
                .inc();
            tracing::warn!(error = %err, tasks = owned.len(), "heartbeat failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_old_attempt_finishing_leaves_the_newer_claim_alone() {
        let in_flight = InFlight::default();
        let id = Uuid::new_v4();
        // Attempt 1 ran long here, was presumed dead and re-queued; attempt 2 landed here too.
        let old = in_flight.insert(id, 1);
        let old_token = old.token.clone();
        let new = in_flight.insert(id, 2);
        drop(old);
        assert_eq!(
            in_flight.claims(),
            vec![(id, 2)],
            "attempt 2 is still heartbeated"
        );
        in_flight.cancel_all();
        assert!(new.token.is_cancelled());
        assert!(!old_token.is_cancelled(), "attempt 1 was no longer tracked");
    }

    #[test]
    fn a_panic_while_a_task_is_owned_stops_its_heartbeat() {
        let in_flight = InFlight::default();
        let owner = in_flight.clone();
        let panicked = std::panic::catch_unwind(move || {
            let _owned = owner.insert(Uuid::new_v4(), 0);
            panic!("a bug after the claim");
        });
        assert!(panicked.is_err());
        assert!(in_flight.is_empty(), "{:?}", in_flight.claims());
    }
}
