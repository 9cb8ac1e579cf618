//! The oracle every scenario shares: what went in must come out. Once the fault has healed
//! and the system is quiet, PostgreSQL, the side-effect log and the load generator's answers
//! must agree. All of the suite's SQL is here.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use conveyor_core::db::Db;
use conveyor_core::lifecycle::check_chain;
use conveyor_core::TaskState;
use uuid::Uuid;

use crate::load::{Answer, Outcome};
use crate::sidecar::EffectCounts;

/// Per scenario: the figures of the report.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Verdict {
    pub accepted: usize,
    pub refused: usize,
    pub unknown: usize,
    pub completed: usize,
    pub dead_lettered: usize,
    /// Accepted tasks neither COMPLETED nor DEAD_LETTER once quiet.
    pub lost: usize,
    /// Tasks with more than one COMPLETED transition.
    pub duplicate_completions: usize,
    /// The same attempt of a task performing its side effect twice.
    pub duplicate_side_effects: usize,
    /// Handler runs beyond one per task (at-least-once re-runs after a fault).
    pub reruns: usize,
    /// Healthy (non-poison) tasks that ended DEAD_LETTER.
    pub healthy_dead_lettered: usize,
    /// Audit chains that are not a valid lifecycle path.
    pub invalid_chains: usize,
    /// PostgreSQL sessions left idle in a transaction.
    pub idle_in_transaction: usize,
    /// From the fault healing to throughput back at half its level before the fault.
    pub recovery_seconds: f64,
}

impl Verdict {
    /// The invariants: nothing lost, nothing done twice, every chain valid.
    pub fn failures(&self) -> Vec<String> {
        let checks = [
            (self.lost, "lost"),
            (self.duplicate_completions, "duplicate completions"),
            (self.duplicate_side_effects, "duplicate side effects"),
            (self.healthy_dead_lettered, "healthy tasks dead-lettered"),
            (self.invalid_chains, "invalid audit chains"),
            (self.idle_in_transaction, "sessions idle in transaction"),
        ];
        let mut failures: Vec<String> = checks
            .iter()
            .filter(|(n, _)| *n > 0)
            .map(|(n, what)| format!("{n} {what}"))
            .collect();
        if self.accepted == 0 {
            failures.push("no task was accepted".to_owned());
        }
        if self.recovery_seconds > 60.0 {
            failures.push(format!("recovery took {:.1}s", self.recovery_seconds));
        }
        failures
    }
}

/// Accepted tasks not yet COMPLETED or DEAD_LETTER (None while the database cannot say).
pub async fn open_tasks(db: &Db, task_type: &str, load: &Outcome) -> Option<usize> {
    let states = states_by_key(db, task_type).await.ok()?;
    let accepted = accepted_keys(load);
    Some(
        accepted
            .iter()
            .filter(|k| !is_terminal(states.get(*k)))
            .count(),
    )
}

fn accepted_keys(load: &Outcome) -> Vec<Uuid> {
    load.tasks
        .iter()
        .filter(|t| t.answer == Answer::Accepted)
        .map(|t| t.key)
        .collect()
}

fn is_terminal(state: Option<&(Uuid, TaskState)>) -> bool {
    matches!(
        state,
        Some((_, TaskState::Completed | TaskState::DeadLetter))
    )
}

/// The owners of the tasks of `task_type` that are PROCESSING now.
pub async fn processing_owners(db: &Db, task_type: &str) -> Vec<String> {
    sqlx::query_scalar::<_, String>(
        "SELECT owner FROM tasks WHERE task_type = $1 AND state = $2 AND owner IS NOT NULL
         LIMIT 50",
    )
    .bind(task_type)
    .bind(TaskState::Processing.as_str())
    .fetch_all(db.pool())
    .await
    .unwrap_or_default()
}

/// Judges a quiet system.
pub async fn judge(
    db: &Db,
    database: &str,
    task_type: &str,
    load: &Outcome,
    effects: EffectCounts,
) -> anyhow::Result<Verdict> {
    let states = states_by_key(db, task_type).await?;
    let mut verdict = Verdict {
        accepted: load.count(Answer::Accepted),
        unknown: load.count(Answer::Unknown),
        refused: load.tasks.len() - load.count(Answer::Accepted) - load.count(Answer::Unknown),
        duplicate_side_effects: effects.duplicates,
        reruns: effects.reruns,
        ..Verdict::default()
    };
    for task in &load.tasks {
        let state = states.get(&task.key);
        if task.answer == Answer::Accepted && !is_terminal(state) {
            verdict.lost += 1;
        }
        if let Some((_, TaskState::DeadLetter)) = state {
            if !task.poison {
                verdict.healthy_dead_lettered += 1;
            }
        }
    }
    for (_, state) in states.values() {
        match state {
            TaskState::Completed => verdict.completed += 1,
            TaskState::DeadLetter => verdict.dead_lettered += 1,
            _ => {}
        }
    }
    let completions: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT task_id, count(*) FROM task_events
         WHERE task_type = $1 AND to_state = 'COMPLETED' GROUP BY task_id HAVING count(*) > 1",
    )
    .bind(task_type)
    .fetch_all(db.pool())
    .await?;
    verdict.duplicate_completions = completions.len();
    for (id, _) in states.values() {
        let chain = db.events(*id).await?;
        let steps: Vec<_> = chain.iter().map(|e| (e.from_state, e.to_state)).collect();
        if check_chain(&steps).is_err() {
            verdict.invalid_chains += 1;
        }
    }
    let idle: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = $1 AND state LIKE 'idle in transaction%'",
    )
    .bind(database)
    .fetch_one(db.pool())
    .await?;
    verdict.idle_in_transaction = usize::try_from(idle).unwrap_or(0);
    Ok(verdict)
}

