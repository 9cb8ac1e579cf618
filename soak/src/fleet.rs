//! The operator's side of the soak, on the local stack (`scripts/stack.sh`): a population of
//! TaskTypes and WorkerPools that grows every simulated day, one namespace each, and the
//! operator restarted (kill -9, started again) or failed over to a standby every few days.
//! Sampled from outside: the operator's memory from `/proc`, its reconciles and broker
//! requests from its /metrics, its own requests to the kube-apiserver from the apiserver's
//! audit log (`cluster/up.sh` writes it: who made each request), and the apiserver's count
//! of requests on TaskTypes, WorkerPools and Deployments (every client's). Across a restart,
//! the Deployments applied again are the apiserver's count of APPLY requests on
//! Deployments: only the operator applies them.
//!
//! kubectl and the stack's scripts block: every call runs on tokio's blocking threads, so
//! that the load's clients, which share the runtime, are never held up by them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use conveyor_core::testing::{free_port, proc_status_mib};
use conveyor_e2e_tests::audit::{self, AuditLog};
use conveyor_e2e_tests::{
    kill_operator, kubectl_with, lease_holder, standby_operator, start_operator,
};

/// The stack's operator admin address (`scripts/stack.sh`).
const OPERATOR: &str = "127.0.0.1:8081";
/// Label of every namespace the soak made, for the clean-up.
const LABEL: &str = "conveyor.dev/soak";

#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct Operator {
    pub namespaces: usize,
    pub rss_mib: f64,
    pub reconciles: f64,
    pub broker_requests: f64,
    /// The apiserver's count of requests on TaskTypes, WorkerPools and Deployments.
    pub apiserver_requests: f64,
    /// The operator's own requests to the apiserver since the soak began (its audit log).
    pub own_apiserver_requests: f64,
}

/// The fleet's namespaces; deleted when dropped, however the soak ends.
pub struct Fleet {
    run: String,
    namespaces: AtomicUsize,
    audit: Mutex<OperatorRequests>,
}

impl Fleet {
    /// Whether the local stack runs (its operator's pid file and a kubeconfig).
    pub fn available() -> bool {
        std::path::Path::new(".dev/operator.pid").exists()
            && std::env::var_os("KUBECONFIG").is_some()
    }

    pub fn new() -> Fleet {
        Fleet {
            run: uuid::Uuid::new_v4().simple().to_string()[..8].to_owned(),
            namespaces: AtomicUsize::new(0),
            audit: Mutex::new(OperatorRequests::from_now()),
        }
    }

    /// `n` more namespaces, each with a TaskType and a WorkerPool of it (scaled on backlog
    /// from zero: no pods while idle).
    pub async fn grow(&self, n: usize) -> anyhow::Result<()> {
        let first = self.namespaces.load(Ordering::Relaxed);
        let manifests: String = (first..first + n)
            .map(|i| {
                let namespace = format!("soak-{}-{i}", self.run);
                format!(
                    "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n  \
                     labels: {{{LABEL}: \"{run}\"}}\n\
                     ---\napiVersion: conveyor.dev/v1alpha1\nkind: TaskType\n\
                     metadata: {{name: encode, namespace: {namespace}}}\n\
                     spec: {{maxRetries: 2, deletionPolicy: Delete}}\n\
                     ---\napiVersion: conveyor.dev/v1alpha1\nkind: WorkerPool\n\
                     metadata: {{name: encoders, namespace: {namespace}}}\n\
                     spec:\n  taskTypes: [encode]\n  image: conveyor:dev\n  handler: {{type: sleep}}\n  \
                     autoscaling: {{minReplicas: 0, maxReplicas: 2}}\n",
                    run = self.run
                )
            })
            .collect();
        blocking(move || kubectl_with(&["apply", "-f", "-"], Some(&manifests)))
            .await?
            .map_err(|err| anyhow::anyhow!("kubectl apply of the fleet: {err}"))?;
        self.namespaces.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }

    pub async fn sample(&self) -> Operator {
        let pid = std::fs::read_to_string(".dev/operator.pid")
            .ok()
            .and_then(|p| p.trim().parse().ok());
        let metrics = metrics(OPERATOR).await.unwrap_or_default();
        let apiserver = apiserver_metrics().await;
        let own = {
            let mut audit = self.audit.lock().unwrap_or_else(|p| p.into_inner());
            audit.count() as f64
        };
        Operator {
            own_apiserver_requests: own,
            namespaces: self.namespaces.load(Ordering::Relaxed),
            rss_mib: pid.and_then(|p| proc_status_mib(p, "VmRSS")).unwrap_or(0.0),
            reconciles: sum(&metrics, "conveyor_operator_reconciles_total", &[]),
            broker_requests: sum(&metrics, "conveyor_operator_broker_requests_total", &[]),
            apiserver_requests: ["tasktypes", "workerpools", "deployments"]
                .iter()
                .map(|r| {
                    sum(
                        &apiserver,
                        "apiserver_request_total",
                        &[&format!("resource=\"{r}\"")],
                    )
                })
                .sum(),
        }
    }

