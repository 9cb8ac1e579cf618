//! The load generator: submits tasks with unique idempotency keys at a steady rate and keeps
//! every answer. A refusal that invites a retry (429, 503, no answer at all) is retried with
//! the same key and payload, as a careful client would; that must never create a second
//! task.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use uuid::Uuid;

/// What to submit.
#[derive(Debug, Clone)]
pub struct Plan {
    pub tasks: usize,
    /// Spread over this long.
    pub over: Duration,
    /// Tasks per request.
    pub batch: usize,
    /// The handler's work per task.
    pub sleep_ms: u64,
    /// Every n-th task fails on every try (`"poison": "error"`).
    pub poison_error_every: Option<usize>,
    /// This many tasks crash their worker on every try (`"poison": "crash"`).
    pub poison_crash: usize,
    /// Every n-th task fails its first try only (`"failFirst": true`): healthy, but its
    /// retry goes through a re-queue transaction.
    pub flaky_every: Option<usize>,
    /// Retries stop this long after the last first submission.
    pub give_up_after: Duration,
    /// Every n-th task is not retried after a request that got no answer: a client that
    /// hung up or sent no key. Only the sweeper can finish such a task if its gateway died
    /// between recording and publishing it.
    pub forget_unanswered_every: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Accepted,
    Refused(u16),
    /// No answer (connection refused or reset, timeout).
    Unknown,
}

#[derive(Debug, Clone)]
pub struct Submitted {
    pub key: Uuid,
    pub poison: bool,
    pub answer: Answer,
}

/// One request of the load, as its client saw it.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    pub sent: Instant,
    pub latency: Duration,
    /// The HTTP status; 0 for no answer.
    pub status: u16,
    /// Tasks it got accepted.
    pub accepted: usize,
}

#[derive(Debug, Default)]
pub struct Outcome {
    pub tasks: Vec<Submitted>,
    /// Every request, retries included, in the order they were sent.
    pub requests: Vec<Request>,
    /// Every refusal seen on the way, by status (retried ones included).
    pub refusals: BTreeMap<u16, usize>,
    /// 429 and 503 answers without a Retry-After header.
    pub missing_retry_after: usize,
}

impl Outcome {
    pub fn count(&self, answer: Answer) -> usize {
        self.tasks.iter().filter(|t| t.answer == answer).count()
    }
}

/// Tasks per request of most scenarios.
pub const BATCH: usize = 10;

/// Where the load goes: a gateway, a client's token, and a task type in a namespace (none
/// for a task types file).
pub struct Client {
    pub gateway: String,
    pub token: String,
    pub task_type: String,
    pub namespace: Option<String>,
}

