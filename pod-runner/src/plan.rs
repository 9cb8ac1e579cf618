//! What a pod means on this machine: the pure translation of a pod's container into a local
//! process (program, arguments, environment, files), given the Secrets and ConfigMaps it
//! refers to. Paths inside the image and the pod's mounts become directories here; ports
//! bound on 0.0.0.0 are bound on the pod's own loopback address (its podIP) instead.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, EnvVarSource, Pod};

/// The process to start for a pod, and the files it expects to find.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub files: Vec<(PathBuf, String)>,
    pub dirs: Vec<PathBuf>,
    /// SIGTERM, then this long before SIGKILL (the pod's termination grace period).
    pub grace: Duration,
    /// When an exited process is started again.
    pub restart: RestartPolicy,
}

/// A pod's `restartPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum RestartPolicy {
    #[default]
    Always,
    OnFailure,
    Never,
}

impl RestartPolicy {
    fn of(policy: Option<&str>) -> RestartPolicy {
        match policy {
            Some("Never") => RestartPolicy::Never,
            Some("OnFailure") => RestartPolicy::OnFailure,
            _ => RestartPolicy::Always,
        }
    }

    /// Whether a process that exited with `code` is started again.
    pub fn after(self, code: i32) -> bool {
        match self {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => code != 0,
            RestartPolicy::Never => false,
        }
    }
}

/// Where the pod lands on this machine.
#[derive(Debug, Clone)]
pub struct Host {
    /// Where a bare command name (`conveyor-worker`) is looked up first.
    pub bin_dir: PathBuf,
    /// Other releases' binaries: an image tagged `T` runs those in `releases/T/bin` when
    /// that folder exists (the chart's upgrade test installs the previous release this way).
    pub releases: Option<PathBuf>,
    /// This pod's own directory: volumes live under it.
    pub pod_dir: PathBuf,
    /// Image path prefix → local directory (e.g. the handler scripts).
    pub path_maps: Vec<(String, PathBuf)>,
    /// The pod's own loopback address (its `status.podIP`): the pod's ports keep their
    /// numbers there, so `podIP:containerPort` reaches it as in a cluster.
    pub address: std::net::Ipv4Addr,
    /// How this runner reaches the apiserver; a pod that mounts its service account's token
    /// gets a kubeconfig acting as that account instead (what a kubelet's projected token
    /// gives a pod in a cluster).
    pub apiserver: Option<Apiserver>,
}

/// The apiserver's address and a token allowed to impersonate service accounts.
#[derive(Debug, Clone, PartialEq)]
pub struct Apiserver {
    pub server: String,
    pub token: String,
}

/// `$(NAME)` replaced by an earlier variable's value, as a kubelet does: `$$` is a literal
/// `$`, and a reference to a variable not defined before stays as written.
fn expand(value: &str, defined: &[(String, String)]) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        if let Some(after) = rest.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some((name, after)) = rest.strip_prefix("$(").and_then(|r| r.split_once(')'))
        {
            match defined.iter().rev().find(|(n, _)| n == name) {
                Some((_, v)) => out.push_str(v),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = after;
        } else {
            out.push('$');
            rest = &rest[1..];
        }
    }
    out.push_str(rest);
    out
}

/// The projected volume of a service account's token, its CA and namespace.
fn is_api_access(volume: &k8s_openapi::api::core::v1::Volume) -> bool {
    volume.projected.as_ref().is_some_and(|p| {
        p.sources
            .iter()
            .flatten()
            .any(|s| s.service_account_token.is_some())
    })
}

/// A kubeconfig acting as `system:serviceaccount:<namespace>:<account>`.
fn service_account_kubeconfig(apiserver: &Apiserver, namespace: &str, account: &str) -> String {
    let user = format!("system:serviceaccount:{namespace}:{account}");
    // JSON is YAML: no quoting rules to get wrong.
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": apiserver.server, "insecure-skip-tls-verify": true}}],
        "users": [{"name": user, "user": {"token": apiserver.token, "as": user}}],
        "contexts": [{"name": "pod", "context": {"cluster": "local", "user": user, "namespace": namespace}}],
        "current-context": "pod",
    })
    .to_string()
}

/// The Secrets and ConfigMaps of the pod's namespace that it refers to, by name.
#[derive(Debug, Default, Clone)]
pub struct Objects {
    pub secrets: BTreeMap<String, BTreeMap<String, String>>,
    pub config_maps: BTreeMap<String, BTreeMap<String, String>>,
}

