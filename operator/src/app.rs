//! The operator process, wired as a library so the binary stays a command line: the admin
//! server, leader election, the shared context and the controllers, and how it stops.

use conveyor_core::plaintext::Link;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use conveyor_core::amqp::Publisher;
use conveyor_core::config::{AmqpArgs, TelemetryArgs};
use conveyor_core::crd::{TaskType, WorkerPool};
use conveyor_core::watch_scope::WatchScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::ListParams;
use kube::runtime::events::Reporter;
use kube::Client;
use tokio_util::sync::CancellationToken;

use crate::build::ConnectionSecret;
use crate::context::{Context, OperatorMetrics};
use crate::controllers;
use crate::leader::Leader;
use crate::rabbitmq::ManagementArgs;

/// How long reconciles under way may take to finish once the controllers are told to stop.
pub const STOP_WITHIN: Duration = Duration::from_secs(3);

/// `conveyor-operator run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "CONVEYOR_OPERATOR_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: String,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "conveyor-system")]
    pub namespace: String,
    /// This replica's identity in the Lease.
    #[arg(long, env = "POD_NAME", default_value = "conveyor-operator")]
    pub identity: String,
    /// Lease duration in seconds.
    #[arg(long, env = "CONVEYOR_LEASE_SECONDS", default_value_t = 15)]
    pub lease_seconds: u64,
    #[command(flatten)]
    pub management: ManagementArgs,
    #[command(flatten)]
    pub ca: conveyor_core::tls::CaArgs,
    /// Secret (in each pool's namespace) with the workers' database-url and amqp-url.
    #[arg(
        long,
        env = "CONVEYOR_CONNECTION_SECRET",
        default_value = "conveyor-connections"
    )]
    pub connection_secret: String,
    /// The key each pool's worker admin token is derived from (`conveyorctl grant
    /// --component operator` makes one). Without it, the operator makes one and keeps it in
    /// Secret `conveyor-operator-admin-key` of its namespace.
    #[arg(long, env = "CONVEYOR_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Namespaces to watch, separated by commas: the operator then needs Roles in those
    /// namespaces only (the chart's `watchNamespaces`). Empty: every namespace, with
    /// ClusterRoles.
    #[arg(
        long,
        env = "CONVEYOR_WATCH_NAMESPACES",
        default_value = "",
        value_parser = WatchScope::parse
    )]
    pub watch_namespaces: WatchScope,
    #[command(flatten)]
    pub amqp: AmqpArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    #[command(flatten)]
    pub require_tls: conveyor_core::plaintext::RequireTls,
}

