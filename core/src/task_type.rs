//! Task type settings: what the gateway validates against and how workers retry.
//!
//! These are the fields of the future `TaskType` custom resource's spec; until the operator
//! issue lands they are read from a YAML file (`--task-types`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use rand::Rng;
use serde::{Deserialize, Serialize};

/// One task type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TaskTypeSpec {
    /// Name; queues are `conveyor.<name>`, `.retry` and `.remediation`.
    pub name: String,
    /// JSON schema every payload must satisfy. Absent: any JSON object.
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    /// Largest accepted payload, serialized, in bytes.
    #[serde(default = "defaults::max_payload_bytes")]
    pub max_payload_bytes: usize,
    /// Retries after the first attempt before the task is dead-lettered.
    #[serde(default = "defaults::max_retries")]
    pub max_retries: u32,
    /// Delay before each retry.
    #[serde(default)]
    pub backoff: Backoff,
    /// Longest a handler may run for one attempt, in seconds.
    #[serde(default = "defaults::timeout_seconds")]
    pub timeout_seconds: f64,
    /// A task whose owner has not heartbeated for this long is re-queued, in seconds.
    #[serde(default = "defaults::heartbeat_timeout_seconds")]
    pub heartbeat_timeout_seconds: f64,
    /// Above this many ready messages the gateway refuses new tasks with 429.
    #[serde(default = "defaults::max_queue_depth")]
    pub max_queue_depth: u64,
    /// Submissions per second accepted for this type across all clients.
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
}

/// Exponential backoff with jitter: `initial * multiplier^retry`, capped at `max`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Backoff {
    /// Delay before the first retry, in seconds.
    pub initial_seconds: f64,
    /// Upper bound of any delay, in seconds.
    pub max_seconds: f64,
    /// Growth factor per retry.
    pub multiplier: f64,
}

/// A token bucket: `per_second` refill, up to `burst` at once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateLimit {
    /// Sustained tasks per second.
    pub per_second: f64,
    /// Largest burst; defaults to one second's worth.
    #[serde(default)]
    pub burst: Option<f64>,
}

mod defaults {
    pub fn max_payload_bytes() -> usize {
        256 * 1024
    }
    pub fn max_retries() -> u32 {
        3
    }
    pub fn timeout_seconds() -> f64 {
        3600.0
    }
    pub fn heartbeat_timeout_seconds() -> f64 {
        30.0
    }
    pub fn max_queue_depth() -> u64 {
        100_000
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial_seconds: 1.0,
            max_seconds: 300.0,
            multiplier: 2.0,
        }
    }
}

impl Backoff {
    /// The delay before retry number `retry` (0 for the first): the exponential value with
    /// its last quarter jittered, so that delays still grow strictly from one retry to the
    /// next while retries of many tasks spread out.
    pub fn delay(&self, retry: u32) -> Duration {
        let exp = self.initial_seconds * self.multiplier.powi(retry.min(64) as i32);
        let ceiling = exp.min(self.max_seconds).max(0.0);
        let jittered = ceiling * rand::thread_rng().gen_range(0.75..=1.0);
        Duration::from_secs_f64(jittered)
    }
}

impl TaskTypeSpec {
    /// A type with every default, as a YAML file with only `name` would give.
    pub fn named(name: impl Into<String>) -> Self {
        TaskTypeSpec {
            name: name.into(),
            schema: None,
            max_payload_bytes: defaults::max_payload_bytes(),
            max_retries: defaults::max_retries(),
            backoff: Backoff::default(),
            timeout_seconds: defaults::timeout_seconds(),
            heartbeat_timeout_seconds: defaults::heartbeat_timeout_seconds(),
            max_queue_depth: defaults::max_queue_depth(),
            rate_limit: None,
        }
    }

