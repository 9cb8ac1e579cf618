//! The load: batch submits, single-task submits from many keep-alive connections, and single
//! submits at a fixed offered rate. Completions are counted from the workers' /metrics (no
//! query against the database while it is measured); what the clients were told is checked
//! against the database once, at the end of each phase.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use conveyor_core::testing;
use conveyor_core::TaskState;
use serde::Deserialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::system::{System, TOKEN};

/// How often the workers' counters are read while a phase runs.
const WATCH_EVERY: Duration = Duration::from_millis(250);

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Answer {
    id: Option<Uuid>,
}

#[derive(Deserialize)]
struct BatchAnswer {
    results: Vec<Answer>,
}

/// Tasks the clients were told were accepted, with when they were sent.
pub type Accepted = Vec<(Uuid, DateTime<Utc>)>;

fn body(task_type: &str, n: usize) -> serde_json::Value {
    serde_json::json!({ "taskType": task_type, "payload": { "video": "bench.mp4", "n": n } })
}

/// A task as a video pipeline labels it: what it belongs to, and one of a few tiers. Rows
/// with labels are the ones the GIN index `tasks_labels` holds (decision 0024).
fn labelled(task_type: &str, n: usize) -> serde_json::Value {
    const TIERS: [&str; 3] = ["gold", "silver", "bronze"];
    let mut task = body(task_type, n);
    task["labels"] = serde_json::json!({
        "asset": format!("a{}", n / 10),
        "pipeline": "vod",
        "tier": TIERS[n % 3],
    });
    task
}

/// Batches of `batch` from `clients` concurrent submitters until `tasks` are accepted;
/// with three labels on each task when `with_labels`.
pub async fn batches(
    system: &System,
    tasks: usize,
    batch: usize,
    clients: usize,
    with_labels: bool,
) -> anyhow::Result<Accepted> {
    let make = if with_labels { labelled } else { body };
    let http = reqwest::Client::new();
    let next = Arc::new(AtomicUsize::new(0));
    let url = format!("{}/v1/tasks:batch", system.gateway_url);
    let submitters = (0..clients).map(|_| {
        let (http, next, url) = (http.clone(), next.clone(), url.clone());
        let task_type = system.task_type.clone();
        async move {
            let mut accepted = Accepted::new();
            loop {
                let start = next.fetch_add(batch, Ordering::Relaxed);
                if start >= tasks {
                    return anyhow::Ok(accepted);
                }
                let n = batch.min(tasks - start);
                let entries: Vec<_> = (start..start + n).map(|i| make(&task_type, i)).collect();
                let sent = Utc::now();
                let answer = http
                    .post(&url)
                    .bearer_auth(TOKEN)
                    .json(&serde_json::json!({ "tasks": entries }))
                    .send()
                    .await?
                    .error_for_status()?
                    .json::<BatchAnswer>()
                    .await?;
                let ids: Vec<Uuid> = answer.results.iter().filter_map(|a| a.id).collect();
                anyhow::ensure!(ids.len() == n, "{} of {n} tasks refused", n - ids.len());
                accepted.extend(ids.into_iter().map(|id| (id, sent)));
            }
        }
    });
    let answers = futures_util::future::try_join_all(submitters).await?;
    Ok(answers.into_iter().flatten().collect())
}

/// Single-task submits from `connections` clients, each waiting for its answer before the
/// next (keep-alive), until `tasks` are accepted.
pub async fn singles(
    system: &System,
    tasks: usize,
    connections: usize,
) -> anyhow::Result<Accepted> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .build()?;
    let next = Arc::new(AtomicUsize::new(0));
    let submitters = (0..connections).map(|_| {
        let (http, next) = (http.clone(), next.clone());
        async move {
            let mut accepted = Accepted::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= tasks {
                    return anyhow::Ok(accepted);
                }
                accepted.push(submit_one(&http, system, i).await?);
            }
        }
    });
    let answers = futures_util::future::try_join_all(submitters).await?;
    Ok(answers.into_iter().flatten().collect())
}

