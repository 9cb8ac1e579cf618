//! A WorkerPool's pod template (`spec.pod`, decision 0028) against the real kube-apiserver:
//! what the CRD refuses and with which words, what it accepts, and what the operator reports
//! when the Deployment it builds cannot run. Needs the stack `scripts/stack.sh up` runs.
//! (A test target of its own, beside `e2e/`: it shares only the library.)

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use conveyor_core::testing::wait_until;
use conveyor_e2e_tests::{kubectl_with, Stack};

const MINUTE: Duration = Duration::from_secs(60);

/// A pool of task type `t` with no workers, and `pod` as its `spec.pod` (indented YAML).
fn pool_with_pod(name: &str, task_type: &str, pod: &str) -> String {
    format!(
        "apiVersion: conveyor.dev/v1alpha1\nkind: WorkerPool\nmetadata: {{name: {name}}}\nspec:\n  \
         taskTypes: [{task_type}]\n  image: conveyor:dev\n  handler: {{type: sleep}}\n  replicas: 0\n  \
         pod:\n{pod}"
    )
}

/// A namespace of its own with a TaskType for pools to consume.
async fn with_task_type(prefix: &str) -> (Stack, String) {
    let mut stack = Stack::namespace(prefix).await;
    let t = stack.task_type(&format!("e2e-{prefix}"));
    stack.apply(&format!(
        "apiVersion: conveyor.dev/v1alpha1\nkind: TaskType\nmetadata: {{name: {t}}}\nspec: {{maxRetries: 1}}\n"
    ));
    (stack, t)
}

/// Every field of `spec.pod` that media work needs, valid.
const FULL_POD: &str = "    volumes:
      - {name: media, emptyDir: {}}
      - {name: models, emptyDir: {}}
    volumeMounts: [{name: media, mountPath: /media}]
    initContainers:
      - {name: fetch-models, image: busybox, command: ['true'], volumeMounts: [{name: models, mountPath: /models}]}
    sidecars:
      - name: http-handler
        image: registry.example.com/handler:1
        readinessProbe: {httpGet: {path: /healthz, port: 8000}}
        securityContext: {readOnlyRootFilesystem: false}
    imagePullSecrets: [{name: registry}]
    securityContext: {runAsUser: 1000}
    containerSecurityContext: {capabilities: {add: [SYS_NICE]}}
    runtimeClassName: nvidia
    env: [{name: PRESET, value: slow}]
    envFrom: [{configMapRef: {name: encoder-settings, optional: true}}]
    topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: ScheduleAnyway}
    tmpSizeLimit: 1Gi
    bufferSizeLimit: 256Mi
";

#[tokio::test]
async fn invalid_pod_templates_are_refused_with_a_clear_message() {
    let stack = Stack::namespace("pt-invalid").await;
    let long = "v".repeat(64);
    let cases = [
        (
            "    env: [{name: CONVEYOR_AMQP_URL, value: amqp://elsewhere}]\n".to_owned(),
            "spec.pod.env must not set POD_NAME, CONVEYOR_DATABASE_URL or CONVEYOR_AMQP_URL",
        ),
        (
            "    volumes: [{name: tmp, emptyDir: {}}]\n".to_owned(),
            "spec.pod.volumes must not be named config, tmp, buffer or tls",
        ),
        (
            "    volumes: [{name: media, emptyDir: {}}, {name: media, emptyDir: {}}]\n".to_owned(),
            "spec.pod.volumes names must be unique",
        ),
        (
            "    volumes: [{name: scratch, emptyDir: {}}]\n    volumeMounts: [{name: scratch, mountPath: /tmp}]\n"
                .to_owned(),
            "spec.pod.volumeMounts must not mount at /etc/conveyor, /tmp, /var/lib/conveyor or /var/run/conveyor/tls",
        ),
        (
            "    volumes: [{name: a, emptyDir: {}}, {name: b, emptyDir: {}}]\n    \
             volumeMounts: [{name: a, mountPath: /media}, {name: b, mountPath: /media}]\n"
                .to_owned(),
            "spec.pod.volumeMounts mountPaths must be unique",
        ),
        (
            "    volumeMounts: [{name: media, mountPath: /media}]\n".to_owned(),
            "each of spec.pod.volumeMounts must name a volume of spec.pod.volumes",
        ),
        (
            "    sidecars: [{name: worker, image: x}]\n".to_owned(),
            "spec.pod.initContainers and spec.pod.sidecars names must be unique among them and not worker",
        ),
        (
            "    initContainers: [{name: prepare, image: x}]\n    sidecars: [{name: prepare, image: z}]\n"
                .to_owned(),
            "spec.pod.initContainers and spec.pod.sidecars names must be unique among them and not worker",
        ),
        (
            "    initContainers: [{name: prepare, image: x, readinessProbe: {exec: {command: ['true']}}}]\n"
                .to_owned(),
            "spec.pod.initContainers run to completion and may not have lifecycle hooks or probes",
        ),
        (
            "    sidecars: [{name: shipper, image: x, restartPolicy: Never}]\n".to_owned(),
            "spec.pod.sidecars always restart",
        ),
        (
            "    sidecars: [{name: shipper}]\n".to_owned(),
            "spec.pod.sidecars[0].image: Required value",
        ),
        (
            format!("    volumes: [{{name: {long}, emptyDir: {{}}}}]\n"),
            "spec.pod.volumes[0].name: Too long",
        ),
        (
            format!("    sidecars: [{{name: {long}, image: x}}]\n"),
            "spec.pod.sidecars[0].name: Too long",
        ),
        (
            "    volumes: [{name: Media, emptyDir: {}}]\n".to_owned(),
            "spec.pod.volumes[0].name in body should match",
        ),
    ];
    for (pod, message) in cases {
        let yaml = pool_with_pod("p", "t", &pod);
        let err = kubectl_with(&["apply", "-n", &stack.namespace, "-f", "-"], Some(&yaml))
            .expect_err(&format!("accepted:\n{yaml}"));
        assert!(
            err.contains(message),
            "refusal of\n{yaml}\nsays {err:?}, not {message:?}"
        );
    }
    let left = stack.kubectl(&["get", "workerpools", "-o", "name"]);
    assert_eq!(left.trim(), "", "a refused manifest left something behind");
    stack.finish().await;
}

