//! The oracle every scenario shares: what went in must come out. Once the fault has healed
//! and the system is quiet, three sources that do not trust each other must agree: what
//! each client was told (the load generator), what the handler really did (the side-effect
//! sidecar) and what PostgreSQL says (decision 0009). All of the suite's SQL is here.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use conveyor_core::db::Db;
use conveyor_core::lifecycle::check_chain;
use conveyor_core::TaskState;
use uuid::Uuid;

use crate::load::{Answer, Outcome};
use crate::sidecar::Sidecar;

/// Per scenario: the figures of the report.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Verdict {
    pub accepted: usize,
    pub refused: usize,
    pub unknown: usize,
    pub completed: usize,
    pub dead_lettered: usize,
    /// Client view against the database: tasks a client was told were accepted (2xx) that
    /// are neither COMPLETED nor DEAD_LETTER once quiet.
    pub lost: usize,
    /// Database view alone: tasks of the scenario, whoever submitted them and whatever the
    /// client heard (a request that got no answer, say), neither COMPLETED nor DEAD_LETTER.
    pub stranded: usize,
    /// Database against the sidecar: COMPLETED tasks whose completing attempt never
    /// performed its effect (the product says done, the world says not).
    pub completed_without_effect: usize,
    /// Sidecar against the clients: effects of tasks no client submitted or that were
    /// refused with an error that means "not taken" (4xx).
    pub effects_of_refused: usize,
    /// Sidecar alone: the same attempt of a task performing its side effect twice (two
    /// workers running one delivery at once, which fencing must make impossible).
    pub duplicate_side_effects: usize,
    /// Sidecar alone: effects performed again by a later attempt of the same task. At least
    /// once allows them after a fault; they are counted, never called "nothing done twice".
    pub reruns: usize,
    /// Re-runs this scenario may cause: the effects under way when the fault struck (the
    /// sidecar's peak in the fault window), times the fault's rounds. `None`: unbounded by
    /// design (poison, continuous faults).
    pub rerun_bound: Option<usize>,
    /// The product's own audit log: tasks with more than one COMPLETED event. A cross-check
    /// of the log, not of the outcome (the outside checks are the columns above).
    pub duplicate_completions: usize,
    /// Healthy (non-poison) tasks that ended DEAD_LETTER.
    pub healthy_dead_lettered: usize,
    /// The product's own audit log: chains that are not a valid lifecycle path.
    pub invalid_chains: usize,
    /// PostgreSQL sessions left idle in a transaction for more than 5 s once quiet.
    pub idle_in_transaction: usize,
    /// From the fault really healing to throughput back at half its level before the fault.
    pub recovery_seconds: f64,
}

