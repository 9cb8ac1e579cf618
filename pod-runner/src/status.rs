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
    /// Its process exited with this code and is not started again (restartPolicy Never,
    /// or OnFailure after a success): the pod Succeeded (0) or Failed.
    Terminated(i32),
}

impl ContainerState {
    pub fn of(process: ProcessState) -> ContainerState {
        if let Some(code) = process.terminated {
            return ContainerState::Terminated(code);
        }
        match process.running_since {
            Some(since) => ContainerState::Running(since),
            None if process.restarts > 0 => ContainerState::BackingOff,
            // Being started (a moment): reported as the first start's back-off would be
            // only after an exit, so as running, and not ready until its probe answers.
            None => ContainerState::Running(SystemTime::now()),
        }
    }
}

/// What the runner reports of a pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub state: ContainerState,
    pub restarts: u32,
    pub ready: bool,
}

impl Report {
    /// The same report but for times (a state's start).
    pub fn same_as(&self, other: &Report) -> bool {
        self.ready == other.ready
            && self.restarts == other.restarts
            && std::mem::discriminant(&self.state) == std::mem::discriminant(&other.state)
    }

    /// Whether the pod's status already says this (readiness, restarts and the kind of
    /// state; not the times). Compared with the pod as the API server has it, not with the
    /// last report: the node controller also writes Ready (False, when a node's heartbeats
    /// lapse), and a runner must put it back.
    pub fn shown_by(&self, pod: &Pod) -> bool {
        let Some(status) = pod.status.as_ref() else {
            return false;
        };
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let Some(container) = status.container_statuses.iter().flatten().next() else {
            return false;
        };
        let state = container.state.as_ref();
        let waiting = state
            .and_then(|s| s.waiting.as_ref())
            .and_then(|w| w.reason.as_deref());
        let kind_shown = match &self.state {
            ContainerState::Refused(_) => waiting == Some("CreateContainerConfigError"),
            ContainerState::BackingOff => waiting == Some("CrashLoopBackOff"),
            ContainerState::Running(_) => state.is_some_and(|s| s.running.is_some()),
            ContainerState::Terminated(code) => {
                state
                    .and_then(|s| s.terminated.as_ref())
                    .is_some_and(|t| t.exit_code == *code)
                    && status.phase.as_deref() == Some(phase_after(*code))
            }
        };
        kind_shown && ready == self.ready && container.restart_count == self.restarts as i32
    }
}

/// A pod's readiness as a kubelet keeps it: not ready until its probe first answers, then
/// ready until the probe fails `failureThreshold` times in a row (one slow answer on a busy
/// machine does not take a worker out of its pool), not ready whenever the process is not
/// running.
#[derive(Debug, Clone, Copy, Default)]
pub struct Readiness {
    ready: bool,
    failures: u32,
}

impl Readiness {
    /// Takes one round: whether the process runs and what its probe said (`None`: it has
    /// none); returns whether the pod is ready now.
    pub fn after(&mut self, running: bool, answered: Option<bool>, failure_threshold: u32) -> bool {
        match (running, answered) {
            (false, _) => *self = Readiness::default(),
            (true, None) | (true, Some(true)) => {
                self.ready = true;
                self.failures = 0;
            }
            (true, Some(false)) => {
                self.failures += 1;
                if self.failures >= failure_threshold {
                    self.ready = false;
                }
            }
        }
        self.ready
    }
}

/// A container's HTTP readiness probe, at the pod's address.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadinessProbe {
    pub url: String,
    /// Failures in a row before a ready pod is not ready (`failureThreshold`, default 3).
    pub failure_threshold: u32,
}

/// The container's HTTP readiness probe; `None` when it has none (then running is ready).
pub fn readiness_probe(pod: &Pod, address: Ipv4Addr) -> Option<ReadinessProbe> {
    let container = pod.spec.as_ref()?.containers.first()?;
    let probe = container.readiness_probe.as_ref()?;
    let get = probe.http_get.as_ref()?;
    let port = match &get.port {
        IntOrString::Int(port) => *port,
        IntOrString::String(name) => named_port(container, name)?,
    };
    let path = get.path.as_deref().unwrap_or("/");
    Some(ReadinessProbe {
        url: format!("http://{address}:{port}{path}"),
        failure_threshold: probe.failure_threshold.map_or(3, |n| n.max(1) as u32),
    })
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
        ContainerState::Terminated(code) => json!({"terminated": {
            "exitCode": code,
            "reason": if *code == 0 { "Completed" } else { "Error" },
            "finishedAt": now,
        }}),
    };
    let (status, reason) = match report.ready {
        true => ("True", None),
        false => ("False", Some("ContainersNotReady")),
    };
    let condition = |kind: &str| json!({"type": kind, "status": status, "reason": reason, "lastTransitionTime": now});
    let mut patch = json!({"status": {
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
    }});
    if let ContainerState::Terminated(code) = report.state {
        patch["status"]["phase"] = json!(phase_after(code));
    }
    patch
}

