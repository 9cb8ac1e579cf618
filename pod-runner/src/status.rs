//! What the runner tells the API server about a pod, as a kubelet would: its container is
//! waiting (it cannot be made, e.g. a Secret is missing), running, or backing off after it
//! exited; the pod is Ready only while the process runs and its readiness probe answers. So
//! a Deployment, a rollout and a pool's READY column count only workers that can work.

use std::net::Ipv4Addr;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{json, Value};

use crate::supervisor::ProcessState;

/// How long a readiness probe may take (a kubelet's default `timeoutSeconds` is 1).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The pod's one container, as this runner sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum ContainerState {
    /// It cannot be made: why (a kubelet's `CreateContainerConfigError`).
    Refused(String),
    /// Its process runs (since then).
    Running(SystemTime),
    /// Its process exited and waits for its back-off to end.
    BackingOff,
}

impl ContainerState {
    pub fn of(process: ProcessState) -> ContainerState {
        match process.running_since {
            Some(since) => ContainerState::Running(since),
            None if process.restarts > 0 => ContainerState::BackingOff,
            // Started a moment ago and not yet running: as good as running for a report.
            None => ContainerState::Running(SystemTime::now()),
        }
    }
}

/// What was last reported of a pod: a new report goes out only when this changes.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub state: ContainerState,
    pub restarts: u32,
    pub ready: bool,
}

/// The URL of the container's HTTP readiness probe at the pod's address; `None` when it
/// has none (then running is ready).
pub fn readiness_url(pod: &Pod, address: Ipv4Addr) -> Option<String> {
    let container = pod.spec.as_ref()?.containers.first()?;
    let get = container.readiness_probe.as_ref()?.http_get.as_ref()?;
    let port = match &get.port {
        IntOrString::Int(port) => *port,
        IntOrString::String(name) => named_port(container, name)?,
    };
    let path = get.path.as_deref().unwrap_or("/");
    Some(format!("http://{address}:{port}{path}"))
}

fn named_port(container: &Container, name: &str) -> Option<i32> {
    container
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .map(|p| p.container_port)
}

/// Whether the probe answers with a success status within [`PROBE_TIMEOUT`].
pub async fn probe(http: &reqwest::Client, url: &str) -> bool {
    http.get(url)
        .timeout(PROBE_TIMEOUT)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

/// The status patch (strategic merge: conditions merge by type) for `report`.
pub fn patch(pod: &Pod, report: &Report) -> Value {
    let now = rfc3339(SystemTime::now());
    let container = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
        .unwrap_or_default();
    let state = match &report.state {
        ContainerState::Refused(why) => {
            json!({"waiting": {"reason": "CreateContainerConfigError", "message": why}})
        }
        ContainerState::Running(since) => {
            json!({"running": {"startedAt": rfc3339(*since)}})
        }
        ContainerState::BackingOff => json!({"waiting": {
            "reason": "CrashLoopBackOff",
            "message": "back-off restarting failed container"
        }}),
    };
    let (status, reason) = match report.ready {
        true => ("True", None),
        false => ("False", Some("ContainersNotReady")),
    };
    let condition = |kind: &str| json!({"type": kind, "status": status, "reason": reason, "lastTransitionTime": now});
    json!({"status": {
        "conditions": [condition("Ready"), condition("ContainersReady")],
        "containerStatuses": [{
            "name": container.0,
            "image": container.1,
            "imageID": "",
            "ready": report.ready,
            "started": matches!(report.state, ContainerState::Running(_)),
            "restartCount": report.restarts,
            "state": state,
        }],
    }})
}

/// A Kubernetes timestamp (RFC 3339, whole seconds, UTC).
fn rfc3339(at: SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(at).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(probe: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{
                "name": "worker",
                "image": "conveyor:dev",
                "ports": [{"name": "metrics", "containerPort": 9090}],
                "readinessProbe": probe,
            }]}
        }))
        .unwrap()
    }

    #[test]
    fn the_readiness_probe_is_reached_at_the_pod_address_by_port_name_or_number() {
        let address = Ipv4Addr::new(127, 2, 0, 5);
        let named = pod(json!({"httpGet": {"path": "/readyz", "port": "metrics"}}));
        assert_eq!(
            readiness_url(&named, address).as_deref(),
            Some("http://127.2.0.5:9090/readyz")
        );
        let numbered = pod(json!({"httpGet": {"port": 8000}}));
        assert_eq!(
            readiness_url(&numbered, address).as_deref(),
            Some("http://127.2.0.5:8000/")
        );
        assert_eq!(readiness_url(&pod(json!(null)), address), None);
    }

    #[test]
    fn a_pod_that_cannot_start_is_reported_waiting_and_not_ready() {
        let report = Report {
            state: ContainerState::Refused("secret \"s\" has no key \"k\"".into()),
            restarts: 0,
            ready: false,
        };
        let patch = patch(&pod(json!(null)), &report);
        let status = &patch["status"];
        assert_eq!(status["conditions"][0]["type"], "Ready");
        assert_eq!(status["conditions"][0]["status"], "False");
        let container = &status["containerStatuses"][0];
        assert_eq!(container["ready"], false);
        assert_eq!(
            container["state"]["waiting"]["reason"],
            "CreateContainerConfigError"
        );
    }
}