async fn submit_one(
    http: &reqwest::Client,
    system: &System,
    i: usize,
) -> anyhow::Result<(Uuid, DateTime<Utc>)> {
    let sent = Utc::now();
    let answer: Answer = http
        .post(format!("{}/v1/tasks", system.gateway_url))
        .bearer_auth(TOKEN)
        .json(&body(&system.task_type, i))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    Ok((answer.id.context("an accepted task has an id")?, sent))
}

/// Single submits at `rate` per second for `seconds`, each sent on schedule whether or not
/// the ones before it were answered (an open loop: a slow answer does not slow the offer).
/// Refusals (429, 503: the system over its limits) are counted in `refused`, not failed.
pub async fn fixed_rate(
    system: &System,
    rate: u32,
    seconds: u64,
    refused: &AtomicUsize,
) -> anyhow::Result<Accepted> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;
    let total = rate as usize * seconds as usize;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sends = tokio::task::JoinSet::new();
    let start = Utc::now();
    for i in 0..total {
        tick.tick().await;
        // The scheduled time, not the moment of sending: a send delayed by a busy load
        // generator (ticks that burst after a stall) counts as latency.
        let sent = start + chrono::TimeDelta::microseconds(i as i64 * 1_000_000 / i64::from(rate));
        let (http, url, task_type) = (
            http.clone(),
            system.gateway_url.clone(),
            system.task_type.clone(),
        );
        sends.spawn(async move {
            let answer = http
                .post(format!("{url}/v1/tasks"))
                .bearer_auth(TOKEN)
                .json(&body(&task_type, i))
                .send()
                .await?;
            let status = answer.status();
            if status.as_u16() == 429 || status.as_u16() == 503 {
                return Ok(None);
            }
            let answer: Answer = answer.error_for_status()?.json().await?;
            let id = answer.id.context("an accepted task has an id")?;
            anyhow::Ok(Some((id, sent)))
        });
    }
    let mut accepted = Accepted::new();
    while let Some(joined) = sends.join_next().await {
        match joined?? {
            Some(task) => accepted.push(task),
            None => {
                refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(accepted)
}

/// Completions the workers report, summed.
pub async fn completed(http: &reqwest::Client, system: &System) -> f64 {
    let mut total = 0.0;
    for listen in &system.worker_metrics {
        if let Some(page) = testing::metrics_page(http, listen).await {
            total += page
                .lines()
                .filter(|l| l.starts_with("conveyor_tasks_total{") && l.contains("\"completed\""))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>();
        }
    }
    total
}

/// The completion counter over time while `load` runs, until `expected` more are done.
pub struct Timeline {
    /// (seconds since start, completions since start).
    pub samples: Vec<(f64, f64)>,
}

impl Timeline {
    /// Seconds from the start to the last completion.
    pub fn seconds(&self) -> f64 {
        self.samples.last().map_or(0.0, |s| s.0)
    }

    /// Completions per second between 10 % and 90 % of the total: the steady state, without
    /// the ramp-up and the tail.
    pub fn steady_rate(&self, total: f64) -> f64 {
        let at = |fraction: f64| {
            self.samples
                .iter()
                .find(|s| s.1 >= total * fraction)
                .copied()
        };
        match (at(0.1), at(0.9)) {
            (Some(a), Some(b)) if b.0 > a.0 => (b.1 - a.1) / (b.0 - a.0),
            _ => total / self.seconds().max(f64::EPSILON),
        }
    }
}

/// Runs `load`, watching completions until as many more are reported as `load` had tasks
/// accepted (at most `expected`), or `limit` passes. A failed load ends the phase at once.
pub async fn watched<F>(
    system: &System,
    expected: usize,
    limit: Duration,
    load: F,
) -> anyhow::Result<(Accepted, Timeline)>
where
    F: std::future::Future<Output = anyhow::Result<Accepted>>,
{
    let http = reqwest::Client::new();
    let base = completed(&http, system).await;
    let started = Instant::now();
    let target = AtomicUsize::new(expected);
    let mut samples = Vec::new();
    let load = async {
        let accepted = load.await?;
        target.store(accepted.len(), Ordering::Relaxed);
        anyhow::Ok(accepted)
    };
    let watch = async {
        loop {
            tokio::time::sleep(WATCH_EVERY).await;
            let done = completed(&http, system).await - base;
            samples.push((started.elapsed().as_secs_f64(), done));
            let wanted = target.load(Ordering::Relaxed);
            if done >= wanted as f64 {
                return Ok(());
            }
            if started.elapsed() > limit {
                anyhow::bail!("{done} of {wanted} tasks completed within {limit:?}");
            }
        }
    };
    let (accepted, ()) = tokio::try_join!(load, watch)?;
    Ok((accepted, Timeline { samples }))
}

/// What the database says of the tasks the clients were told were accepted: every one
/// COMPLETED once, with the whole audit chain; and when each completed.
pub struct Verdict {
    pub completed_once: usize,
    pub full_chains: usize,
    pub duplicate_completions: usize,
    /// Tasks whose chain is longer than the five states of one attempt (a re-run after a
    /// timeout, a re-queue): allowed, at least once, and counted.
    pub reruns: usize,
    pub completed_at: HashMap<Uuid, DateTime<Utc>>,
}

/// A task as the database has it: id, state, its audit chain's states, when it completed
/// and how many COMPLETED rows it has.
type TaskReadBack = (Uuid, String, Vec<String>, Option<DateTime<Utc>>, i64);

const FULL_CHAIN: &str = "{INGESTED,QUEUED,CLAIMED,PROCESSING,COMPLETED}";

pub async fn verify(pool: &PgPool, accepted: &Accepted) -> anyhow::Result<Verdict> {
    let ids: Vec<Uuid> = accepted.iter().map(|(id, _)| *id).collect();
    let rows: Vec<TaskReadBack> = sqlx::query_as(
        "SELECT t.id, t.state,
                array_agg(e.to_state ORDER BY e.at, e.seq),
                max(e.at) FILTER (WHERE e.to_state = 'COMPLETED'),
                count(*) FILTER (WHERE e.to_state = 'COMPLETED')
         FROM tasks t JOIN task_events e ON e.task_id = t.id
         WHERE t.id = ANY($1) GROUP BY t.id, t.state",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await
    .context("read the accepted tasks back")?;
    let chain: Vec<String> = FULL_CHAIN
        .trim_matches(['{', '}'])
        .split(',')
        .map(str::to_owned)
        .collect();
    let mut verdict = Verdict {
        completed_once: 0,
        full_chains: 0,
        duplicate_completions: 0,
        reruns: 0,
        completed_at: HashMap::new(),
    };
    for (id, state, events, at, completions) in rows {
        if state == "COMPLETED" && completions == 1 {
            verdict.completed_once += 1;
        }
        if completions > 1 {
            verdict.duplicate_completions += 1;
        }
        if valid_chain(&events) {
            verdict.full_chains += 1;
        }
        if events != chain {
            verdict.reruns += 1;
        }
        if let Some(at) = at {
            verdict.completed_at.insert(id, at);
        }
    }
    Ok(verdict)
}

/// A whole audit chain: from INGESTED, each step an edge of the lifecycle, to COMPLETED.
fn valid_chain(states: &[String]) -> bool {
    let parsed: Option<Vec<TaskState>> = states.iter().map(|s| s.parse().ok()).collect();
    let Some(parsed) = parsed else { return false };
    parsed.first() == Some(&TaskState::Ingested)
        && parsed.last() == Some(&TaskState::Completed)
        && parsed
            .windows(2)
            .all(|w| conveyor_core::lifecycle::check(w[0], w[1]).is_ok())
}

/// Submit → COMPLETED latencies in milliseconds, sorted.
pub fn latencies_ms(accepted: &Accepted, verdict: &Verdict) -> Vec<f64> {
    let mut latencies: Vec<f64> = accepted
        .iter()
        .filter_map(|(id, sent)| {
            let done = verdict.completed_at.get(id)?;
            Some((*done - *sent).num_microseconds()? as f64 / 1000.0)
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    latencies
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
