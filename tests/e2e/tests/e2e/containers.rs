//! Stories on the real node (cluster/real-node.sh): workers as containers from the images
//! `scripts/images.sh` builds, run by a kubelet with containerd. What the simulated nodes
//! cannot show: logs and exec through the kubelet, probes, cgroup limits, a container killed
//! and restarted by the runtime, real termination grace, a node that dies with its
//! containers, and media on a mounted volume.

use std::time::Instant;

use conveyor_core::testing::wait_until;
use conveyor_core::TaskState;
use conveyor_e2e_tests::real_node::{
    self, container_id, node_ready, node_script, placement, restarts, NODE_PATIENCE,
};
use conveyor_e2e_tests::{assert_valid_chain, Stack};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use crate::nodes::{readiness, ready_column};
use crate::scaling::scale_down_under_load;
use crate::{pool_yaml, rolling_update_under_load, task_type_yaml, Node, MINUTE};

/// The pool's one running pod, once it is Ready (its readiness probe passed).
async fn ready_pod(stack: &Stack, pool: &str) -> Pod {
    let found = std::cell::RefCell::new(None);
    wait_until(&format!("a Ready pod of {pool}"), NODE_PATIENCE, || async {
        let ready = stack.running_pods(pool).await.into_iter().find(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
        let seen = ready.is_some();
        *found.borrow_mut() = ready;
        seen
    })
    .await;
    found.into_inner().unwrap()
}

/// Waits until the kubelet has restarted `pod`'s worker in place: a new container where
/// `before` was, in the same pod.
async fn container_replaced(stack: &Stack, pool: &str, pod: &str, before: &str) {
    wait_until(
        "the worker container replaced in its pod",
        NODE_PATIENCE,
        || async {
            let pods = stack.pool_pods(pool).await.unwrap_or_default();
            pods.iter().any(|p| {
                p.metadata.name.as_deref() == Some(pod)
                    && restarts(p, "worker") >= 1
                    && container_id(p, "worker").is_some_and(|c| c != before)
            })
        },
    )
    .await;
}

#[tokio::test]
async fn a_pool_on_the_real_node_runs_in_containers_with_logs_exec_probes_and_limits() {
    let _node = real_node::shared().await;
    let mut stack = Stack::on_real_node("containers").await;
    let t = stack.task_type("e2e-containers");
    stack.apply(&task_type_yaml(&t, ""));
    let pool = format!(
        "  replicas: 1\n  resources: {{requests: {{cpu: 50m, memory: 64Mi}}, limits: {{cpu: 500m, memory: 200Mi}}}}\n{}",
        placement("")
    );
    stack.apply(&pool_yaml("boxed", &t, &pool));
    let pod = ready_pod(&stack, "boxed").await;
    let name = pod.metadata.name.clone().unwrap();
    assert_eq!(
        pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some(real_node::node().as_str())
    );
    assert!(
        container_id(&pod, "worker").is_some(),
        "the worker runs in a containerd container: {:?}",
        pod.status
    );

    // The kubelet serves the container's output and runs commands in it.
    let logs = stack.kubectl(&["logs", &name, "-c", "worker"]);
    assert!(
        logs.contains("\"level\""),
        "kubectl logs shows the worker's JSON log:\n{logs}"
    );
    let version = stack.kubectl(&[
        "exec",
        &name,
        "-c",
        "worker",
        "--",
        "conveyor-worker",
        "--version",
    ]);
    assert!(version.starts_with("conveyor-worker "), "{version}");
    let user = stack.kubectl(&["exec", &name, "-c", "worker", "--", "id", "-u"]);
    assert_eq!(
        user.trim(),
        "65532",
        "the worker runs as the image's non-root user"
    );
    // The pool's limits are the container's cgroup's (cgroup v1 here).
    let memory = stack.kubectl(&[
        "exec",
        &name,
        "-c",
        "worker",
        "--",
        "cat",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]);
    assert_eq!(memory.trim(), (200 * 1024 * 1024).to_string());
    let quota = stack.kubectl(&[
        "exec",
        &name,
        "-c",
        "worker",
        "--",
        "cat",
        "/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
    ]);
    assert_eq!(
        quota.trim(),
        "50000",
        "500m of CPU is 50 ms per 100 ms period"
    );

    let ids = stack.submit_all(&t, vec![json!({"sleepMs": 10}); 20]).await;
    stack
        .wait_for_state(&t, TaskState::Completed, ids.len() as i64, 2 * MINUTE)
        .await;
    stack.finish().await;
}

#[tokio::test]
async fn a_container_killed_through_the_runtime_is_restarted_and_its_task_runs_again() {
    let _node = real_node::shared().await;
    let mut stack = Stack::on_real_node("restart").await;
    let t = stack.task_type("e2e-restart");
    // A few seconds of missed heartbeats and the task is given to another attempt.
    stack.apply(&task_type_yaml(&t, "  heartbeatTimeoutSeconds: 4\n"));
    stack.apply(&pool_yaml(
        "crashy",
        &t,
        &format!("  replicas: 1\n  drainGraceSeconds: 1\n{}", placement("")),
    ));
    let pod = ready_pod(&stack, "crashy").await;
    let name = pod.metadata.name.clone().unwrap();
    let id = stack.submit_all(&t, vec![json!({"sleepMs": 6000})]).await[0];
    stack
        .wait_for_state(&t, TaskState::Processing, 1, NODE_PATIENCE)
        .await;
    let before = container_id(&pod, "worker").expect("a container");
    node_script(&["kill-container", &before]);

    // The kubelet restarts the container in place (same pod), and the task runs again.
    container_replaced(&stack, "crashy", &name, &before).await;
    stack
        .wait_for_state(&t, TaskState::Completed, 1, 3 * MINUTE)
        .await;
    let chain = stack.events(id).await;
    assert_valid_chain(&chain);
    let completed: Vec<_> = chain
        .iter()
        .filter(|e| e.to_state == TaskState::Completed)
        .collect();
    assert_eq!(completed.len(), 1, "completed once: {chain:?}");
    let first = chain
        .iter()
        .find(|e| e.to_state == TaskState::Claimed)
        .unwrap();
    assert!(
        completed[0].attempt > first.attempt,
        "the killed attempt did not count; a later one completed: {chain:?}"
    );
    let reruns = stack.reruns(&t).await;
    assert_eq!(
        reruns.get(&id).copied().unwrap_or(0),
        2,
        "counted as one re-run: {reruns:?}"
    );
    stack.finish().await;
}

#[tokio::test]
async fn a_rolling_update_on_the_real_node_loses_and_repeats_nothing() {
    let _node = real_node::shared().await;
    rolling_update_under_load(Node::Real).await;
}

#[tokio::test]
async fn a_scale_down_on_the_real_node_removes_no_worker_with_a_task_in_flight() {
    let _node = real_node::shared().await;
    scale_down_under_load(Node::Real).await;
}

#[tokio::test]
async fn the_real_node_lost_under_load_loses_nothing_and_recovers() {
    let _node = real_node::exclusive().await;
    let mut stack = Stack::on_real_node("nodeloss").await;
    let t = stack.task_type("e2e-nodeloss");
    stack.apply(&task_type_yaml(&t, "  heartbeatTimeoutSeconds: 5\n"));
    stack.apply(&pool_yaml(
        "lost",
        &t,
        &format!(
            "  replicas: 2\n  concurrency: 4\n  drainGraceSeconds: 5\n{}",
            placement("")
        ),
    ));
    stack.wait_for_workers(&t, 2).await;
    let ids = stack
        .submit_all(&t, vec![json!({"sleepMs": 1500}); 80])
        .await;
    wait_until("both workers holding tasks", NODE_PATIENCE, || async {
        stack.busy_workers(&t).await == 2
    })
    .await;

    // The node dies with its containers, as a machine losing power.
    let killed = Instant::now();
    node_script(&["kill"]);
    wait_until("the node seen NotReady", 2 * MINUTE, || async {
        !node_ready()
    })
    .await;
    let not_ready = killed.elapsed();
    node_script(&["up"]);
    let back = killed.elapsed();
    stack
        .wait_for_state(&t, TaskState::Completed, ids.len() as i64, 5 * MINUTE)
        .await;
    let recovered = killed.elapsed();
    let report = format!(
        "real node lost under load: NotReady after {:.0} s, back after {:.0} s, all {} tasks done {:.0} s after the kill\n",
        not_ready.as_secs_f64(),
        back.as_secs_f64(),
        ids.len(),
        recovered.as_secs_f64()
    );
    eprint!("{report}");
    let _ = std::fs::create_dir_all("../../target/e2e");
    let _ = std::fs::write("../../target/e2e/real-node-loss.txt", &report);

    let completions = stack.completions(&t).await;
    assert_eq!(
        completions.len(),
        ids.len(),
        "every accepted task completed"
    );
    assert!(completions.values().all(|n| *n == 1), "completed twice");
    for id in &ids {
        assert_valid_chain(&stack.events(*id).await);
    }
    stack.finish().await;
}

/// Waits for the pod `name` to end; panics when it fails.
async fn pod_succeeded(stack: &Stack, name: &str) {
    wait_until(&format!("pod {name} succeeded"), NODE_PATIENCE, || async {
        let phase = stack.kubectl(&["get", "pod", name, "-o", "jsonpath={.status.phase}"]);
        assert_ne!(phase, "Failed", "{}", stack.kubectl(&["logs", name]));
        phase == "Succeeded"
    })
    .await;
}

#[tokio::test]
async fn the_video_pipeline_runs_in_containers_with_its_media_on_a_volume() {
    let _node = real_node::shared().await;
    let mut stack = Stack::on_real_node("video").await;
    // The media: a folder of this machine, a hostPath PersistentVolume bound to the claim
    // `media` the example pools mount.
    let media = format!("../../.dev/real-node-media/{}", stack.namespace);
    std::fs::create_dir_all(&media).unwrap();
    // The apiserver takes a hostPath without `..` only.
    let media = std::fs::canonicalize(media).unwrap();
    std::os::unix::fs::chown(&media, Some(65532), Some(65532)).unwrap();
    let volume = format!("media-{}", stack.namespace);
    stack.apply(&format!(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {volume}}}\nspec:\n  \
         capacity: {{storage: 1Gi}}\n  accessModes: [ReadWriteMany]\n  storageClassName: \"\"\n  \
         persistentVolumeReclaimPolicy: Retain\n  hostPath: {{path: {}, type: Directory}}\n  \
         claimRef: {{namespace: {}, name: media}}\n---\n\
         apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: media}}\nspec:\n  \
         accessModes: [ReadWriteMany]\n  storageClassName: \"\"\n  volumeName: {volume}\n  \
         resources: {{requests: {{storage: 1Gi}}}}\n",
        media.display(),
        stack.namespace
    ));
    // A test clip, made on the volume by a pod of the same image.
    stack.apply(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: make-clip}\nspec:\n  restartPolicy: Never\n  \
         nodeSelector: {conveyor.dev/node: real}\n  \
         tolerations: [{key: conveyor.dev/real-node, operator: Exists, effect: NoSchedule}]\n  \
         securityContext: {runAsUser: 65532, runAsGroup: 65532}\n  containers:\n  \
         - name: ffmpeg\n    image: conveyor-video-worker:dev\n    command: [ffmpeg, -nostdin, -loglevel, error, -y, \
         -f, lavfi, -i, \"testsrc2=duration=3:size=320x180:rate=25\", -f, lavfi, -i, \"sine=frequency=440:duration=3\", \
         -c:v, libx264, -preset, veryfast, -pix_fmt, yuv420p, -c:a, aac, -shortest, /media/clip.mp4]\n    \
         volumeMounts: [{name: media, mountPath: /media}]\n  \
         volumes: [{name: media, persistentVolumeClaim: {claimName: media}}]\n"
    );
    pod_succeeded(&stack, "make-clip").await;
    assert!(media.join("clip.mp4").metadata().unwrap().len() > 0);

    // The example as shipped, in this namespace, placed on the real node.
    for (file, kind) in [
        ("tasktypes.yaml", "TaskType"),
        ("workerpools.yaml", "WorkerPool"),
    ] {
        let text =
            std::fs::read_to_string(format!("../../examples/video-pipeline/{file}")).unwrap();
        for doc in text.split("\n---") {
            let mut object: serde_yaml::Value = serde_yaml::from_str(doc).unwrap();
            if object["kind"].as_str() != Some(kind) {
                continue;
            }
            object["metadata"]
                .as_mapping_mut()
                .unwrap()
                .remove("namespace");
            if kind == "TaskType" {
                stack.share_task_type(object["metadata"]["name"].as_str().unwrap());
            } else {
                let spec = object["spec"].as_mapping_mut().unwrap();
                let pod = spec
                    .entry("pod".into())
                    .or_insert_with(|| serde_yaml::Mapping::new().into());
                pod["nodeSelector"] = serde_yaml::from_str("{conveyor.dev/node: real}").unwrap();
                pod["tolerations"] = serde_yaml::from_str(
                    "[{key: conveyor.dev/real-node, operator: Exists, effect: NoSchedule}]",
                )
                .unwrap();
                // One core for the transcode pool fits the node beside the other tests.
                spec.remove("resources");
            }
            stack.apply(&serde_yaml::to_string(&object).unwrap());
        }
    }

    let submit = |task_type: &'static str, payload: serde_json::Value| {
        let stack = &stack;
        async move { stack.submit_all(task_type, vec![payload]).await[0] }
    };
    let transcode = submit(
        "transcode",
        json!({"source": "clip.mp4", "renditions": [240]}),
    )
    .await;
    let thumbnail = submit("thumbnail", json!({"source": "clip.mp4", "atSeconds": 1.5})).await;
    let metadata = submit("metadata", json!({"source": "clip.mp4"})).await;
    let done = |id| {
        let stack = &stack;
        async move { stack.task_when_settled(id, 5 * MINUTE).await }
    };
    let transcoded = done(transcode).await;
    assert_eq!(transcoded["state"], "COMPLETED", "{transcoded}");
    let rendition = transcoded["result"]["outputs"][0]
        .as_str()
        .unwrap()
        .to_owned();
    let quality = submit(
        "quality-analysis",
        json!({"source": rendition, "reference": "clip.mp4", "metric": "ssim"}),
    )
    .await;
    let mut results = vec![transcoded];
    for id in [thumbnail, metadata, quality] {
        let task = done(id).await;
        assert_eq!(task["state"], "COMPLETED", "{task}");
        results.push(task);
    }

    // Judged on the volume, from this machine: the outputs the clients were told of exist,
    // and are the media they claim to be.
    let file = |rel: &str| std::fs::read(media.join(rel)).unwrap_or_default();
    let mp4 = file(&rendition);
    assert!(
        mp4.len() > 1000 && &mp4[4..8] == b"ftyp",
        "an MP4 rendition at {rendition}"
    );
    let image = results[1]["result"]["thumbnail"]
        .as_str()
        .unwrap_or_else(|| panic!("the thumbnail's result names its file: {}", results[1]));
    assert!(
        file(image).starts_with(&[0xff, 0xd8]),
        "a JPEG thumbnail at {image}"
    );
    assert!(
        results[2]["result"].to_string().contains("duration"),
        "{}",
        results[2]
    );
    assert!(
        results[3]["result"].to_string().contains("ssim"),
        "{}",
        results[3]
    );
    // Every one ran in a container on the real node.
    let pods: Vec<Pod> = stack.pods_on(&real_node::node()).await;
    for id in [transcode, thumbnail, metadata, quality] {
        let worker = stack
            .events(id)
            .await
            .into_iter()
            .find(|e| e.to_state == TaskState::Completed)
            .and_then(|e| e.worker_id)
            .unwrap_or_default();
        assert!(
            pods.iter()
                .any(|p| worker.starts_with(p.metadata.name.as_deref().unwrap())),
            "{id} was completed by {worker}, not by a pod of the real node"
        );
    }
    stack.kubectl(&[
        "delete",
        "workerpools",
        "--all",
        "--wait=true",
        "--timeout=120s",
    ]);
    stack.finish().await;
    let _ = conveyor_e2e_tests::kubectl_with(&["delete", "pv", &volume, "--wait=false"], None);
}

