//! The task types the gateway accepts, with compiled payload schemas. Fixed when they come
//! from a file; refreshed from the TaskType resources when the gateway runs in a cluster.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use conveyor_core::task_type::{NamedTaskType, TaskTypes};

/// A task type with its compiled payload schema.
pub struct KnownType {
    pub spec: NamedTaskType,
    pub validator: Option<jsonschema::Validator>,
}

/// Task types by (tenant, local name): what a client names in its tenant. Shared, so that a
/// new set keeps the compiled schemas of the types that did not change.
pub type Known = HashMap<(String, String), Arc<KnownType>>;

/// The current set of task types; readers take a cheap snapshot.
#[derive(Default)]
pub struct Registry {
    types: RwLock<Arc<Known>>,
    /// Types no TaskType defines any more whose tasks are still open (found by the
    /// upkeep): never served for submissions, still listed (decision 0033).
    retired: RwLock<Arc<Vec<NamedTaskType>>>,
    /// The last spec of each type that left the set while this process ran: its tasks
    /// are reaped by its own heartbeat timeout, not a guess.
    departed: RwLock<HashMap<String, (Instant, NamedTaskType)>>,
}

fn entry(spec: &NamedTaskType) -> (String, String) {
    (spec.tenant.clone(), spec.local_name().to_owned())
}

impl Registry {
    /// All types must be valid (a file with a broken type or schema is a start-up error).
    pub fn from_file(types: &TaskTypes) -> Result<Registry, String> {
        let mut known = HashMap::new();
        for spec in types.values() {
            known.insert(entry(spec), compile(spec)?);
        }
        Ok(Registry {
            types: RwLock::new(Arc::new(known)),
            retired: RwLock::default(),
            departed: RwLock::default(),
        })
    }

