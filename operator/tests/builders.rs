//! The WorkerPool builders against fixtures: `fixtures/<name>.yaml` is the input and
//! `fixtures/<name>.objects.yaml` the expected output (`UPDATE_FIXTURES=1` rewrites it).
#![allow(clippy::unwrap_used)] // fixtures fail loudly on purpose

use conveyor_core::crd::WorkerPool;
use conveyor_core::task_type::NamedTaskType;
use conveyor_operator::build::{pool_objects, BuildError, ConnectionSecret, PoolObjects};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Fixture {
    pool: WorkerPool,
    task_types: Vec<NamedTaskType>,
}

fn fixture(name: &str) -> (Fixture, std::path::PathBuf) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let text = std::fs::read_to_string(dir.join(format!("{name}.yaml"))).unwrap();
    (
        serde_yaml::from_str(&text).unwrap(),
        dir.join(format!("{name}.objects.yaml")),
    )
}

fn render(objects: &PoolObjects) -> String {
    [
        serde_yaml::to_string(&objects.config_map).unwrap(),
        serde_yaml::to_string(&objects.deployment).unwrap(),
        serde_yaml::to_string(&objects.service).unwrap(),
        serde_yaml::to_string(&objects.pod_disruption_budget).unwrap(),
    ]
    .join("---\n")
}

#[test]
fn transcode_pool_matches_its_fixture() {
    let (input, expected_path) = fixture("transcode-pool");
    let objects = pool_objects(
        &input.pool,
        &input.task_types,
        3,
        &ConnectionSecret::default(),
    )
    .unwrap();
    let rendered = render(&objects);
    if std::env::var_os("UPDATE_FIXTURES").is_some() {
        std::fs::write(&expected_path, &rendered).unwrap();
    }
    let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
    assert!(
        rendered == expected,
        "builders changed; review and rerun with UPDATE_FIXTURES=1:\n{rendered}"
    );
}

/// With an admin token the worker container gets it in its environment, and nothing else
/// changes (issue 33, item 2).
#[test]
fn an_admin_token_reaches_the_worker_container_only() {
    let (input, _) = fixture("transcode-pool");
    let build = || {
        pool_objects(
            &input.pool,
            &input.task_types,
            3,
            &ConnectionSecret::default(),
        )
        .unwrap()
    };
    let (plain, mut tokened) = (build(), build());
    conveyor_operator::build::set_admin_token(&mut tokened.deployment, "t0ken");
    let containers = |objects: &conveyor_operator::build::PoolObjects| {
        objects
            .deployment
            .spec
            .clone()
            .unwrap()
            .template
            .spec
            .unwrap()
            .containers
    };
    let (before, after) = (containers(&plain), containers(&tokened));
    assert_eq!(before.len(), after.len());
    for (b, a) in before.iter().zip(&after) {
        let added: Vec<_> = a
            .env
            .iter()
            .flatten()
            .filter(|e| !b.env.iter().flatten().any(|x| x == *e))
            .collect();
        if a.name == conveyor_core::crd::worker_pool::WORKER_CONTAINER {
            assert_eq!(added.len(), 1, "{added:?}");
            assert_eq!(added[0].name, conveyor_core::drain::ADMIN_TOKEN_ENV);
            assert_eq!(added[0].value.as_deref(), Some("t0ken"));
        } else {
            assert!(added.is_empty(), "{}: {added:?}", a.name);
        }
    }
}

