//! The local cluster's apiserver audit log (`cluster/up.sh` writes it: who made each
//! request, one JSON line at each stage), read as it grows: what a client of the platform
//! asks of the apiserver, judged from the apiserver's side.

use std::io::{Read as _, Seek as _};
use std::path::{Path, PathBuf};

/// The service account the stack's operator (and a standby) acts as.
pub const OPERATOR: &str = "system:serviceaccount:conveyor-system:conveyor-operator";
/// The service account the stack's gateway acts as.
pub const GATEWAY: &str = "system:serviceaccount:conveyor-system:conveyor-gateway";

/// The completed requests written to the log since it was opened, or since the last read.
pub struct AuditLog {
    path: PathBuf,
    offset: u64,
}

impl AuditLog {
    /// Reading from the log's end now.
    pub fn from_now() -> AuditLog {
        let dir = std::env::var_os("CONVEYOR_CLUSTER_DIR")
            .map_or_else(|| crate::repo_root().join(".dev/cluster"), PathBuf::from);
        let path = dir.join("audit.log");
        let offset = std::fs::metadata(&path).map_or(0, |m| m.len());
        AuditLog { path, offset }
    }

    /// Whether the apiserver writes the log this reads: a log that is not there would read
    /// as a client that made no request.
    pub fn exists(&self) -> bool {
        self.path.exists()
    }

    /// The completed requests (whole lines) written since the last call. The apiserver
    /// rotates the log at 100 MB: the rest of the rotated file is read from where this left
    /// it.
    pub fn new_requests(&mut self) -> Vec<Request> {
        let mut requests = Vec::new();
        let len = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if len < self.offset {
            if let Some(rotated) = newest_rotated(&self.path) {
                requests.extend(read_from(&rotated, self.offset).0);
            }
            self.offset = 0;
        }
        let (read, bytes) = read_from(&self.path, self.offset);
        self.offset += bytes;
        requests.extend(read);
        requests
    }
}

/// One completed request: who made it, the verb, and the resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub user: String,
    pub verb: String,
    pub resource: String,
}

/// Completed requests in `path` from byte `offset` on, in whole lines, and the bytes of
/// those lines (a line still being written waits).
fn read_from(path: &Path, offset: u64) -> (Vec<Request>, u64) {
    let Ok(mut file) = std::fs::File::open(path) else {
        return (Vec::new(), 0);
    };
    let mut bytes = Vec::new();
    if file.seek(std::io::SeekFrom::Start(offset)).is_err() || file.read_to_end(&mut bytes).is_err()
    {
        return (Vec::new(), 0);
    }
    let whole = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    let requests = String::from_utf8_lossy(&bytes[..whole])
        .lines()
        // Cheap before parsing: most lines are other stages of a request.
        .filter(|l| l.contains("\"stage\":\"ResponseComplete\""))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|event| {
            let text = |pointer: &str| {
                event
                    .pointer(pointer)
                    .and_then(|v| v.as_str())
                    .unwrap_or_default()
                    .to_owned()
            };
            // The stack's processes act as their service accounts by impersonation
            // (`scripts/stack.sh`): the account is the impersonated user.
            let impersonated = text("/impersonatedUser/username");
            Request {
                user: match impersonated.is_empty() {
                    true => text("/user/username"),
                    false => impersonated,
                },
                verb: text("/verb"),
                resource: text("/objectRef/resource"),
            }
        })
        .collect();
    (requests, whole as u64)
}

/// The audit log's most recently rotated file (`audit-<time>.log`).
fn newest_rotated(log: &Path) -> Option<PathBuf> {
    let dir = log.parent()?;
    let mut rotated: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("audit-") && n.ends_with(".log"))
        })
        .collect();
    rotated.sort();
    rotated.pop()
}
