//! What the operator process remembers between scale-down rounds, on its own monotonic
//! clock: another operator's wall-clock stamp is not trusted for a grace (decision 0017).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;

use super::plan::Worker;
use crate::shared::lock;

/// A pool with nothing to shrink and no drain known is still looked at this often, so that
/// a drain left by a crashed operator (or a status write that failed) is undone.
const LOOK_EVERY: Duration = Duration::from_secs(60);

/// Drains of pods this process has not seen for this long are forgotten (the pod is gone).
const FORGET_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Since when this process has seen each pod draining and unreadable (by uid), and when it
/// last looked at each pool's pods (`namespace/name`).
pub struct Memory {
    draining_since: Mutex<HashMap<String, Instant>>,
    unreadable_since: Mutex<HashMap<String, Instant>>,
    looked: Mutex<HashMap<String, Instant>>,
    started: Instant,
}

impl Default for Memory {
    fn default() -> Self {
        Memory {
            draining_since: Mutex::default(),
            unreadable_since: Mutex::default(),
            looked: Mutex::default(),
            started: Instant::now(),
        }
    }
}

impl Memory {
    /// Whether the pool is due its periodic look ([`LOOK_EVERY`]); a pool not looked at yet
    /// counts as looked at when the process started.
    pub fn look_due(&self, pool: &str) -> bool {
        lock(&self.looked)
            .get(pool)
            .map_or(self.started.elapsed(), Instant::elapsed)
            >= LOOK_EVERY
    }

    pub fn looked_at(&self, pool: &str) {
        lock(&self.looked).insert(pool.to_owned(), Instant::now());
    }

    /// Keeps, per pod uid, when this process first saw it draining and first found it
    /// unreadable, and sets each worker's `draining_for` and `unreadable_for` from them.
    pub fn remember(&self, live: &[Pod], workers: &mut [Worker]) {
        let uids: Vec<String> = live
            .iter()
            .zip(workers.iter())
            .map(|(pod, w)| pod.metadata.uid.clone().unwrap_or_else(|| w.pod.clone()))
            .collect();
        let draining: Vec<bool> = workers.iter().map(Worker::draining).collect();
        let unreadable: Vec<bool> = workers
            .iter()
            .map(|w| !w.unstarted && w.state.is_none())
            .collect();
        let draining_for = since(&self.draining_since, &uids, &draining);
        let unreadable_for = since(&self.unreadable_since, &uids, &unreadable);
        for (i, worker) in workers.iter_mut().enumerate() {
            worker.draining_for = draining_for[i];
            worker.unreadable_for = unreadable_for[i];
        }
    }
}

/// For each of `uids`, how long `flags[i]` has held as this process saw it; those of
/// `uids` no longer flagged are forgotten, and so is anything not seen for a day.
fn since(
    memory: &Mutex<HashMap<String, Instant>>,
    uids: &[String],
    flags: &[bool],
) -> Vec<Option<Duration>> {
    let mut seen = lock(memory);
    let mut kept = Vec::new();
    let out = uids
        .iter()
        .zip(flags)
        .map(|(uid, &flag)| {
            flag.then(|| {
                let at = seen.get(uid).copied().unwrap_or_else(Instant::now);
                kept.push((uid.clone(), at));
                at.elapsed()
            })
        })
        .collect();
    seen.retain(|uid, at| at.elapsed() < FORGET_AFTER && !uids.contains(uid));
    seen.extend(kept);
    out
}