/// Names the pod refers to, to be fetched before planning.
#[derive(Debug, Default, PartialEq)]
pub struct References {
    pub secrets: BTreeSet<String>,
    pub config_maps: BTreeSet<String>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("the pod has no spec")]
    NoSpec,
    #[error("the pod has {0} containers; the local runner runs pods of exactly one")]
    Containers(usize),
    #[error("container {0:?} has no command")]
    NoCommand(String),
    #[error("secret {name:?} has no key {key:?} (or does not exist)")]
    MissingSecret { name: String, key: String },
    #[error("config map {name:?} has no key {key:?} (or does not exist)")]
    MissingConfigMapKey { name: String, key: String },
    #[error("config map {0:?} does not exist")]
    MissingConfigMap(String),
    #[error("env {var}: {what} is not supported by the local runner")]
    UnsupportedEnv { var: String, what: String },
    #[error("volume {0:?}: only configMap, secret, emptyDir and service account token volumes are supported by the local runner (or any volume mounted under a --map path)")]
    UnsupportedVolume(String),
}

fn container(pod: &Pod) -> Result<&Container, PlanError> {
    let spec = pod.spec.as_ref().ok_or(PlanError::NoSpec)?;
    match spec.containers.as_slice() {
        [one] => Ok(one),
        many => Err(PlanError::Containers(many.len())),
    }
}

/// The Secrets and ConfigMaps the pod's container and volumes need.
pub fn references(pod: &Pod) -> Result<References, PlanError> {
    let mut refs = References::default();
    for var in container(pod)?.env.iter().flatten() {
        if let Some(from) = &var.value_from {
            if let Some(secret) = &from.secret_key_ref {
                refs.secrets.insert(secret.name.clone());
            }
            if let Some(map) = &from.config_map_key_ref {
                refs.config_maps.insert(map.name.clone());
            }
        }
    }
    let volumes = pod.spec.as_ref().and_then(|s| s.volumes.as_ref());
    for volume in volumes.into_iter().flatten() {
        if let Some(map) = &volume.config_map {
            refs.config_maps.insert(map.name.clone());
        }
        if let Some(name) = volume.secret.as_ref().and_then(|s| s.secret_name.as_ref()) {
            refs.secrets.insert(name.clone());
        }
    }
    Ok(refs)
}

