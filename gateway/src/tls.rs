//! HTTPS for the API: rustls, with the certificate re-read from its files while serving
//! (cert-manager and Kubernetes Secret volumes replace them in place), and handshakes done
//! beside the accept loop so that a slow or silent client delays only itself.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Longest a client may take to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; connections past this are closed unanswered.
const MAX_HANDSHAKES: usize = 1024;

/// Where the gateway's certificate and key are, and how often they are checked for a
/// replacement.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    pub reload_every: Duration,
}

/// Each message holds its cause (which is therefore not a `source` too).
#[derive(Debug, thiserror::Error)]
pub enum TlsServeError {
    #[error("cannot read the certificate {path}: {cause}")]
    Cert {
        path: PathBuf,
        cause: rustls::pki_types::pem::Error,
    },
    #[error("cannot read the private key {path}: {cause}")]
    Key {
        path: PathBuf,
        cause: rustls::pki_types::pem::Error,
    },
    #[error("the certificate {cert} and the key {key} cannot be used: {cause}")]
    Unusable {
        cert: PathBuf,
        key: PathBuf,
        cause: rustls::Error,
    },
}

/// Reads and checks the pair: the chain is not empty and the key is the leaf's.
fn load(files: &TlsFiles) -> Result<CertifiedKey, TlsServeError> {
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|cause| TlsServeError::Cert {
            path: files.cert.clone(),
            cause,
        })?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|cause| TlsServeError::Key {
        path: files.key.clone(),
        cause,
    })?;
    let unusable = |cause| TlsServeError::Unusable {
        cert: files.cert.clone(),
        key: files.key.clone(),
        cause,
    };
    if chain.is_empty() {
        return Err(unusable(rustls::Error::NoCertificatesPresented));
    }
    let signer = rustls::crypto::ring::sign::any_supported_type(&key).map_err(unusable)?;
    let certified = CertifiedKey::new(chain, signer);
    certified.keys_match().map_err(unusable)?;
    Ok(certified)
}

/// Modification times of the pair; a change means "read them again".
fn stamp(files: &TlsFiles) -> Option<(SystemTime, SystemTime)> {
    let modified = |path: &PathBuf| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    Some((modified(&files.cert)?, modified(&files.key)?))
}

/// Serves whichever certificate was read last.
#[derive(Debug)]
struct ReloadingCert {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .map_or_else(|p| p.into_inner().clone(), |c| c.clone()),
        )
    }
}

/// The server side of TLS: a rustls configuration whose certificate follows its files.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: TlsAcceptor,
}

impl ServerTls {
    /// Reads the pair (an unusable pair fails the start) and keeps re-reading it every
    /// `reload_every` until `shutdown`. A replacement that cannot be used is logged and the
    /// certificate in service stays.
    pub fn start(files: TlsFiles, shutdown: CancellationToken) -> Result<Self, TlsServeError> {
        let mut seen = stamp(&files);
        let resolver = Arc::new(ReloadingCert {
            current: RwLock::new(Arc::new(load(&files)?)),
        });
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|cause| TlsServeError::Unusable {
            cert: files.cert.clone(),
            key: files.key.clone(),
            cause,
        })?
        .with_no_client_auth()
        .with_cert_resolver(resolver.clone());
        // The API speaks HTTP/1.1 only.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(files.reload_every) => {}
                }
                let now = stamp(&files);
                if now == seen {
                    continue;
                }
                match load(&files) {
                    Ok(certified) => {
                        *resolver.current.write().unwrap_or_else(|p| p.into_inner()) =
                            Arc::new(certified);
                        seen = now;
                        tracing::info!(cert = %files.cert.display(), "serving the renewed certificate");
                    }
                    // Possibly half-written (the certificate replaced before its key): try
                    // again at the next check, and keep serving the old pair meanwhile.
                    Err(err) => tracing::warn!(error = %err,
                        "the replaced certificate cannot be used yet; serving the previous one"),
                }
            }
        });
        Ok(ServerTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// `listener`, answering in TLS.
    pub fn listen(&self, listener: TcpListener) -> std::io::Result<TlsListener> {
        let local = listener.local_addr()?;
        let (sender, incoming) = mpsc::channel(64);
        tokio::spawn(accept_loop(listener, self.acceptor.clone(), sender));
        Ok(TlsListener { incoming, local })
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    sender: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let accepted = tokio::select! {
            // The server stopped taking connections.
            _ = sender.closed() => return,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of descriptors, most likely: let some close before trying again.
                tracing::warn!(error = %err, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = handshakes.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "too many TLS handshakes in progress; connection closed");
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let sender = sender.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => {
                    let _ = sender.send((tls, peer)).await;
                }
                // A client that does not trust us, or a port scanner: theirs to report.
                Ok(Err(err)) => tracing::debug!(%peer, error = %err, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
            drop(permit);
        });
    }
}

/// Connections whose handshake is done, for `axum::serve`.
pub struct TlsListener {
    incoming: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.incoming.recv().await {
            Some(connection) => connection,
            // The accept loop ended, which it does only once this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
