//! The exec handler's progress channel: lines the command writes on descriptor 3
//! (`echo 40 >&3`), which `exec.rs` opens on this file before the command starts, or
//! appends to the file by its path (`$CONVEYOR_PROGRESS_FILE`); the worker reads the file
//! while the command runs. A file rather than a pipe: nothing blocks a command that writes
//! while nobody reads, and nothing is lost when the worker reads late.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::progress::{parse_line, ProgressSink};

/// Bytes of progress read from one attempt at most; a runaway writer is ignored beyond it.
const MAX_FILE: u64 = 1024 * 1024;
const READ_EVERY: Duration = Duration::from_millis(250);

/// The attempt's progress file, removed when dropped.
pub struct ProgressFile {
    path: PathBuf,
}

impl ProgressFile {
    /// An empty file of the worker's own (mode 0600) in the temporary directory.
    pub fn create(id: Uuid, attempt: i32) -> std::io::Result<ProgressFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = std::env::temp_dir().join(format!(
            "conveyor-progress-{id}-{attempt}-{}",
            Uuid::new_v4().simple()
        ));
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        Ok(ProgressFile { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reports the last complete line written since the previous read, every
    /// [`READ_EVERY`], until `done` (then reads once more).
    pub async fn follow(&self, sink: &ProgressSink, done: &CancellationToken) {
        let Ok(mut file) = tokio::fs::File::open(&self.path).await else {
            return;
        };
        let mut offset = 0u64;
        let mut partial = String::new();
        loop {
            let finished = done.is_cancelled();
            if offset < MAX_FILE {
                let mut chunk = Vec::new();
                let readable = (&mut file).take(MAX_FILE - offset);
                if file_read(readable, offset, &mut chunk).await.is_ok() && !chunk.is_empty() {
                    offset += chunk.len() as u64;
                    if offset >= MAX_FILE {
                        tracing::warn!(
                            limit = MAX_FILE,
                            "the progress file reached its limit: later reports of this attempt are not read"
                        );
                    }
                    partial.push_str(&String::from_utf8_lossy(&chunk));
                    if let Some(end) = partial.rfind('\n') {
                        let complete: String = partial.drain(..=end).collect();
                        if let Some(last) = complete.lines().rev().find(|l| !l.trim().is_empty()) {
                            if let Err(refused) = sink.report(parse_line(last)) {
                                tracing::debug!(error = %refused, "progress report refused");
                            }
                        }
                    }
                }
            }
            if finished {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(READ_EVERY) => {}
                _ = done.cancelled() => {}
            }
        }
    }
}

async fn file_read(
    mut from: tokio::io::Take<&mut tokio::fs::File>,
    offset: u64,
    into: &mut Vec<u8>,
) -> std::io::Result<()> {
    from.get_mut()
        .seek(std::io::SeekFrom::Start(offset))
        .await?;
    from.read_to_end(into).await?;
    Ok(())
}

impl Drop for ProgressFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