/// Every task of the type: idempotency key → (id, state).
async fn states_by_key(
    db: &Db,
    task_type: &str,
) -> anyhow::Result<HashMap<Uuid, (Uuid, TaskState)>> {
    let rows: Vec<(Uuid, Uuid, String)> =
        sqlx::query_as("SELECT idempotency_key, id, state FROM tasks WHERE task_type = $1")
            .bind(task_type)
            .fetch_all(db.pool())
            .await?;
    rows.into_iter()
        .map(|(key, id, state)| Ok((key, (id, state.parse().map_err(anyhow::Error::msg)?))))
        .collect()
}

/// Terminates every session of `database` but the suite's own (a crashing pooler, an
/// administrator's `pg_terminate_backend`).
pub async fn terminate_sessions(db: &Db, database: &str) -> anyhow::Result<u64> {
    let terminated: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name <> 'conveyor-chaos'",
    )
    .bind(database)
    .fetch_all(db.pool())
    .await?;
    Ok(terminated.into_iter().filter(|t| *t).count() as u64)
}

/// The owner (worker name) of a task now.
pub async fn owner(db: &Db, task: Uuid) -> anyhow::Result<Option<String>> {
    Ok(db.task(task).await?.and_then(|t| t.owner))
}

/// Completed-count samples over time, for the recovery time.
#[derive(Debug, Default)]
pub struct Throughput {
    samples: Vec<(Instant, i64)>,
}

impl Throughput {
    pub async fn sample(&mut self, db: &Db, task_type: &str) {
        if let Ok(counts) = db.state_counts(task_type).await {
            let done = counts
                .iter()
                .filter(|(s, _)| matches!(s, TaskState::Completed | TaskState::DeadLetter))
                .map(|(_, n)| n)
                .sum();
            self.samples.push((Instant::now(), done));
        }
    }

    /// Completions per second between the samples nearest `from` and `to`.
    fn rate(&self, from: Instant, to: Instant) -> f64 {
        let nearest = |t: Instant| {
            self.samples
                .iter()
                .min_by_key(|(at, _)| if *at > t { *at - t } else { t - *at })
                .copied()
        };
        match (nearest(from), nearest(to)) {
            (Some((t0, n0)), Some((t1, n1))) if t1 > t0 => {
                (n1 - n0) as f64 / (t1 - t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }

    /// Seconds from `healed` until completions flow again at half the rate of the 3 s
    /// before `fault`: the first 2 s window of samples after healing at that rate, measured
    /// to the first sample in it that saw a completion (so a burst at a window's end does not
    /// count from the window's start). When the work ran out first: until the last
    /// completion.
    pub fn recovery(&self, fault: Instant, healed: Instant) -> f64 {
        let before = self.rate(fault - Duration::from_secs(3), fault);
        let after: Vec<(Instant, i64)> = self
            .samples
            .iter()
            .copied()
            .filter(|(t, _)| *t >= healed)
            .collect();
        for (j, &(t1, n1)) in after.iter().enumerate() {
            let Some(i) = after[..j]
                .iter()
                .position(|(t0, _)| t1.duration_since(*t0) <= Duration::from_secs(2))
            else {
                continue;
            };
            let (t0, n0) = after[i];
            let span = t1.duration_since(t0).as_secs_f64();
            if span >= 1.0 && n1 > n0 && (n1 - n0) as f64 / span >= before * 0.5 {
                let resumed = after[i..=j]
                    .windows(2)
                    .find(|w| w[1].1 > w[0].1)
                    .map_or(t1, |w| w[1].0);
                return resumed.saturating_duration_since(healed).as_secs_f64();
            }
        }
        let last_change = after
            .windows(2)
            .rev()
            .find(|w| w[1].1 > w[0].1)
            .map(|w| w[1].0);
        last_change.map_or(0.0, |t| t.saturating_duration_since(healed).as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samples every 250 ms: `rate` completions per second, none in `stalled`, then a burst.
    fn samples(start: Instant, stalled: std::ops::Range<f64>, burst: i64) -> Throughput {
        let mut done = 0;
        let mut samples = Vec::new();
        for k in 0..80 {
            let t = k as f64 * 0.25;
            if !stalled.contains(&t) {
                done += if t == stalled.end { burst } else { 2 };
            }
            samples.push((start + Duration::from_secs_f64(t), done));
        }
        Throughput { samples }
    }

    #[test]
    fn recovery_counts_to_when_completions_resume_not_to_the_window_start() {
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        // Fault at 4 s, healed at 6 s, nothing completes until 11 s, then a burst.
        let throughput = samples(start, 4.0..11.0, 100);
        let recovery = throughput.recovery(at(4.0), at(6.0));
        assert!((recovery - 5.0).abs() < 0.01, "{recovery}");
    }

    #[test]
    fn no_dip_means_no_recovery_time() {
        let start = Instant::now();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        let throughput = samples(start, 0.0..0.0, 0);
        let recovery = throughput.recovery(at(4.0), at(6.0));
        assert!(recovery <= 0.25, "{recovery}");
    }
}