/// Runs `plan` against the gateway; returns when every task was accepted or given up on.
pub async fn run(client: Client, plan: Plan) -> Outcome {
    let Client {
        gateway,
        token,
        task_type,
        namespace,
    } = client;
    // The local stack's gateway serves HTTPS with the dev CA's certificate.
    let http = conveyor_core::testing::dev_roots()
        .client_builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap_or_default();
    let payloads: Vec<(Uuid, Value, bool)> = (0..plan.tasks)
        .map(|i| {
            let poison = if i < plan.poison_crash {
                Some("crash")
            } else if plan.poison_error_every.is_some_and(|n| i % n == n - 1) {
                Some("error")
            } else {
                None
            };
            let flaky = plan.flaky_every.is_some_and(|n| i % n == n - 1);
            let payload = match poison {
                Some(kind) => json!({"poison": kind}),
                None => json!({"sleepMs": plan.sleep_ms, "failFirst": flaky}),
            };
            (Uuid::new_v4(), payload, poison.is_some())
        })
        .collect();
    let mut answers: BTreeMap<Uuid, Answer> = BTreeMap::new();
    let mut outcome = Outcome::default();
    // (not before, entries)
    let mut retries: Vec<(Instant, Vec<usize>)> = Vec::new();
    let batch_size = plan.batch.max(1);
    let pause = plan
        .over
        .div_f64((plan.tasks.div_ceil(batch_size)).max(1) as f64);
    let mut next = Instant::now();
    let mut fresh = (0..plan.tasks).collect::<Vec<_>>().into_iter();
    let mut deadline = None;
    loop {
        let now = Instant::now();
        let due = retries.iter().position(|(at, _)| *at <= now);
        let batch: Vec<usize> = if let Some(i) = due {
            retries.swap_remove(i).1
        } else if now >= next && deadline.is_none() {
            next += pause;
            let batch: Vec<usize> = fresh.by_ref().take(batch_size).collect();
            if batch.is_empty() {
                deadline = Some(now + plan.give_up_after);
                continue;
            }
            batch
        } else if deadline.is_some_and(|d| retries.is_empty() || now >= d) {
            break;
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let tasks: Vec<Value> = batch
            .iter()
            .map(|&i| {
                json!({"taskType": task_type, "namespace": namespace,
                "payload": payloads[i].1, "idempotencyKey": payloads[i].0})
            })
            .collect();
        let started = Instant::now();
        let sent = http
            .post(format!("{gateway}/v1/tasks:batch"))
            .bearer_auth(&token)
            .json(&json!({ "tasks": tasks }))
            .send()
            .await;
        let mut request = Request {
            sent: started,
            latency: Duration::ZERO,
            status: 0,
            accepted: 0,
        };
        let mut again = Vec::new();
        let mut wait = Duration::from_millis(500);
        match sent {
            Err(_) => {
                for &i in &batch {
                    answers.insert(payloads[i].0, Answer::Unknown);
                }
                let forgotten = |i: &usize| {
                    plan.forget_unanswered_every
                        .is_some_and(|n| i.is_multiple_of(n))
                };
                again = batch.into_iter().filter(|i| !forgotten(i)).collect();
            }
            Ok(response) => {
                let status = response.status().as_u16();
                request.status = status;
                if let Some(after) = retry_after(response.headers()) {
                    wait = after;
                } else if status == 429 || status == 503 {
                    outcome.missing_retry_after += 1;
                }
                let body: Value = response.json().await.unwrap_or_default();
                match body["results"].as_array() {
                    Some(results) if results.len() == batch.len() => {
                        for (result, &i) in results.iter().zip(&batch) {
                            let code = result["status"].as_u64().unwrap_or(0) as u16;
                            if result["id"].is_string() {
                                request.accepted += 1;
                                answers.insert(payloads[i].0, Answer::Accepted);
                            } else {
                                *outcome.refusals.entry(code).or_default() += 1;
                                answers.insert(payloads[i].0, Answer::Refused(code));
                                if code == 429 || code == 503 {
                                    again.push(i);
                                }
                            }
                        }
                    }
                    _ => {
                        // The batch as a whole was refused (503 while the database is down).
                        *outcome.refusals.entry(status).or_default() += batch.len();
                        for &i in &batch {
                            answers.insert(payloads[i].0, Answer::Refused(status));
                        }
                        if status == 429 || status >= 500 {
                            again = batch;
                        }
                    }
                }
            }
        }
        // Until the whole answer was read: what a client waits for.
        request.latency = started.elapsed();
        outcome.requests.push(request);
        if !again.is_empty() {
            retries.push((Instant::now() + wait, again));
        }
    }
    outcome.tasks = payloads
        .iter()
        .map(|(key, _, poison)| Submitted {
            key: *key,
            poison: *poison,
            answer: answers.get(key).copied().unwrap_or(Answer::Unknown),
        })
        .collect();
    outcome
}

fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let seconds: f64 = headers.get("retry-after")?.to_str().ok()?.parse().ok()?;
    Some(Duration::from_secs_f64(seconds.clamp(0.05, 5.0)))
}