/// An operator run with `--require-tls` used to leave its workers free to connect in
/// plaintext unless each pool opted in: now their container says so last, after whatever the
/// pool's own `spec.pod.env` sets (Kubernetes takes the last of a repeated name).
#[test]
fn an_operator_requiring_tls_makes_every_worker_require_it() {
    let (mut input, _) = fixture("transcode-pool");
    let pod = input.pool.spec.pod.get_or_insert_with(Default::default);
    pod.env.push(k8s_openapi::api::core::v1::EnvVar {
        name: "CONVEYOR_REQUIRE_TLS".into(),
        value: Some("false".into()),
        value_from: None,
    });
    let mut objects = pool_objects(
        &input.pool,
        &input.task_types,
        3,
        &ConnectionSecret::default(),
    )
    .unwrap();
    conveyor_operator::build::require_tls(&mut objects.deployment);
    let pod = objects.deployment.spec.unwrap().template.spec.unwrap();
    let worker = pod
        .containers
        .iter()
        .find(|c| c.name == conveyor_core::crd::worker_pool::WORKER_CONTAINER)
        .unwrap();
    let last = worker
        .env
        .iter()
        .flatten()
        .rfind(|e| e.name == "CONVEYOR_REQUIRE_TLS")
        .unwrap();
    assert_eq!(last.value.as_deref(), Some("true"), "{:?}", worker.env);
}

/// A node lost takes its pods away after 30 s (not Kubernetes' 300 s), unless the pool says
/// otherwise for a taint; and pods spread over nodes where they can.
#[test]
fn pods_leave_a_lost_node_soon_and_spread_over_nodes() {
    let (mut input, _) = fixture("transcode-pool");
    let pod_spec = |pool: &WorkerPool| {
        let objects = pool_objects(pool, &input.task_types, 3, &ConnectionSecret::default());
        serde_json::to_value(objects.unwrap().deployment).unwrap()["spec"]["template"]["spec"]
            .clone()
    };
    let pod = pod_spec(&input.pool);
    let seconds = |pod: &serde_json::Value, key: &str| {
        pod["tolerations"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["key"] == key)
            .map(|t| t["tolerationSeconds"].as_i64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(seconds(&pod, "node.kubernetes.io/unreachable"), [30]);
    assert_eq!(seconds(&pod, "node.kubernetes.io/not-ready"), [30]);
    let spread = &pod["topologySpreadConstraints"][0];
    assert_eq!(spread["topologyKey"], "kubernetes.io/hostname");
    assert_eq!(spread["whenUnsatisfiable"], "ScheduleAnyway");

    let own = serde_json::json!({"key": "node.kubernetes.io/unreachable", "operator": "Exists",
        "effect": "NoExecute", "tolerationSeconds": 600});
    let mut overrides = input.pool.spec.pod.clone().unwrap_or_default();
    overrides.tolerations = vec![serde_json::from_value(own).unwrap()];
    input.pool.spec.pod = Some(overrides);
    let pod = pod_spec(&input.pool);
    assert_eq!(seconds(&pod, "node.kubernetes.io/unreachable"), [600]);
    assert_eq!(seconds(&pod, "node.kubernetes.io/not-ready"), [30]);
}

#[test]
fn workers_run_restricted_and_owned_by_the_pool() {
    let (input, _) = fixture("transcode-pool");
    let objects = pool_objects(
        &input.pool,
        &input.task_types,
        3,
        &ConnectionSecret::default(),
    )
    .unwrap();
    let deployment = serde_json::to_value(&objects.deployment).unwrap();
    let owner = &deployment["metadata"]["ownerReferences"][0];
    assert_eq!(owner["kind"], "WorkerPool");
    assert_eq!(owner["controller"], true);
    assert_eq!(deployment["spec"]["replicas"], 3);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    assert_eq!(
        pod["terminationGracePeriodSeconds"], 130,
        "drain grace + margin"
    );
    assert_eq!(pod["nodeSelector"]["workload"], "video");
    let container = &pod["containers"][0];
    let security = &container["securityContext"];
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(args.contains(&"--consume=video.transcode,video.thumbnail"));
    assert!(args.contains(&"--concurrency=4"));
    // The exec command goes after `--`, argument by argument (spaces survive).
    let dashdash = args.iter().position(|a| *a == "--").unwrap();
    assert_eq!(
        &args[dashdash + 1..],
        ["/usr/local/bin/transcode-task", "--preset", "slow veryslow"]
    );
    // Only the consumed task types are in the workers' config.
    let config = &objects.config_map.data.as_ref().unwrap()["task-types.yaml"];
    assert!(
        config.contains("transcode")
            && config.contains("thumbnail")
            && !config.contains("metadata")
    );
}

#[test]
fn changing_a_task_type_rolls_the_workers() {
    let (input, _) = fixture("transcode-pool");
    let secret = ConnectionSecret::default();
    let hash = |types: &[NamedTaskType]| {
        let objects = pool_objects(&input.pool, types, 1, &secret).unwrap();
        let template = objects.deployment.spec.unwrap().template;
        template.metadata.unwrap().annotations.unwrap()["conveyor.dev/config-hash"].clone()
    };
    let before = hash(&input.task_types);
    let mut changed = input.task_types.clone();
    changed[0].max_retries = 7;
    assert_ne!(hash(&changed), before);
    let mut unrelated = input.task_types.clone();
    unrelated[2].max_retries = 9; // metadata: not consumed by this pool
    assert_eq!(hash(&unrelated), before);
}

#[test]
fn a_missing_task_type_is_a_clear_error() {
    let (input, _) = fixture("transcode-pool");
    let err = pool_objects(
        &input.pool,
        &input.task_types[1..],
        1,
        &ConnectionSecret::default(),
    )
    .err()
    .unwrap();
    assert!(matches!(err, BuildError::UnknownTaskType(ref t) if t == "transcode"));
    assert_eq!(err.category(), "UnknownTaskType");
    let mut no_uid = input.pool.clone();
    no_uid.metadata.uid = None;
    assert!(pool_objects(&no_uid, &input.task_types, 1, &ConnectionSecret::default()).is_err());
}

/// Every document of a multi-document YAML file.
fn documents(path: &std::path::Path) -> Vec<serde_yaml::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde_yaml::Value::deserialize(doc).unwrap())
        .collect()
}

