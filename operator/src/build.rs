//! WorkerPool → the objects that run it: ConfigMap, Deployment, metrics Service and
//! PodDisruptionBudget. Pure functions: the reconciler applies what they return with
//! server-side apply; tests compare them with fixtures.

use std::collections::BTreeMap;

use conveyor_core::crd::status::reasons;
use conveyor_core::crd::worker_pool::HandlerKind;
use conveyor_core::crd::WorkerPool;
use conveyor_core::task_type::NamedTaskType;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, Toleration};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use serde_json::json;

/// The field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "conveyor-operator";
pub const POOL_LABEL: &str = "conveyor.dev/pool";
pub const CONFIG_HASH_ANNOTATION: &str = "conveyor.dev/config-hash";
pub const METRICS_PORT: i32 = 9090;
const CONFIG_DIR: &str = "/etc/conveyor";
/// The worker's degraded-mode buffer: an emptyDir, so it survives a container restart (a
/// crashed worker replays what it buffered) but not the pod.
const BUFFER_DIR: &str = "/var/lib/conveyor";
/// Where a worker finds the CA of its database and broker: the connection Secret's
/// `ca.crt`, when it has one (URLs name it: `sslrootcert=`, `cacertfile=`; decision 0014).
pub const WORKER_CA_DIR: &str = "/var/run/conveyor/tls";
pub const WORKER_CA_KEY: &str = "ca.crt";
const TASK_TYPES_FILE: &str = "task-types.yaml";
/// How long a worker pod stays bound to a node that stopped reporting (NotReady or
/// unreachable) before it is evicted and replaced elsewhere, unless the pool's own
/// tolerations say otherwise (decision 0022). Kubernetes' default is 300 s: five minutes of a
/// pool's capacity gone with the node, while its tasks are re-run elsewhere anyway once their
/// heartbeats stop.
pub const NODE_LOST_TOLERATION_SECONDS: i64 = 30;
const NODE_LOST_TAINTS: [&str; 2] = [
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
];

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("WorkerPool has no {0} (it was not read from the API server)")]
    Missing(&'static str),
    #[error("WorkerPool consumes task type {0:?}, which does not exist in its namespace")]
    UnknownTaskType(String),
    #[error("cannot build {kind}")]
    Serde {
        kind: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

impl BuildError {
    /// Stable label for metrics and Event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            BuildError::Missing(_) => reasons::INVALID_OBJECT,
            BuildError::UnknownTaskType(_) => reasons::UNKNOWN_TASK_TYPE,
            BuildError::Serde { .. } => reasons::BUILD_FAILED,
        }
    }
}

/// Everything a pool runs on.
pub struct PoolObjects {
    pub config_map: ConfigMap,
    pub deployment: Deployment,
    pub service: Service,
    pub pod_disruption_budget: PodDisruptionBudget,
}

/// Where workers find the broker and the database: keys of a Secret in the pool's namespace.
#[derive(Debug, Clone)]
pub struct ConnectionSecret {
    pub name: String,
    pub database_url_key: String,
    pub amqp_url_key: String,
}

impl Default for ConnectionSecret {
    fn default() -> Self {
        ConnectionSecret {
            name: "conveyor-connections".into(),
            database_url_key: "database-url".into(),
            amqp_url_key: "amqp-url".into(),
        }
    }
}

