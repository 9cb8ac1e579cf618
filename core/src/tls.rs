//! Which certificate authorities the clients trust (decision 0014).
//!
//! Each protocol names its CA the way its users already know:
//! - PostgreSQL: libpq's URL parameters, `sslmode=verify-full&sslrootcert=/path/ca.crt`
//!   (sqlx reads them; nothing here).
//! - AMQP: `amqps://…?cacertfile=/path/ca.crt`, the parameter RabbitMQ's own clients take.
//! - HTTPS (the management API, the gateway): `--ca-file` / `CONVEYOR_CA_FILE`.
//!
//! Without one, the public web PKI roots are trusted. Certificates are read when a
//! connection is made, so a renewed CA file takes effect on the next reconnect.

use std::path::{Path, PathBuf};

use clap::Args;

/// Each message holds its cause (which is therefore not a `source` too).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the CA file {path}: {cause}")]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("the CA file {path} holds no PEM certificate")]
    Empty { path: PathBuf },
    #[error("the CA file {path} is not valid PEM: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

/// Reads a PEM bundle, refusing a file without a certificate in it (a key, a typo'd path
/// to an empty file): trusting nothing extra by accident shows up later as a vaguer error.
pub fn read_ca(path: &Path) -> Result<String, TlsError> {
    let pem = std::fs::read_to_string(path).map_err(|cause| TlsError::Read {
        path: path.to_owned(),
        cause,
    })?;
    if !pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(TlsError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(pem)
}

/// The CA an `amqps://` URL names in its `cacertfile` parameter, read; `None` when it
/// names none (the public roots are trusted then).
pub fn amqp_ca(url: &str) -> Result<Option<String>, TlsError> {
    url_ca(url, "cacertfile")
}

/// The CA file a URL names in its query parameter `param`, read.
pub fn url_ca(url: &str, param: &str) -> Result<Option<String>, TlsError> {
    crate::urls::query_param(url, param)
        .map(|path| read_ca(Path::new(&path)))
        .transpose()
}

/// The CA HTTPS clients trust beside the public roots.
#[derive(Debug, Clone, Default, Args)]
pub struct CaArgs {
    /// PEM file of the CA that signed the HTTPS servers Conveyor calls (the RabbitMQ
    /// management API, the gateway), trusted beside the public roots.
    #[arg(long = "ca-file", env = "CONVEYOR_CA_FILE", global = true)]
    pub ca_file: Option<PathBuf>,
}

impl CaArgs {
    /// The roots, read now, so that a bad path fails at start and not at the first call.
    pub fn roots(&self) -> Result<TrustedRoots, TlsError> {
        match &self.ca_file {
            None => Ok(TrustedRoots::default()),
            Some(path) => TrustedRoots::from_file(path),
        }
    }
}

/// Extra roots for HTTPS clients, cheap to clone.
#[derive(Clone, Default)]
pub struct TrustedRoots(Vec<reqwest::Certificate>);

impl TrustedRoots {
    pub fn from_file(path: &Path) -> Result<Self, TlsError> {
        let pem = read_ca(path)?;
        reqwest::Certificate::from_pem_bundle(pem.as_bytes())
            .map(TrustedRoots)
            .map_err(|err| TlsError::Invalid {
                path: path.to_owned(),
                reason: err.to_string(),
            })
    }

    /// A client builder that trusts these roots (and the public ones).
    pub fn client_builder(&self) -> reqwest::ClientBuilder {
        self.0
            .iter()
            .cloned()
            .fold(reqwest::Client::builder(), |builder, cert| {
                builder.add_root_certificate(cert)
            })
    }
}

impl std::fmt::Debug for TrustedRoots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TrustedRoots({} extra)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_amqp_url_without_cacertfile_trusts_the_public_roots() {
        assert!(amqp_ca("amqps://u:p@host:5671/%2f?heartbeat=5")
            .expect("no CA")
            .is_none());
        assert!(amqp_ca("amqp://u:p@host/%2f").expect("no CA").is_none());
    }

    #[test]
    fn a_missing_or_empty_ca_file_is_a_clear_error() {
        let err = amqp_ca("amqps://h/%2f?heartbeat=5&cacertfile=/nonexistent/ca.crt")
            .expect_err("missing file");
        assert!(err.to_string().contains("/nonexistent/ca.crt"), "{err}");
        let empty = std::env::temp_dir().join(format!("empty-ca-{}.pem", std::process::id()));
        std::fs::write(&empty, "not a certificate").expect("write");
        let url = format!("amqps://h/%2f?cacertfile={}", empty.display());
        assert!(matches!(amqp_ca(&url), Err(TlsError::Empty { .. })));
        let _ = std::fs::remove_file(empty);
    }

    #[test]
    fn cacertfile_is_percent_decoded() {
        let err = amqp_ca("amqps://h/%2f?cacertfile=%2Fnonexistent%2Fca.crt").expect_err("missing");
        assert!(err.to_string().contains("/nonexistent/ca.crt"), "{err}");
    }
}