/// The phase of a pod whose one container exited for good with `code`.
fn phase_after(code: i32) -> &'static str {
    if code == 0 {
        "Succeeded"
    } else {
        "Failed"
    }
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
        let url = |pod: &Pod| readiness_probe(pod, address).map(|p| p.url);
        assert_eq!(url(&named).as_deref(), Some("http://127.2.0.5:9090/readyz"));
        let numbered = pod(json!({"httpGet": {"port": 8000}, "failureThreshold": 6}));
        assert_eq!(url(&numbered).as_deref(), Some("http://127.2.0.5:8000/"));
        assert_eq!(
            readiness_probe(&numbered, address)
                .unwrap()
                .failure_threshold,
            6
        );
        assert_eq!(
            readiness_probe(&named, address).unwrap().failure_threshold,
            3
        );
        assert_eq!(url(&pod(json!(null))), None);
    }

    #[test]
    fn readiness_needs_one_answer_and_is_lost_after_the_failure_threshold() {
        let mut readiness = Readiness::default();
        assert!(
            !readiness.after(true, Some(false), 3),
            "not ready before its first answer"
        );
        assert!(readiness.after(true, Some(true), 3));
        assert!(
            readiness.after(true, Some(false), 3),
            "one slow answer is not enough"
        );
        assert!(readiness.after(true, Some(false), 3));
        assert!(!readiness.after(true, Some(false), 3));
        assert!(readiness.after(true, Some(true), 3));
        assert!(
            !readiness.after(false, None, 3),
            "a process that exited is not ready"
        );
        assert!(readiness.after(true, None, 3), "no probe: running is ready");
    }

    #[test]
    fn a_pod_that_cannot_start_is_reported_waiting_and_not_ready() {
        let report = Report {
            state: ContainerState::Refused("secret \"s\" has no key \"k\"".into()),
            restarts: 0,
            ready: false,
        };
        let mut unready = pod(json!(null));
        let patch = patch(&unready, &report);
        let status = &patch["status"];
        assert_eq!(status["conditions"][0]["type"], "Ready");
        assert_eq!(status["conditions"][0]["status"], "False");
        let container = &status["containerStatuses"][0];
        assert_eq!(container["ready"], false);
        assert_eq!(
            container["state"]["waiting"]["reason"],
            "CreateContainerConfigError"
        );
        // Once the API server has the patch, the pod shows the report; not before.
        assert!(!report.shown_by(&unready));
        unready.status = Some(serde_json::from_value(patch["status"].clone()).unwrap());
        assert!(report.shown_by(&unready));
        let ready = Report {
            ready: true,
            ..report
        };
        assert!(
            !ready.shown_by(&unready),
            "the node controller's Ready=False is put back"
        );
    }

    #[test]
    fn a_process_that_exited_for_good_ends_its_pod_succeeded_or_failed() {
        let pod = pod(json!(null));
        for (code, phase, reason) in [(0, "Succeeded", "Completed"), (3, "Failed", "Error")] {
            let report = Report {
                state: ContainerState::Terminated(code),
                restarts: 0,
                ready: false,
            };
            let patch = patch(&pod, &report);
            assert_eq!(patch["status"]["phase"], phase);
            let terminated = &patch["status"]["containerStatuses"][0]["state"]["terminated"];
            assert_eq!(terminated["exitCode"], code);
            assert_eq!(terminated["reason"], reason);
            let mut shown = pod.clone();
            shown.status = Some(serde_json::from_value(patch["status"].clone()).unwrap());
            assert!(report.shown_by(&shown));
        }
        assert!(crate::plan::RestartPolicy::OnFailure.after(1));
        assert!(!crate::plan::RestartPolicy::OnFailure.after(0));
        assert!(!crate::plan::RestartPolicy::Never.after(1));
    }
}
