//! WorkerPool → the objects that run it: ConfigMap, Deployment, metrics Service and
//! PodDisruptionBudget. Pure functions: the reconciler applies what they return with
//! server-side apply; tests compare them with fixtures.

use std::collections::BTreeMap;

use conveyor_core::crd::status::reasons;
use conveyor_core::crd::worker_pool::{
    HandlerKind, PodOverrides, RESERVED_VOLUMES, WORKER_CONTAINER,
};
use conveyor_core::crd::WorkerPool;
use conveyor_core::task_type::NamedTaskType;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Service, Toleration};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};

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
    /// What the CRD's rules cannot check cheaply: the mounts of init and sidecar containers.
    #[error("container {container:?} of spec.pod mounts volume {volume:?}, which is neither in spec.pod.volumes nor one of the operator's (config, tmp, buffer, tls)")]
    UnknownVolume { container: String, volume: String },
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
            BuildError::UnknownVolume { .. } => reasons::INVALID_POD_TEMPLATE,
            BuildError::Serde { .. } => reasons::BUILD_FAILED,
        }
    }
}

/// Gives the pool's workers their admin token ([`conveyor_core::drain::ADMIN_TOKEN_ENV`]):
/// an env value, so it is as visible as the Deployment (to the pool's namespace); handlers
/// never see it.
pub fn set_admin_token(deployment: &mut Deployment, token: &str) {
    set_worker_env(deployment, conveyor_core::drain::ADMIN_TOKEN_ENV, token);
}

/// Makes the pool's workers refuse plaintext links, as the operator does
/// (`--require-tls`): last in the list, so a pool's own `spec.pod.env` cannot turn it off.
pub fn require_tls(deployment: &mut Deployment) {
    set_worker_env(deployment, "CONVEYOR_REQUIRE_TLS", "true");
}

/// Appends `name=value` to the worker container's environment.
fn set_worker_env(deployment: &mut Deployment, name: &str, value: &str) {
    let containers = deployment
        .spec
        .as_mut()
        .and_then(|spec| spec.template.spec.as_mut())
        .map(|pod| &mut pod.containers);
    if let Some(worker) = containers.and_then(|c| c.iter_mut().find(|c| c.name == WORKER_CONTAINER))
    {
        worker
            .env
            .get_or_insert_with(Vec::new)
            .push(k8s_openapi::api::core::v1::EnvVar {
                name: name.to_owned(),
                value: Some(value.to_owned()),
                value_from: None,
            });
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
    let bytes = config_map
        .data
        .iter()
        .flatten()
        .flat_map(|(key, value)| key.bytes().chain([0]).chain(value.bytes()).chain([0]));
    format!("{:016x}", fnv1a(bytes))
}

/// FNV-1a, 64 bits: a hash that stays the same across builds and processes.
pub fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
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
    check_mounts(&overrides)?;
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
    env.extend(values(&overrides.env)?);
    let mut mounts = vec![
        json!({"name": "config", "mountPath": CONFIG_DIR, "readOnly": true}),
        json!({"name": "tmp", "mountPath": "/tmp"}),
        json!({"name": "buffer", "mountPath": BUFFER_DIR}),
        json!({"name": "tls", "mountPath": WORKER_CA_DIR, "readOnly": true}),
    ];
    mounts.extend(values(&overrides.volume_mounts)?);
    let mut volumes = vec![
        json!({"name": "config", "configMap": {"name": format!("{name}-worker")}}),
        json!({"name": "tmp", "emptyDir": {"sizeLimit": overrides.tmp_size_limit}}),
        json!({"name": "buffer", "emptyDir": {"sizeLimit": overrides.buffer_size_limit}}),
        // Optional: a Secret without the key mounts an empty directory.
        json!({"name": "tls", "secret": {
            "secretName": secret.name,
            "optional": true,
            "items": [{"key": WORKER_CA_KEY, "path": WORKER_CA_KEY}]
        }}),
    ];
    volumes.extend(values(&overrides.volumes)?);
    let mut pod_security = restricted_pod_security();
    if let Some(own) = &overrides.security_context {
        merge(&mut pod_security, value(own)?);
    }
    let mut worker_security = restricted_container_security();
    if let Some(own) = &overrides.container_security_context {
        merge(&mut worker_security, value(own)?);
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
                    "runtimeClassName": overrides.runtime_class_name,
                    "imagePullSecrets": non_empty(&overrides.image_pull_secrets),
                    "nodeSelector": overrides.node_selector,
                    "tolerations": tolerations(&overrides.tolerations),
                    "affinity": overrides.affinity,
                    "topologySpreadConstraints": spread(&overrides, name)?,
                    "terminationGracePeriodSeconds": i64::from(spec.drain_grace_seconds) + 10,
                    "automountServiceAccountToken": false,
                    "securityContext": pod_security,
                    "initContainers": init_containers(&overrides)?,
                    "containers": [{
                        "name": WORKER_CONTAINER,
                        "image": spec.image,
                        "command": ["conveyor-worker"],
                        "args": worker_args(pool, pod.consumed),
                        "env": env,
                        "envFrom": non_empty(&overrides.env_from),
                        "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
                        "resources": spec.resources,
                        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5},
                        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10, "failureThreshold": 6},
                        "securityContext": worker_security,
                        "volumeMounts": mounts
                    }],
                    "volumes": volumes
                }
            }
        }
    });
    typed("Deployment", strip_nulls(deployment))
}

