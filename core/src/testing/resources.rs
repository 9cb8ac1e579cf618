//! Builders for the custom resources, so that a test reads like its story:
//! `WorkerPool::test().named("transcode").consumes("transcode").replicas(3).build()`.
//! Objects are in namespace `video` with a uid and a generation, as the apiserver would
//! return them.

use std::collections::BTreeMap;

use crate::crd::worker_pool::{Autoscaling, HandlerKind, HandlerSpec, PodOverrides};
use crate::crd::{TaskType, TaskTypeSpec, WorkerPool, WorkerPoolSpec};

const NAMESPACE: &str = "video";

impl WorkerPool {
    /// A pool `pool` of noop workers consuming nothing yet, with no count set.
    pub fn test() -> PoolBuilder {
        let mut pool = WorkerPool::new(
            "pool",
            WorkerPoolSpec {
                task_types: Vec::new(),
                image: "conveyor:dev".to_owned(),
                handler: HandlerSpec {
                    kind: HandlerKind::Noop,
                    command: None,
                    url: None,
                },
                concurrency: 16,
                replicas: None,
                autoscaling: None,
                resources: None,
                drain_grace_seconds: 25,
                pod: None,
            },
        );
        pool.metadata.namespace = Some(NAMESPACE.to_owned());
        pool.metadata.uid = Some("9d0c1f52-0000-4000-8000-000000000002".to_owned());
        pool.metadata.generation = Some(1);
        PoolBuilder { pool }
    }
}

pub struct PoolBuilder {
    pool: WorkerPool,
}

impl PoolBuilder {
    pub fn named(mut self, name: &str) -> Self {
        self.pool.metadata.name = Some(name.to_owned());
        self
    }

    pub fn in_namespace(mut self, namespace: &str) -> Self {
        self.pool.metadata.namespace = Some(namespace.to_owned());
        self
    }

    pub fn consumes(mut self, task_type: &str) -> Self {
        self.pool.spec.task_types.push(task_type.to_owned());
        self
    }

    pub fn replicas(mut self, replicas: i32) -> Self {
        self.pool.spec.replicas = Some(replicas);
        self.pool.spec.autoscaling = None;
        self
    }

    pub fn concurrency(mut self, concurrency: u16) -> Self {
        self.pool.spec.concurrency = concurrency;
        self
    }

    /// Autoscaled between `min` and `max` with the defaults of the CRD otherwise.
    pub fn autoscaled(mut self, min: i32, max: i32) -> Self {
        self.pool.spec.replicas = None;
        self.pool.spec.autoscaling = Some(Autoscaling {
            min_replicas: min,
            max_replicas: max,
            target_backlog_per_replica: 100,
            scale_down_stabilization_seconds: 300,
            activation_backlog: 0,
            target_utilization_percent: None,
            scale_down_max_percent: 50,
            fallback: None,
        });
        self
    }

    /// The pod template, as a user writes `spec.pod` (YAML).
    pub fn pod(mut self, yaml: &str) -> Self {
        let pod: PodOverrides = serde_yaml::from_str(yaml)
            .unwrap_or_else(|err| panic!("spec.pod of a test pool: {err}\n{yaml}"));
        self.pool.spec.pod = Some(pod);
        self
    }

    pub fn annotated(mut self, key: &str, value: &str) -> Self {
        self.pool
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(key.to_owned(), value.to_owned());
        self
    }

    pub fn build(self) -> WorkerPool {
        self.pool
    }
}

impl TaskType {
    /// A TaskType `name` with the default spec, as read back from the apiserver.
    pub fn test(name: &str) -> TaskTypeBuilder {
        let mut task_type = TaskType::new(name, TaskTypeSpec::default());
        task_type.metadata.namespace = Some(NAMESPACE.to_owned());
        task_type.metadata.uid = Some("3b7f0d1e-0000-4000-8000-000000000001".to_owned());
        task_type.metadata.generation = Some(2);
        task_type.metadata.resource_version = Some("41".to_owned());
        TaskTypeBuilder { task_type }
    }
}

pub struct TaskTypeBuilder {
    task_type: TaskType,
}

impl TaskTypeBuilder {
    pub fn in_namespace(mut self, namespace: &str) -> Self {
        self.task_type.metadata.namespace = Some(namespace.to_owned());
        self
    }

    pub fn spec(mut self, spec: TaskTypeSpec) -> Self {
        self.task_type.spec = spec;
        self
    }

    pub fn build(self) -> TaskType {
        self.task_type
    }
}
