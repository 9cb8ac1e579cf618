//! The operator's side of the soak, on the local stack (`scripts/stack.sh`): a population of
//! TaskTypes and WorkerPools that grows every simulated day, one namespace each, and the
//! operator restarted (kill -9, started again) or failed over to a standby every few days.
//! Sampled from outside: the operator's memory from `/proc`, its reconciles and broker
//! requests from its /metrics, and, across a restart, how many of the fleet's Deployments
//! it wrote again (none should: nothing changed).

use std::time::{Duration, Instant};

use conveyor_core::testing::{free_port, proc_status_mib};
use conveyor_e2e_tests::{kill_operator, kubectl_with, standby_operator, start_operator};

/// The stack's operator admin address (`scripts/stack.sh`).
const OPERATOR: &str = "127.0.0.1:8081";
/// Label of every namespace the soak made, for the clean-up.
const LABEL: &str = "conveyor.dev/soak";

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Operator {
    pub namespaces: usize,
    pub rss_mib: f64,
    pub reconciles: f64,
    pub broker_requests: f64,
}

#[derive(Clone)]
pub struct Fleet {
    run: String,
    namespaces: Vec<String>,
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
            namespaces: Vec::new(),
        }
    }

    /// `n` more namespaces, each with a TaskType and a WorkerPool of it (scaled on backlog
    /// from zero: no pods while idle).
    pub fn grow(&mut self, n: usize) -> anyhow::Result<()> {
        for _ in 0..n {
            let namespace = format!("soak-{}-{}", self.run, self.namespaces.len());
            let manifest = format!(
                "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n  labels: {{{LABEL}: \"{run}\"}}\n\
                 ---\napiVersion: conveyor.dev/v1alpha1\nkind: TaskType\nmetadata: {{name: encode, namespace: {namespace}}}\n\
                 spec: {{maxRetries: 2, deletionPolicy: Delete}}\n\
                 ---\napiVersion: conveyor.dev/v1alpha1\nkind: WorkerPool\nmetadata: {{name: encoders, namespace: {namespace}}}\n\
                 spec:\n  taskTypes: [encode]\n  image: conveyor:dev\n  handler: {{type: sleep}}\n  \
                 autoscaling: {{minReplicas: 0, maxReplicas: 2}}\n",
                run = self.run
            );
            kubectl_with(&["apply", "-f", "-"], Some(&manifest))
                .map_err(|err| anyhow::anyhow!("kubectl apply of {namespace}: {err}"))?;
            self.namespaces.push(namespace);
        }
        Ok(())
    }

    pub async fn sample(&self) -> Operator {
        let pid = std::fs::read_to_string(".dev/operator.pid")
            .ok()
            .and_then(|p| p.trim().parse().ok());
        let metrics = metrics(OPERATOR).await.unwrap_or_default();
        Operator {
            namespaces: self.namespaces.len(),
            rss_mib: pid.and_then(|p| proc_status_mib(p, "VmRSS")).unwrap_or(0.0),
            reconciles: sum(&metrics, "conveyor_operator_reconciles_total"),
            broker_requests: sum(&metrics, "conveyor_operator_broker_requests_total"),
        }
    }

    /// Kills the operator (-9) and starts it again; returns what happened, with how many of
    /// the fleet's Deployments it wrote again within 30 s of being ready.
    pub async fn restart(&self) -> anyhow::Result<String> {
        // Every pool applied first: what the restart writes is then a write again.
        let until = Instant::now() + Duration::from_secs(120);
        let mut before = self.deployment_versions()?;
        while before.len() < self.namespaces.len() && Instant::now() < until {
            tokio::time::sleep(Duration::from_secs(1)).await;
            before = self.deployment_versions()?;
        }
        let down = Instant::now();
        kill_operator();
        start_operator();
        wait_ready(OPERATOR).await?;
        let ready = down.elapsed();
        tokio::time::sleep(Duration::from_secs(30)).await;
        let rewritten = changed(&before, &self.deployment_versions()?);
        Ok(format!(
            "operator killed and restarted: ready in {:.1} s, {rewritten} of {} Deployments written again",
            ready.as_secs_f64(),
            before.len()
        ))
    }

    /// A standby beside the operator, the leader killed: returns how long until the standby
    /// held the lease. The stack's operator then comes back as the standby, and takes the
    /// lease back when the soak's standby stops.
    pub async fn failover(&self) -> anyhow::Result<String> {
        let listen = format!("127.0.0.1:{}", free_port());
        let mut standby = standby_operator("soak-standby", &listen, &[]);
        let result = async {
            wait_ready(&listen).await?;
            let down = Instant::now();
            kill_operator();
            wait_for_holder("soak-standby").await?;
            let took = down.elapsed();
            start_operator();
            anyhow::Ok(took)
        }
        .await;
        let _ = standby.kill();
        let _ = standby.wait();
        let took = result?;
        wait_for_holder("conveyor-operator").await?;
        Ok(format!(
            "operator failed over to a standby in {:.1} s, and back",
            took.as_secs_f64()
        ))
    }

    /// Deletes the fleet's namespaces (their TaskTypes' queues go with them).
    pub fn clean(&self) {
        let selector = format!("{LABEL}={}", self.run);
        if let Err(err) = kubectl_with(
            &["delete", "namespace", "-l", &selector, "--wait=false"],
            None,
        ) {
            eprintln!("soak: deleting the fleet's namespaces: {err}");
        }
    }

    /// Each of the fleet's Deployments with its generation and the time of the operator's
    /// last write to it (a status update by the cluster changes neither).
    fn deployment_versions(&self) -> anyhow::Result<Vec<(String, String)>> {
        let out = kubectl_with(
            &[
                "get",
                "deployments",
                "--all-namespaces",
                "-o",
                "jsonpath={range .items[*]}{.metadata.namespace} {.metadata.generation} \
                 {.metadata.managedFields[?(@.manager==\"conveyor-operator\")].time}{\"\\n\"}{end}",
            ],
            None,
        )
        .map_err(|err| anyhow::anyhow!("kubectl get deployments: {err}"))?;
        let prefix = format!("soak-{}-", self.run);
        Ok(out
            .lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(ns, _)| ns.starts_with(&prefix))
            .map(|(ns, v)| (ns.to_owned(), v.to_owned()))
            .collect())
    }
}

fn changed(before: &[(String, String)], after: &[(String, String)]) -> usize {
    before.iter().filter(|b| !after.contains(b)).count()
}

async fn metrics(listen: &str) -> anyhow::Result<String> {
    Ok(reqwest::get(format!("http://{listen}/metrics"))
        .await?
        .text()
        .await?)
}

fn sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name))
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

async fn wait_for_holder(identity: &str) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(120);
    while Instant::now() < until {
        let holder = kubectl_with(
            &[
                "-n",
                "conveyor-system",
                "get",
                "lease",
                "conveyor-operator",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ],
            None,
        )
        .unwrap_or_default();
        if holder == identity {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    anyhow::bail!("{identity} did not hold the operator's lease within 120 s")
}
