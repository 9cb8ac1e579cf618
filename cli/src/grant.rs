//! `conveyorctl grant -n NS`: least-privilege credentials for one namespace's workers
//! (decision 0013), printed as the `conveyor-connections` Secret their pods read, so that
//! `conveyorctl grant -n video | kubectl apply -f -` is the one command. With
//! `--component gateway|operator`, the same for the components in conveyor-system
//! (decision 0015).
//!
//! - PostgreSQL: role `conveyor-NS`, which reads and changes only NS's rows (row-level
//!   security) and cannot insert or delete tasks.
//! - RabbitMQ: user `conveyor-NS`, which may consume, declare and publish to only NS's
//!   queues and exchanges (`conveyor.NS.…`); messages go through each type's own exchange,
//!   so it cannot put one into another namespace's queue.

use anyhow::Context;
use conveyor_core::db::{ComponentRole, TenantRole};
use conveyor_core::urls::with_params;
use conveyor_operator::rabbitmq::ManagementApi;
use reqwest::Url;

use crate::Direct;

/// The workers' connection URLs for one namespace, and the CA they verify the servers with
/// (put in the Secret, where the operator mounts it for the pods).
pub struct Granted {
    pub database_url: String,
    pub amqp_url: String,
    pub ca: Option<String>,
}

/// Points the URLs' CA parameters at the CA the pods get mounted
/// (`sslmode=verify-full&sslrootcert=…`, `cacertfile=…` on `amqps://`).
pub fn with_pod_ca(granted: Granted, ca_pem: String) -> anyhow::Result<Granted> {
    let mounted = format!(
        "{}/{}",
        conveyor_operator::build::WORKER_CA_DIR,
        conveyor_operator::build::WORKER_CA_KEY
    );
    let database_url = with_params(
        &granted.database_url,
        &[("sslmode", "verify-full"), ("sslrootcert", &mounted)],
    )?;
    let every_node_tls = conveyor_core::amqp::node_urls(&granted.amqp_url)
        .iter()
        .all(|url| url.starts_with("amqps://"));
    let amqp_url = if every_node_tls {
        each_node(&granted.amqp_url, |url| {
            Ok(with_params(url, &[("cacertfile", &mounted)])?)
        })?
    } else {
        anyhow::bail!("--worker-ca needs an amqps:// broker URL")
    };
    Ok(Granted {
        database_url,
        amqp_url,
        ca: Some(ca_pem),
    })
}

pub async fn grant(
    direct: &Direct,
    management: &ManagementApi,
    database_url: &str,
    namespace: &str,
) -> anyhow::Result<Granted> {
    let role = TenantRole::new(namespace).map_err(anyhow::Error::msg)?;
    direct
        .db
        .grant_tenant(&role)
        .await
        .context("creating the namespace's database role (the admin role needs CREATEROLE)")?;
    let user = role.name();
    management
        .put_user(user, role.password(), "")
        .await
        .context("creating the namespace's broker user")?;
    let own = format!(r"^conveyor\.{namespace}\.");
    management
        .put_permissions(user, &own, &own, &own)
        .await
        .context("setting the broker user's permissions")?;
    Ok(Granted {
        database_url: with_credentials(database_url, user, role.password())?,
        amqp_url: amqp_with_credentials(&direct.amqp_url, user, role.password())?,
        ca: None,
    })
}

/// Withdraws what `grant` made for a namespace: the database role (in this database) and
/// the broker user. Returns whether the role existed.
pub async fn revoke(
    direct: &Direct,
    management: &ManagementApi,
    namespace: &str,
) -> anyhow::Result<bool> {
    let role = TenantRole::new(namespace).map_err(anyhow::Error::msg)?;
    let existed = direct
        .db
        .revoke_tenant(namespace)
        .await
        .context("removing the namespace's database role")?;
    management
        .delete_user(role.name())
        .await
        .context("removing the namespace's broker user")?;
    Ok(existed)
}

/// The components that run with credentials of their own, in conveyor-system.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Component {
    /// A database role that owns nothing and cannot rewrite the audit log, and a broker
    /// user that declares and publishes only `conveyor.` queues, without the management API.
    Gateway,
    /// A broker user (policymaker) for `conveyor.` queues and policies; the operator holds
    /// no database credentials.
    Operator,
}

