//! The task types the gateway accepts, with compiled payload schemas. Fixed when they come
//! from a file; refreshed from the TaskType resources when the gateway runs in a cluster.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use conveyor_core::crd::TaskType;
use conveyor_core::task_type::{NamedTaskType, TaskTypes};
use kube::api::{Api, ListParams};

/// A task type with its compiled payload schema.
pub struct KnownType {
    pub spec: NamedTaskType,
    pub validator: Option<jsonschema::Validator>,
}

/// Task types by (tenant, local name): what a client names in its tenant.
pub type Known = HashMap<(String, String), KnownType>;

/// The current set of task types; readers take a cheap snapshot.
#[derive(Default)]
pub struct Registry {
    types: RwLock<Arc<Known>>,
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

    /// Replaces the set; a type that is invalid is left out (and logged), the rest serve.
    pub fn replace(&self, types: Vec<NamedTaskType>) {
        let mut known = HashMap::new();
        for spec in types {
            match compile(&spec) {
                Ok(k) => {
                    known.insert(entry(&spec), k);
                }
                Err(err) => tracing::warn!(task_type = spec.name, error = err, "TaskType refused"),
            }
        }
        *self.types.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(known);
    }
}

/// Every TaskType in the cluster, as the data path sees it.
pub async fn list_cluster_types(client: &kube::Client) -> Result<Vec<NamedTaskType>, kube::Error> {
    let list = Api::<TaskType>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    Ok(list.items.iter().map(NamedTaskType::from).collect())
}

/// Validates a type and compiles its payload schema (see [`NamedTaskType::compile`]).
fn compile(spec: &NamedTaskType) -> Result<KnownType, String> {
    Ok(KnownType {
        spec: spec.clone(),
        validator: spec.compile()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