/// A pool whose image the node does not have (no registry is reachable from it) shows the
/// kubelet's reason and is not Ready; with an image the node has, the same pool starts.
#[tokio::test]
async fn a_pool_whose_image_is_missing_says_so_and_is_not_ready() {
    let _node = real_node::shared().await;
    let mut stack = Stack::on_real_node("noimage").await;
    let t = stack.task_type("e2e-noimage");
    stack.apply(&task_type_yaml(&t, ""));
    let pool = pool_yaml("noimage", &t, &format!("  replicas: 1\n{}", placement("")))
        .replace("image: conveyor:dev", "image: conveyor-absent:dev");
    stack.apply(&pool);
    wait_until("the pod waiting on its image", NODE_PATIENCE, || async {
        let pods = readiness(&stack, "noimage").await;
        pods.len() == 1
            && pods[0].0 == "False"
            && matches!(
                pods[0].1.as_deref(),
                Some("ErrImagePull" | "ImagePullBackOff")
            )
    })
    .await;
    assert_eq!(ready_column(&stack).as_deref(), Some("0"));
    assert_eq!(stack.consumers(&stack.queue_of(&t, "")).await, 0);

    stack.kubectl(&[
        "patch",
        "workerpool",
        "noimage",
        "--type=merge",
        "-p",
        r#"{"spec":{"image":"conveyor:dev"}}"#,
    ]);
    stack.wait_for_workers(&t, 1).await;
    wait_until("the pool shows it ready", NODE_PATIENCE, || async {
        ready_column(&stack).as_deref() == Some("1")
    })
    .await;
    stack.finish().await;
}