#[test]
fn the_video_pipeline_example_is_valid_and_builds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/video-pipeline");
    let task_types: Vec<NamedTaskType> = documents(&dir.join("tasktypes.yaml"))
        .into_iter()
        .map(|doc| {
            let tt: conveyor_core::crd::TaskType = serde_yaml::from_value(doc).unwrap();
            let named = NamedTaskType::in_namespace("video", &tt.metadata.name.unwrap(), tt.spec);
            named.validate().unwrap();
            named
        })
        .collect();
    assert_eq!(task_types.len(), 4);
    let pools = documents(&dir.join("workerpools.yaml"));
    assert_eq!(pools.len(), 3);
    for doc in pools {
        let mut pool: WorkerPool = serde_yaml::from_value(doc).unwrap();
        pool.metadata.uid = Some("00000000-0000-4000-8000-000000000000".into());
        let objects = pool_objects(&pool, &task_types, 1, &ConnectionSecret::default()).unwrap();
        let command = &objects
            .deployment
            .spec
            .unwrap()
            .template
            .spec
            .unwrap()
            .containers[0];
        // Every pool mounts the media volume where its handler's media root is.
        let mounts = command.volume_mounts.as_ref().unwrap();
        assert!(
            mounts
                .iter()
                .any(|m| m.name == "media" && m.mount_path == "/media"),
            "{:?}",
            pool.metadata.name
        );
        // `-- <script> <media root>`: the script is the first word after `--`.
        let args = command.args.as_ref().unwrap();
        let after = args.iter().position(|a| a == "--").unwrap() + 1;
        let handler = args[after].clone();
        let script = dir
            .join("handlers")
            .join(handler.rsplit('/').next().unwrap());
        assert!(
            script.exists(),
            "{} runs {handler}, which the example does not ship",
            pool.metadata.name.unwrap()
        );
    }
}

