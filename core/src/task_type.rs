//! Task type settings: what the gateway validates against and how workers retry.
//!
//! These are the fields of the future `TaskType` custom resource's spec; until the operator
//! issue lands they are read from a YAML file (`--task-types`).

use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::time::Duration;

use rand::Rng;
use serde::{Deserialize, Serialize};

pub use crate::crd::task_type::{Backoff, DeletionPolicy, RateLimit, TaskTypeSpec};

/// The one tenant outside a cluster (a task types file), as `docs/security.md` says.
pub const DEFAULT_TENANT: &str = "default";

fn default_tenant() -> String {
    DEFAULT_TENANT.to_owned()
}

/// A task type: what its queues and rows are keyed by, who owns it, and its spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedTaskType {
    /// The key its queues (`conveyor.<name>`, its retry queues, `.remediation`) and task rows
    /// go by: `<namespace>.<name>` for a TaskType resource, so that two namespaces never
    /// share one; the entry's own name in a task types file.
    pub name: String,
    /// The tenant that owns it: the resource's namespace; [`DEFAULT_TENANT`] in a file.
    #[serde(default = "default_tenant")]
    pub tenant: String,
    #[serde(flatten)]
    pub spec: TaskTypeSpec,
}

/// Settings are read as `task_type.max_retries`: the name travels with its spec.
impl Deref for NamedTaskType {
    type Target = TaskTypeSpec;
    fn deref(&self) -> &TaskTypeSpec {
        &self.spec
    }
}

impl DerefMut for NamedTaskType {
    fn deref_mut(&mut self) -> &mut TaskTypeSpec {
        &mut self.spec
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
        seconds(jittered)
    }
}

impl TaskTypeSpec {
    pub fn heartbeat_timeout(&self) -> Duration {
        seconds(self.heartbeat_timeout_seconds)
    }

    pub fn timeout(&self) -> Duration {
        seconds(self.timeout_seconds)
    }
}

/// A TaskType resource as the data path sees it: keyed by namespace and name.
impl From<&crate::crd::TaskType> for NamedTaskType {
    fn from(resource: &crate::crd::TaskType) -> Self {
        let namespace = resource
            .metadata
            .namespace
            .as_deref()
            .unwrap_or(DEFAULT_TENANT);
        let name = resource.metadata.name.as_deref().unwrap_or_default();
        NamedTaskType::in_namespace(namespace, name, resource.spec.clone())
    }
}

/// Most retry queues a type gets (the last also takes every later retry).
pub const MAX_RETRY_TIERS: u32 = 6;

impl NamedTaskType {
    /// How many retry queues this type has: one per retry number whose backoff differs
    /// from the one before, up to [`MAX_RETRY_TIERS`] and the type's `maxRetries`. RabbitMQ
    /// expires per-message TTLs only at a queue's head, so one queue for every delay would
    /// hold a 1 s retry behind a 300 s one; in a queue of its own retry number a message
    /// waits behind messages of about its own delay (jitter is at most a quarter).
    pub fn retry_tiers(&self) -> u32 {
        let b = &self.backoff;
        let mut distinct = 1;
        while distinct < MAX_RETRY_TIERS
            && distinct < self.max_retries
            && b.multiplier > 1.0
            && b.initial_seconds * b.multiplier.powi(distinct as i32 - 1) < b.max_seconds
        {
            distinct += 1;
        }
        distinct
    }

    /// The retry queue (0-based) of retry number `retry` (0 for the first).
    pub fn retry_tier(&self, retry: u32) -> u32 {
        retry.min(self.retry_tiers() - 1)
    }

    /// A type with every default, as a file entry with only `name` would give.
    pub fn named(name: impl Into<String>) -> Self {
        NamedTaskType {
            name: name.into(),
            tenant: default_tenant(),
            spec: TaskTypeSpec::default(),
        }
    }

    /// The type of TaskType resource `name` in `namespace`.
    pub fn in_namespace(namespace: &str, name: &str, spec: TaskTypeSpec) -> Self {
        NamedTaskType {
            name: format!("{namespace}.{name}"),
            tenant: namespace.to_owned(),
            spec,
        }
    }

    /// The name clients submit with and users see: the resource's (or entry's) own.
    pub fn local_name(&self) -> &str {
        local_name(&self.name, &self.tenant)
    }

