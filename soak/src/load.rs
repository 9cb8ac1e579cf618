//! The steady load: single submits at a fixed offered rate, a mix of what a video pipeline
//! sends (mostly quick tasks; every 10th a larger payload with labels, every 50th failing
//! its first try, every 250th failing every try, to be dead-lettered), each with a key of
//! its own and retried with that key after a refusal that invites it (429, 5xx) or no answer,
//! as a careful client would. Each request is its own task, so one slow answer does not hide
//! the next: every request's latency is kept, and a stall shows from outside.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uuid::Uuid;

/// Where the load goes.
#[derive(Debug, Clone)]
pub struct Target {
    pub gateway: String,
    pub token: String,
    pub task_type: String,
}

/// What the submitters saw since the last [`Load::take_window`].
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct Window {
    pub requests: usize,
    pub accepted: usize,
    /// The slowest answer (or the longest wait for none), in milliseconds.
    pub slowest_ms: u64,
    /// Requests that waited longer than a second for their answer.
    pub over_one_second: usize,
    /// The longest time between two acceptances, in milliseconds.
    pub longest_gap_ms: u64,
}

/// What the clients were told, over the whole run.
#[derive(Debug, Default)]
pub struct Told {
    pub submitted: Vec<Uuid>,
    pub accepted: HashSet<Uuid>,
    /// Tasks that fail every try: they must end DEAD_LETTER, the others COMPLETED.
    pub poison: HashSet<Uuid>,
    /// Refusals by status (retried ones included); status 0: no answer.
    pub refusals: BTreeMap<u16, usize>,
    pub slowest_ms: u64,
    pub over_one_second: usize,
    pub longest_gap_ms: u64,
}

#[derive(Default)]
struct Shared {
    told: Told,
    window: Window,
    last_accepted: Option<Instant>,
}

impl Shared {
    fn answered(&mut self, took: Duration, status: u16, key: Uuid) {
        let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        let slow = took > Duration::from_secs(1);
        for (slowest, over) in [
            (
                &mut self.window.slowest_ms,
                &mut self.window.over_one_second,
            ),
            (&mut self.told.slowest_ms, &mut self.told.over_one_second),
        ] {
            *slowest = (*slowest).max(ms);
            *over += usize::from(slow);
        }
        self.window.requests += 1;
        if (200..300).contains(&status) {
            let now = Instant::now();
            if let Some(last) = self.last_accepted.replace(now) {
                let gap = u64::try_from((now - last).as_millis()).unwrap_or(u64::MAX);
                self.window.longest_gap_ms = self.window.longest_gap_ms.max(gap);
                self.told.longest_gap_ms = self.told.longest_gap_ms.max(gap);
            }
            self.window.accepted += 1;
            self.told.accepted.insert(key);
        } else {
            *self.told.refusals.entry(status).or_default() += 1;
        }
    }
}

pub struct Load {
    shared: Arc<Mutex<Shared>>,
    offering: tokio::task::JoinHandle<()>,
    submits: Arc<tokio::sync::Semaphore>,
}

/// Requests under way at once, at most; beyond it the offered rate is not kept.
const IN_FLIGHT: usize = 512;
/// A task still refused this long after its first try is given up on (a lost client).
const GIVE_UP_AFTER: Duration = Duration::from_secs(60);

impl Load {
    /// Offers `rate` tasks a second until [`Load::stop`].
    pub fn start(target: Target, rate: f64) -> anyhow::Result<Load> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(64)
            .build()?;
        let shared: Arc<Mutex<Shared>> = Arc::default();
        let submits = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
        let every = Duration::from_secs_f64(1.0 / rate.max(0.1));
        let offering = {
            let (shared, submits) = (shared.clone(), submits.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                loop {
                    tick.tick().await;
                    let Ok(permit) = submits.clone().acquire_owned().await else {
                        return;
                    };
                    let key = Uuid::new_v4();
                    let body = {
                        let mut shared = lock(&shared);
                        let n = shared.told.submitted.len();
                        shared.told.submitted.push(key);
                        let (body, poison) = task(&target.task_type, n);
                        if poison {
                            shared.told.poison.insert(key);
                        }
                        body
                    };
                    let (http, target, shared) = (http.clone(), target.clone(), shared.clone());
                    tokio::spawn(async move {
                        submit(&http, &target, key, &body, &shared).await;
                        drop(permit);
                    });
                }
            })
        };
        Ok(Load {
            shared,
            offering,
            submits,
        })
    }

    /// What the submitters saw since the last call.
    pub fn take_window(&self) -> Window {
        std::mem::take(&mut lock(&self.shared).window)
    }

    /// Stops offering, waits for every submit to be answered or given up on, and returns
    /// what the clients were told.
    pub async fn stop(self) -> Told {
        self.offering.abort();
        let _ = self.submits.acquire_many(IN_FLIGHT as u32).await;
        std::mem::take(&mut lock(&self.shared).told)
    }
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// The `n`-th task of the mix, and whether it fails every try.
fn task(task_type: &str, n: usize) -> (serde_json::Value, bool) {
    let mut task = serde_json::json!({
        "taskType": task_type,
        "payload": { "sleepMs": 20, "failFirst": n % 50 == 49 },
    });
    if n % 10 == 9 {
        task["payload"]["renditions"] = serde_json::json!([240, 360, 480, 720, 1080]);
        task["payload"]["notes"] = serde_json::json!("x".repeat(4096));
        task["labels"] = serde_json::json!({ "asset": format!("a{}", n / 100), "tier": "gold" });
    }
    let poison = n % 250 == 249;
    if poison {
        task["payload"] = serde_json::json!({ "poison": "error" });
    }
    (task, poison)
}

async fn submit(
    http: &reqwest::Client,
    target: &Target,
    key: Uuid,
    body: &serde_json::Value,
    shared: &Mutex<Shared>,
) {
    let mut give_up: Option<Instant> = None;
    loop {
        let sent = Instant::now();
        let answer = http
            .post(format!("{}/v1/tasks", target.gateway))
            .bearer_auth(&target.token)
            .header("Idempotency-Key", key.to_string())
            .json(body)
            .send()
            .await;
        let status = answer.as_ref().map_or(0, |r| r.status().as_u16());
        lock(shared).answered(sent.elapsed(), status, key);
        let retry = status == 0 || status == 429 || status >= 500;
        if !retry {
            return;
        }
        let deadline = *give_up.get_or_insert_with(|| Instant::now() + GIVE_UP_AFTER);
        if Instant::now() > deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
