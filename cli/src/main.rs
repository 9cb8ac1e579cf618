//! `conveyorctl`: submit and inspect tasks through the gateway; redrive and audit queries
//! against the broker and the database directly.

mod adopt;
mod grant;
mod redrive;

use anyhow::{bail, Context};
use chrono::{DateTime, Utc};
use clap::{Parser, Subcommand};
use conveyor_core::amqp::Publisher;
use conveyor_core::config::{AmqpArgs, DatabaseArgs, Secret};
use conveyor_core::db::Db;
use conveyor_core::task::TaskEvent;
use conveyor_core::tls::CaArgs;
use conveyor_operator::rabbitmq::ManagementArgs;
use uuid::Uuid;

#[derive(Debug, Parser)]
#[command(
    name = "conveyorctl",
    version,
    about = "Command-line client for Conveyor"
)]
struct Cli {
    /// Gateway base URL.
    #[arg(
        long,
        global = true,
        env = "CONVEYOR_GATEWAY_URL",
        default_value = "https://127.0.0.1:8080"
    )]
    gateway: String,
    /// Bearer token for the gateway (never printed).
    #[arg(long, global = true, env = "CONVEYOR_TOKEN", hide_env_values = true)]
    token: Option<Secret<String>>,
    /// The namespace (tenant) of the task type: sent to the gateway, and part of the type's
    /// key (`<namespace>.<type>`) for the commands that go to the database and broker. Leave
    /// it out for task types from a file (tenant `default`).
    #[arg(long, short = 'n', global = true, env = "CONVEYOR_NAMESPACE")]
    namespace: Option<String>,
    #[command(flatten)]
    ca: CaArgs,
    #[command(subcommand)]
    command: Command,
}

/// The database and broker, for the commands that work on them directly.
pub struct Direct {
    pub db: Db,
    pub amqp_url: String,
    pub publisher: Publisher,
}

impl Direct {
    fn connect(database: &DatabaseArgs, amqp: &AmqpArgs) -> anyhow::Result<Direct> {
        Ok(Direct {
            db: Db::connect(&database.options())?,
            amqp_url: amqp.connection_url(),
            publisher: Publisher::new(amqp.connection_url(), "conveyorctl", amqp.confirm_timeout()),
        })
    }
}

impl Cli {
    /// --namespace, which this command needs: `what` says what it is for.
    fn namespace(&self, what: &str) -> anyhow::Result<&str> {
        match &self.namespace {
            Some(namespace) => Ok(namespace),
            None => bail!("give --namespace: {what}"),
        }
    }

    /// The database, the broker and its management API, as their administrator: what
    /// `grant` and `revoke` work with.
    fn administer(
        &self,
        database: &DatabaseArgs,
        amqp: &AmqpArgs,
        management: &ManagementArgs,
    ) -> anyhow::Result<(Direct, conveyor_operator::rabbitmq::ManagementApi)> {
        let direct = Direct::connect(database, amqp)?;
        let roots = self.ca.roots()?;
        let api = management.api(&grant::vhost_of(&amqp.connection_url())?, &roots)?;
        Ok((direct, api))
    }

