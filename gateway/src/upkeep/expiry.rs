//! Retention of settled tasks (decision 0034): each type's COMPLETED and CANCELLED tasks
//! settled longer ago than its retention (and its DEAD_LETTER ones, once its TaskType was
//! deleted with its queues: decision 0044) are written to the archive, when one is set, and
//! deleted, at most [`MAX_BATCHES`] batches per type and pass. The archive is written and
//! synced before the delete commits: a task is never deleted unarchived (one whose delete
//! then fails is archived again by the next pass).

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use chrono::Utc;
use conveyor_core::db::Db;
use conveyor_core::metrics::Metrics;
use conveyor_core::task::TaskRecord;
use conveyor_core::upkeep::UpkeepError;
use conveyor_core::watch_scope::WatchScope;

use crate::registry::Registry;

/// Tasks per batch.
const BATCH: i64 = 1000;
/// Batches per type and pass.
const MAX_BATCHES: usize = 20;
/// Longest a pass runs before it leaves the rest for the next one.
const BUDGET: Duration = Duration::from_secs(10);

/// How long settled tasks are kept, and where expired ones are written.
#[derive(Debug, Clone)]
pub struct TaskRetention {
    /// For types that do not set `settledRetentionDays`; `None` keeps them for ever.
    pub default_days: Option<u32>,
    /// Expired tasks go to `<archive>/<day they settled>/<task type>.ndjson` first.
    pub archive: Option<PathBuf>,
    /// How long a day of retention lasts: 24 hours, except in a soak, which compresses
    /// months into hours (`--retention-day-seconds`).
    pub day: Duration,
}

/// A real day.
pub const DAY: Duration = Duration::from_secs(86_400);

/// One pass over every task type the table holds in `scope`'s namespaces, for at most [`BUDGET`] (the rest waits
/// for the next pass, so that reaping and sweeping do not). A type goes by its own
/// retention when this process knows its spec (now, or before it left the set); a type it
/// never knew (deleted before this process started, or left out of the file), by the
/// default: a deleted type's own setting went with it, and its rows must not stay for ever.
/// Nor must the dead letters of a type deleted with its queues (`deleted`, found so by two
/// looks of [`super::retired`]), which nothing can redrive unless the type comes back: they
/// expire too, by the time they were dead-lettered. Returns how many tasks were deleted.
pub(super) async fn pass(
    db: &Db,
    types: &Registry,
    retention: &TaskRetention,
    scope: &WatchScope,
    deleted: &HashSet<String>,
    metrics: &Metrics,
) -> Result<u64, UpkeepError> {
    let started = Instant::now();
    let days: HashMap<String, Option<u32>> = types
        .snapshot()
        .values()
        .map(|k| (k.spec.name.clone(), k.spec.settled_retention_days))
        .collect();
    let mut gone_total = 0;
    for task_type in db.task_types_in_table().await? {
        // A type key is `<namespace>.<name>`: another install's namespace keeps its own
        // retention.
        let namespace = task_type
            .split_once('.')
            .map_or("", |(namespace, _)| namespace);
        if !scope.covers(namespace) {
            continue;
        }
        let dead_letters_too = deleted.contains(&task_type) && !days.contains_key(&task_type);
        let own = match days.get(&task_type) {
            Some(own) => Some(*own),
            None => types
                .departed(&task_type)
                .map(|spec| spec.settled_retention_days),
        };
        let days = own.flatten().or(retention.default_days);
        let Some(days) = days.filter(|d| *d > 0) else {
            continue;
        };
        // A retention too long to compute is one that keeps everything.
        let kept = chrono::Duration::from_std(retention.day.saturating_mul(days));
        let Some(cutoff) = kept
            .ok()
            .and_then(|kept| Utc::now().checked_sub_signed(kept))
        else {
            continue;
        };
        let mut after = None;
        for _ in 0..MAX_BATCHES {
            if started.elapsed() > BUDGET {
                return Ok(gone_total);
            }
            let whole = retention.archive.is_some();
            let Some(mut pending) = db
                .begin_expiry(&task_type, cutoff, after, BATCH, whole, dead_letters_too)
                .await?
            else {
                break;
            };
            after = pending.ids.last().copied();
            if let Some(dir) = &retention.archive {
                let (folder, records) = (dir.clone(), std::mem::take(&mut pending.records));
                tokio::task::spawn_blocking(move || archive(&folder, &records))
                    .await
                    .map_err(|join| UpkeepError::Archive {
                        path: dir.clone(),
                        source: std::io::Error::other(join),
                    })??;
            }
            let gone = pending.delete().await?;
            metrics
                .tasks_expired
                .with_label_values(&[task_type.as_str()])
                .inc_by(gone);
            gone_total += gone;
            if (gone as i64) < BATCH {
                break;
            }
        }
    }
    Ok(gone_total)
}

/// Appends each task as one JSON line to `<dir>/<YYYY-MM-DD it settled>/<type>.ndjson`,
/// synced to disk with its directory.
fn archive(dir: &Path, tasks: &[TaskRecord]) -> Result<(), UpkeepError> {
    let mut files: HashMap<PathBuf, Vec<u8>> = HashMap::new();
    for task in tasks {
        let day = dir.join(task.updated_at.format("%Y-%m-%d").to_string());
        let lines = files
            .entry(day.join(format!("{}.ndjson", task.task_type)))
            .or_default();
        serde_json::to_writer(&mut *lines, task).map_err(|e| UpkeepError::Archive {
            path: day.clone(),
            source: e.into(),
        })?;
        lines.push(b'\n');
    }
    for (path, lines) in files {
        let failed = |source| UpkeepError::Archive {
            path: path.clone(),
            source,
        };
        let day = path.parent().expect("a file in a day's folder");
        std::fs::create_dir_all(day).map_err(failed)?;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(failed)?;
        file.write_all(&lines).map_err(failed)?;
        file.sync_all().map_err(failed)?;
        std::fs::File::open(day)
            .and_then(|d| d.sync_all())
            .map_err(failed)?;
    }
    Ok(())
}
