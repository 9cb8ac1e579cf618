//! The degraded-mode buffer: outcomes the database could not take, kept in an fsynced local
//! file until they are replayed (decision 0010).
//!
//! One JSON line per transition, appended and fsynced before the delivery is acked, so an
//! acked task's outcome is always durable somewhere (invariant 4, `docs/invariants.md`).
//! After a replay the file is rewritten with what is left (written aside, fsynced, renamed).
//! A line torn by a crash mid-append is skipped on load: its delivery was never acked, so
//! the task comes back through the broker or the heartbeat reaper.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use conveyor_core::metrics::Metrics;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// What a finished attempt produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Completed { result: serde_json::Value },
    Failed { error: String },
}

/// An outcome of one attempt, owned by `owner` (the worker id that claimed it, which may be
/// a previous process of this pod).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub id: Uuid,
    pub attempt: i32,
    pub owner: String,
    pub task_type: String,
    pub outcome: Outcome,
}

#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    #[error("the degraded-mode buffer is full ({entries} transitions, {bytes} bytes)")]
    Full { entries: usize, bytes: u64 },
    #[error("degraded-mode buffer {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The buffer file and its contents (bounded by `max_bytes`, so memory is bounded too).
#[derive(Clone)]
pub struct Buffer {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    path: PathBuf,
    max_bytes: u64,
    entries: Vec<(Transition, u64)>,
    bytes: u64,
}

impl Buffer {
    /// Opens (creating its directory) the buffer at `path` and loads what a previous process
    /// left in it.
    pub fn open(path: &Path, max_bytes: u64) -> Result<Buffer, BufferError> {
        let io = |source| BufferError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut entries = Vec::new();
        match File::open(path) {
            Ok(file) => {
                for (n, line) in BufReader::new(file).lines().enumerate() {
                    let line = line.map_err(io)?;
                    match serde_json::from_str::<Transition>(&line) {
                        Ok(entry) => entries.push((entry, line.len() as u64 + 1)),
                        Err(err) if !line.trim().is_empty() => tracing::warn!(
                            path = %path.display(), line = n + 1, error = %err,
                            "skipping an unreadable buffer line (torn by a crash?)"
                        ),
                        Err(_) => {}
                    }
                }
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => return Err(io(err)),
        }
        let bytes = entries.iter().map(|(_, b)| b).sum();
        let buffer = Buffer {
            inner: Arc::new(Mutex::new(Inner {
                path: path.to_owned(),
                max_bytes,
                entries,
                bytes,
            })),
        };
        // Start from a clean file: torn lines dropped, nothing appended after them.
        buffer.lock().rewrite()?;
        Ok(buffer)
    }

    /// Appends `entry` and fsyncs it. Blocking: call from `spawn_blocking`.
    pub fn append(&self, entry: &Transition) -> Result<(), BufferError> {
        let mut line = serde_json::to_vec(entry).expect("a transition serializes");
        line.push(b'\n');
        let mut inner = self.lock();
        let size = line.len() as u64;
        if inner.bytes + size > inner.max_bytes {
            return Err(BufferError::Full {
                entries: inner.entries.len(),
                bytes: inner.bytes,
            });
        }
        let path = inner.path.clone();
        let written = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut file| {
                file.write_all(&line)?;
                file.sync_data()
            });
        written.map_err(|source| BufferError::Io { path, source })?;
        inner.entries.push((entry.clone(), size));
        inner.bytes += size;
        Ok(())
    }

    /// Everything buffered, oldest first.
    pub fn entries(&self) -> Vec<Transition> {
        self.lock().entries.iter().map(|(e, _)| e.clone()).collect()
    }

    /// The (task, attempt, owner) claims buffered, for the heartbeat: no results copied.
    pub fn claims(&self) -> Vec<(Uuid, i32, String)> {
        let inner = self.lock();
        inner
            .entries
            .iter()
            .map(|(e, _)| (e.id, e.attempt, e.owner.clone()))
            .collect()
    }

    /// Drops the entries `done` says are settled and rewrites the file durably. Blocking.
    pub fn remove(&self, done: impl Fn(&Transition) -> bool) -> Result<(), BufferError> {
        let mut inner = self.lock();
        inner.entries.retain(|(e, _)| !done(e));
        inner.bytes = inner.entries.iter().map(|(_, b)| b).sum();
        inner.rewrite()
    }

