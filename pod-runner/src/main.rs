//! conveyor-pod-runner: the kubelet of the local cluster, for tests and `make dev`. kwok
//! marks the pods scheduled to its node Running; this runs each of them (those selected by
//! `--selector`) as a local process with the pod's command, arguments and environment, and
//! stops it when the pod goes away. So an applied WorkerPool really processes tasks, and
//! `kubectl delete pod` really stops a worker.

mod plan;
mod status;
mod supervisor;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::pin::pin;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use conveyor_core::config::TelemetryArgs;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};

use crate::plan::{Apiserver, Host, Objects};
use crate::status::{ContainerState, Readiness, Report};
use crate::supervisor::Supervisor;

/// How often pods' readiness probes run (a kubelet's probe period) and processes are checked.
const PERIOD: Duration = Duration::from_secs(2);
/// A status sent this long ago that the pod still does not show is sent again.
const RESEND_AFTER: Duration = Duration::from_secs(5);

#[derive(Debug, Parser)]
#[command(name = "conveyor-pod-runner", version)]
struct Args {
    /// The kwok node whose pods run here.
    #[arg(long, default_value = "conveyor-node")]
    node: String,
    /// Label selector of the pods to run (others stay kwok's fakes).
    /// The default is every Conveyor pod: the operator's workers, and the chart's operator,
    /// gateway and test pods.
    #[arg(long, default_value = "app.kubernetes.io/part-of=conveyor")]
    selector: String,
    /// Where bare command names (`conveyor-worker`) are found.
    #[arg(long, default_value = "target/debug")]
    bin_dir: PathBuf,
    /// Other releases' binaries, a folder per image tag: a pod whose image is tagged `T`
    /// runs those in `RELEASES/T/bin` when that folder exists, and the --bin-dir's otherwise.
    #[arg(long)]
    releases: Option<PathBuf>,
    /// Pods get loopback addresses 127.SUBNET.x.y (one runner per subnet).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=254))]
    pod_subnet: u8,
    /// Per-pod directories (volumes, logs).
    #[arg(long, default_value = ".dev/pods")]
    state_dir: PathBuf,
    /// IMAGE_PATH=LOCAL_DIR: a path prefix inside the image and where it is here.
    #[arg(long = "map", value_parser = parse_map)]
    path_maps: Vec<(String, PathBuf)>,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

fn parse_map(s: &str) -> Result<(String, PathBuf), String> {
    let (from, to) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not IMAGE_PATH=LOCAL_DIR"))?;
    let to = std::fs::canonicalize(to).map_err(|e| format!("{to}: {e}"))?;
    Ok((from.to_owned(), to))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    args.telemetry.init();
    args.bin_dir = std::fs::canonicalize(&args.bin_dir)
        .with_context(|| format!("bin dir {}", args.bin_dir.display()))?;
    std::fs::create_dir_all(&args.state_dir)?;
    args.state_dir = std::fs::canonicalize(&args.state_dir)?;
    let client = Client::try_default()
        .await
        .context("no Kubernetes client configuration (set KUBECONFIG)")?;

    let config = watcher::Config::default()
        .fields(&format!("spec.nodeName={}", args.node))
        .labels(&args.selector);
    let (store, writer) = reflector::store();
    let mut events = pin!(reflector::reflector(
        writer,
        watcher(Api::<Pod>::all(client.clone()), config)
    )
    .default_backoff());
    let mut runner = Runner {
        client,
        args,
        running: HashMap::new(),
        stopping: Vec::new(),
        addresses: HashMap::new(),
        refused: HashMap::new(),
        reported: HashMap::new(),
        readiness: HashMap::new(),
        http: reqwest::Client::new(),
        apiserver: own_apiserver(),
    };
    let mut tick = tokio::time::interval(PERIOD);
    tracing::info!(node = %runner.args.node, selector = %runner.args.selector, "running pods");
    loop {
        // Statuses are reported once a period: a pod's own status patch comes back as a
        // watch event, and probing on each would count failures faster than the period.
        let period = tokio::select! {
            event = events.next() => match event {
                Some(Ok(_)) => false,
                Some(Err(err)) => {
                    tracing::warn!(error = %err, "pod watch failed; retrying");
                    false
                }
                None => break,
            },
            _ = tick.tick() => true,
            _ = shutdown_signal() => break,
        };
        runner.sync(&store, period).await;
    }
    runner.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

struct Runner {
    client: Client,
    args: Args,
    /// By pod uid.
    running: HashMap<String, Supervisor>,
    /// Processes of deleted pods, draining; each keeps its pod's address until it exits.
    stopping: Vec<(Supervisor, Ipv4Addr)>,
    /// The address of each running pod, by uid.
    addresses: HashMap<String, Ipv4Addr>,
    /// Pods that cannot run here, with why (logged once per reason).
    refused: HashMap<String, String>,
    /// What was last sent of each pod's status, and when, by uid.
    reported: HashMap<String, (Report, std::time::Instant)>,
    /// Each running pod's readiness probe results, by uid.
    readiness: HashMap<String, Readiness>,
    /// What pods' service-account kubeconfigs point at (see `plan::Host::apiserver`).
    apiserver: Option<Apiserver>,
    /// For readiness probes.
    http: reqwest::Client,
}

impl Runner {
    /// Starts a process for every running pod without one, stops those whose pod is gone;
    /// with `report`, reports their statuses too.
    async fn sync(&mut self, store: &Store<Pod>, report: bool) {
        let wanted: BTreeMap<String, std::sync::Arc<Pod>> = store
            .state()
            .into_iter()
            .filter(|pod| {
                pod.metadata.deletion_timestamp.is_none()
                    && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
            .filter_map(|pod| Some((pod.uid()?, pod)))
            .collect();
        let gone: Vec<String> = self
            .running
            .keys()
            .filter(|uid| !wanted.contains_key(*uid))
            .cloned()
            .collect();
        for uid in gone {
            if let (Some(supervisor), Some(address)) =
                (self.running.remove(&uid), self.addresses.remove(&uid))
            {
                supervisor.stop();
                self.stopping.push((supervisor, address));
            }
        }
        self.stopping.retain(|(s, _)| !s.is_finished());
        self.refused.retain(|uid, _| wanted.contains_key(uid));
        self.reported.retain(|uid, _| wanted.contains_key(uid));
        for (uid, pod) in &wanted {
            let uid = uid.clone();
            let pod = pod.clone();
            if let Some(address) = self.addresses.get(&uid) {
                self.report_address(&pod, *address).await;
                continue;
            }
            let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
            let Some(address) = self.free_address() else {
                tracing::warn!(pod = %key, "no free pod address on this runner");
                continue;
            };
            match self.prepare(&pod, address).await {
                Ok((launch, log)) => {
                    self.refused.remove(&uid);
                    self.running
                        .insert(uid.clone(), Supervisor::spawn(key, launch, log));
                    self.addresses.insert(uid, address);
                    self.report_address(&pod, address).await;
                }
                Err(err) => {
                    let reason = format!("{err:#}");
                    if self.refused.get(&uid) != Some(&reason) {
                        tracing::warn!(pod = %key, error = %reason, "cannot run pod yet");
                        self.refused.insert(uid, reason);
                    }
                }
            }
        }
        if report {
            self.report_statuses(&wanted).await;
        }
    }

    /// Reports each pod's container state and readiness where the pod does not show them
    /// yet (the probes run side by side, each bounded by a second).
    async fn report_statuses(&mut self, wanted: &BTreeMap<String, std::sync::Arc<Pod>>) {
        self.readiness.retain(|uid, _| wanted.contains_key(uid));
        let probes = wanted.iter().filter_map(|(uid, pod)| {
            let process = self.running.get(uid).map(Supervisor::state);
            let state = match (self.refused.get(uid), process) {
                (Some(why), _) => ContainerState::Refused(why.clone()),
                (None, Some(process)) => ContainerState::of(process),
                (None, None) => return None,
            };
            let restarts = process.map_or(0, |p| p.restarts);
            let probe = self
                .addresses
                .get(uid)
                .and_then(|address| status::readiness_probe(pod, *address));
            let http = &self.http;
            Some(async move {
                let answered = match (&state, &probe) {
                    (ContainerState::Running(_), Some(probe)) => {
                        Some(status::probe(http, &probe.url).await)
                    }
                    _ => None,
                };
                let threshold = probe.map_or(1, |p| p.failure_threshold);
                (
                    uid.clone(),
                    pod.clone(),
                    state,
                    restarts,
                    answered,
                    threshold,
                )
            })
        });
        let probed = futures_util::future::join_all(probes).await;
        for (uid, pod, state, restarts, answered, threshold) in probed {
            let running = matches!(state, ContainerState::Running(_));
            let readiness = self.readiness.entry(uid.clone()).or_default();
            let ready = readiness.after(running, answered, threshold);
            let report = Report {
                state,
                restarts,
                ready,
            };
            if report.shown_by(&pod) {
                continue;
            }
            // Sent a moment ago: the watch has not brought it back yet.
            let just_sent = self
                .reported
                .get(&uid)
                .is_some_and(|(last, at)| last.same_as(&report) && at.elapsed() < RESEND_AFTER);
            if just_sent {
                continue;
            }
            let pods: Api<Pod> =
                Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
            let patch = status::patch(&pod, &report);
            match pods
                .patch_status(
                    &pod.name_any(),
                    &PatchParams::default(),
                    &Patch::Strategic(&patch),
                )
                .await
            {
                Ok(_) => {
                    self.reported
                        .insert(uid, (report, std::time::Instant::now()));
                }
                Err(err) => {
                    tracing::warn!(pod = %pod.name_any(), error = %err, "cannot report the pod's status")
                }
            }
        }
    }

    /// The lowest address no running or draining pod holds.
    fn free_address(&self) -> Option<Ipv4Addr> {
        let taken: HashSet<Ipv4Addr> = self
            .addresses
            .values()
            .chain(self.stopping.iter().map(|(_, a)| a))
            .copied()
            .collect();
        (0..=255u8)
            .flat_map(|x| (1..=254u8).map(move |y| (x, y)))
            .map(|(x, y)| Ipv4Addr::new(127, self.args.pod_subnet, x, y))
            .find(|a| !taken.contains(a))
    }

    /// Writes the pod's address to `status.podIP`, as a kubelet does, so that whoever
    /// reaches pods by address (the operator reads each worker's drain state) reaches this
    /// process.
    async fn report_address(&self, pod: &Pod, address: Ipv4Addr) {
        let ip = address.to_string();
        if pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()) == Some(ip.as_str()) {
            return;
        }
        let pods: Api<Pod> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let patch = serde_json::json!({"status": {"podIP": ip, "podIPs": [{"ip": ip}]}});
        if let Err(err) = pods
            .patch_status(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            tracing::warn!(pod = %pod.name_any(), error = %err, "cannot report the pod's address");
        }
    }

    async fn prepare(
        &self,
        pod: &Pod,
        address: Ipv4Addr,
    ) -> anyhow::Result<(plan::Launch, PathBuf)> {
        let namespace = pod.namespace().unwrap_or_default();
        let refs = plan::references(pod)?;
        let mut objects = Objects::default();
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &namespace);
        for name in refs.secrets {
            if let Some(secret) = secrets.get_opt(&name).await? {
                let data = secret
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()));
                let mut all: BTreeMap<String, String> = data.collect();
                all.extend(secret.string_data.unwrap_or_default());
                objects.secrets.insert(name, all);
            }
        }
        let maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &namespace);
        for name in refs.config_maps {
            if let Some(map) = maps.get_opt(&name).await? {
                objects
                    .config_maps
                    .insert(name, map.data.unwrap_or_default());
            }
        }
        let pod_dir = self.args.state_dir.join(&namespace).join(pod.name_any());
        let host = Host {
            bin_dir: self.args.bin_dir.clone(),
            releases: self.args.releases.clone(),
            pod_dir: pod_dir.clone(),
            path_maps: self.args.path_maps.clone(),
            address,
            apiserver: self.apiserver.clone(),
        };
        let launch = plan::plan(pod, &objects, &host)?;
        Ok((launch, pod_dir.join("container.log")))
    }

    /// Stops every process, as a node shutting down would.
    async fn shutdown(self) {
        tracing::info!(pods = self.running.len(), "stopping all pods");
        let all: Vec<Supervisor> = self
            .running
            .into_values()
            .chain(self.stopping.into_iter().map(|(s, _)| s))
            .collect();
        for supervisor in &all {
            supervisor.stop();
        }
        futures_util::future::join_all(all.into_iter().map(Supervisor::join)).await;
    }
}

/// The apiserver and token of this runner's own kubeconfig ($KUBECONFIG), which pods' service
/// accounts are impersonated with; `None` (pods get no API access) when it has no token.
fn own_apiserver() -> Option<Apiserver> {
    let config = kube::config::Kubeconfig::read().ok()?;
    let context_name = config.current_context.clone()?;
    let context = config
        .contexts
        .iter()
        .find(|c| c.name == context_name)?
        .context
        .clone()?;
    let server = config
        .clusters
        .iter()
        .find(|c| c.name == context.cluster)?
        .cluster
        .as_ref()?
        .server
        .clone()?;
    let user = context.user.as_deref()?;
    let token = config
        .auth_infos
        .iter()
        .find(|a| a.name == user)?
        .auth_info
        .as_ref()?
        .token
        .as_ref()?;
    use secrecy::ExposeSecret;
    Some(Apiserver {
        server,
        token: token.expose_secret().to_owned(),
    })
}