    pub fn heartbeat_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.heartbeat_timeout_seconds)
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_seconds)
    }

    /// Rejects settings no task could run under.
    pub fn validate(&self) -> Result<(), String> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 63
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
        if !name_ok {
            return Err(format!(
                "task type name {:?} must be 1-63 characters of a-z, 0-9, '-' or '_'",
                self.name
            ));
        }
        let positive = [
            ("timeoutSeconds", self.timeout_seconds),
            ("heartbeatTimeoutSeconds", self.heartbeat_timeout_seconds),
            ("backoff.initialSeconds", self.backoff.initial_seconds),
            ("backoff.maxSeconds", self.backoff.max_seconds),
        ];
        for (field, value) in positive {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!("{}: {field} must be > 0", self.name));
            }
        }
        if !(self.backoff.multiplier.is_finite() && self.backoff.multiplier >= 1.0) {
            return Err(format!("{}: backoff.multiplier must be >= 1", self.name));
        }
        if self.max_payload_bytes == 0 {
            return Err(format!("{}: maxPayloadBytes must be > 0", self.name));
        }
        if let Some(rate) = &self.rate_limit {
            if !(rate.per_second.is_finite() && rate.per_second > 0.0) {
                return Err(format!("{}: rateLimit.perSecond must be > 0", self.name));
            }
        }
        if let Some(schema) = &self.schema {
            if !schema.is_object() && !schema.is_boolean() {
                return Err(format!(
                    "{}: schema must be a JSON schema object",
                    self.name
                ));
            }
        }
        Ok(())
    }
}

/// The task types a process knows, by name.
pub type TaskTypes = BTreeMap<String, TaskTypeSpec>;

#[derive(Debug, thiserror::Error)]
pub enum TaskTypesFileError {
    #[error("cannot read task types file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("task types file {path} is not valid: {source}")]
    Parse {
        path: String,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("task types file {path}: {message}")]
    Invalid { path: String, message: String },
}

/// The file format: `taskTypes: [ {name: ..., ...}, ... ]`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TaskTypesFile {
    task_types: Vec<TaskTypeSpec>,
}

/// Parses and validates a task types YAML document.
pub fn parse_task_types(yaml: &str, path: &str) -> Result<TaskTypes, TaskTypesFileError> {
    let file: TaskTypesFile =
        serde_yaml::from_str(yaml).map_err(|source| TaskTypesFileError::Parse {
            path: path.to_owned(),
            source,
        })?;
    let mut types = TaskTypes::new();
    for spec in file.task_types {
        let invalid = |message| TaskTypesFileError::Invalid {
            path: path.to_owned(),
            message,
        };
        spec.validate().map_err(invalid)?;
        if types.contains_key(&spec.name) {
            return Err(invalid(format!(
                "task type {:?} is defined twice",
                spec.name
            )));
        }
        types.insert(spec.name.clone(), spec);
    }
    Ok(types)
}

pub fn load_task_types(path: &Path) -> Result<TaskTypes, TaskTypesFileError> {
    let shown = path.display().to_string();
    let yaml = std::fs::read_to_string(path).map_err(|source| TaskTypesFileError::Read {
        path: shown.clone(),
        source,
    })?;
    parse_task_types(&yaml, &shown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_in() {
        let types = parse_task_types("taskTypes:\n  - name: thumbnail\n", "t.yaml").unwrap();
        assert_eq!(types["thumbnail"], TaskTypeSpec::named("thumbnail"));
        assert_eq!(types["thumbnail"].max_queue_depth, 100_000);
        assert_eq!(types["thumbnail"].max_retries, 3);
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let unknown_field = parse_task_types("taskTypes:\n  - name: a\n    retries: 2\n", "t");
        assert!(unknown_field.unwrap_err().to_string().contains("retries"));
        let bad_name = parse_task_types("taskTypes:\n  - name: Bad Name\n", "t");
        assert!(bad_name.unwrap_err().to_string().contains("a-z"));
        let twice = parse_task_types("taskTypes:\n  - name: a\n  - name: a\n", "t");
        assert!(twice.unwrap_err().to_string().contains("twice"));
        let zero = parse_task_types("taskTypes:\n  - name: a\n    timeoutSeconds: 0\n", "t");
        assert!(zero.unwrap_err().to_string().contains("timeoutSeconds"));
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let backoff = Backoff {
            initial_seconds: 0.2,
            max_seconds: 1.0,
            multiplier: 2.0,
        };
        for _ in 0..100 {
            let delays: Vec<f64> = (0..4).map(|r| backoff.delay(r).as_secs_f64()).collect();
            assert!(delays[0] >= 0.15 && delays[0] <= 0.2);
            assert!(delays[1] > delays[0] && delays[2] > delays[1]);
            assert!(delays[3] <= 1.0);
        }
    }
}