/// The pods' default security context (Pod Security Standards' restricted profile);
/// `spec.pod.securityContext` is merged over it.
fn restricted_pod_security() -> Value {
    json!({
        "runAsNonRoot": true,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"}
    })
}

/// Every container's default security context (restricted, and a read-only root
/// filesystem); the worker's `spec.pod.containerSecurityContext`, and an init or sidecar
/// container's own `securityContext`, are merged over it.
fn restricted_container_security() -> Value {
    json!({
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": true,
        "runAsNonRoot": true,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}
    })
}

/// `over` merged into `base` field by field: objects recursively, anything else (a list
/// included) replaces what `base` has. Unset fields are absent from `over` (k8s-openapi
/// does not serialize `None`), so they keep the default.
fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(base), Value::Object(over)) => {
            for (key, value) in over {
                merge(base.entry(key).or_insert(Value::Null), value);
            }
        }
        (base, over) => *base = over,
    }
}

/// The user's init containers, then the sidecars as native sidecars (`restartPolicy:
/// Always`): one-shot preparation is done before a sidecar starts, and every sidecar is
/// started before the worker. Each gets the restricted container security context below
/// its own. `None` when there are none, so that pools without any claim no field.
fn init_containers(overrides: &PodOverrides) -> Result<Option<Vec<Value>>, BuildError> {
    let prepare = |container: &Container, sidecar: bool| -> Result<Value, BuildError> {
        let mut container = value(container)?;
        let mut security = restricted_container_security();
        if let Some(own) = container.get_mut("securityContext").map(Value::take) {
            merge(&mut security, own);
        }
        container["securityContext"] = security;
        if sidecar {
            container["restartPolicy"] = "Always".into();
        }
        Ok(container)
    };
    let inits = overrides.init_containers.iter().map(|c| prepare(c, false));
    let sidecars = overrides.sidecars.iter().map(|c| prepare(c, true));
    let all = inits.chain(sidecars).collect::<Result<Vec<_>, _>>()?;
    Ok((!all.is_empty()).then_some(all))
}

/// The pool's spread constraints (each without a selector gets the pool's), or else a soft
/// spread over nodes where the scheduler can (never blocking it), so that a node lost takes
/// a share of the pool, not all of it.
fn spread(overrides: &PodOverrides, name: &str) -> Result<Vec<Value>, BuildError> {
    let selector = json!({"matchLabels": {POOL_LABEL: name}});
    if overrides.topology_spread_constraints.is_empty() {
        return Ok(vec![json!({
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": selector
        })]);
    }
    let mut constraints = values(&overrides.topology_spread_constraints)?;
    for constraint in &mut constraints {
        if constraint.get("labelSelector").is_none() {
            constraint["labelSelector"] = selector.clone();
        }
    }
    Ok(constraints)
}

/// Every volume an init or sidecar container mounts exists. (The worker's mounts are
/// checked by the CRD's rules; the containers' own lists are too deep for them.)
fn check_mounts(overrides: &PodOverrides) -> Result<(), BuildError> {
    let known = |volume: &str| {
        RESERVED_VOLUMES.contains(&volume) || overrides.volumes.iter().any(|v| v.name == volume)
    };
    let containers = overrides.init_containers.iter().chain(&overrides.sidecars);
    for container in containers {
        for mount in container.volume_mounts.iter().flatten() {
            if !known(&mount.name) {
                return Err(BuildError::UnknownVolume {
                    container: container.name.clone(),
                    volume: mount.name.clone(),
                });
            }
        }
    }
    Ok(())
}

/// `list`, or `None` when it is empty: a pool that sets nothing claims no field.
fn non_empty<T>(list: &[T]) -> Option<&[T]> {
    (!list.is_empty()).then_some(list)
}

fn value<T: serde::Serialize>(item: &T) -> Result<Value, BuildError> {
    serde_json::to_value(item).map_err(|source| BuildError::Serde {
        kind: "Deployment",
        source,
    })
}

fn values<T: serde::Serialize>(items: &[T]) -> Result<Vec<Value>, BuildError> {
    items.iter().map(value).collect()
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
