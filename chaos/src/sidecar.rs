//! The handler every chaos worker calls (`--handler http`): it performs the task's "side
//! effect" and records it by idempotency key and attempt, so the oracle can count re-runs
//! and duplicate side effects. A payload may ask it to misbehave: `"poison": "error"` fails
//! every try, `"poison": "crash"` has the calling worker killed (the whole process, as a
//! segfaulting codec would), and `"failFirst": true` fails the first attempt only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use tokio::sync::mpsc;
use uuid::Uuid;

#[derive(Default)]
struct Effects {
    /// Idempotency key → the attempts whose effect was performed.
    by_key: HashMap<Uuid, Vec<i32>>,
    /// Effects under way now, and the most at once since the last mark.
    in_flight: usize,
    peak: usize,
}

#[derive(Clone)]
struct Shared {
    effects: Arc<Mutex<Effects>>,
    crash: mpsc::UnboundedSender<Uuid>,
}

pub struct Sidecar {
    pub url: String,
    effects: Arc<Mutex<Effects>>,
    server: tokio::task::JoinHandle<()>,
}

/// What the side-effect log shows.
#[derive(Debug, Default, Clone, Copy)]
pub struct EffectCounts {
    /// Handler runs that performed their effect.
    pub runs: usize,
    /// Runs beyond the first per key (at-least-once: expected under faults).
    pub reruns: usize,
    /// The same attempt of the same task performing its effect twice: two workers ran one
    /// delivery at once, which fencing must make impossible.
    pub duplicates: usize,
}

impl Sidecar {
    /// Starts the handler; task ids whose worker must crash arrive on the receiver.
    pub async fn start() -> anyhow::Result<(Sidecar, mpsc::UnboundedReceiver<Uuid>)> {
        let (crash, crashes) = mpsc::unbounded_channel();
        let effects: Arc<Mutex<Effects>> = Arc::default();
        let shared = Shared {
            effects: effects.clone(),
            crash,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/effect", listener.local_addr()?);
        let app = Router::new()
            .route("/effect", post(effect))
            .with_state(shared);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok((
            Sidecar {
                url,
                effects,
                server,
            },
            crashes,
        ))
    }

    /// Idempotency key → the attempts that performed their effect, as the sidecar saw them.
    pub fn attempts_by_key(&self) -> HashMap<Uuid, Vec<i32>> {
        self.lock().by_key.clone()
    }

    /// Starts counting the most effects under way at once from now (the fault's start).
    pub fn mark(&self) {
        let mut effects = self.lock();
        effects.peak = effects.in_flight;
    }

    /// The most effects under way at once since [`Sidecar::mark`]: what a fault can catch
    /// mid-task, hence what may have to run again.
    pub fn peak_in_flight(&self) -> usize {
        self.lock().peak
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Effects> {
        self.effects.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn counts(&self) -> EffectCounts {
        let effects = self.effects.lock().unwrap_or_else(|p| p.into_inner());
        let mut counts = EffectCounts::default();
        for attempts in effects.by_key.values() {
            counts.runs += attempts.len();
            counts.reruns += attempts.len().saturating_sub(1);
            let mut sorted = attempts.clone();
            sorted.sort_unstable();
            counts.duplicates += sorted.windows(2).filter(|w| w[0] == w[1]).count();
        }
        counts
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn effect(
    State(shared): State<Shared>,
    headers: HeaderMap,
    Json(payload): Json<serde_json::Value>,
) -> StatusCode {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let key = header("Idempotency-Key").and_then(|v| v.parse::<Uuid>().ok());
    let attempt = header("X-Conveyor-Attempt").and_then(|v| v.parse::<i32>().ok());
    let task = header("X-Conveyor-Task-Id").and_then(|v| v.parse::<Uuid>().ok());
    let (Some(key), Some(attempt), Some(task)) = (key, attempt, task) else {
        return StatusCode::BAD_REQUEST;
    };
    match payload["poison"].as_str() {
        Some("error") => return StatusCode::INTERNAL_SERVER_ERROR,
        Some("crash") => {
            let _ = shared.crash.send(task);
            // The caller is killed before this answers.
            tokio::time::sleep(Duration::from_secs(30)).await;
            return StatusCode::INTERNAL_SERVER_ERROR;
        }
        _ if attempt == 0 && payload["failFirst"] == true => {
            return StatusCode::SERVICE_UNAVAILABLE;
        }
        _ => {}
    }
    // The effect happens as the request arrives: a worker killed mid-task has already
    // caused it (as an output file half-written would), and a re-run causes it again.
    {
        let mut effects = shared.effects.lock().unwrap_or_else(|p| p.into_inner());
        effects.by_key.entry(key).or_default().push(attempt);
        effects.in_flight += 1;
        effects.peak = effects.peak.max(effects.in_flight);
    }
    // Counted down however the request ends (a killed worker drops it mid-sleep).
    let _done = InFlight(shared.effects.clone());
    let ms = payload["sleepMs"].as_u64().unwrap_or(20);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    StatusCode::OK
}

struct InFlight(Arc<Mutex<Effects>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut effects = self.0.lock().unwrap_or_else(|p| p.into_inner());
        effects.in_flight = effects.in_flight.saturating_sub(1);
    }
}
