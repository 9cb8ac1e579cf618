//! The commands that find, follow and fix tasks, all over the gateway's API (no database
//! or broker credentials): `list`, `get`, `events`, `wait`, `watch`, `retry`, `cancel`,
//! `redrive`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use chrono::Utc;
use clap::Args;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::gateway::Gateway;
use crate::output::{age, labels, print_data, shorten, text, Format, Progress, Table};

/// States a task rests in.
const SETTLED: [&str; 3] = ["COMPLETED", "DEAD_LETTER", "CANCELLED"];

fn settled(task: &Value) -> bool {
    task["state"].as_str().is_some_and(|s| SETTLED.contains(&s))
}

/// Filters of `conveyorctl list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Task type (every type of yours when absent).
    #[arg(long = "type")]
    pub task_type: Option<String>,
    /// States, comma-separated or repeated: `--state DEAD_LETTER,CANCELLED`.
    #[arg(long, value_delimiter = ',')]
    pub state: Vec<String>,
    /// Label selector, as kubectl's: `-l 'pipeline=vod,tier in (gold),!canary'`.
    #[arg(long, short = 'l')]
    pub selector: Option<String>,
    /// Only tasks created within this long: `90s`, `15m`, `2h`, `7d`.
    #[arg(long, value_parser = parse_age)]
    pub since: Option<chrono::Duration>,
    /// Only tasks changed within this long (`1h`: what failed in the last hour).
    #[arg(long, value_parser = parse_age)]
    pub changed_since: Option<chrono::Duration>,
    /// Tasks per page.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Follow the pages to the end (otherwise the next page's cursor is printed).
    #[arg(long)]
    pub all: bool,
    /// Start at this page (`nextCursor` of the one before).
    #[arg(long)]
    pub cursor: Option<String>,
}