/// The local process for `pod`.
pub fn plan(pod: &Pod, objects: &Objects, host: &Host) -> Result<Launch, PlanError> {
    let container = container(pod)?;
    let spec = pod.spec.as_ref().ok_or(PlanError::NoSpec)?;

    // A volume the container mounts only where the runner maps a directory of this machine
    // (`--map /media=...`) is that directory, whatever its source: a claim or a hostPath
    // means storage this machine does not have.
    let mapped = |path: &str| {
        host.path_maps.iter().any(|(prefix, _)| {
            path.strip_prefix(prefix.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
    };
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    let by_map: BTreeSet<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .filter(|name| {
            let mut its = mounts.iter().filter(|m| m.name == *name).peekable();
            its.peek().is_some() && its.all(|m| mapped(&m.mount_path))
        })
        .collect();

    // Volumes become directories under the pod's own; config maps become files in them.
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    let mut volume_dirs = BTreeMap::new();
    for volume in spec.volumes.iter().flatten() {
        if by_map.contains(volume.name.as_str()) {
            continue;
        }
        let dir = host.pod_dir.join("volumes").join(&volume.name);
        if let Some(source) = &volume.config_map {
            let data = objects
                .config_maps
                .get(&source.name)
                .ok_or_else(|| PlanError::MissingConfigMap(source.name.clone()))?;
            for (key, value) in data {
                files.push((dir.join(key), value.clone()));
            }
        } else if let Some(source) = &volume.secret {
            files.extend(
                secret_files(source, objects)?
                    .into_iter()
                    .map(|(path, value)| (dir.join(path), value)),
            );
        } else if is_api_access(volume) {
            // The service account's token volume the apiserver adds: the pod gets a
            // kubeconfig acting as its account instead (below); the directory stays empty.
        } else if volume.empty_dir.is_none() {
            return Err(PlanError::UnsupportedVolume(volume.name.clone()));
        }
        dirs.push(dir.clone());
        volume_dirs.insert(volume.name.clone(), dir);
    }

    // Every image path and every 0.0.0.0 port is rewritten to its local counterpart.
    let mut rewrites: Vec<(String, String)> = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        if let Some(dir) = volume_dirs.get(&mount.name) {
            rewrites.push((mount.mount_path.clone(), display(dir)));
        }
    }
    for (prefix, dir) in &host.path_maps {
        rewrites.push((prefix.clone(), display(dir)));
    }
    rewrites.push(("0.0.0.0:".to_owned(), format!("{}:", host.address)));
    // Longest pattern first, so `/etc/conveyor/x` wins over `/etc`.
    rewrites.sort_by_key(|(from, _)| std::cmp::Reverse(from.len()));
    let localize = |s: &str| {
        rewrites
            .iter()
            .find(|(from, _)| s.contains(from.as_str()))
            .map_or_else(|| s.to_owned(), |(from, to)| s.replacen(from, to, 1))
    };

    let mut line: Vec<String> = container
        .command
        .iter()
        .flatten()
        .map(|s| localize(s))
        .collect();
    line.extend(container.args.iter().flatten().map(|s| localize(s)));
    if container.command.as_ref().is_none_or(Vec::is_empty) {
        return Err(PlanError::NoCommand(container.name.clone()));
    }
    let program = line.remove(0);
    let bin_dir = host.bin_dir_for(container.image.as_deref());
    let program = if program.contains('/') || !bin_dir.join(&program).is_file() {
        PathBuf::from(program)
    } else {
        bin_dir.join(program)
    };

    let mut env = vec![
        ("HOME".to_owned(), display(&host.pod_dir)),
        ("TMPDIR".to_owned(), display(&host.pod_dir.join("tmp"))),
    ];
    // The image's binaries are on its PATH: here they are in bin_dir.
    let path = std::env::var("PATH").unwrap_or_default();
    env.push(("PATH".to_owned(), format!("{}:{path}", display(&bin_dir))));
    dirs.push(host.pod_dir.join("tmp"));
    // The container's own variables, for `$(VAR)` references in later ones (a kubelet's
    // dependent environment variables).
    let mut defined: Vec<(String, String)> = Vec::new();
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (_, Some(from)) => env_from(pod, &var.name, from, objects, host)?,
            (Some(value), None) => localize(&expand(value, &defined)),
            (None, None) => String::new(),
        };
        defined.push((var.name.clone(), value.clone()));
        env.push((var.name.clone(), value));
    }

    if let (Some(apiserver), false) = (
        &host.apiserver,
        spec.automount_service_account_token == Some(false),
    ) {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let account = spec.service_account_name.as_deref().unwrap_or("default");
        let path = host.pod_dir.join("serviceaccount").join("kubeconfig");
        files.push((
            path.clone(),
            service_account_kubeconfig(apiserver, namespace, account),
        ));
        dirs.push(host.pod_dir.join("serviceaccount"));
        env.push(("KUBECONFIG".to_owned(), display(&path)));
    }

    let grace = spec.termination_grace_period_seconds.unwrap_or(30).max(0);
    Ok(Launch {
        program,
        args: line,
        env,
        files,
        dirs,
        grace: Duration::from_secs(grace.unsigned_abs()),
        restart: RestartPolicy::of(spec.restart_policy.as_deref()),
    })
}

/// A secret volume's files, as the kubelet makes them: every key, or the listed `items`;
/// an `optional` volume tolerates a missing Secret or key.
fn secret_files(
    source: &k8s_openapi::api::core::v1::SecretVolumeSource,
    objects: &Objects,
) -> Result<Vec<(String, String)>, PlanError> {
    let name = source.secret_name.clone().unwrap_or_default();
    let optional = source.optional.unwrap_or(false);
    let missing = |key: &str| PlanError::MissingSecret {
        name: name.clone(),
        key: key.to_owned(),
    };
    let Some(data) = objects.secrets.get(&name) else {
        return if optional {
            Ok(Vec::new())
        } else {
            Err(missing("*"))
        };
    };
    let Some(items) = &source.items else {
        return Ok(data.iter().map(|(k, v)| (k.clone(), v.clone())).collect());
    };
    let mut files = Vec::new();
    for item in items {
        match data.get(&item.key) {
            Some(value) => files.push((item.path.clone(), value.clone())),
            None if optional => {}
            None => return Err(missing(&item.key)),
        }
    }
    Ok(files)
}