    pub fn snapshot(&self) -> Arc<Known> {
        self.types.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The keys (`<namespace>.<name>` in a cluster) of every type.
    pub fn names(&self) -> Vec<String> {
        self.snapshot()
            .values()
            .map(|k| k.spec.name.clone())
            .collect()
    }

    /// Replaces the set. A type that is invalid is refused (and logged): a new one is left
    /// out, an edited one keeps serving as it was, so that an edit that fails validation
    /// does not take the type's tasks out of upkeep and lists. The rest serve.
    pub fn replace(&self, types: Vec<NamedTaskType>) {
        let before = self.snapshot();
        let mut known = HashMap::new();
        for spec in types {
            // Unchanged since the last set: its schema is not compiled again (a refresh of
            // ten thousand types compiled ten thousand schemas every few seconds).
            if let Some(same) = before.get(&entry(&spec)).filter(|k| k.spec == spec) {
                known.insert(entry(&spec), same.clone());
                continue;
            }
            match compile(&spec) {
                Ok(k) => {
                    known.insert(entry(&spec), k);
                }
                Err(err) => {
                    let kept = before.get(&entry(&spec)).cloned();
                    tracing::warn!(
                        task_type = spec.name,
                        error = err,
                        kept = kept.is_some(),
                        "TaskType refused"
                    );
                    if let Some(kept) = kept {
                        known.insert(entry(&spec), kept);
                    }
                }
            }
        }
        let mut departed = self.departed.write().unwrap_or_else(|p| p.into_inner());
        for (key, gone) in before.iter().filter(|(key, _)| !known.contains_key(*key)) {
            departed.insert(gone.spec.name.clone(), (Instant::now(), gone.spec.clone()));
            tracing::info!(task_type = gone.spec.name, key = ?key, "TaskType left the set");
        }
        for spec in known.values() {
            departed.remove(&spec.spec.name);
        }
        *self.types.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(known);
    }

    /// The last spec of `key` (`<namespace>.<name>`), if it left the set while this
    /// process ran.
    pub fn departed(&self, key: &str) -> Option<NamedTaskType> {
        let departed = self.departed.read().unwrap_or_else(|p| p.into_inner());
        departed.get(key).map(|(_, spec)| spec.clone())
    }

    /// Types no TaskType defines any more whose tasks are still open.
    pub fn retired(&self) -> Arc<Vec<NamedTaskType>> {
        self.retired
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Sets the retired types found by a look that began at `since`; departed specs of
    /// types no longer retired are forgotten (not those that left after the look began).
    pub fn set_retired(&self, retired: Vec<NamedTaskType>, since: Instant) {
        let mut departed = self.departed.write().unwrap_or_else(|p| p.into_inner());
        departed.retain(|key, (left, _)| {
            *left >= since || retired.iter().any(|spec| spec.name == *key)
        });
        drop(departed);
        *self.retired.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(retired);
    }
}

/// Validates a type and compiles its payload schema (see [`NamedTaskType::compile`]).
fn compile(spec: &NamedTaskType) -> Result<Arc<KnownType>, String> {
    Ok(Arc::new(KnownType {
        spec: spec.clone(),
        validator: spec.compile()?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refresh_compiles_only_the_types_that_changed() {
        let registry = Registry::default();
        let kept = NamedTaskType::named("kept");
        let mut edited = NamedTaskType::named("edited");
        registry.replace(vec![kept.clone(), edited.clone()]);
        let before = registry.snapshot();
        edited.spec.max_retries = 9;
        registry.replace(vec![kept, edited]);
        let after = registry.snapshot();
        let key = |name: &str| ("default".to_owned(), name.to_owned());
        assert!(Arc::ptr_eq(&before[&key("kept")], &after[&key("kept")]));
        assert!(!Arc::ptr_eq(
            &before[&key("edited")],
            &after[&key("edited")]
        ));
        assert_eq!(after[&key("edited")].spec.spec.max_retries, 9);
    }

    #[test]
    fn invalid_types_are_left_out_and_the_rest_serve() {
        let registry = Registry::default();
        let good = NamedTaskType::named("good");
        let mut bad_schema = NamedTaskType::named("bad");
        bad_schema.schema = Some(serde_json::json!({"type": "no-such-type"}));
        let mut bad_timeout = NamedTaskType::named("slow");
        bad_timeout.heartbeat_timeout_seconds = 0.0;
        registry.replace(vec![good, bad_schema, bad_timeout]);
        assert_eq!(registry.names(), ["good"]);
    }

    #[test]
    fn an_edit_that_fails_validation_keeps_the_type_as_it_was() {
        let registry = Registry::default();
        let mut spec = NamedTaskType::named("transcode");
        spec.spec.max_retries = 7;
        registry.replace(vec![spec.clone()]);
        let mut broken = spec.clone();
        broken.heartbeat_timeout_seconds = 0.0;
        let mut new_and_broken = NamedTaskType::named("thumbnail");
        new_and_broken.heartbeat_timeout_seconds = 0.0;
        registry.replace(vec![broken, new_and_broken]);
        assert_eq!(registry.names(), ["transcode"]);
        let known = registry.snapshot();
        let kept = &known[&("default".to_owned(), "transcode".to_owned())].spec;
        assert_eq!(kept, &spec);
    }

    #[test]
    fn a_pattern_that_needs_backtracking_is_refused_with_its_type() {
        let mut lookahead = NamedTaskType::named("lookahead");
        lookahead.schema = Some(serde_json::json!({"type": "string", "pattern": "^(?=(a+)+$)a"}));
        let types: TaskTypes = [("lookahead".to_owned(), lookahead)].into();
        let err = Registry::from_file(&types).err().expect("refused");
        assert!(err.contains("lookahead") && err.contains("schema"), "{err}");
    }

    #[test]
    fn two_namespaces_each_keep_their_own_type_of_one_name() {
        let registry = Registry::default();
        let spec = conveyor_core::task_type::TaskTypeSpec::default;
        registry.replace(vec![
            NamedTaskType::in_namespace("video", "transcode", spec()),
            NamedTaskType::in_namespace("audio", "transcode", spec()),
        ]);
        let known = registry.snapshot();
        let key = |ns: &str| {
            known[&(ns.to_owned(), "transcode".to_owned())]
                .spec
                .name
                .clone()
        };
        assert_eq!(
            (key("video"), key("audio")),
            ("video.transcode".into(), "audio.transcode".into())
        );
    }
}