impl Component {
    /// The Secret the component's Deployment reads (`manifests/base`).
    pub fn secret(self) -> &'static str {
        match self {
            Component::Gateway => "conveyor-gateway-connections",
            Component::Operator => "conveyor-operator-connections",
        }
    }

    /// Its role and user name unless `--role` gives one; `_` cannot be in a namespace, so
    /// it never meets a tenant's `conveyor-<namespace>`.
    pub fn default_role(self) -> &'static str {
        match self {
            Component::Gateway => conveyor_core::db::DEFAULT_GATEWAY_ROLE,
            Component::Operator => "conveyor_operator",
        }
    }
}

/// Every `conveyor.` queue and exchange: the components serve every tenant.
const ALL_QUEUES: &str = r"^conveyor\.";
/// Writes to those and to the default exchange: RabbitMQ lets a queue whose dead-letter
/// exchange is the default one (every work and retry queue) be declared only by a user who
/// may write to it. The components declare queues; a tenant's workers do not.
const DECLARE_ALL_QUEUES: &str = r"^(amq\.default|conveyor\..*)$";

/// Makes (or re-keys) the component's role and user; returns the Secret's entries.
pub async fn grant_component(
    component: Component,
    role: &str,
    direct: &Direct,
    management: &ManagementApi,
    management_url: &str,
    database_url: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    match component {
        Component::Gateway => {
            let role = ComponentRole::new(role).map_err(anyhow::Error::msg)?;
            direct.db.grant_gateway(&role).await.context(
                "creating the gateway's database role (the admin role needs CREATEROLE; run \
                 `conveyorctl migrate` first)",
            )?;
            let (user, password) = (role.name(), role.password());
            management
                .put_user(user, password, "")
                .await
                .context("creating the gateway's broker user")?;
            management
                .put_permissions(user, ALL_QUEUES, DECLARE_ALL_QUEUES, ALL_QUEUES)
                .await
                .context("setting the gateway's broker permissions")?;
            Ok(vec![
                (
                    "database-url".to_owned(),
                    with_credentials(database_url, user, password)?,
                ),
                (
                    "amqp-url".to_owned(),
                    amqp_with_credentials(&direct.amqp_url, user, password)?,
                ),
            ])
        }
        Component::Operator => {
            let user = ComponentRole::new(role).map_err(anyhow::Error::msg)?;
            let (user, password) = (user.name(), user.password());
            management
                .put_user(user, password, "policymaker")
                .await
                .context("creating the operator's broker user")?;
            management
                .put_permissions(user, ALL_QUEUES, DECLARE_ALL_QUEUES, ALL_QUEUES)
                .await
                .context("setting the operator's broker permissions")?;
            Ok(vec![
                (
                    "amqp-url".to_owned(),
                    amqp_with_credentials(&direct.amqp_url, user, password)?,
                ),
                (
                    "rabbitmq-management-url".to_owned(),
                    management_url.to_owned(),
                ),
                ("rabbitmq-user".to_owned(), user.to_owned()),
                ("rabbitmq-password".to_owned(), password.to_owned()),
                // The key of each pool's worker admin token (`/drain` needs it).
                ("admin-key".to_owned(), conveyor_core::secrets::random()),
            ])
        }
    }
}

/// `url` with another user and password: the workers reach the same servers as the admin.
fn with_credentials(url: &str, user: &str, password: &str) -> anyhow::Result<String> {
    let mut url = Url::parse(url).context("the admin connection URL")?;
    let scheme = url.scheme().to_owned();
    let refused = || anyhow::anyhow!("cannot put credentials into a {scheme} URL");
    url.set_username(user).map_err(|()| refused())?;
    url.set_password(Some(password)).map_err(|()| refused())?;
    Ok(url.to_string())
}

/// An AMQP setting (one URL per node) with another user and password on every node.
fn amqp_with_credentials(setting: &str, user: &str, password: &str) -> anyhow::Result<String> {
    each_node(setting, |url| with_credentials(url, user, password))
}

/// An AMQP setting with `change` applied to each node's URL.
fn each_node(
    setting: &str,
    change: impl Fn(&str) -> anyhow::Result<String>,
) -> anyhow::Result<String> {
    let urls = conveyor_core::amqp::node_urls(setting)
        .into_iter()
        .map(change)
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(urls.join(","))
}

