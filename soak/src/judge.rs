//! The verdict once the load has stopped and the system is quiet. Three sources that do not
//! trust each other must agree: what each client was told (the load), what the handler did
//! (the side-effect sidecar), and where each task ended: its row in PostgreSQL, or, once
//! the settled-task retention expired it, its line in the archive the gateway wrote first.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use conveyor_chaos::sidecar::Sidecar;
use conveyor_core::db::Db;
use uuid::Uuid;

use crate::load::Told;

#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct Verdict {
    pub submitted: usize,
    pub accepted: usize,
    /// Healthy tasks COMPLETED, in the table or in the archive.
    pub completed: usize,
    /// Expired from the table into the archive.
    pub archived: usize,
    /// Accepted, and neither COMPLETED nor DEAD_LETTER in the table nor archived.
    pub lost: usize,
    /// Rows of the soak's type neither COMPLETED, CANCELLED nor DEAD_LETTER once quiet.
    pub stranded: usize,
    /// Healthy tasks that ended DEAD_LETTER.
    pub dead_lettered: usize,
    /// Tasks failing every try that ended DEAD_LETTER, as they must.
    pub poison_dead_lettered: usize,
    /// Tasks failing every try that ended otherwise (COMPLETED: a handler's failure lost).
    pub poison_completed: usize,
    /// COMPLETED (table or archive) by an attempt whose effect the handler never saw.
    pub completed_without_effect: usize,
    /// One attempt of a task performing its effect twice (fencing must prevent it).
    pub duplicate_side_effects: usize,
    /// Effects performed again by a later attempt (at least once: counted, not failed).
    pub reruns: usize,
    /// Tasks the archive holds more than once (a delete that failed after its archive).
    pub archived_twice: usize,
}

impl Verdict {
    pub fn failures(&self) -> Vec<String> {
        let mut failures: Vec<String> = [
            (self.lost, "lost"),
            (self.stranded, "stranded"),
            (
                self.completed_without_effect,
                "COMPLETED without their effect",
            ),
            (self.duplicate_side_effects, "duplicate side effects"),
            (self.dead_lettered, "healthy tasks dead-lettered"),
            (self.poison_completed, "failing tasks COMPLETED"),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
        if self.accepted == 0 {
            failures.push("no task was accepted".to_owned());
        }
        failures
    }
}

const TERMINAL: [&str; 3] = ["COMPLETED", "CANCELLED", "DEAD_LETTER"];

/// Waits up to `limit` for every task of the type to settle; returns how many did not.
pub async fn quiet(db: &Db, task_type: &str, limit: Duration) -> anyhow::Result<i64> {
    let until = Instant::now() + limit;
    loop {
        let open = open_tasks(db, task_type).await?;
        if open == 0 || Instant::now() > until {
            return Ok(open);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn open_tasks(db: &Db, task_type: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM tasks WHERE task_type = $1 AND NOT (state = ANY($2))",
    )
    .bind(task_type)
    .bind(&TERMINAL[..])
    .fetch_one(db.pool())
    .await?)
}

/// Where a task ended: its state and the attempt that got there.
#[derive(Debug, Clone)]
struct End {
    state: String,
    attempt: i32,
}

pub async fn judge(
    db: &Db,
    task_type: &str,
    archive: &Path,
    told: &Told,
    sidecar: &Sidecar,
) -> anyhow::Result<Verdict> {
    let rows: Vec<(Uuid, String, i32)> =
        sqlx::query_as("SELECT idempotency_key, state, attempt FROM tasks WHERE task_type = $1")
            .bind(task_type)
            .fetch_all(db.pool())
            .await?;
    let mut ends: HashMap<Uuid, End> = rows
        .into_iter()
        .map(|(key, state, attempt)| (key, End { state, attempt }))
        .collect();
    let mut verdict = Verdict {
        submitted: told.submitted.len(),
        accepted: told.accepted.len(),
        stranded: ends
            .values()
            .filter(|e| !TERMINAL.contains(&e.state.as_str()))
            .count(),
        ..Verdict::default()
    };
    let mut archived: HashSet<Uuid> = HashSet::new();
    for (key, end) in archived_tasks(archive, task_type)? {
        if !archived.insert(key) {
            verdict.archived_twice += 1;
        }
        // A row still in the table is the truth (its delete failed after the archive).
        ends.entry(key).or_insert(end);
    }
    verdict.archived = archived.len();
    let effects = sidecar.attempts_by_key();
    let counts = sidecar.counts();
    verdict.duplicate_side_effects = counts.duplicates;
    verdict.reruns = counts.reruns;
    for key in &told.accepted {
        match ends.get(key) {
            Some(end) if end.state == "COMPLETED" && told.poison.contains(key) => {
                verdict.poison_completed += 1;
            }
            Some(end) if end.state == "COMPLETED" => {
                verdict.completed += 1;
                if !effects.get(key).is_some_and(|a| a.contains(&end.attempt)) {
                    verdict.completed_without_effect += 1;
                }
            }
            Some(end) if end.state == "DEAD_LETTER" => match told.poison.contains(key) {
                true => verdict.poison_dead_lettered += 1,
                false => verdict.dead_lettered += 1,
            },
            _ => verdict.lost += 1,
        }
    }
    Ok(verdict)
}

/// Every task of `task_type` in the archive (`<dir>/<day>/<type>.ndjson`).
fn archived_tasks(dir: &Path, task_type: &str) -> anyhow::Result<Vec<(Uuid, End)>> {
    let mut tasks = Vec::new();
    let Ok(days) = std::fs::read_dir(dir) else {
        return Ok(tasks);
    };
    for day in days.flatten() {
        let file = day.path().join(format!("{task_type}.ndjson"));
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for line in text.lines().filter(|l| !l.is_empty()) {
            let task: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            let key = task["idempotencyKey"].as_str().and_then(|k| k.parse().ok());
            let state = task["state"].as_str().map(str::to_owned);
            let attempt = task["attempt"].as_i64().and_then(|a| i32::try_from(a).ok());
            let (Some(key), Some(state), Some(attempt)) = (key, state, attempt) else {
                anyhow::bail!("{}: a line without key, state or attempt", file.display());
            };
            tasks.push((key, End { state, attempt }));
        }
    }
    Ok(tasks)
}