pub fn parse_age(text: &str) -> Result<chrono::Duration, String> {
    let (number, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: i64 = number
        .parse()
        .map_err(|_| format!("{text:?}: a number and a unit (s, m, h, d), e.g. 15m"))?;
    match unit {
        "s" => Ok(chrono::Duration::seconds(n)),
        "m" => Ok(chrono::Duration::minutes(n)),
        "h" => Ok(chrono::Duration::hours(n)),
        "d" => Ok(chrono::Duration::days(n)),
        _ => Err(format!("{text:?}: the unit is s, m, h or d")),
    }
}

pub async fn list(
    gateway: &Gateway,
    namespace: Option<&str>,
    args: &ListArgs,
    format: Format,
) -> anyhow::Result<()> {
    let now = Utc::now();
    let mut query: Vec<(&str, String)> = vec![("limit", args.limit.to_string())];
    let mut push = |key, value: Option<String>| {
        if let Some(value) = value {
            query.push((key, value));
        }
    };
    push("type", args.task_type.clone());
    push("namespace", namespace.map(str::to_owned));
    push(
        "state",
        (!args.state.is_empty()).then(|| args.state.join(",")),
    );
    push("labelSelector", args.selector.clone());
    push("createdAfter", args.since.map(|d| (now - d).to_rfc3339()));
    push(
        "updatedAfter",
        args.changed_since.map(|d| (now - d).to_rfc3339()),
    );
    let mut tasks = Vec::new();
    let mut cursor = args.cursor.clone();
    let progress = Progress::new();
    let next = loop {
        let mut page_query = query.clone();
        if let Some(cursor) = &cursor {
            page_query.push(("cursor", cursor.clone()));
        }
        let page = gateway.get("/v1/tasks", &page_query).await?;
        tasks.extend(page["tasks"].as_array().cloned().unwrap_or_default());
        let next = page["nextCursor"].as_str().map(str::to_owned);
        match next {
            Some(next) if args.all => {
                progress.show(tasks.len(), None, "tasks listed");
                cursor = Some(next);
            }
            next => break next,
        }
    };
    progress.finish();
    if format.is_table() {
        print!("{}", task_table(&tasks, format == Format::Wide, now));
        if let Some(next) = &next {
            eprintln!("more: --cursor {next} (or --all)");
        }
    } else {
        print_data(format, &json!({"tasks": tasks, "nextCursor": next}))?;
    }
    Ok(())
}

fn task_table(tasks: &[Value], wide: bool, now: chrono::DateTime<Utc>) -> String {
    let mut table = if wide {
        Table::new(&[
            "ID",
            "NAMESPACE",
            "TYPE",
            "STATE",
            "ATTEMPT",
            "RETRIES",
            "AGE",
            "UPDATED",
            "OWNER",
            "LABELS",
            "ERROR",
        ])
    } else {
        Table::new(&["ID", "TYPE", "STATE", "RETRIES", "AGE", "OWNER", "ERROR"])
    };
    for task in tasks {
        let owner = text(task, "owner");
        let error = text(task, "error").replace('\n', " ");
        let created = age(task["createdAt"].as_str().unwrap_or(""), now);
        table.row(if wide {
            vec![
                text(task, "id"),
                text(task, "namespace"),
                text(task, "taskType"),
                text(task, "state"),
                text(task, "attempt"),
                text(task, "retries"),
                created,
                age(task["updatedAt"].as_str().unwrap_or(""), now),
                owner,
                labels(task),
                error,
            ]
        } else {
            vec![
                text(task, "id"),
                shorten(&text(task, "taskType"), 24),
                text(task, "state"),
                text(task, "retries"),
                created,
                shorten(&owner, 32),
                shorten(&error, 48),
            ]
        });
    }
    table.render()
}

pub async fn get(gateway: &Gateway, id: Uuid, format: Format) -> anyhow::Result<()> {
    let task = gateway.get(&format!("/v1/tasks/{id}"), &[]).await?;
    if !format.is_table() {
        return print_data(format, &task);
    }
    let mut table = Table::new(&["FIELD", "VALUE"]);
    for field in [
        "id",
        "namespace",
        "taskType",
        "state",
        "attempt",
        "retries",
        "owner",
        "createdAt",
        "updatedAt",
        "error",
    ] {
        table.row(vec![field.to_owned(), text(&task, field)]);
    }
    table.row(vec!["labels".into(), labels(&task)]);
    for field in ["payload", "result"] {
        table.row(vec![field.to_owned(), task[field].to_string()]);
    }
    print!("{}", table.render());
    Ok(())
}

async fn fetch_events(gateway: &Gateway, id: Uuid) -> anyhow::Result<Vec<Value>> {
    let body = gateway.get(&format!("/v1/tasks/{id}/events"), &[]).await?;
    Ok(body["events"].as_array().cloned().unwrap_or_default())
}

pub async fn events(gateway: &Gateway, id: Uuid, format: Format) -> anyhow::Result<()> {
    let events = fetch_events(gateway, id).await?;
    if format.is_table() {
        print!("{}", events_table(&events, format == Format::Wide));
        Ok(())
    } else {
        print_data(format, &json!({ "events": events }))
    }
}

/// The audit timeline, one transition per row.
fn events_table(events: &[Value], wide: bool) -> String {
    let mut table = Table::new(&["TIME", "FROM", "TO", "ATTEMPT", "WORKER", "DETAIL"]);
    for event in events {
        let worker = text(event, "workerId");
        let detail = text(event, "detail").replace('\n', " ");
        table.row(vec![
            text(event, "at"),
            text(event, "fromState"),
            text(event, "toState"),
            text(event, "attempt"),
            if wide { worker } else { shorten(&worker, 32) },
            if wide { detail } else { shorten(&detail, 80) },
        ]);
    }
    table.render()
}

/// Polls a task, a second apart at most, backing off from a tenth of a second.
struct Poll {
    every: Duration,
}

impl Poll {
    fn new() -> Poll {
        Poll {
            every: Duration::from_millis(100),
        }
    }

    async fn pause(&mut self) {
        tokio::time::sleep(self.every).await;
        self.every = (self.every * 2).min(Duration::from_secs(1));
    }
}

/// Waits until every task has settled; fails unless all of them COMPLETED.
pub async fn wait(
    gateway: &Gateway,
    ids: &[Uuid],
    timeout: Duration,
    format: Format,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let progress = Progress::new();
    let mut done: BTreeMap<Uuid, Value> = BTreeMap::new();
    let mut poll = Poll::new();
    while done.len() < ids.len() {
        for id in ids
            .iter()
            .filter(|id| !done.contains_key(id))
            .copied()
            .collect::<Vec<_>>()
        {
            let task = gateway.get(&format!("/v1/tasks/{id}"), &[]).await?;
            if settled(&task) {
                done.insert(id, task);
            }
        }
        progress.show(done.len(), Some(ids.len()), "settled");
        if done.len() == ids.len() {
            break;
        }
        if Instant::now() >= deadline {
            progress.finish();
            bail!(
                "{} of {} tasks had not settled after {timeout:?}",
                ids.len() - done.len(),
                ids.len()
            );
        }
        poll.pause().await;
    }
    progress.finish();
    let tasks: Vec<Value> = ids.iter().filter_map(|id| done.remove(id)).collect();
    if format.is_table() {
        print!("{}", task_table(&tasks, format == Format::Wide, Utc::now()));
    } else {
        print_data(format, &json!({ "tasks": tasks }))?;
    }
    let unhappy: Vec<String> = tasks
        .iter()
        .filter(|t| t["state"] != "COMPLETED")
        .map(|t| format!("{} {}", text(t, "id"), text(t, "state")))
        .collect();
    if !unhappy.is_empty() {
        bail!("{} did not complete: {}", unhappy.len(), unhappy.join(", "));
    }
    Ok(())
}

/// Prints a task's transitions as they happen, until it settles.
pub async fn watch(gateway: &Gateway, id: Uuid, format: Format) -> anyhow::Result<()> {
    let mut seen = 0;
    let mut poll = Poll::new();
    let mut table_started = false;
    loop {
        let events = fetch_events(gateway, id).await?;
        let fresh = &events[seen.min(events.len())..];
        if !fresh.is_empty() {
            poll = Poll::new();
        }
        for event in fresh {
            match format {
                Format::Json => println!("{}", serde_json::to_string(event)?),
                Format::Yaml => print!("---\n{}", serde_yaml::to_string(event)?),
                _ => {
                    let rendered =
                        events_table(std::slice::from_ref(event), format == Format::Wide);
                    let mut lines = rendered.lines();
                    let header = lines.next().unwrap_or("");
                    if !table_started {
                        println!("{header}");
                        table_started = true;
                    }
                    for line in lines {
                        println!("{line}");
                    }
                }
            }
        }
        seen = events.len();
        let last = events.last().and_then(|e| e["toState"].as_str());
        if last.is_some_and(|s| SETTLED.contains(&s)) {
            return Ok(());
        }
        poll.pause().await;
    }
}

/// `:retry` or `:cancel` of each task; every one is tried, and the command fails if any was
/// refused.
pub async fn act(gateway: &Gateway, action: &str, ids: &[Uuid]) -> anyhow::Result<()> {
    let mut refused = 0;
    for id in ids {
        match gateway
            .post(&format!("/v1/tasks/{id}:{action}"), &json!({}))
            .await
        {
            Ok(task) => println!("{id}  {}", text(&task, "state")),
            Err(err) => {
                refused += 1;
                println!("{id}  refused: {err:#}");
            }
        }
    }
    if refused > 0 {
        let done = if action == "retry" {
            "retried"
        } else {
            "cancelled"
        };
        bail!("{refused} of {} could not be {done}", ids.len());
    }
    Ok(())
}

/// Redrives a type's dead letters (those the selector picks) over the API, a request of up
/// to 1,000 at a time until none is left or `limit` were sent back.
pub async fn redrive(
    gateway: &Gateway,
    namespace: Option<&str>,
    task_type: &str,
    selector: Option<&str>,
    limit: u64,
) -> anyhow::Result<()> {
    let progress = Progress::new();
    let (mut redriven, mut skipped) = (0u64, 0u64);
    loop {
        let batch = (limit - redriven).min(1000);
        let answer = gateway
            .post(
                "/v1/tasks:redrive",
                &json!({
                    "taskType": task_type,
                    "namespace": namespace,
                    "labelSelector": selector,
                    "limit": batch,
                }),
            )
            .await?;
        redriven += answer["redriven"].as_u64().unwrap_or(0);
        skipped += answer["skipped"].as_u64().unwrap_or(0);
        progress.show(redriven as usize, Some(limit as usize), "redriven");
        if let Some(message) = answer["error"]["message"].as_str() {
            progress.finish();
            bail!("stopped after {redriven} redriven: {message}");
        }
        let more = answer["more"].as_bool().unwrap_or(false);
        if !more || redriven >= limit || answer["redriven"].as_u64() == Some(0) {
            progress.finish();
            println!(
                "redriven: {redriven}  skipped (no longer dead-lettered): {skipped}  more left: {}",
                if more { "yes" } else { "no" }
            );
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_parse_with_their_units_and_refuse_others() {
        assert_eq!(parse_age("90s"), Ok(chrono::Duration::seconds(90)));
        assert_eq!(parse_age("2h"), Ok(chrono::Duration::hours(2)));
        assert_eq!(parse_age("7d"), Ok(chrono::Duration::days(7)));
        assert!(parse_age("1w").is_err());
        assert!(parse_age("h").is_err());
    }

    #[test]
    fn a_table_of_tasks_shortens_long_owners_but_wide_does_not() {
        let owner = "transcode-pool-7f9c6d5b8-x2k4q-0123456789abcdef-worker";
        let task = json!({"id": "0193", "taskType": "transcode", "state": "PROCESSING",
            "retries": 0, "attempt": 1, "owner": owner, "createdAt": Utc::now().to_rfc3339(),
            "updatedAt": Utc::now().to_rfc3339(), "labels": {"a": "b"}, "error": null,
            "namespace": "video"});
        let narrow = task_table(std::slice::from_ref(&task), false, Utc::now());
        assert!(
            !narrow.contains(owner) && narrow.contains("transcode-pool"),
            "{narrow}"
        );
        let wide = task_table(&[task], true, Utc::now());
        assert!(wide.contains(owner) && wide.contains("a=b"), "{wide}");
    }
}
