//! A TCP proxy tests put between a client and a service, to break the link on purpose:
//! `cut` drops every connection and refuses new ones (a service gone, with resets);
//! `black_hole` keeps connections open but forwards nothing (a link gone silent, no reset:
//! only heartbeats notice); `delay` holds every chunk a while (a slow link); `reset_after`
//! resets one connection right after it forwards a chosen request (a reset at COMMIT: the
//! server acts on it, the client never hears); `restore` heals all but the last.
//!
//! `start_postgres_tls` opens PostgreSQL's TLS on both sides (with the dev certificate
//! towards the client, verifying the server against the dev CA), so that `reset_after` can
//! see the statements a TLS link carries.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pass,
    Cut,
    BlackHole,
    Delay(Duration),
}

/// The one-shot trap of `reset_after`, shared by every connection.
#[derive(Default)]
struct Trap {
    armed: Mutex<Option<Vec<u8>>>,
    sprung: AtomicUsize,
}

impl Trap {
    /// Disarms and returns `true` when `chunk` holds the armed pattern.
    fn springs_on(&self, chunk: &[u8]) -> bool {
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        let hit = armed
            .as_deref()
            .is_some_and(|p| !p.is_empty() && chunk.windows(p.len()).any(|w| w == p));
        if hit {
            *armed = None;
            self.sprung.fetch_add(1, Ordering::Relaxed);
        }
        hit
    }
}

pub struct Proxy {
    pub port: u16,
    /// Where new connections go (`point_to` moves it, as a Service's endpoint moves).
    upstream: Arc<Mutex<SocketAddr>>,
    mode: watch::Sender<Mode>,
    trap: Arc<Trap>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

/// What a connection's two ends speak.
#[derive(Clone)]
enum Link {
    /// Bytes, as they come.
    Tcp,
    /// PostgreSQL with TLS opened by the proxy on both sides.
    PostgresTls(postgres_tls::Ends),
}

impl Proxy {
    /// A proxy that forwards bytes as they are (TLS passes through unread).
    pub async fn start(upstream: SocketAddr) -> Proxy {
        Self::start_link(upstream, Link::Tcp).await
    }

    /// A proxy in front of the local PostgreSQL that ends TLS on both sides, so that it
    /// sees (and can trap) the statements: clients must trust the dev CA.
    pub async fn start_postgres_tls(upstream: SocketAddr) -> Proxy {
        Self::start_link(upstream, Link::PostgresTls(postgres_tls::Ends::dev())).await
    }

    async fn start_link(upstream: SocketAddr, link: Link) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let port = listener.local_addr().expect("local address").port();
        let (mode, _) = watch::channel(Mode::Pass);
        let trap: Arc<Trap> = Arc::default();
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let upstream = Arc::new(Mutex::new(upstream));
        let accept = tokio::spawn({
            let upstream = upstream.clone();
            let mode = mode.clone();
            let trap = trap.clone();
            let connections = connections.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    if *mode.borrow() == Mode::Cut {
                        continue; // dropped: the client sees its connection closed
                    }
                    let to = *upstream.lock().unwrap_or_else(|p| p.into_inner());
                    let relay = tokio::spawn(connect(
                        client,
                        to,
                        link.clone(),
                        mode.subscribe(),
                        trap.clone(),
                    ));
                    let mut all = connections.lock().unwrap_or_else(|p| p.into_inner());
                    all.retain(|r| !r.is_finished());
                    all.push(relay);
                }
            }
        });
        Proxy {
            port,
            upstream,
            mode,
            trap,
            connections,
            accept,
        }
    }

    /// Drops every connection and refuses new ones.
    pub fn cut(&self) {
        self.mode.send_replace(Mode::Cut);
        self.drop_connections();
    }

    /// Sends new connections to `upstream` and drops those open to the old one: an
    /// address that moves to a new server (a Service whose endpoint moved to a promoted
    /// standby), as clients of the old one find out.
    pub fn point_to(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap_or_else(|p| p.into_inner()) = upstream;
        self.drop_connections();
    }

    fn drop_connections(&self) {
        let mut all = self.connections.lock().unwrap_or_else(|p| p.into_inner());
        for relay in all.drain(..) {
            relay.abort();
        }
    }

    /// Keeps every connection open but lets no byte through, either way.
    pub fn black_hole(&self) {
        self.mode.send_replace(Mode::BlackHole);
    }

    /// Holds every chunk, both ways, for `latency` before forwarding it.
    pub fn delay(&self, latency: Duration) {
        self.mode.send_replace(Mode::Delay(latency));
    }

    /// Arms a one-shot trap: the next client chunk containing `pattern` is forwarded, and
    /// then its connection is reset (both sides) before any answer comes back.
    pub fn reset_after(&self, pattern: &[u8]) {
        *self.trap.armed.lock().unwrap_or_else(|p| p.into_inner()) = Some(pattern.to_vec());
    }

    /// How many connections `reset_after` has reset so far.
    pub fn resets(&self) -> usize {
        self.trap.sprung.load(Ordering::Relaxed)
    }

    pub fn restore(&self) {
        self.mode.send_replace(Mode::Pass);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// Opens the upstream link, and relays until either end closes or the trap springs.
async fn connect(
    client: TcpStream,
    upstream: SocketAddr,
    link: Link,
    mode: watch::Receiver<Mode>,
    trap: Arc<Trap>,
) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    match link {
        Link::Tcp => {
            if let Some((client, server)) = relay(client, server, mode, trap).await {
                spring(client, server).await;
            }
        }
        Link::PostgresTls(ends) => {
            let Some((client, server)) = ends.open(client, server).await else {
                return;
            };
            if let Some((client, server)) = relay(client, server, mode, trap).await {
                let (client, _session) = client.into_inner();
                spring(client, server).await;
            }
        }
    }
}