    /// Refuses a key that could name another type's queues (`foo.retry` would be type
    /// `foo`'s retry queue): the local name is 1-63 characters of a-z, 0-9, `-` or `_`, the
    /// tenant a DNS label, and the key the local name alone (in a file) or
    /// `<tenant>.<local name>`. Checked before anything is made or deleted by this name.
    pub fn validate_name(&self) -> Result<(), String> {
        let local = self.local_name();
        let local_ok = !local.is_empty()
            && local.len() <= 63
            && local
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
        if !local_ok {
            return Err(format!(
                "task type name {local:?} must be 1-63 characters of a-z, 0-9, '-' or '_'"
            ));
        }
        // `conveyor.<ns>.retry` is also the retry queue of a type keyed `<ns>` (a file's, or
        // one from before tenancy): the queue suffixes are not names.
        if RESERVED_NAMES.contains(&local) {
            return Err(format!(
                "task type name {local:?} is reserved (it names queues of other types)"
            ));
        }
        let tenant_ok = !self.tenant.is_empty()
            && self.tenant.len() <= 63
            && self
                .tenant
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if !tenant_ok {
            return Err(format!(
                "task type {local:?}: namespace {:?} is not a DNS label",
                self.tenant
            ));
        }
        if local == self.name && self.tenant != DEFAULT_TENANT {
            return Err(format!(
                "task type {local:?} of namespace {:?} must be keyed {:?}",
                self.tenant,
                format!("{}.{local}", self.tenant)
            ));
        }
        Ok(())
    }

    /// Rejects settings no task could run under (the CRD schema says the same to kubectl)
    /// and a payload schema that does not compile.
    pub fn validate(&self) -> Result<(), String> {
        self.compile().map(drop)
    }

    /// Validates the type and compiles its payload schema (`None`: any JSON object).
    /// `pattern`s run on the `regex` engine, which matches in time linear in the input: a
    /// catastrophic-backtracking pattern cannot stall a gateway's threads (a pattern that
    /// needs backtracking, a look-around or a back-reference is refused with the type).
    pub fn compile(&self) -> Result<Option<jsonschema::Validator>, String> {
        self.check_settings()?;
        self.schema
            .as_ref()
            .map(|schema| {
                jsonschema::options()
                    .with_pattern_options(jsonschema::PatternOptions::regex())
                    .build(schema)
                    .map_err(|e| format!("{}: invalid payload schema: {e}", self.name))
            })
            .transpose()
    }

    fn check_settings(&self) -> Result<(), String> {
        self.validate_name()?;
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

/// A type key's tenant and local name. Neither may hold a dot (`validate_name`), so a key
/// with one is `<namespace>.<name>`, and one without is a file's type in tenant `default`.
pub fn split_key(key: &str) -> (&str, &str) {
    key.split_once('.').unwrap_or((DEFAULT_TENANT, key))
}

/// Names a task type may not have: the suffixes of a type's queues.
pub const RESERVED_NAMES: [&str; 2] = ["retry", "remediation"];

/// The local name in a type key: what follows `<tenant>.`, or the whole key.
pub fn local_name<'a>(key: &'a str, tenant: &str) -> &'a str {
    key.strip_prefix(tenant)
        .and_then(|rest| rest.strip_prefix('.'))
        .unwrap_or(key)
}

/// Seconds from a settings field as a Duration, capped at a year so that a user's "1e30"
/// can neither panic a conversion nor overflow a timer; invalid values (caught by
/// `validate`) become zero.
fn seconds(value: f64) -> Duration {
    const YEAR: f64 = 365.0 * 24.0 * 3600.0;
    if value.is_nan() || value <= 0.0 {
        Duration::ZERO
    } else {
        Duration::from_secs_f64(value.min(YEAR))
    }
}

/// The task types a process knows, by name.
pub type TaskTypes = BTreeMap<String, NamedTaskType>;

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

/// The file format: `taskTypes: [ {name: ..., <TaskType spec fields>}, ... ]`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TaskTypesFile {
    task_types: Vec<serde_json::Value>,
}

/// Fields of an entry that the spec does not have (serde's `deny_unknown_fields` does not
/// work through `flatten`): every field serializes, so the known ones are those it writes.
fn unknown_fields(entry: &serde_json::Value, parsed: &NamedTaskType) -> Vec<String> {
    let known = serde_json::to_value(parsed).unwrap_or_default();
    let mut unknown = Vec::new();
    if let (Some(entry), Some(known)) = (entry.as_object(), known.as_object()) {
        for (key, value) in entry {
            match known.get(key) {
                None => unknown.push(key.clone()),
                Some(known) if key != "schema" && value.is_object() && known.is_object() => {
                    for inner in value.as_object().into_iter().flatten().map(|(k, _)| k) {
                        if !known.as_object().is_some_and(|k| k.contains_key(inner)) {
                            unknown.push(format!("{key}.{inner}"));
                        }
                    }
                }
                Some(_) => {}
            }
        }
    }
    unknown
}