/// The pod template of a pool on media work: every field `spec.pod` has beyond scheduling.
const MEDIA_POD: &str = r#"
volumes:
  - {name: media, persistentVolumeClaim: {claimName: media}}
  - {name: models, emptyDir: {}}
volumeMounts:
  - {name: media, mountPath: /media}
initContainers:
  - name: fetch-models
    image: registry.example.com/models:1
    args: [--into, /models]
    volumeMounts: [{name: models, mountPath: /models}]
sidecars:
  - name: http-handler
    image: registry.example.com/handler:1
    securityContext: {readOnlyRootFilesystem: false}
    volumeMounts: [{name: media, mountPath: /media}, {name: tmp, mountPath: /scratch}]
imagePullSecrets: [{name: registry}]
securityContext: {runAsUser: 1000, supplementalGroups: [44]}
containerSecurityContext:
  readOnlyRootFilesystem: false
  capabilities: {add: [SYS_NICE]}
runtimeClassName: nvidia
envFrom: [{configMapRef: {name: encoder-settings}}]
topologySpreadConstraints:
  - {maxSkew: 2, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: DoNotSchedule}
tmpSizeLimit: 1Gi
bufferSizeLimit: 256Mi
"#;

/// Pool `media`, consuming `transcode`, with [`MEDIA_POD`].
fn media_pool() -> WorkerPool {
    WorkerPool::test()
        .named("media")
        .consumes("transcode")
        .pod(MEDIA_POD)
        .build()
}

/// The Deployment's pod spec for `pool` (consuming `transcode`), as JSON.
fn pod_spec_of(pool: &WorkerPool) -> serde_json::Value {
    let types = [NamedTaskType::in_namespace(
        "video",
        "transcode",
        Default::default(),
    )];
    let objects = pool_objects(pool, &types, 1, &ConnectionSecret::default()).unwrap();
    serde_json::to_value(objects.deployment).unwrap()["spec"]["template"]["spec"].clone()
}

fn names(list: &serde_json::Value, field: &str) -> Vec<String> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|item| item[field].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_media_pool_gets_its_volumes_containers_and_runtime() {
    let pod = pod_spec_of(&media_pool());
    // The pool's volumes come after the operator's own.
    assert_eq!(
        names(&pod["volumes"], "name"),
        ["config", "tmp", "buffer", "tls", "media", "models"]
    );
    assert_eq!(
        pod["volumes"][4]["persistentVolumeClaim"]["claimName"],
        "media"
    );
    assert_eq!(pod["volumes"][1]["emptyDir"]["sizeLimit"], "1Gi");
    assert_eq!(pod["volumes"][2]["emptyDir"]["sizeLimit"], "256Mi");
    let worker = &pod["containers"][0];
    assert_eq!(worker["name"], "worker");
    assert_eq!(
        names(&worker["volumeMounts"], "mountPath"),
        [
            "/etc/conveyor",
            "/tmp",
            "/var/lib/conveyor",
            "/var/run/conveyor/tls",
            "/media"
        ]
    );
    assert_eq!(
        worker["envFrom"],
        serde_json::json!([{"configMapRef": {"name": "encoder-settings"}}])
    );
    // One-shot init containers first, then the sidecars as native sidecars.
    let inits = &pod["initContainers"];
    assert_eq!(names(inits, "name"), ["fetch-models", "http-handler"]);
    assert!(inits[0].get("restartPolicy").is_none());
    assert_eq!(inits[1]["restartPolicy"], "Always");
    assert_eq!(pod["containers"].as_array().unwrap().len(), 1);
    assert_eq!(
        pod["imagePullSecrets"],
        serde_json::json!([{"name": "registry"}])
    );
    assert_eq!(pod["runtimeClassName"], "nvidia");
    // The pool's spread replaces the default one, with the pool's selector filled in.
    assert_eq!(
        pod["topologySpreadConstraints"],
        serde_json::json!([{
            "maxSkew": 2,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"conveyor.dev/pool": "media"}}
        }])
    );
}