#[tokio::test]
async fn a_full_pod_template_is_accepted_and_becomes_the_deployment() {
    let (stack, t) = with_task_type("pt-full").await;
    stack.apply(&pool_with_pod("media", &t, FULL_POD));
    // The operator's Deployment passes the apiserver's own validation of a pod template.
    wait_until("the pool's Deployment exists", MINUTE, || async {
        stack
            .deployments()
            .get_opt("media-worker")
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;
    let deployment = stack.deployments().get("media-worker").await.unwrap();
    let pod = deployment.spec.unwrap().template.spec.unwrap();
    let inits = pod.init_containers.unwrap();
    let order: Vec<(&str, Option<&str>)> = inits
        .iter()
        .map(|c| (c.name.as_str(), c.restart_policy.as_deref()))
        .collect();
    assert_eq!(
        order,
        [("fetch-models", None), ("http-handler", Some("Always"))]
    );
    assert_eq!(pod.runtime_class_name.as_deref(), Some("nvidia"));
    let volumes: Vec<&str> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(
        volumes,
        ["config", "tmp", "buffer", "tls", "media", "models"]
    );
    let security = pod.security_context.unwrap();
    assert_eq!(
        (security.run_as_user, security.run_as_non_root),
        (Some(1000), Some(true))
    );
    let pulls: Vec<&str> = pod
        .image_pull_secrets
        .iter()
        .flatten()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(pulls, ["registry"]);
    let worker = pod.containers.iter().find(|c| c.name == "worker").unwrap();
    let env_from = worker.env_from.as_ref().unwrap();
    assert_eq!(
        env_from[0].config_map_ref.as_ref().map(|c| c.name.as_str()),
        Some("encoder-settings")
    );
    let spread = pod.topology_spread_constraints.unwrap();
    assert_eq!(
        spread.len(),
        1,
        "the pool's spread replaces the default one"
    );
    assert_eq!(spread[0].topology_key, "topology.kubernetes.io/zone");
    // Once the operator has written the pool's status, it is not Degraded.
    wait_until("the pool's status written", MINUTE, || async {
        !stack
            .kubectl(&["get", "workerpool/media", "-o", "jsonpath={.status.phase}"])
            .trim()
            .is_empty()
    })
    .await;
    let phase = stack.kubectl(&["get", "workerpool/media", "-o", "jsonpath={.status.phase}"]);
    assert_ne!(phase.trim(), "Degraded");
    stack.finish().await;
}

/// What the CRD's rules cannot see reaches the pool's status and an Event, not only the
/// operator's log.
#[tokio::test]
async fn a_pod_template_that_cannot_run_degrades_the_pool_with_its_reason() {
    let (stack, t) = with_task_type("pt-bad").await;
    let cases = [
        // The operator's own check: a sidecar's mounts are too deep for the CRD's rules.
        (
            "    sidecars: [{name: shipper, image: x, volumeMounts: [{name: logs, mountPath: /logs}]}]\n",
            "mounts volume \"logs\"",
        ),
        // The apiserver's: a volume with two sources (one without any is an emptyDir).
        (
            "    volumes: [{name: two, emptyDir: {}, configMap: {name: x}}]\n",
            "may not specify more than 1 volume type",
        ),
    ];
    for (i, (pod, message)) in cases.into_iter().enumerate() {
        let name = format!("bad{i}");
        stack.apply(&pool_with_pod(&name, &t, pod));
        let condition = "jsonpath={.status.phase} {.status.conditions[?(@.type==\"Ready\")].reason} {.status.conditions[?(@.type==\"Ready\")].message}";
        wait_until(
            &format!("pool {name} reports {message:?}"),
            MINUTE,
            || async {
                let status =
                    stack.kubectl(&["get", &format!("workerpool/{name}"), "-o", condition]);
                status.starts_with("Degraded InvalidPodTemplate ") && status.contains(message)
            },
        )
        .await;
        let events = stack.kubectl(&[
            "get",
            "events",
            "--field-selector",
            &format!("involvedObject.name={name},reason=InvalidPodTemplate"),
            "-o",
            "name",
        ]);
        assert!(
            !events.trim().is_empty(),
            "no InvalidPodTemplate Event for {name}"
        );
        let deployment = stack.deployments().get_opt(&format!("{name}-worker")).await;
        assert!(
            deployment.unwrap().is_none(),
            "{name}: a Deployment was made"
        );
    }
    stack.finish().await;
}