/// A worker that is alive but answers nothing (its process stopped) fails its liveness probe,
/// and the kubelet replaces its container in the same pod.
#[tokio::test]
async fn a_wedged_worker_fails_its_liveness_probe_and_is_restarted() {
    let _node = real_node::shared().await;
    let mut stack = Stack::on_real_node("liveness").await;
    let t = stack.task_type("e2e-liveness");
    stack.apply(&task_type_yaml(&t, ""));
    stack.apply(&pool_yaml(
        "wedged",
        &t,
        &format!("  replicas: 1\n  drainGraceSeconds: 1\n{}", placement("")),
    ));
    let pod = ready_pod(&stack, "wedged").await;
    let name = pod.metadata.name.clone().unwrap();
    let before = container_id(&pod, "worker").expect("a container");
    node_script(&["stop-container", &before]);

    // Six failed probes 10 s apart, then the grace period: well inside the patience.
    container_replaced(&stack, "wedged", &name, &before).await;
    let events = stack.kubectl(&[
        "get",
        "events",
        "--field-selector",
        &format!("involvedObject.name={name}"),
        "-o",
        "jsonpath={.items[*].message}",
    ]);
    assert!(
        events.contains("Liveness probe failed"),
        "the kubelet says why it restarted the worker: {events}"
    );
    stack.wait_for_workers(&t, 1).await;
    let ids = stack.submit_all(&t, vec![json!({"sleepMs": 10}); 5]).await;
    stack
        .wait_for_state(&t, TaskState::Completed, ids.len() as i64, 2 * MINUTE)
        .await;
    stack.finish().await;
}