fn env_from(
    pod: &Pod,
    var: &str,
    from: &EnvVarSource,
    objects: &Objects,
    host: &Host,
) -> Result<String, PlanError> {
    if let Some(secret) = &from.secret_key_ref {
        return objects
            .secrets
            .get(&secret.name)
            .and_then(|data| data.get(&secret.key))
            .cloned()
            .ok_or_else(|| PlanError::MissingSecret {
                name: secret.name.clone(),
                key: secret.key.clone(),
            });
    }
    if let Some(map) = &from.config_map_key_ref {
        return objects
            .config_maps
            .get(&map.name)
            .and_then(|data| data.get(&map.key))
            .cloned()
            .ok_or_else(|| PlanError::MissingConfigMapKey {
                name: map.name.clone(),
                key: map.key.clone(),
            });
    }
    let unsupported = |what: &str| PlanError::UnsupportedEnv {
        var: var.to_owned(),
        what: what.to_owned(),
    };
    let field = from
        .field_ref
        .as_ref()
        .ok_or_else(|| unsupported("this valueFrom"))?;
    let meta = &pod.metadata;
    match field.field_path.as_str() {
        "metadata.name" => Ok(meta.name.clone().unwrap_or_default()),
        "metadata.namespace" => Ok(meta.namespace.clone().unwrap_or_default()),
        "spec.nodeName" => Ok(pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default()),
        "status.podIP" => Ok(host.address.to_string()),
        "status.hostIP" => Ok("127.0.0.1".to_owned()),
        other => Err(unsupported(&format!("fieldRef {other}"))),
    }
}

impl Host {
    /// The folder an image's binaries are in: its release's when this machine has it.
    pub fn bin_dir_for(&self, image: Option<&str>) -> PathBuf {
        self.releases
            .as_deref()
            .zip(image.and_then(image_tag))
            .map(|(releases, tag)| releases.join(tag).join("bin"))
            .filter(|dir| dir.is_dir())
            .unwrap_or_else(|| self.bin_dir.clone())
    }
}