/// Builds a pool's objects. `task_types` are the TaskTypes of its namespace; `replicas` is
/// what the scaling decision (or `spec.replicas`) says.
pub fn pool_objects(
    pool: &WorkerPool,
    task_types: &[NamedTaskType],
    replicas: i32,
    secret: &ConnectionSecret,
) -> Result<PoolObjects, BuildError> {
    let name = pool
        .metadata
        .name
        .clone()
        .ok_or(BuildError::Missing("name"))?;
    let owner = pool
        .controller_owner_ref(&())
        .ok_or(BuildError::Missing("uid"))?;
    let consumed = pool
        .spec
        .task_types
        .iter()
        .map(|wanted| {
            task_types
                .iter()
                .find(|t| t.local_name() == wanted)
                .cloned()
                .ok_or_else(|| BuildError::UnknownTaskType(wanted.clone()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let config_map = config_map(pool, &name, &owner, &consumed)?;
    let hash = config_hash(&config_map);
    let keys: Vec<&str> = consumed.iter().map(|t| t.name.as_str()).collect();
    let pod = PodInputs {
        config_hash: &hash,
        secret,
        consumed: &keys,
    };
    Ok(PoolObjects {
        deployment: deployment(pool, &name, &owner, replicas, &pod)?,
        service: service(pool, &name, &owner)?,
        pod_disruption_budget: pod_disruption_budget(pool, &name, &owner)?,
        config_map,
    })
}

fn meta(pool: &WorkerPool, name: &str, owner: &OwnerReference) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: pool.namespace(),
        labels: Some(labels(&pool.name_any())),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}

/// Labels on everything a pool owns; the selector is the pool label alone.
pub fn labels(pool: &str) -> BTreeMap<String, String> {
    [
        ("app.kubernetes.io/name", "conveyor-worker"),
        ("app.kubernetes.io/instance", pool),
        ("app.kubernetes.io/managed-by", FIELD_MANAGER),
        // The local cluster's pod runners run the pods of this label (and kwok fakes the rest).
        ("app.kubernetes.io/part-of", "conveyor"),
        (POOL_LABEL, pool),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The selector string the scale subresource reports.
pub fn selector(pool: &str) -> String {
    format!("{POOL_LABEL}={pool}")
}

fn typed<T: serde::de::DeserializeOwned>(
    kind: &'static str,
    value: serde_json::Value,
) -> Result<T, BuildError> {
    serde_json::from_value(value).map_err(|source| BuildError::Serde { kind, source })
}

fn config_map(
    pool: &WorkerPool,
    name: &str,
    owner: &OwnerReference,
    consumed: &[NamedTaskType],
) -> Result<ConfigMap, BuildError> {
    let file = json!({ "taskTypes": consumed });
    let yaml = serde_yaml::to_string(&file).map_err(|e| BuildError::Serde {
        kind: "ConfigMap",
        source: serde::ser::Error::custom(e),
    })?;
    Ok(ConfigMap {
        metadata: meta(pool, &format!("{name}-worker"), owner),
        data: Some([(TASK_TYPES_FILE.to_owned(), yaml)].into()),
        ..ConfigMap::default()
    })
}

/// FNV-1a over the ConfigMap data: stable across builds, so pods roll exactly when the
/// task type settings they run with change.
fn config_hash(config_map: &ConfigMap) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (key, value) in config_map.data.iter().flatten() {
        for byte in key.bytes().chain([0]).chain(value.bytes()).chain([0]) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{hash:016x}")
}

/// What a pool's pods run with besides the pool's spec.
struct PodInputs<'a> {
    /// Of the ConfigMap: pods roll when it changes.
    config_hash: &'a str,
    secret: &'a ConnectionSecret,
    /// Keys of the task types the workers consume (`<namespace>.<name>`).
    consumed: &'a [&'a str],
}

fn worker_args(pool: &WorkerPool, consumed: &[&str]) -> Vec<String> {
    let spec = &pool.spec;
    let mut args = vec![
        format!("--task-types={CONFIG_DIR}/{TASK_TYPES_FILE}"),
        format!("--consume={}", consumed.join(",")),
        format!("--handler={}", spec.handler.kind.as_str()),
        format!("--concurrency={}", spec.concurrency),
        format!("--drain-grace-seconds={}", spec.drain_grace_seconds),
        format!("--metrics-listen=0.0.0.0:{METRICS_PORT}"),
        format!("--buffer-dir={BUFFER_DIR}"),
        // The operator declares the queues: a TaskType deleted with `Delete` stays deleted.
        "--no-declare".to_owned(),
        "--log-json".to_owned(),
    ];
    if let (HandlerKind::Http, Some(url)) = (spec.handler.kind, &spec.handler.url) {
        args.push(format!("--http-url={url}"));
    }
    if let (HandlerKind::Exec, Some(command)) = (spec.handler.kind, &spec.handler.command) {
        args.push("--".to_owned());
        args.extend(command.iter().cloned());
    }
    args
}

fn deployment(
    pool: &WorkerPool,
    name: &str,
    owner: &OwnerReference,
    replicas: i32,
    pod: &PodInputs<'_>,
) -> Result<Deployment, BuildError> {
    let (config_hash, secret) = (pod.config_hash, pod.secret);
    let spec = &pool.spec;
    let overrides = spec.pod.clone().unwrap_or_default();
    let mut pod_labels = overrides.labels.clone();
    pod_labels.extend(labels(name));
    let mut annotations = overrides.annotations.clone();
    annotations.insert(CONFIG_HASH_ANNOTATION.to_owned(), config_hash.to_owned());
    let secret_env = |var: &str, key: &str| json!({"name": var, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": key}}});
    let mut env = vec![
        json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
        secret_env("CONVEYOR_DATABASE_URL", &secret.database_url_key),
        secret_env("CONVEYOR_AMQP_URL", &secret.amqp_url_key),
    ];
    for var in &overrides.env {
        env.push(
            serde_json::to_value(var).map_err(|source| BuildError::Serde {
                kind: "Deployment",
                source,
            })?,
        );
    }
    let deployment = json!({
        "metadata": meta(pool, &format!("{name}-worker"), owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {POOL_LABEL: name}},
            // New workers start before old ones go: a rollout never drops capacity, and old
            // workers drain their tasks (terminationGracePeriod covers the drain).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": annotations},
                "spec": {
                    "serviceAccountName": overrides.service_account_name,
                    "priorityClassName": overrides.priority_class_name,
                    "nodeSelector": overrides.node_selector,
                    "tolerations": tolerations(&overrides.tolerations),
                    "affinity": overrides.affinity,
                    // Spread over nodes where the scheduler can (never blocking it), so that
                    // a node lost takes a share of the pool, not all of it.
                    "topologySpreadConstraints": [{
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {"matchLabels": {POOL_LABEL: name}}
                    }],
                    "terminationGracePeriodSeconds": i64::from(spec.drain_grace_seconds) + 10,
                    "automountServiceAccountToken": false,
                    "securityContext": {
                        "runAsNonRoot": true,
                        "runAsUser": 65532,
                        "runAsGroup": 65532,
                        "fsGroup": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"}
                    },
                    "containers": [{
                        "name": "worker",
                        "image": spec.image,
                        "command": ["conveyor-worker"],
                        "args": worker_args(pool, pod.consumed),
                        "env": env,
                        "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
                        "resources": spec.resources,
                        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5},
                        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10, "failureThreshold": 6},
                        "securityContext": {
                            "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true,
                            "runAsNonRoot": true,
                            "capabilities": {"drop": ["ALL"]},
                            "seccompProfile": {"type": "RuntimeDefault"}
                        },
                        "volumeMounts": [
                            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": true},
                            {"name": "tmp", "mountPath": "/tmp"},
                            {"name": "buffer", "mountPath": BUFFER_DIR},
                            {"name": "tls", "mountPath": WORKER_CA_DIR, "readOnly": true}
                        ]
                    }],
                    "volumes": [
                        {"name": "config", "configMap": {"name": format!("{name}-worker")}},
                        {"name": "tmp", "emptyDir": {}},
                        {"name": "buffer", "emptyDir": {}},
                        // Optional: a Secret without the key mounts an empty directory.
                        {"name": "tls", "secret": {
                            "secretName": secret.name,
                            "optional": true,
                            "items": [{"key": WORKER_CA_KEY, "path": WORKER_CA_KEY}]
                        }}
                    ]
                }
            }
        }
    });
    typed("Deployment", strip_nulls(deployment))
}

/// The pool's tolerations, and [`NODE_LOST_TOLERATION_SECONDS`] for the node-lost taints it
/// does not tolerate itself.
fn tolerations(given: &[Toleration]) -> Vec<Toleration> {
    let covered = |key: &str| given.iter().any(|t| t.key.as_deref() == Some(key));
    let defaults = NODE_LOST_TAINTS
        .into_iter()
        .filter(|key| !covered(key))
        .map(|key| Toleration {
            key: Some(key.to_owned()),
            operator: Some("Exists".to_owned()),
            effect: Some("NoExecute".to_owned()),
            toleration_seconds: Some(NODE_LOST_TOLERATION_SECONDS),
            value: None,
        });
    given.iter().cloned().chain(defaults).collect()
}

fn service(pool: &WorkerPool, name: &str, owner: &OwnerReference) -> Result<Service, BuildError> {
    typed(
        "Service",
        json!({
            "metadata": meta(pool, &format!("{name}-worker-metrics"), owner),
            "spec": {
                "clusterIP": "None",
                "selector": {POOL_LABEL: name},
                "ports": [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]
            }
        }),
    )
}

fn pod_disruption_budget(
    pool: &WorkerPool,
    name: &str,
    owner: &OwnerReference,
) -> Result<PodDisruptionBudget, BuildError> {
    typed(
        "PodDisruptionBudget",
        json!({
            "metadata": meta(pool, &format!("{name}-worker"), owner),
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": {POOL_LABEL: name}}
            }
        }),
    )
}

/// Drops `null` fields (unset overrides), so that the applied object claims only the
/// fields the pool actually sets: server-side apply takes ownership of what is sent.
fn strip_nulls(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => serde_json::Value::Object(
            map.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, strip_nulls(v)))
                .collect(),
        ),
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(strip_nulls).collect())
        }
        other => other,
    }
}