#[test]
fn security_contexts_merge_field_by_field_over_the_restricted_defaults() {
    let pod = pod_spec_of(&media_pool());
    assert_eq!(
        pod["securityContext"],
        serde_json::json!({
            "runAsNonRoot": true,
            "runAsUser": 1000,
            "runAsGroup": 65532,
            "fsGroup": 65532,
            "supplementalGroups": [44],
            "seccompProfile": {"type": "RuntimeDefault"}
        })
    );
    assert_eq!(
        pod["containers"][0]["securityContext"],
        serde_json::json!({
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": false,
            "runAsNonRoot": true,
            "capabilities": {"add": ["SYS_NICE"], "drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}
        })
    );
    // Init containers and sidecars get the restricted default below their own context.
    let restricted = serde_json::json!({
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": true,
        "runAsNonRoot": true,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}
    });
    assert_eq!(pod["initContainers"][0]["securityContext"], restricted);
    let mut sidecar = restricted;
    sidecar["readOnlyRootFilesystem"] = false.into();
    assert_eq!(pod["initContainers"][1]["securityContext"], sidecar);
}

#[test]
fn without_a_pod_template_the_restricted_defaults_hold() {
    let pool = WorkerPool::test()
        .named("plain")
        .consumes("transcode")
        .build();
    let pod = pod_spec_of(&pool);
    assert_eq!(
        pod["securityContext"],
        serde_json::json!({
            "runAsNonRoot": true,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"}
        })
    );
    assert_eq!(
        pod["containers"][0]["securityContext"],
        serde_json::json!({
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "runAsNonRoot": true,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}
        })
    );
    // Nothing claimed that the pool does not set.
    for field in ["initContainers", "imagePullSecrets", "runtimeClassName"] {
        assert!(pod.get(field).is_none(), "{field}: {}", pod[field]);
    }
    assert!(pod["containers"][0].get("envFrom").is_none());
    assert_eq!(pod["volumes"][1]["emptyDir"], serde_json::json!({}));
    assert_eq!(
        pod["topologySpreadConstraints"][0]["topologyKey"],
        "kubernetes.io/hostname"
    );
}

/// The CRD refuses what clashes with the operator's own names (`RESERVED_*`): they must be
/// the names the builder uses.
#[test]
fn the_reserved_names_are_the_operators_own() {
    use conveyor_core::crd::worker_pool::{RESERVED_ENV, RESERVED_MOUNT_PATHS, RESERVED_VOLUMES};
    let pod = pod_spec_of(&WorkerPool::test().named("p").consumes("transcode").build());
    assert_eq!(names(&pod["volumes"], "name"), RESERVED_VOLUMES);
    let worker = &pod["containers"][0];
    assert_eq!(
        names(&worker["volumeMounts"], "mountPath"),
        RESERVED_MOUNT_PATHS
    );
    assert_eq!(names(&worker["env"], "name"), RESERVED_ENV);
}

#[test]
fn a_sidecar_mounting_a_volume_the_pod_lacks_is_a_clear_error() {
    let pool = WorkerPool::test()
        .named("media")
        .consumes("transcode")
        .pod(
            "sidecars: [{name: shipper, image: x, volumeMounts: [{name: logs, mountPath: /logs}]}]",
        )
        .build();
    let types = [NamedTaskType::in_namespace(
        "video",
        "transcode",
        Default::default(),
    )];
    let err = pool_objects(&pool, &types, 1, &ConnectionSecret::default())
        .err()
        .unwrap();
    assert!(
        matches!(err, BuildError::UnknownVolume { ref container, ref volume }
            if container == "shipper" && volume == "logs"),
        "{err}"
    );
    assert_eq!(err.category(), "InvalidPodTemplate");
    assert!(err.to_string().contains("spec.pod.volumes"), "{err}");
}