/// Sprung: the client gets a reset (linger 0) at once; the server gets a moment to act on
/// the request, then a plain close, so the request usually takes effect unheard.
async fn spring<S>(client: TcpStream, server: S) {
    let _ = client.set_zero_linger();
    drop(client);
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(server);
}

/// Copies both ways while the mode lets it; holds (reads nothing) while it is BlackHole.
/// Returns both ends when the trap sprang (the caller resets the client, then closes the
/// server).
async fn relay<C, S>(
    client: C,
    server: S,
    mut mode: watch::Receiver<Mode>,
    trap: Arc<Trap>,
) -> Option<(C, S)>
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        let current = *mode.borrow_and_update();
        if current == Mode::BlackHole {
            if mode.changed().await.is_err() {
                return None;
            }
            continue;
        }
        let hold = || async move {
            if let Mode::Delay(latency) = current {
                tokio::time::sleep(latency).await;
            }
        };
        tokio::select! {
            read = client_read.read(&mut up) => match read {
                Ok(0) | Err(_) => return None,
                Ok(n) => {
                    hold().await;
                    if server_write.write_all(&up[..n]).await.is_err() { return None }
                    let _ = server_write.flush().await;
                    if trap.springs_on(&up[..n]) { break }
                }
            },
            read = server_read.read(&mut down) => match read {
                Ok(0) | Err(_) => return None,
                Ok(n) => {
                    hold().await;
                    if client_write.write_all(&down[..n]).await.is_err() { return None }
                    let _ = client_write.flush().await;
                }
            },
            changed = mode.changed() => if changed.is_err() { return None },
        }
    }
    Some((
        client_read.unsplit(client_write),
        server_read.unsplit(server_write),
    ))
}

/// PostgreSQL's TLS: the client asks with an SSLRequest before the handshake, and so does
/// the proxy towards the server.
mod postgres_tls {
    use std::sync::Arc;

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio_rustls::{client, server, TlsAcceptor, TlsConnector};

    use crate::testing::{DEV_CA, DEV_SERVER_CERT, DEV_SERVER_KEY};

    /// The 8 bytes of an SSLRequest: length 8, code 80877103.
    const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 4, 210, 22, 47];

    #[derive(Clone)]
    pub struct Ends {
        acceptor: TlsAcceptor,
        connector: TlsConnector,
    }

    impl Ends {
        /// The dev certificate towards clients; the server verified against the dev CA.
        pub fn dev() -> Ends {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let chain = CertificateDer::pem_file_iter(DEV_SERVER_CERT)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .expect("the dev server certificate (scripts/services.sh makes it)");
            let key = PrivateKeyDer::from_pem_file(DEV_SERVER_KEY).expect("the dev server key");
            let server = rustls::ServerConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key))
                .expect("a TLS server configuration");
            let mut roots = rustls::RootCertStore::empty();
            for ca in CertificateDer::pem_file_iter(DEV_CA).expect("the dev CA") {
                roots
                    .add(ca.expect("a CA certificate"))
                    .expect("a usable CA");
            }
            let client = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_root_certificates(roots)
                .with_no_client_auth();
            Ends {
                acceptor: TlsAcceptor::from(Arc::new(server)),
                connector: TlsConnector::from(Arc::new(client)),
            }
        }

        /// Answers the client's SSLRequest and asks the server's; `None` when either side
        /// does not go along.
        pub async fn open(
            &self,
            mut client: TcpStream,
            mut server: TcpStream,
        ) -> Option<(server::TlsStream<TcpStream>, client::TlsStream<TcpStream>)> {
            let mut request = [0u8; 8];
            client.read_exact(&mut request).await.ok()?;
            if request != SSL_REQUEST {
                return None; // a plaintext client: the server would refuse it too
            }
            server.write_all(&SSL_REQUEST).await.ok()?;
            let mut answer = [0u8; 1];
            server.read_exact(&mut answer).await.ok()?;
            if answer != *b"S" {
                return None;
            }
            client.write_all(b"S").await.ok()?;
            let client = self.acceptor.accept(client).await.ok()?;
            let name = ServerName::try_from("127.0.0.1").ok()?;
            let server = self.connector.connect(name, server).await.ok()?;
            Some((client, server))
        }
    }
}
