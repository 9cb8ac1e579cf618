//! Hostile-tenant scenarios (issue 33, item 8): the scenario's own tenant is the calm one,
//! under the usual steady load; a second namespace on the same gateway, database and broker
//! acts against the platform for the fault's window with its own token and its own database
//! role. The calm tenant's requests before the act are its baseline: while the hostile one
//! acts, its accepted-task rate must stay within 10 %, its p99 within 2x, none of its
//! requests may get a 5xx, and nothing may be lost (the oracle, as in every scenario).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use conveyor_core::amqp::QueueNames;
use conveyor_core::db::{Db, DbOptions, TenantRole};
use conveyor_core::testing;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::load::Request;
use crate::scenarios::Scenario;
use crate::system::System;

/// Concurrent hostile loops, each with a client of its own in the hostile namespace (as
/// ClientTokens minted at will would be): eight times the calm load's one.
pub const LOOPS: usize = 8;

/// The token of the hostile namespace's client `i` (file tokens: no ClientToken resources
/// here).
pub fn token(i: usize) -> String {
    format!("hostile-chaos-token-6b1f0e92d4a7-{i}")
}

/// The hostile namespace of a run: unique, since its database role outlives the database.
pub fn namespace(calm_type: &str) -> String {
    // The calm type's name ends in its random part (`testing::unique_type`).
    let suffix = calm_type.rsplit('-').next().unwrap_or(calm_type);
    format!("hostile-{suffix}")
}

/// Whether the scenario has a hostile tenant beside the calm one.
pub fn is_hostile(scenario: Scenario) -> bool {
    matches!(
        scenario,
        Scenario::TenantDeletesTopology
            | Scenario::TenantFloodsStreamsAndLists
            | Scenario::TenantHoldsTransactions
            | Scenario::TenantPoisonsPayloads
    )
}

/// What the hostile tenant did, for the report.
#[derive(Default)]
struct Tally {
    sent: AtomicUsize,
    server_errors: AtomicUsize,
}