/// An image's tag, when it has one that can name a folder (`conveyor:0.1.0` → `0.1.0`; an
/// image by digest, or a tag of characters a registry refuses, has none).
fn image_tag(image: &str) -> Option<&str> {
    if image.contains('@') {
        return None;
    }
    let (_, tag) = image.rsplit_once(':')?;
    let valid = tag.len() <= 128
        && tag
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        && tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    valid.then_some(tag)
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "w-1", "namespace": "video"},
            "spec": {
                "nodeName": "conveyor-node",
                "terminationGracePeriodSeconds": 35,
                "containers": [{
                    "name": "worker",
                    "command": ["conveyor-worker"],
                    "args": ["--task-types=/etc/conveyor/task-types.yaml",
                             "--metrics-listen=0.0.0.0:9090", "--",
                             "/usr/local/lib/conveyor/handlers/light.sh"],
                    "env": [
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "CONVEYOR_AMQP_URL", "valueFrom": {"secretKeyRef": {"name": "conn", "key": "amqp-url"}}},
                        {"name": "PLAIN", "value": "x"}
                    ],
                    "volumeMounts": [{"name": "config", "mountPath": "/etc/conveyor"}]
                }],
                "volumes": [{"name": "config", "configMap": {"name": "w-config"}}, {"name": "tmp", "emptyDir": {}}]
            }
        }))
        .unwrap()
    }

    fn host() -> Host {
        Host {
            bin_dir: PathBuf::from("/nonexistent-bin"),
            releases: None,
            pod_dir: PathBuf::from("/run/pods/video/w-1"),
            path_maps: vec![(
                "/usr/local/lib/conveyor/handlers".to_owned(),
                PathBuf::from("/src/handlers"),
            )],
            address: std::net::Ipv4Addr::new(127, 1, 0, 7),
            apiserver: None,
        }
    }

    fn objects() -> Objects {
        Objects {
            secrets: [(
                "conn".to_owned(),
                [("amqp-url".to_owned(), "amqp://x".to_owned())].into(),
            )]
            .into(),
            config_maps: [(
                "w-config".to_owned(),
                [("task-types.yaml".to_owned(), "taskTypes: []".to_owned())].into(),
            )]
            .into(),
        }
    }

    #[test]
    fn a_pod_acts_as_its_service_account_unless_it_opts_out() {
        let apiserver = Apiserver {
            server: "https://127.0.0.1:16443".into(),
            token: "admin".into(),
        };
        let host = Host {
            apiserver: Some(apiserver),
            ..host()
        };
        let mut pod = pod();
        pod.spec.as_mut().unwrap().service_account_name = Some("conveyor-gateway".into());
        // What the apiserver's ServiceAccount admission adds to every pod.
        let api_access: k8s_openapi::api::core::v1::Volume = serde_json::from_value(serde_json::json!({
            "name": "kube-api-access-x1",
            "projected": {"sources": [{"serviceAccountToken": {"path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}
        }))
        .unwrap();
        pod.spec
            .as_mut()
            .unwrap()
            .volumes
            .get_or_insert_with(Vec::new)
            .push(api_access);
        let launch = plan(&pod, &objects(), &host).unwrap();
        let env: BTreeMap<_, _> = launch.env.into_iter().collect();
        let path = "/run/pods/video/w-1/serviceaccount/kubeconfig";
        assert_eq!(env["KUBECONFIG"], path);
        let (_, kubeconfig) = launch
            .files
            .iter()
            .find(|(p, _)| p == Path::new(path))
            .unwrap();
        let config: serde_json::Value = serde_json::from_str(kubeconfig).unwrap();
        assert_eq!(
            config["users"][0]["user"]["as"],
            "system:serviceaccount:video:conveyor-gateway"
        );
        assert_eq!(config["contexts"][0]["context"]["namespace"], "video");

        pod.spec.as_mut().unwrap().automount_service_account_token = Some(false);
        let launch = plan(&pod, &objects(), &host).unwrap();
        assert!(launch.env.iter().all(|(k, _)| k != "KUBECONFIG"));
    }

    #[test]
    fn references_name_every_secret_and_config_map() {
        let refs = references(&pod()).unwrap();
        assert_eq!(refs.secrets, ["conn".to_owned()].into());
        assert_eq!(refs.config_maps, ["w-config".to_owned()].into());
    }

    #[test]
    fn a_worker_pod_becomes_a_local_process() {
        let launch = plan(&pod(), &objects(), &host()).unwrap();
        assert_eq!(launch.program, PathBuf::from("conveyor-worker"));
        assert_eq!(
            launch.args,
            [
                "--task-types=/run/pods/video/w-1/volumes/config/task-types.yaml",
                "--metrics-listen=127.1.0.7:9090",
                "--",
                "/src/handlers/light.sh"
            ]
        );
        let env: BTreeMap<_, _> = launch.env.into_iter().collect();
        assert_eq!(env["POD_NAME"], "w-1");
        assert_eq!(env["CONVEYOR_AMQP_URL"], "amqp://x");
        assert_eq!(env["PLAIN"], "x");
        assert_eq!(
            launch.files,
            [(
                PathBuf::from("/run/pods/video/w-1/volumes/config/task-types.yaml"),
                "taskTypes: []".to_owned()
            )]
        );
        assert_eq!(launch.grace, Duration::from_secs(35));
    }

    #[test]
    fn a_missing_secret_key_is_named() {
        let mut objects = objects();
        objects.secrets.clear();
        assert_eq!(
            plan(&pod(), &objects, &host()).unwrap_err().to_string(),
            "secret \"conn\" has no key \"amqp-url\" (or does not exist)"
        );
    }

    #[test]
    fn secret_volumes_hold_their_items_and_an_optional_one_may_be_missing() {
        let secret_volume = |optional: bool| {
            serde_json::from_value::<k8s_openapi::api::core::v1::Volume>(serde_json::json!({
                "name": "tls",
                "secret": {"secretName": "conn", "optional": optional,
                           "items": [{"key": "ca.crt", "path": "ca.crt"}]}
            }))
            .unwrap()
        };
        let with = |volume| {
            let mut pod = pod();
            pod.spec
                .as_mut()
                .unwrap()
                .volumes
                .as_mut()
                .unwrap()
                .push(volume);
            pod
        };
        let mut objects = objects();
        let ca = PathBuf::from("/run/pods/video/w-1/volumes/tls/ca.crt");
        // The key is missing: an optional volume is an empty directory, a required one fails.
        let launch = plan(&with(secret_volume(true)), &objects, &host()).unwrap();
        assert!(launch.files.iter().all(|(path, _)| *path != ca));
        assert!(launch.dirs.contains(&ca.parent().unwrap().to_owned()));
        assert_eq!(
            plan(&with(secret_volume(false)), &objects, &host()).unwrap_err(),
            PlanError::MissingSecret {
                name: "conn".to_owned(),
                key: "ca.crt".to_owned()
            }
        );
        objects
            .secrets
            .get_mut("conn")
            .unwrap()
            .insert("ca.crt".to_owned(), "PEM".to_owned());
        let launch = plan(&with(secret_volume(true)), &objects, &host()).unwrap();
        assert!(launch.files.contains(&(ca, "PEM".to_owned())));
        assert!(references(&with(secret_volume(true)))
            .unwrap()
            .secrets
            .contains("conn"));
    }

    #[test]
    fn unsupported_volumes_are_refused() {
        let mut pod = pod();
        let volumes = pod.spec.as_mut().unwrap().volumes.as_mut().unwrap();
        volumes[1].empty_dir = None;
        volumes[1].host_path = Some(Default::default());
        assert_eq!(
            plan(&pod, &objects(), &host()).unwrap_err(),
            PlanError::UnsupportedVolume("tmp".to_owned())
        );
    }

    #[test]
    fn a_claim_mounted_under_a_mapped_path_is_the_mapped_directory() {
        let mut pod = pod();
        let spec = pod.spec.as_mut().unwrap();
        spec.volumes.as_mut().unwrap().push(
            serde_json::from_value(
                serde_json::json!({"name": "media", "persistentVolumeClaim": {"claimName": "media"}}),
            )
            .unwrap(),
        );
        let worker = &mut spec.containers[0];
        worker.volume_mounts.as_mut().unwrap().push(
            serde_json::from_value(serde_json::json!({"name": "media", "mountPath": "/media"}))
                .unwrap(),
        );
        worker.args.as_mut().unwrap().push("/media".to_owned());
        let host = Host {
            path_maps: vec![("/media".to_owned(), PathBuf::from("/src/media"))],
            ..host()
        };
        let launch = plan(&pod, &objects(), &host).unwrap();
        assert_eq!(launch.args.last().unwrap(), "/src/media");
        // Not under a mapped path: the runner has no storage for it.
        assert_eq!(
            plan(&pod, &objects(), &self::host()).unwrap_err(),
            PlanError::UnsupportedVolume("media".to_owned())
        );
    }

    #[test]
    fn an_image_whose_release_this_machine_holds_runs_that_releases_binaries() {
        let root = std::env::temp_dir().join(format!("releases-{}", std::process::id()));
        let releases = root.join("releases");
        std::fs::create_dir_all(releases.join("0.1.0/bin")).unwrap();
        std::fs::write(releases.join("0.1.0/bin/conveyor-worker"), "").unwrap();
        // What `conveyor:..` would reach if the tag were taken as a path.
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::write(root.join("bin/conveyor-worker"), "").unwrap();
        let host = Host {
            releases: Some(releases.clone()),
            ..host()
        };
        let with_image = |image: &str| {
            let mut pod = pod();
            pod.spec.as_mut().unwrap().containers[0].image = Some(image.to_owned());
            plan(&pod, &objects(), &host).unwrap()
        };
        let old = with_image("conveyor:0.1.0");
        assert_eq!(old.program, releases.join("0.1.0/bin/conveyor-worker"));
        let path = &old.env.iter().find(|(k, _)| k == "PATH").unwrap().1;
        assert!(path.starts_with(&format!("{}:", releases.join("0.1.0/bin").display())));
        // A tag this machine holds no release of, a digest, and a tag that would climb out
        // of the folder: this build's binaries.
        for image in [
            "conveyor:dev",
            "conveyor@sha256:0a1b",
            "conveyor:..",
            "conveyor",
        ] {
            let launch = with_image(image);
            assert_eq!(launch.program, PathBuf::from("conveyor-worker"), "{image}");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn dependent_variables_expand_as_a_kubelet_expands_them() {
        let defined = vec![
            ("USER".to_owned(), "ops".to_owned()),
            ("PASS".to_owned(), "s3cret".to_owned()),
        ];
        assert_eq!(
            expand("amqps://$(USER):$(PASS)@rabbitmq:5671/%2f", &defined),
            "amqps://ops:s3cret@rabbitmq:5671/%2f"
        );
        assert_eq!(
            expand("$(MISSING) and $$(USER) cost $5", &defined),
            "$(MISSING) and $(USER) cost $5"
        );
        assert_eq!(expand("unclosed $(USER", &defined), "unclosed $(USER");
    }
}