/// Parses and validates a task types YAML document.
pub fn parse_task_types(yaml: &str, path: &str) -> Result<TaskTypes, TaskTypesFileError> {
    let file: TaskTypesFile =
        serde_yaml::from_str(yaml).map_err(|source| TaskTypesFileError::Parse {
            path: path.to_owned(),
            source,
        })?;
    let mut types = TaskTypes::new();
    for entry in file.task_types {
        let invalid = |message| TaskTypesFileError::Invalid {
            path: path.to_owned(),
            message,
        };
        let spec: NamedTaskType = serde_json::from_value(entry.clone())
            .map_err(|e| invalid(format!("task type {}: {e}", entry["name"])))?;
        let unknown = unknown_fields(&entry, &spec);
        if !unknown.is_empty() {
            return Err(invalid(format!(
                "task type {}: unknown field(s) {}",
                spec.name,
                unknown.join(", ")
            )));
        }
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
        assert_eq!(types["thumbnail"], NamedTaskType::named("thumbnail"));
        assert_eq!(types["thumbnail"].max_queue_depth, 100_000);
        assert_eq!(types["thumbnail"].max_retries, 3);
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let unknown_field = parse_task_types("taskTypes:\n  - name: a\n    retries: 2\n", "t");
        assert!(unknown_field.unwrap_err().to_string().contains("retries"));
        let nested = "taskTypes:\n  - name: a\n    backoff: {initialSeconds: 1, maxSeconds: 2, multiplier: 2, jitter: 1}\n";
        assert!(parse_task_types(nested, "t")
            .unwrap_err()
            .to_string()
            .contains("backoff.jitter"));
        let bad_name = parse_task_types("taskTypes:\n  - name: Bad Name\n", "t");
        assert!(bad_name.unwrap_err().to_string().contains("a-z"));
        let twice = parse_task_types("taskTypes:\n  - name: a\n  - name: a\n", "t");
        assert!(twice.unwrap_err().to_string().contains("twice"));
        let zero = parse_task_types("taskTypes:\n  - name: a\n    timeoutSeconds: 0\n", "t");
        assert!(zero.unwrap_err().to_string().contains("timeoutSeconds"));
    }

    #[test]
    fn a_resource_is_keyed_by_namespace_and_a_name_that_could_alias_is_refused() {
        let video = NamedTaskType::in_namespace("video", "transcode", TaskTypeSpec::default());
        assert_eq!(
            (video.name.as_str(), video.local_name()),
            ("video.transcode", "transcode")
        );
        assert_eq!(video.validate(), Ok(()));
        assert_eq!(NamedTaskType::named("transcode").validate(), Ok(()));
        let in_default = NamedTaskType::in_namespace("default", "x", TaskTypeSpec::default());
        assert_eq!(in_default.local_name(), "x");
        assert_eq!(in_default.validate(), Ok(()));
        // `foo.retry` would name type foo's retry queue, in a file or in a namespace.
        for alias in [
            NamedTaskType::named("foo.retry"),
            NamedTaskType::in_namespace("video", "foo.retry", TaskTypeSpec::default()),
            NamedTaskType::in_namespace("Bad_NS", "x", TaskTypeSpec::default()),
            // `conveyor.foo.retry` is type foo's retry queue.
            NamedTaskType::in_namespace("foo", "retry", TaskTypeSpec::default()),
            NamedTaskType::in_namespace("foo", "remediation", TaskTypeSpec::default()),
        ] {
            assert!(alias.validate_name().is_err(), "{alias:?}");
        }
        let unqualified = NamedTaskType {
            tenant: "video".into(),
            ..NamedTaskType::named("transcode")
        };
        assert!(unqualified
            .validate_name()
            .unwrap_err()
            .contains("video.transcode"));
    }

    #[test]
    fn absurd_durations_saturate_instead_of_panicking() {
        let mut spec = NamedTaskType::named("t");
        spec.timeout_seconds = 1e300;
        assert_eq!(spec.timeout(), Duration::from_secs(365 * 24 * 3600));
        spec.backoff.max_seconds = 1e300;
        spec.backoff.initial_seconds = 1e300;
        assert!(spec.backoff.delay(64) <= Duration::from_secs(365 * 24 * 3600));
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