    /// Kills the operator (-9) and starts it again; returns what happened, with how many
    /// Deployments it applied within `watch` of being ready (none changed).
    pub async fn restart(&self, watch: Duration) -> anyhow::Result<String> {
        let applies = || async {
            sum(
                &apiserver_metrics().await,
                "apiserver_request_total",
                &["resource=\"deployments\"", "verb=\"APPLY\""],
            )
        };
        // Every pool applied first, so that what follows the restart is a write again.
        self.settled().await?;
        let before = applies().await;
        let pools = self.namespaces.load(Ordering::Relaxed);
        let down = Instant::now();
        blocking(|| {
            kill_operator();
            start_operator();
        })
        .await?;
        wait_ready(OPERATOR).await?;
        let ready = down.elapsed();
        tokio::time::sleep(watch).await;
        let applied = applies().await - before;
        // Pools the soak added meanwhile are applied for the first time.
        let added = self.namespaces.load(Ordering::Relaxed) - pools;
        Ok(format!(
            "operator killed and restarted: ready in {:.1} s; in the {:.0} s after, {applied:.0} \
             Deployments applied (the apiserver's count), {added} of them for pools added \
             meanwhile, so {:.0} of the {pools} unchanged ones applied again",
            ready.as_secs_f64(),
            watch.as_secs_f64(),
            (applied - added as f64).max(0.0),
        ))
    }

    /// A standby beside the operator, the leader killed: returns how long until the standby
    /// held the lease. The stack's operator then comes back as the standby, and takes the
    /// lease back when the soak's standby stops.
    pub async fn failover(&self) -> anyhow::Result<String> {
        let listen = format!("127.0.0.1:{}", free_port());
        let standby = Standby(Some(
            blocking({
                let listen = listen.clone();
                move || standby_operator("soak-standby", &listen, &[])
            })
            .await?,
        ));
        let took = async {
            wait_ready(&listen).await?;
            let down = Instant::now();
            blocking(kill_operator).await?;
            wait_for_holder("soak-standby").await?;
            anyhow::Ok(down.elapsed())
        }
        .await;
        // Whatever happened, the stack's operator runs again, and takes the lease back once
        // the standby is gone.
        blocking(start_operator).await?;
        drop(standby);
        let took = took?;
        wait_for_holder("conveyor-operator").await?;
        Ok(format!(
            "operator failed over to a standby in {:.1} s, and back",
            took.as_secs_f64()
        ))
    }
}

impl Fleet {
    /// Waits (up to two minutes) until every pool has its Deployment.
    async fn settled(&self) -> anyhow::Result<()> {
        let prefix = format!("soak-{}-", self.run);
        let until = Instant::now() + Duration::from_secs(120);
        loop {
            let listed = blocking(|| {
                kubectl_with(
                    &[
                        "get",
                        "deployments",
                        "--all-namespaces",
                        "-o",
                        "jsonpath={.items[*].metadata.namespace}",
                    ],
                    None,
                )
            })
            .await?
            .map_err(|err| anyhow::anyhow!("kubectl get deployments: {err}"))?;
            let applied = listed
                .split(' ')
                .filter(|ns| ns.starts_with(&prefix))
                .count();
            if applied >= self.namespaces.load(Ordering::Relaxed) {
                return Ok(());
            }
            if Instant::now() > until {
                anyhow::bail!("{applied} of the fleet's pools have a Deployment after 2 minutes");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

impl Drop for Fleet {
    /// Deletes the fleet's namespaces (their TaskTypes' queues go with them).
    fn drop(&mut self) {
        let selector = format!("{LABEL}={}", self.run);
        if let Err(err) = kubectl_with(
            &["delete", "namespace", "-l", &selector, "--wait=false"],
            None,
        ) {
            eprintln!("soak: deleting the fleet's namespaces: {err}");
        }
    }
}

/// The operator's requests in the apiserver's audit log, counted as it grows (a standby's
/// too: they share its service account).
struct OperatorRequests {
    log: AuditLog,
    counted: u64,
}

impl OperatorRequests {
    fn from_now() -> OperatorRequests {
        OperatorRequests {
            log: AuditLog::from_now(),
            counted: 0,
        }
    }

    /// The operator's requests since the soak began.
    fn count(&mut self) -> u64 {
        let new = self.log.new_requests();
        self.counted += new.iter().filter(|r| r.user == audit::OPERATOR).count() as u64;
        self.counted
    }
}

/// The soak's standby operator, killed when dropped.
struct Standby(Option<std::process::Child>);

impl Drop for Standby {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs a blocking call (kubectl, the stack's scripts) off the runtime's worker threads.
async fn blocking<T: Send + 'static>(
    call: impl FnOnce() -> T + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(call)
        .await
        .map_err(|err| anyhow::anyhow!("a kubectl or stack call panicked: {err}"))
}

async fn metrics(listen: &str) -> anyhow::Result<String> {
    Ok(reqwest::get(format!("http://{listen}/metrics"))
        .await?
        .text()
        .await?)
}

/// The kube-apiserver's /metrics (empty when it cannot be read).
async fn apiserver_metrics() -> String {
    blocking(|| kubectl_with(&["get", "--raw", "/metrics"], None))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default()
}

/// The sum of a counter's series whose labels contain every one of `labels`.
fn sum(metrics: &str, name: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn wait_ready(listen: &str) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(120);
    while Instant::now() < until {
        let ready = reqwest::get(format!("http://{listen}/readyz"))
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("the operator at {listen} did not become ready in 120 s")
}

async fn wait_for_holder(identity: &'static str) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(120);
    while Instant::now() < until {
        let holder = blocking(lease_holder).await?.unwrap_or_default();
        if holder == identity {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    anyhow::bail!("{identity} did not hold the operator's lease within 120 s")
}