impl Verdict {
    /// The invariants: nothing lost, nothing done twice, every chain valid.
    pub fn failures(&self) -> Vec<String> {
        let checks = [
            (self.lost, "lost"),
            (self.stranded, "stranded in the database"),
            (
                self.completed_without_effect,
                "COMPLETED without their effect",
            ),
            (self.effects_of_refused, "effects of tasks not accepted"),
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
        if let Some(bound) = self.rerun_bound {
            if self.reruns > bound {
                failures.push(format!(
                    "{} re-runs, more than the {bound} the fault could cause",
                    self.reruns
                ));
            }
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
    let state = |k: &Uuid| states.get(k).map(|t| (t.id, t.state));
    Some(
        accepted
            .iter()
            .filter(|k| !is_terminal(state(k).as_ref()))
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

/// Tasks of `task_type` claimed or running by a worker of one of `pods` (worker ids are
/// `<pod>-<suffix>`). An error is an error: a count of 0 would pass for "all reaped".
pub async fn count_owned_by(db: &Db, task_type: &str, pods: &[String]) -> anyhow::Result<i64> {
    let prefixes: Vec<String> = pods.iter().map(|pod| format!("{pod}-%")).collect();
    let states = [TaskState::Claimed.as_str(), TaskState::Processing.as_str()];
    let count = sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM tasks WHERE task_type = $1 AND state = ANY($2)
           AND owner LIKE ANY($3)",
    )
    .bind(task_type)
    .bind(&states[..])
    .bind(&prefixes)
    .fetch_one(db.pool())
    .await?;
    Ok(count)
}

/// Judges a quiet system.
pub async fn judge(
    db: &Db,
    database: &str,
    task_type: &str,
    load: &Outcome,
    sidecar: &Sidecar,
) -> anyhow::Result<Verdict> {
    let states = states_by_key(db, task_type).await?;
    let effects = sidecar.counts();
    let attempts = sidecar.attempts_by_key();
    let mut verdict = Verdict {
        accepted: load.count(Answer::Accepted),
        unknown: load.count(Answer::Unknown),
        refused: load.tasks.len() - load.count(Answer::Accepted) - load.count(Answer::Unknown),
        duplicate_side_effects: effects.duplicates,
        reruns: effects.reruns,
        ..Verdict::default()
    };
    let mut answers = HashMap::new();
    for task in &load.tasks {
        answers.insert(task.key, task.answer);
        let state = states.get(&task.key).map(|t| (t.id, t.state));
        if task.answer == Answer::Accepted && !is_terminal(state.as_ref()) {
            verdict.lost += 1;
        }
        if let Some((_, TaskState::DeadLetter)) = state {
            if !task.poison {
                verdict.healthy_dead_lettered += 1;
            }
        }
    }
    for (key, task) in &states {
        match task.state {
            TaskState::Completed => {
                verdict.completed += 1;
                let performed = attempts.get(key).is_some_and(|a| a.contains(&task.attempt));
                if !performed {
                    verdict.completed_without_effect += 1;
                }
            }
            TaskState::DeadLetter => verdict.dead_lettered += 1,
            _ => verdict.stranded += 1,
        }
    }
    for key in attempts.keys() {
        let taken = matches!(
            answers.get(key),
            Some(Answer::Accepted | Answer::Unknown | Answer::Refused(500..))
        );
        if !taken {
            verdict.effects_of_refused += 1;
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
    for task in states.values() {
        let chain = db.events(task.id).await?;
        let steps: Vec<_> = chain.iter().map(|e| (e.from_state, e.to_state)).collect();
        if check_chain(&steps).is_err() {
            verdict.invalid_chains += 1;
        }
    }
    // A transaction idle for a moment is normal (a re-queue waits for its confirm); one
    // idle for seconds once the system is quiet is a leak.
    let idle: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = $1 AND state LIKE 'idle in transaction%'
           AND state_change < now() - interval '5 seconds'",
    )
    .bind(database)
    .fetch_one(db.pool())
    .await?;
    verdict.idle_in_transaction = usize::try_from(idle).unwrap_or(0);
    Ok(verdict)
}

/// A task as the database holds it now.
struct Stored {
    id: Uuid,
    state: TaskState,
    attempt: i32,
}

/// Every task of the type by idempotency key.
async fn states_by_key(db: &Db, task_type: &str) -> anyhow::Result<HashMap<Uuid, Stored>> {
    let rows: Vec<(Uuid, Uuid, String, i32)> = sqlx::query_as(
        "SELECT idempotency_key, id, state, attempt FROM tasks WHERE task_type = $1",
    )
    .bind(task_type)
    .fetch_all(db.pool())
    .await?;
    rows.into_iter()
        .map(|(key, id, state, attempt)| {
            let state = state.parse().map_err(anyhow::Error::msg)?;
            Ok((key, Stored { id, state, attempt }))
        })
        .collect()
}

/// Terminates every client session of `database` but the suite's own (a crashing pooler,
/// an administrator's `pg_terminate_backend`). Background processes (an autovacuum worker
/// of the database, say) are left alone: they run as the superuser, whom a plain role may
/// not signal.
pub async fn terminate_sessions(db: &Db, database: &str) -> anyhow::Result<u64> {
    let terminated: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name <> 'conveyor-chaos'
           AND backend_type = 'client backend' AND usename = current_user",
    )
    .bind(database)
    .fetch_all(db.pool())
    .await?;
    Ok(terminated.into_iter().filter(|t| *t).count() as u64)
}

/// Tasks of `task_type` in any of `states` now (0 while the database cannot say).
pub async fn count_in(db: &Db, task_type: &str, states: &[&str]) -> i64 {
    count_older_in(db, task_type, states, std::time::Duration::ZERO).await
}

/// Tasks of `task_type` in any of `states` that were created at least `age` ago. A task
/// INGESTED for longer than the gateway's settle (100 ms, decision 0020) was recorded and
/// not published: a confirmed one is marked QUEUED, or claimed, within it.
pub async fn count_older_in(
    db: &Db,
    task_type: &str,
    states: &[&str],
    age: std::time::Duration,
) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM tasks WHERE task_type = $1 AND state = ANY($2)
         AND created_at <= now() - make_interval(secs => $3)",
    )
    .bind(task_type)
    .bind(states)
    .bind(age.as_secs_f64())
    .fetch_one(db.pool())
    .await
    .unwrap_or(0)
}

/// Writes one audit row per day for the days `days` from today (UTC), under a task type of
/// their own beside `task_type`'s; returns how many.
pub async fn write_calendar_rows(
    db: &Db,
    task_type: &str,
    days: std::ops::Range<i32>,
) -> anyhow::Result<i64> {
    let written = sqlx::query(
        "INSERT INTO task_events (task_id, task_type, to_state, attempt, at)
         SELECT gen_random_uuid(), $1, 'INGESTED', 0,
                date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                    + make_interval(days => d) + interval '12 hours'
         FROM generate_series($2, $3 - 1) AS d",
    )
    .bind(format!("{task_type}-calendar"))
    .bind(days.start)
    .bind(days.end)
    .execute(db.pool())
    .await?
    .rows_affected();
    Ok(written as i64)
}

/// The calendar rows still in the audit log.
pub async fn calendar_rows(db: &Db, task_type: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM task_events WHERE task_type = $1")
        .bind(format!("{task_type}-calendar"))
        .fetch_one(db.pool())
        .await
        .unwrap_or(-1)
}

/// Rows in the audit log's default partition (where rows go when their day's partition is
/// missing).
pub async fn default_partition_rows(db: &Db) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM task_events_default")
        .fetch_one(db.pool())
        .await
        .unwrap_or(-1)
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
