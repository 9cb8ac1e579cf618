//! Finding tasks once the database holds the whole run's (over 100,000 in a full run):
//! pages of `GET /v1/tasks` under the filters users reach for, timed from the client, each
//! query repeated. Runs after the throughput phases, so nothing else competes with it.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::load::percentile;
use crate::system::{System, TOKEN};

/// Times each query is asked.
const REPEATS: usize = 30;
/// Labelled tasks added first, so that selectors have something to find.
const LABELLED: usize = 2_000;

/// One query's timings.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ListTiming {
    pub query: String,
    /// Tasks on the page it answered.
    pub page: usize,
    /// Milliseconds: p50, p99 and max of [`REPEATS`].
    pub ms: BTreeMap<String, f64>,
}

/// The listing measurements of a run.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Listing {
    /// Tasks in the database when it was measured.
    pub tasks: i64,
    pub timings: Vec<ListTiming>,
}

pub async fn measure(system: &System, pool: &PgPool) -> anyhow::Result<Listing> {
    let http = reqwest::Client::new();
    label_some(&http, system).await?;
    let tasks: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks")
        .fetch_one(pool)
        .await?;
    // A cursor half-way down: a page deep in the list costs what the first does.
    let middle: Option<uuid::Uuid> =
        sqlx::query_scalar("SELECT id FROM tasks ORDER BY id OFFSET $1 LIMIT 1")
            .bind(tasks / 2)
            .fetch_optional(pool)
            .await?;
    let minute_ago = (chrono::Utc::now() - chrono::Duration::minutes(1)).to_rfc3339();
    let t = &system.task_type;
    let mut queries = vec![
        format!("type={t}&limit=50"),
        "limit=50".to_owned(),
        format!("type={t}&state=COMPLETED&limit=50"),
        format!("type={t}&state=DEAD_LETTER&limit=50"),
        format!("type={t}&labelSelector=asset%3Da7&limit=50"),
        format!("type={t}&labelSelector=tier%20in%20(gold),!canary&limit=50"),
        format!(
            "type={t}&createdAfter={}&limit=50",
            minute_ago.replace('+', "%2B")
        ),
        format!(
            "type={t}&updatedAfter={}&limit=50",
            minute_ago.replace('+', "%2B")
        ),
        format!("type={t}&labelSelector=asset%3Dnone&limit=50"),
        // The worst case: a state no partial index holds and no task is in, so the page
        // walks every task of the type.
        format!("type={t}&state=RETRY_CLAIMED&limit=50"),
    ];
    if let Some(middle) = middle {
        queries.push(format!("type={t}&cursor={middle}&limit=50"));
    }
    let mut timings = Vec::new();
    for query in queries {
        timings.push(time(&http, system, &query).await?);
    }
    Ok(Listing { tasks, timings })
}

async fn time(http: &reqwest::Client, system: &System, query: &str) -> anyhow::Result<ListTiming> {
    let url = format!("{}/v1/tasks?{query}", system.gateway_url);
    let mut ms = Vec::with_capacity(REPEATS);
    let mut page = 0;
    for _ in 0..REPEATS {
        let started = Instant::now();
        let answer: serde_json::Value = http
            .get(&url)
            .bearer_auth(TOKEN)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
        page = answer["tasks"].as_array().map_or(0, Vec::len);
    }
    ms.sort_by(f64::total_cmp);
    let stats = [("p50", 50.0), ("p99", 99.0), ("max", 100.0)]
        .into_iter()
        .map(|(name, p)| (name.to_owned(), percentile(&ms, p)))
        .collect();
    eprintln!(
        "bench: list {query}: {page} tasks, p50 {:.1} ms",
        percentile(&ms, 50.0)
    );
    Ok(ListTiming {
        query: query.to_owned(),
        page,
        ms: stats,
    })
}

/// Submits [`LABELLED`] tasks with labels: `asset` one of 200 values, `tier` gold or silver.
async fn label_some(http: &reqwest::Client, system: &System) -> anyhow::Result<()> {
    let url = format!("{}/v1/tasks:batch", system.gateway_url);
    for start in (0..LABELLED).step_by(500) {
        let tasks: Vec<serde_json::Value> = (start..start + 500)
            .map(|i| {
                serde_json::json!({
                    "taskType": system.task_type,
                    "payload": {"video": "bench.mp4", "n": i},
                    "labels": {"asset": format!("a{}", i % 200),
                               "tier": if i % 2 == 0 { "gold" } else { "silver" }},
                })
            })
            .collect();
        http.post(&url)
            .bearer_auth(TOKEN)
            .json(&serde_json::json!({ "tasks": tasks }))
            .send()
            .await?
            .error_for_status()?;
    }
    Ok(())
}