    /// Moves `refused` outcomes out of the buffer into its quarantine file (`<buffer>` with
    /// the extension `rejected.jsonl`, fsynced), each with why, for a human to look at.
    /// Blocking.
    pub fn quarantine(&self, refused: &[(Transition, String)]) -> Result<(), BufferError> {
        if refused.is_empty() {
            return Ok(());
        }
        let mut inner = self.lock();
        let path = inner.path.with_extension("rejected.jsonl");
        let mut lines = Vec::new();
        for (entry, why) in refused {
            let line = serde_json::json!({ "transition": entry, "why": why });
            lines.extend(serde_json::to_vec(&line).expect("a transition serializes"));
            lines.push(b'\n');
        }
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut file| {
                file.write_all(&lines)?;
                file.sync_data()
            })
            .map_err(|source| BufferError::Io { path, source })?;
        inner.entries.retain(|(e, _)| {
            !refused
                .iter()
                .any(|(r, _)| r.id == e.id && r.attempt == e.attempt)
        });
        inner.bytes = inner.entries.iter().map(|(_, b)| b).sum();
        inner.rewrite()
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Sets the buffer gauges.
    pub fn report(&self, metrics: &Metrics) {
        let inner = self.lock();
        metrics.buffered.set(inner.entries.len() as i64);
        metrics.buffer_bytes.set(inner.bytes as i64);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Inner {
    /// Writes the entries to a file beside, fsyncs it, renames it over the buffer, and
    /// fsyncs the directory so the rename itself survives a crash.
    fn rewrite(&self) -> Result<(), BufferError> {
        let io = |source| BufferError::Io {
            path: self.path.clone(),
            source,
        };
        let aside = self.path.with_extension("rewrite");
        let mut file = File::create(&aside).map_err(io)?;
        for (entry, _) in &self.entries {
            let mut line = serde_json::to_vec(entry).expect("a transition serializes");
            line.push(b'\n');
            file.write_all(&line).map_err(io)?;
        }
        file.sync_data().map_err(io)?;
        std::fs::rename(&aside, &self.path).map_err(io)?;
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        File::open(dir).and_then(|d| d.sync_all()).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transition(n: u8) -> Transition {
        Transition {
            id: Uuid::from_bytes([n; 16]),
            attempt: 1,
            owner: "w-1".into(),
            task_type: "thumbnail".into(),
            outcome: Outcome::Completed {
                result: serde_json::json!({ "n": n }),
            },
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("conveyor-buffer-{}", Uuid::new_v4()));
        dir.join(name)
    }

    #[test]
    fn survives_a_restart_and_forgets_what_was_replayed() {
        let path = scratch("w.jsonl");
        let buffer = Buffer::open(&path, 1 << 20).unwrap();
        for n in 0..3 {
            buffer.append(&transition(n)).unwrap();
        }
        drop(buffer);
        let reopened = Buffer::open(&path, 1 << 20).unwrap();
        assert_eq!(
            reopened.entries(),
            vec![transition(0), transition(1), transition(2)]
        );
        reopened.remove(|e| e.id == transition(1).id).unwrap();
        let again = Buffer::open(&path, 1 << 20).unwrap();
        assert_eq!(again.entries(), vec![transition(0), transition(2)]);
        assert_eq!(again.bytes(), reopened.bytes());
    }

    #[test]
    fn a_torn_last_line_is_skipped() {
        let path = scratch("torn.jsonl");
        let buffer = Buffer::open(&path, 1 << 20).unwrap();
        buffer.append(&transition(7)).unwrap();
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(br#"{"id":"0707"#).unwrap();
        let reopened = Buffer::open(&path, 1 << 20).unwrap();
        assert_eq!(reopened.entries(), vec![transition(7)]);
        // The torn bytes are gone from the file, so later appends parse.
        reopened.append(&transition(8)).unwrap();
        let again = Buffer::open(&path, 1 << 20).unwrap();
        assert_eq!(again.entries(), vec![transition(7), transition(8)]);
    }

    #[test]
    fn refuses_past_its_bound_and_keeps_what_it_has() {
        let path = scratch("full.jsonl");
        let one = serde_json::to_vec(&transition(0)).unwrap().len() as u64 + 1;
        let buffer = Buffer::open(&path, 2 * one).unwrap();
        buffer.append(&transition(0)).unwrap();
        buffer.append(&transition(1)).unwrap();
        let err = buffer.append(&transition(2)).unwrap_err();
        assert!(matches!(err, BufferError::Full { entries: 2, .. }), "{err}");
        assert_eq!(Buffer::open(&path, 2 * one).unwrap().len(), 2);
    }

    #[test]
    fn an_unwritable_place_is_a_clear_error() {
        let err = Buffer::open(Path::new("/proc/conveyor/w.jsonl"), 1024)
            .err()
            .expect("cannot create under /proc");
        assert!(err.to_string().contains("/proc/conveyor/w.jsonl"), "{err}");
    }
}