/// The vhost an AMQP setting names (`/%2f` is `/`; none is `/`); the first node's, as every
/// node of a cluster serves the same vhosts.
pub fn vhost_of(amqp_setting: &str) -> anyhow::Result<String> {
    let first = conveyor_core::amqp::node_urls(amqp_setting)
        .first()
        .copied()
        .context("the AMQP URL is empty")?;
    let url = Url::parse(first).context("the AMQP URL")?;
    let path = url.path().trim_start_matches('/');
    Ok(if path.is_empty() {
        "/".to_owned()
    } else {
        path.replace("%2f", "/").replace("%2F", "/")
    })
}

/// The Secret the operator's pods read (`--connection-secret`, default
/// `conveyor-connections`).
pub fn secret_yaml(namespace: &str, name: &str, granted: &Granted) -> String {
    let mut entries = vec![
        ("database-url".to_owned(), granted.database_url.clone()),
        ("amqp-url".to_owned(), granted.amqp_url.clone()),
    ];
    if let Some(ca) = &granted.ca {
        entries.push((
            conveyor_operator::build::WORKER_CA_KEY.to_owned(),
            ca.clone(),
        ));
    }
    secret_yaml_of(namespace, name, &entries)
}

/// A Secret of `stringData` entries, multi-line values as literal blocks.
pub fn secret_yaml_of(namespace: &str, name: &str, entries: &[(String, String)]) -> String {
    let mut yaml = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: {namespace}\n\
         stringData:\n"
    );
    for (key, value) in entries {
        if value.contains('\n') {
            yaml.push_str(&format!("  {key}: |\n"));
            for line in value.lines() {
                yaml.push_str(&format!("    {line}\n"));
            }
        } else {
            yaml.push_str(&format!("  {key}: {value}\n"));
        }
    }
    yaml
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_swapped_and_the_rest_kept() {
        let url = with_credentials(
            "postgres://conveyor:conveyor@db.example:5432/conveyor?sslmode=verify-full&sslrootcert=/ca.crt",
            "conveyor-video",
            "abc123",
        )
        .unwrap();
        assert_eq!(
            url,
            "postgres://conveyor-video:abc123@db.example:5432/conveyor?sslmode=verify-full&sslrootcert=/ca.crt"
        );
        let amqp = with_credentials(
            "amqps://conveyor:conveyor@127.0.0.1:5671/%2f?cacertfile=/ca.crt",
            "u",
            "p",
        )
        .unwrap();
        assert_eq!(amqp, "amqps://u:p@127.0.0.1:5671/%2f?cacertfile=/ca.crt");
        // A cluster: every node's URL gets them.
        let nodes = amqp_with_credentials("amqps://a:b@n1:5671/v, amqps://a:b@n2:5671/v", "u", "p")
            .unwrap();
        assert_eq!(nodes, "amqps://u:p@n1:5671/v,amqps://u:p@n2:5671/v");
        assert_eq!(vhost_of("amqps://n1/%2f,amqps://n2/%2f").unwrap(), "/");
    }

    #[test]
    fn a_worker_ca_goes_into_the_secret_and_the_urls_name_its_mount() {
        let granted = Granted {
            database_url: "postgres://u:p@db:5432/conveyor?sslmode=require&application_name=w"
                .to_owned(),
            amqp_url: "amqps://u:p@mq:5671/%2f?heartbeat=10&cacertfile=/host/ca.crt".to_owned(),
            ca: None,
        };
        let pem = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let granted = with_pod_ca(granted, pem.to_owned()).unwrap();
        let mounted = "%2Fvar%2Frun%2Fconveyor%2Ftls%2Fca.crt";
        assert_eq!(
            granted.database_url,
            format!(
                "postgres://u:p@db:5432/conveyor?application_name=w&sslmode=verify-full\
                 &sslrootcert={mounted}"
            )
        );
        assert_eq!(
            granted.amqp_url,
            format!("amqps://u:p@mq:5671/%2f?heartbeat=10&cacertfile={mounted}")
        );
        let secret: serde_yaml::Value =
            serde_yaml::from_str(&secret_yaml("video", "conveyor-connections", &granted)).unwrap();
        assert_eq!(secret["stringData"]["ca.crt"].as_str(), Some(pem));
        assert_eq!(
            secret["stringData"]["database-url"].as_str(),
            Some(granted.database_url.as_str())
        );
        let plain = Granted {
            amqp_url: "amqp://u:p@mq/%2f".to_owned(),
            ..granted
        };
        assert!(with_pod_ca(plain, pem.to_owned()).is_err());
    }
}
