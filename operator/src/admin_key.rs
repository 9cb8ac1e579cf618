//! The key every pool's worker admin token derives from (decision 0046). Given
//! (`--admin-key`), it is used as it is; otherwise the operator makes one, once, and keeps it
//! in a Secret of its own namespace, so that every replica and every restart derives the same
//! tokens (a new key would roll every pool) and no worker's `/drain` is ever left open.

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use kube::Client;

/// The Secret holding a made key, in the operator's namespace.
pub const SECRET: &str = "conveyor-operator-admin-key";
/// Its key.
const KEY: &str = "admin-key";

/// `given` when set, else the key of [`SECRET`] in `namespace`, made when there is none.
pub async fn ensure(
    client: &Client,
    namespace: &str,
    given: Option<&str>,
) -> anyhow::Result<String> {
    if let Some(key) = given.filter(|k| !k.is_empty()) {
        return Ok(key.to_owned());
    }
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    if let Some(key) = read(&secrets).await? {
        return Ok(key);
    }
    let made = conveyor_core::secrets::random();
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(SECRET.to_owned()),
            labels: Some(
                [(
                    "app.kubernetes.io/part-of".to_owned(),
                    "conveyor".to_owned(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        string_data: Some([(KEY.to_owned(), made.clone())].into()),
        ..Default::default()
    };
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            tracing::info!(secret = SECRET, namespace, "made the workers' admin key");
            Ok(made)
        }
        // Another replica made it first: its key is the one.
        Err(kube::Error::Api(status)) if status.code == 409 => read(&secrets)
            .await?
            .ok_or_else(|| anyhow::anyhow!("{SECRET} exists but holds no {KEY}")),
        Err(err) => Err(anyhow::Error::new(err).context(format!(
            "making Secret {namespace}/{SECRET} for the workers' admin key (give the operator \
             --admin-key, or the chart's roles: create and get secrets in its namespace)"
        ))),
    }
}

async fn read(secrets: &Api<Secret>) -> anyhow::Result<Option<String>> {
    let Some(secret) = secrets.get_opt(SECRET).await.map_err(|err| {
        anyhow::Error::new(err).context(format!("reading Secret {SECRET} (the workers' admin key)"))
    })?
    else {
        return Ok(None);
    };
    let key = secret
        .data
        .as_ref()
        .and_then(|data| data.get(KEY))
        .map(|bytes| String::from_utf8_lossy(&bytes.0).trim().to_owned())
        .filter(|key| !key.is_empty());
    match key {
        Some(key) => Ok(Some(key)),
        None => {
            anyhow::bail!("Secret {SECRET} holds no {KEY}: delete it, and the operator makes one")
        }
    }
}