/// What the hostile tenant owns before the calm load starts (so that making it is not
/// measured as the act): the flood's thousands of tasks to follow and list.
pub async fn prepare(scenario: Scenario, system: &System) -> anyhow::Result<()> {
    if scenario == Scenario::TenantFloodsStreamsAndLists {
        let hostile = Hostile::of(system, 0)?;
        let mut taken = 0;
        let deadline = Instant::now() + Duration::from_secs(300);
        // At the namespace's rate: a refused batch waits its Retry-After and goes again.
        while taken < FLOOD_TASKS {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the hostile tenant's tasks were not taken: {taken} of {FLOOD_TASKS}"
            );
            let tasks = (0..100).map(|i| hostile.task(json!({ "n": i }))).collect();
            match hostile.submit_batch(tasks).await {
                Some(response) if response.status().is_success() => {
                    let body: Value = response.json().await.unwrap_or_default();
                    taken += body["results"]
                        .as_array()
                        .map_or(0, |all| all.iter().filter(|r| r["id"].is_string()).count());
                }
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }
    Ok(())
}

/// Tasks the flooding tenant follows and lists: past a list's scan bound, so that its
/// filters that no index serves read as much as they may.
const FLOOD_TASKS: usize = 2 * conveyor_core::db::SCAN_BOUND as usize;

/// The hostile act of `scenario` for `window`; returns notes on what it did.
pub async fn act(
    scenario: Scenario,
    system: &System,
    window: Duration,
) -> anyhow::Result<Vec<String>> {
    let hostile = Hostile::of(system, 0)?;
    let until = Instant::now() + window;
    let what = match scenario {
        Scenario::TenantDeletesTopology => hostile.delete_topology(system, until).await?,
        Scenario::TenantFloodsStreamsAndLists => hostile.flood(system, until).await?,
        Scenario::TenantHoldsTransactions => hostile.hold_transactions(system, until).await?,
        Scenario::TenantPoisonsPayloads => hostile.poison(until).await?,
        _ => anyhow::bail!("{} is not a hostile-tenant scenario", scenario.name()),
    };
    Ok(vec![format!(
        "hostile tenant: {what}; {} requests, {} answered 5xx",
        hostile.tally.sent.load(Ordering::Relaxed),
        hostile.tally.server_errors.load(Ordering::Relaxed)
    )])
}

#[derive(Clone)]
struct Hostile {
    gateway: String,
    namespace: String,
    /// The type's name as the hostile client names it (the calm type's name, in its own
    /// namespace) and its key.
    local_name: String,
    key: String,
    /// This client's token (`token(i)`).
    token: String,
    http: reqwest::Client,
    tally: Arc<Tally>,
}

impl Hostile {
    fn of(system: &System, client: usize) -> anyhow::Result<Hostile> {
        let ns = namespace(&system.task_type);
        Ok(Hostile {
            token: token(client),
            gateway: system.gateway_url.clone(),
            local_name: system.task_type.clone(),
            key: format!("{ns}.{}", system.task_type),
            namespace: ns,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            tally: Arc::new(Tally::default()),
        })
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Option<reqwest::Response> {
        self.tally.sent.fetch_add(1, Ordering::Relaxed);
        let response = request.bearer_auth(&self.token).send().await.ok()?;
        if response.status().is_server_error() {
            self.tally.server_errors.fetch_add(1, Ordering::Relaxed);
        }
        Some(response)
    }

    async fn submit_batch(&self, tasks: Vec<Value>) -> Option<reqwest::Response> {
        let request = self
            .http
            .post(format!("{}/v1/tasks:batch", self.gateway))
            .json(&json!({ "tasks": tasks }));
        self.send(request).await
    }

    fn task(&self, payload: Value) -> Value {
        json!({"taskType": self.local_name, "payload": payload})
    }

    /// This tenant as its client `i`.
    fn as_client(&self, i: usize) -> Hostile {
        Hostile {
            token: token(i % LOOPS),
            ..self.clone()
        }
    }

    /// `LOOPS` copies of `work` until `until`, each as a client of its own.
    async fn loops<F, Fut>(&self, until: Instant, work: F)
    where
        F: Fn(Hostile) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let tasks: Vec<_> = (0..LOOPS)
            .map(|i| {
                let one = work(self.as_client(i));
                tokio::spawn(async move {
                    let _ = tokio::time::timeout_at(until.into(), one).await;
                })
            })
            .collect();
        for task in tasks {
            let _ = task.await;
        }
    }

    /// Submits to its own type from every loop while its exchange and queues are deleted
    /// every two seconds (with the broker's administrator: the tenant's own user may, too).
    async fn delete_topology(&self, system: &System, until: Instant) -> anyhow::Result<String> {
        let names = QueueNames::of(&self.key);
        let management = system.management_url().to_owned();
        let deleting = tokio::spawn(async move {
            let http = testing::http_client();
            let mut rounds = 0;
            while Instant::now() < until {
                let vhost = "%2f";
                let _ = http
                    .delete(format!(
                        "{management}/api/exchanges/{vhost}/{}",
                        names.exchange()
                    ))
                    .send()
                    .await;
                for queue in [&names.main, &names.retry, &names.remediation] {
                    let _ = http
                        .delete(format!("{management}/api/queues/{vhost}/{queue}"))
                        .send()
                        .await;
                }
                rounds += 1;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            rounds
        });
        self.loops(until, |h| async move {
            loop {
                let tasks = (0..10).map(|i| h.task(json!({ "n": i }))).collect();
                h.submit_batch(tasks).await;
            }
        })
        .await;
        Ok(format!(
            "its exchange and queues deleted {} times under its own load",
            deleting.await.unwrap_or(0)
        ))
    }

    /// Streams on its thousands of tasks ([`prepare`]) as fast as it can open them (kept
    /// open), and lists filtered by a state and an update time from every loop.
    async fn flood(&self, system: &System, until: Instant) -> anyhow::Result<String> {
        let ids: Vec<String> =
            sqlx::query_scalar("SELECT id::text FROM tasks WHERE task_type = $1")
                .bind(&self.key)
                .fetch_all(system.db.pool())
                .await?;
        let ids = Arc::new(ids);
        let open = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let streams = {
            let (h, ids, open, refused) =
                (self.clone(), ids.clone(), open.clone(), refused.clone());
            tokio::spawn(async move {
                let mut held = Vec::new();
                let mut i = 0;
                while Instant::now() < until && !ids.is_empty() {
                    let id = &ids[i % ids.len()];
                    let client = h.as_client(i);
                    i += 1;
                    let request = h.http.get(format!("{}/v1/tasks/{id}/stream", h.gateway));
                    match client.send(request).await {
                        Some(r) if r.status().is_success() => {
                            open.fetch_add(1, Ordering::Relaxed);
                            held.push(r);
                        }
                        _ => {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                drop(held);
            })
        };
        let lists = Arc::new(AtomicUsize::new(0));
        let counted = lists.clone();
        self.loops(until, move |h| {
            let counted = counted.clone();
            async move {
                let since = chrono::Utc::now() - chrono::Duration::hours(1);
                let queries = [
                    format!(
                        "type={}&namespace={}&state=QUEUED&limit=500",
                        h.local_name, h.namespace
                    ),
                    format!(
                        "namespace={}&updatedAfter={}&limit=500",
                        h.namespace,
                        since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    ),
                    format!(
                        "namespace={}&labelSelector=missing%3Dlabel&limit=500",
                        h.namespace
                    ),
                    // Match nothing: every page reads its whole scan bound.
                    format!(
                        "type={}&namespace={}&state=RETRY_CLAIMED&limit=500",
                        h.local_name, h.namespace
                    ),
                    format!(
                        "namespace={}&labelSelector=%21absent&state=RETRY_CLAIMED&limit=500",
                        h.namespace
                    ),
                ];
                for query in queries.iter().cycle() {
                    let request = h.http.get(format!("{}/v1/tasks?{query}", h.gateway));
                    h.send(request).await;
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
        .await;
        let _ = streams.await;
        Ok(format!(
            "{} of its tasks; {} streams opened and held, {} refused; {} lists",
            ids.len(),
            open.load(Ordering::Relaxed),
            refused.load(Ordering::Relaxed),
            lists.load(Ordering::Relaxed)
        ))
    }

    /// Its own database role (as `conveyorctl grant` makes it), from every loop: a
    /// repeatable-read transaction that reads the tables it may see and then sits open, one
    /// holding row locks on its own tasks, until the window ends.
    async fn hold_transactions(&self, system: &System, until: Instant) -> anyhow::Result<String> {
        // Some tasks of its own to lock.
        let tasks = (0..50).map(|i| self.task(json!({ "n": i }))).collect();
        self.submit_batch(tasks).await;
        let role = TenantRole::new(&self.namespace).map_err(anyhow::Error::msg)?;
        system
            .db
            .grant_tenant(&role)
            .await
            .context("granting the hostile tenant's role")?;
        let url = system.database_url_as(role.name(), role.password())?;
        let tenant = Db::connect(&DbOptions {
            max_connections: LOOPS as u32,
            statement_timeout: None,
            ..DbOptions::new(url)
        })?;
        let held = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut open = Vec::new();
        for i in 0..LOOPS {
            let (tenant, held, stop) = (tenant.clone(), held.clone(), stop.clone());
            open.push(tokio::spawn(async move {
                let Ok(mut tx) = tenant.pool().begin().await else {
                    return;
                };
                let reads = [
                    "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ",
                    "SET LOCAL idle_in_transaction_session_timeout = 0",
                    "SELECT count(*) FROM tasks",
                    "SELECT count(*) FROM task_events",
                ];
                for statement in reads {
                    if sqlx::query(statement).execute(&mut *tx).await.is_err() {
                        return;
                    }
                }
                if i == 0 {
                    let locked = sqlx::query("SELECT id FROM tasks FOR UPDATE")
                        .execute(&mut *tx)
                        .await;
                    if let Err(err) = locked {
                        eprintln!("chaos: the hostile role could not lock its tasks: {err}");
                        return;
                    }
                }
                held.fetch_add(1, Ordering::Relaxed);
                while !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let _ = tx.rollback().await;
            }));
        }
        // Once they hold (the first its locks), its clients cancel the tasks it holds locked,
        // again and again: each request would wait on the lock with one of the API's
        // connections.
        while held.load(Ordering::Relaxed) < LOOPS && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let locked: Vec<String> =
            sqlx::query_scalar("SELECT id::text FROM tasks WHERE task_type = $1")
                .bind(&self.key)
                .fetch_all(system.db.pool())
                .await
                .context("reading the hostile tenant's tasks")?;
        let locked = Arc::new(locked);
        let cancels = Arc::new(AtomicUsize::new(0));
        let counted = cancels.clone();
        self.loops(until, move |h| {
            let (locked, counted) = (locked.clone(), counted.clone());
            async move {
                for id in locked.iter().cycle() {
                    let request = h.http.post(format!("{}/v1/tasks/{id}:cancel", h.gateway));
                    h.send(request).await;
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
        .await;
        stop.store(true, Ordering::Relaxed);
        for task in open {
            let _ = task.await;
        }
        tenant.close().await;
        system
            .db
            .revoke_tenant(&self.namespace)
            .await
            .context("revoking the hostile tenant's role")?;
        Ok(format!(
            "{} transactions of its own role held open for the window, {} cancels of the \
             tasks they locked",
            held.load(Ordering::Relaxed),
            cancels.load(Ordering::Relaxed)
        ))
    }

    /// Payloads the database or the gateway must refuse, from every loop: NUL characters,
    /// nesting deeper than any parser should follow, bodies past the limit, bodies that are
    /// not JSON, and types that do not exist.
    async fn poison(&self, until: Instant) -> anyhow::Result<String> {
        let refused = Arc::new(AtomicUsize::new(0));
        let counted = refused.clone();
        self.loops(until, move |h| {
            let counted = counted.clone();
            async move {
                let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
                let huge = "x".repeat(2 * 1024 * 1024);
                let bodies: Vec<(String, String)> = vec![
                    (
                        "tasks:batch".into(),
                        json!({"tasks": (0..50).map(|_| h.task(json!({"s": "a\u{0}b"}))).collect::<Vec<_>>()})
                            .to_string(),
                    ),
                    (
                        "tasks".into(),
                        format!(r#"{{"taskType":"{}","payload":{deep}}}"#, h.local_name),
                    ),
                    (
                        "tasks".into(),
                        json!({"taskType": h.local_name, "payload": {"s": huge}}).to_string(),
                    ),
                    ("tasks".into(), "{\"taskType\": \"unterminated".into()),
                    (
                        "tasks".into(),
                        json!({"taskType": "no-such-type", "payload": {}}).to_string(),
                    ),
                ];
                for (route, body) in bodies.iter().cycle() {
                    let request = h
                        .http
                        .post(format!("{}/v1/{route}", h.gateway))
                        .header("content-type", "application/json")
                        .header("Idempotency-Key", Uuid::new_v4().to_string())
                        .body(body.clone());
                    if let Some(response) = h.send(request).await {
                        let status = response.status();
                        let text = response.text().await.unwrap_or_default();
                        let all_refused = status.is_client_error()
                            || (status.is_success() && !text.contains("\"id\""));
                        if all_refused {
                            counted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        })
        .await;
        Ok(format!(
            "{} poisoned requests refused whole",
            refused.load(Ordering::Relaxed)
        ))
    }
}

/// The calm tenant's requests in two windows, compared: the verdict's failures and a note.
pub fn compare(
    requests: &[Request],
    load_started: Instant,
    fault: Instant,
    healed: Instant,
) -> (Vec<String>, String) {
    let window = |from: Instant, to: Instant| -> Vec<&Request> {
        requests
            .iter()
            .filter(|r| r.sent >= from && r.sent < to)
            .collect()
    };
    let baseline = window(load_started, fault);
    let during = window(fault, healed);
    let rate = |rs: &[&Request], from: Instant, to: Instant| {
        let accepted: usize = rs.iter().map(|r| r.accepted).sum();
        accepted as f64 / to.duration_since(from).as_secs_f64().max(0.001)
    };
    let p99 = |rs: &[&Request]| {
        let mut latencies: Vec<Duration> = rs.iter().map(|r| r.latency).collect();
        latencies.sort();
        latencies
            .get((latencies.len() * 99).div_ceil(100).saturating_sub(1))
            .copied()
            .unwrap_or_default()
    };
    let (base_rate, act_rate) = (
        rate(&baseline, load_started, fault),
        rate(&during, fault, healed),
    );
    let (base_p99, act_p99) = (p99(&baseline), p99(&during));
    let server_errors = requests.iter().filter(|r| r.status >= 500).count();
    let no_answer = requests.iter().filter(|r| r.status == 0).count();
    let note = format!(
        "calm tenant: {base_rate:.0} tasks/s, p99 {:.1} ms before ({} requests); \
         {act_rate:.0} tasks/s, p99 {:.1} ms while the hostile tenant acted ({} requests); \
         {server_errors} answered 5xx, {no_answer} unanswered",
        base_p99.as_secs_f64() * 1000.0,
        baseline.len(),
        act_p99.as_secs_f64() * 1000.0,
        during.len(),
    );
    let mut failures = Vec::new();
    if baseline.is_empty() || during.is_empty() {
        failures.push("the calm tenant sent nothing in a window".to_owned());
    }
    if act_rate < 0.9 * base_rate {
        failures.push(format!(
            "the calm tenant's accepted rate fell to {:.0} % of its baseline",
            100.0 * act_rate / base_rate.max(f64::MIN_POSITIVE)
        ));
    }
    if act_p99 > base_p99 * 2 {
        failures.push(format!(
            "the calm tenant's p99 rose to {:.1}x its baseline",
            act_p99.as_secs_f64() / base_p99.as_secs_f64().max(f64::MIN_POSITIVE)
        ));
    }
    if server_errors + no_answer > 0 {
        failures.push(format!(
            "the calm tenant got {server_errors} 5xx answers and {no_answer} no answer"
        ));
    }
    (failures, note)
}