/// Runs until a signal (releasing the lease) or until leadership is lost (an error, so the
/// process exits and its Deployment starts it again as a standby).
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    args.telemetry.init();
    args.require_tls
        .check(&[
            Link::Broker(args.amqp.url.expose()),
            Link::Management(&args.management.management_url),
        ])
        .map_err(anyhow::Error::msg)?;
    let client = Client::try_default()
        .await
        .context("connecting to Kubernetes")?;
    require_access(&client, &args.watch_namespaces).await?;
    tracing::info!(scope = args.watch_namespaces.describe(), "watching");

    let shutdown = CancellationToken::new();
    tokio::spawn(conveyor_core::shutdown_on_signals(shutdown.clone()));
    let metrics = OperatorMetrics::new();
    conveyor_core::metrics::describe_process(&metrics.registry, "operator");
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let ready_client = client.clone();
    let ready: conveyor_core::admin::ReadinessCheck = Arc::new(move || {
        let client = ready_client.clone();
        Box::pin(async move {
            client
                .apiserver_version()
                .await
                .map(drop)
                .map_err(|e| format!("apiserver: {e}"))
        })
    });
    let app = conveyor_core::admin::router(metrics.registry.clone(), ready);
    let admin_stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(admin_stop.cancelled_owned())
            .await;
    });

    let leader = Arc::new(Leader::new(
        client.clone(),
        &args.namespace,
        "conveyor-operator",
        &args.identity,
        Duration::from_secs(args.lease_seconds),
    ));
    if !leader.acquire(&shutdown).await {
        return Ok(());
    }
    // Losing the lease stops the controllers exactly like a shutdown does. The lease is
    // renewed until the controllers have stopped (`stopped`), not only until shutdown began:
    // a standby must not start while reconciles still drain here.
    let stop = CancellationToken::new();
    let stopped = CancellationToken::new();
    let holder = tokio::spawn({
        let (leader, stopped, stop) = (leader.clone(), stopped.clone(), stop.clone());
        async move { leader.hold(stopped, stop).await }
    });
    let relay = stop.clone();
    let outer = shutdown.clone();
    tokio::spawn(async move {
        outer.cancelled().await;
        relay.cancel();
    });

    let reporter = Reporter {
        controller: "conveyor-operator".into(),
        instance: Some(args.identity.clone()),
    };
    let admin_key =
        crate::admin_key::ensure(&client, &args.namespace, args.admin_key.as_deref()).await?;
    let ctx = Arc::new(
        Context::new(
            client.clone(),
            reporter,
            args.management
                .api("/", &args.ca.roots().context("--ca-file")?)
                .context("RabbitMQ management API client")?
                .counted(metrics.broker_requests.with_label_values(&["management"])),
            Publisher::new(
                args.amqp.connection_url(),
                "conveyor-operator",
                args.amqp.confirm_timeout(),
            ),
            ConnectionSecret {
                name: args.connection_secret.clone(),
                ..ConnectionSecret::default()
            },
            metrics,
        )
        .with_admin_key(Some(&admin_key))
        .with_scope(args.watch_namespaces.clone())
        .with_require_tls(args.require_tls.require_tls),
    );

    // Reconciles still under way when the lease is lost or shutdown begins get a bound to
    // finish in, well inside the renew deadline; then the process exits regardless.
    let deadline = stop.clone();
    tokio::select! {
        () = controllers::run(ctx, stop) => {}
        () = async {
            deadline.cancelled().await;
            tokio::time::sleep(STOP_WITHIN).await;
        } => tracing::warn!(within = ?STOP_WITHIN, "controllers did not stop in time; exiting"),
    }
    stopped.cancel();
    if !shutdown.is_cancelled() {
        anyhow::bail!("lost leadership");
    }
    // The controllers have stopped and no renewal is under way: hand the lease on.
    let _ = holder.await;
    leader.release().await;
    Ok(())
}

/// Exits with a clear message when the CRDs are not installed (the operator never installs
/// them itself), or when its roles do not let it read, in its scope, any kind it watches:
/// one such watch that cannot list would hold every reconcile back.
async fn require_access(client: &Client, scope: &WatchScope) -> anyhow::Result<()> {
    let probe = ListParams::default().limit(1);
    let lists = [
        (
            "TaskTypes",
            scope.list::<TaskType>(client, &probe).await.map(drop),
        ),
        (
            "WorkerPools",
            scope.list::<WorkerPool>(client, &probe).await.map(drop),
        ),
        (
            "Deployments",
            scope.list::<Deployment>(client, &probe).await.map(drop),
        ),
        ("Pods", scope.list::<Pod>(client, &probe).await.map(drop)),
        (
            "ConfigMaps",
            scope.list::<ConfigMap>(client, &probe).await.map(drop),
        ),
        (
            "Services",
            scope.list::<Service>(client, &probe).await.map(drop),
        ),
        (
            "PodDisruptionBudgets",
            scope
                .list::<PodDisruptionBudget>(client, &probe)
                .await
                .map(drop),
        ),
    ];
    for (kind, result) in lists {
        match result {
            Ok(()) => {}
            Err(kube::Error::Api(status))
                if status.code == 404 && matches!(kind, "TaskTypes" | "WorkerPools") =>
            {
                anyhow::bail!(
                    "the TaskType and WorkerPool CRDs are not installed: kubectl apply -f crds/"
                )
            }
            Err(kube::Error::Api(status)) if status.code == 403 => anyhow::bail!(
                "may not list {kind} in scope {:?}: {}; give the operator the chart's roles \
                 for that scope (watchNamespaces), or --watch-namespaces the namespaces its \
                 Roles cover",
                scope.describe(),
                status.message
            ),
            Err(err) => return Err(err).with_context(|| format!("listing {kind}")),
        }
    }
    Ok(())
}