    /// What the type's queues and rows are keyed by (`NamedTaskType::name`).
    fn type_key(&self, task_type: &str) -> String {
        match &self.namespace {
            Some(namespace) => format!("{namespace}.{task_type}"),
            None => task_type.to_owned(),
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Submit one task.
    Submit {
        /// Task type.
        #[arg(long = "type")]
        task_type: String,
        /// JSON payload.
        #[arg(long, default_value = "{}")]
        payload: String,
        /// Idempotency key (UUID); the same key twice gives the same task.
        #[arg(long)]
        idempotency_key: Option<Uuid>,
    },
    /// Show a task's current record.
    Get { id: Uuid },
    /// Show a task's audit timeline as a table.
    Events { id: Uuid },
    /// Move dead-lettered tasks from the remediation queue back to the work queue.
    Redrive {
        #[arg(long = "type")]
        task_type: String,
        /// Most tasks to redrive.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// Who redrives, for the audit log.
        #[arg(long, env = "USER", default_value = "conveyorctl")]
        by: String,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        amqp: AmqpArgs,
    },
    /// Move a task type from before tenancy (queues `conveyor.<type>`, rows of tenant
    /// `default`) into the namespace of its TaskType (--namespace): rows, waiting and
    /// dead-lettered tasks, then the old queues are deleted. Apply the TaskType first.
    Adopt {
        #[arg(long = "type")]
        task_type: String,
        /// Who adopts, for the audit log.
        #[arg(long, env = "USER", default_value = "conveyorctl")]
        by: String,
        /// Tasks read and re-published at a time.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
        page_size: i64,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        amqp: AmqpArgs,
    },
    /// Least-privilege credentials for the workers of --namespace: a database role that sees
    /// only its rows and a broker user that reads only its queues. Prints the
    /// `conveyor-connections` Secret for them: `conveyorctl -n NS grant | kubectl apply -f -`.
    /// With --component, the credentials of the gateway or the operator instead, as the
    /// Secret its Deployment reads in --namespace (default conveyor-system).
    Grant {
        /// Name of the Secret printed (default: conveyor-connections, the operator's
        /// --connection-secret; conveyor-<component>-connections with --component).
        #[arg(long)]
        secret: Option<String>,
        /// Credentials for a component that serves every tenant, not a namespace's workers.
        #[arg(long, value_enum, conflicts_with = "worker_ca")]
        component: Option<grant::Component>,
        /// The component's role and user name (default conveyor_gateway or
        /// conveyor_operator): one per Conveyor sharing a database server or broker.
        #[arg(long, requires = "component")]
        role: Option<String>,
        /// PEM CA that signed the database's and broker's certificates, for the pods: put in
        /// the Secret as `ca.crt`, which the operator mounts, and named by the URLs.
        #[arg(long)]
        worker_ca: Option<std::path::PathBuf>,
        #[command(flatten)]
        management: ManagementArgs,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        amqp: AmqpArgs,
    },
    /// Withdraws the credentials `grant` made for --namespace: its database role and its
    /// broker user (the broker disconnects workers still running with them; their database
    /// sessions may do nothing more).
    Revoke {
        #[command(flatten)]
        management: ManagementArgs,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        amqp: AmqpArgs,
    },
    /// Applies the database migrations this build holds, as the tables' owner (the gateway
    /// does it at start unless its role owns nothing: --no-migrate).
    Migrate {
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Point in time: the state of tasks at a timestamp, rebuilt from the audit log.
    StateAt {
        /// RFC 3339 timestamp, e.g. 2026-11-29T14:05:00Z.
        #[arg(long)]
        at: DateTime<Utc>,
        /// Every task of this type (prints counts per state).
        #[arg(long = "type", conflicts_with = "id")]
        task_type: Option<String>,
        /// One task.
        #[arg(long)]
        id: Option<Uuid>,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Audit-log retention: drop daily partitions older than --keep-days.
    Retention {
        #[arg(long)]
        keep_days: i32,
        #[command(flatten)]
        database: DatabaseArgs,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(&cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("conveyorctl: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: &Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Submit {
            task_type,
            payload,
            idempotency_key,
        } => {
            let payload: serde_json::Value =
                serde_json::from_str(payload).context("--payload is not JSON")?;
            let mut request =
                http(cli)?
                    .post(format!("{}/v1/tasks", cli.gateway))
                    .json(&serde_json::json!({
                        "taskType": task_type,
                        "namespace": cli.namespace,
                        "payload": payload,
                    }));
            if let Some(key) = idempotency_key {
                request = request.header("Idempotency-Key", key.to_string());
            }
            print_json(request.send().await?).await?;
        }
        Command::Get { id } => {
            let request = http(cli)?.get(format!("{}/v1/tasks/{id}", cli.gateway));
            print_json(request.send().await?).await?;
        }
        Command::Events { id } => {
            let response = http(cli)?
                .get(format!("{}/v1/tasks/{id}/events", cli.gateway))
                .send()
                .await?;
            let body = checked(response).await?;
            let events: Vec<TaskEvent> = serde_json::from_value(body["events"].clone())?;
            print!("{}", events_table(&events));
        }
        Command::Redrive {
            task_type,
            limit,
            by,
            database,
            amqp,
        } => {
            let direct = Direct::connect(database, amqp)?;
            let report = redrive::redrive(&direct, &cli.type_key(task_type), *limit, by).await?;
            println!(
                "redriven: {}  returned (still waiting): {}  stale messages dropped: {}  kept parked: {}",
                report.redriven, report.returned, report.stale, report.kept
            );
        }
        Command::Adopt {
            task_type,
            by,
            page_size,
            database,
            amqp,
        } => {
            let namespace = cli.namespace("the namespace of the TaskType that adopts it")?;
            let direct = Direct::connect(database, amqp)?;
            let report = adopt::adopt(&direct, task_type, namespace, by, *page_size).await?;
            println!(
                "rows moved: {}  waiting tasks re-published: {}  dead-lettered tasks parked again: {}",
                report.moved, report.requeued, report.parked
            );
        }
        Command::Grant {
            secret,
            component: Some(component),
            role,
            management,
            database,
            amqp,
            ..
        } => {
            let namespace = cli.namespace.as_deref().unwrap_or("conveyor-system");
            let (direct, api) = cli.administer(database, amqp, management)?;
            let entries = grant::grant_component(
                *component,
                role.as_deref().unwrap_or(component.default_role()),
                &direct,
                &api,
                &management.management_url,
                &database.options().url,
            )
            .await?;
            let secret = secret.as_deref().unwrap_or(component.secret());
            print!("{}", grant::secret_yaml_of(namespace, secret, &entries));
        }
        Command::Grant {
            secret,
            component: None,
            worker_ca,
            management,
            database,
            amqp,
            ..
        } => {
            let namespace = cli.namespace("the namespace whose workers get the credentials")?;
            let (direct, management) = cli.administer(database, amqp, management)?;
            let mut granted =
                grant::grant(&direct, &management, &database.options().url, namespace).await?;
            if let Some(path) = worker_ca {
                let pem = conveyor_core::tls::read_ca(path)?;
                granted = grant::with_pod_ca(granted, pem)?;
            }
            let secret = secret.as_deref().unwrap_or("conveyor-connections");
            print!("{}", grant::secret_yaml(namespace, secret, &granted));
        }
        Command::Revoke {
            management,
            database,
            amqp,
        } => {
            let namespace = cli.namespace("the namespace whose credentials are withdrawn")?;
            let (direct, management) = cli.administer(database, amqp, management)?;
            let existed = grant::revoke(&direct, &management, namespace).await?;
            println!(
                "namespace {namespace}: {}",
                if existed {
                    "database role and broker user removed"
                } else {
                    "no database role (broker user removed if there was one)"
                }
            );
        }
        Command::Migrate { database } => {
            let db = Db::connect(&database.options())?;
            db.migrate()
                .await
                .context("migrating the task database (as the tables' owner)")?;
            println!("the task database holds every migration of this build");
        }
        Command::StateAt {
            at,
            task_type,
            id,
            database,
        } => {
            if task_type.is_none() && id.is_none() {
                bail!("give --type or --id");
            }
            let db = Db::connect(&database.options())?;
            let key = task_type.as_deref().map(|t| cli.type_key(t));
            let states = db.states_at(*at, key.as_deref(), *id).await?;
            if id.is_some() {
                for (id, state, since) in &states {
                    println!("{id}  {state}  since {}", since.to_rfc3339());
                }
                if states.is_empty() {
                    println!("the task did not exist at {}", at.to_rfc3339());
                }
            } else {
                let mut counts = std::collections::BTreeMap::new();
                for (_, state, _) in &states {
                    *counts.entry(state.as_str()).or_insert(0u64) += 1;
                }
                println!("{:<14} {:>10}", "STATE", "TASKS");
                for (state, n) in counts {
                    println!("{state:<14} {n:>10}");
                }
            }
        }
        Command::Retention {
            keep_days,
            database,
        } => {
            let db = Db::connect(&database.options())?;
            db.ensure_partitions().await?;
            let dropped = db.drop_partitions(*keep_days).await?;
            println!(
                "dropped {} partition(s): {}",
                dropped.len(),
                dropped.join(", ")
            );
        }
    }
    Ok(())
}

fn http(cli: &Cli) -> anyhow::Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(token) = &cli.token {
        let value = format!("Bearer {}", token.expose());
        let mut value = reqwest::header::HeaderValue::from_str(&value).context("token")?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    Ok(cli
        .ca
        .roots()?
        .client_builder()
        .default_headers(headers)
        .build()?)
}

async fn checked(response: reqwest::Response) -> anyhow::Result<serde_json::Value> {
    let status = response.status();
    let body: serde_json::Value = response
        .json()
        .await
        .context("gateway answer is not JSON")?;
    if !status.is_success() {
        bail!(
            "{status}: {} ({})",
            body["error"]["message"].as_str().unwrap_or("error"),
            body["error"]["code"].as_str().unwrap_or("?")
        );
    }
    Ok(body)
}

async fn print_json(response: reqwest::Response) -> anyhow::Result<()> {
    let body = checked(response).await?;
    println!("{}", serde_json::to_string_pretty(&body)?);
    Ok(())
}

/// The audit timeline, one transition per line.
fn events_table(events: &[TaskEvent]) -> String {
    let mut out = format!(
        "{:<30} {:<14} {:<14} {:>7}  {:<24} {}\n",
        "TIME", "FROM", "TO", "ATTEMPT", "WORKER", "DETAIL"
    );
    for e in events {
        out.push_str(&format!(
            "{:<30} {:<14} {:<14} {:>7}  {:<24} {}\n",
            e.at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            e.from_state.map(|s| s.as_str()).unwrap_or("-"),
            e.to_state.as_str(),
            e.attempt,
            e.worker_id.as_deref().unwrap_or("-"),
            e.detail.as_deref().unwrap_or(""),
        ));
    }
    out
}
