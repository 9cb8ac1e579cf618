//! A TCP proxy tests put between a client and a service, to break the link on purpose:
//! `cut` drops every connection and refuses new ones (a service gone, with resets);
//! `black_hole` keeps connections open but forwards nothing (a link gone silent, no reset:
//! only heartbeats notice); `delay` holds every chunk a while (a slow link); `reset_after`
//! resets one connection right after it forwards a chosen request (a reset at COMMIT: the
//! server acts on it, the client never hears); `restore` heals all but the last.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
    mode: watch::Sender<Mode>,
    trap: Arc<Trap>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let port = listener.local_addr().expect("local address").port();
        let (mode, _) = watch::channel(Mode::Pass);
        let trap: Arc<Trap> = Arc::default();
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn({
            let mode = mode.clone();
            let trap = trap.clone();
            let connections = connections.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    if *mode.borrow() == Mode::Cut {
                        continue; // dropped: the client sees its connection closed
                    }
                    let relay =
                        tokio::spawn(relay(client, upstream, mode.subscribe(), trap.clone()));
                    let mut all = connections.lock().unwrap_or_else(|p| p.into_inner());
                    all.retain(|r| !r.is_finished());
                    all.push(relay);
                }
            }
        });
        Proxy {
            port,
            mode,
            trap,
            connections,
            accept,
        }
    }

    /// Drops every connection and refuses new ones.
    pub fn cut(&self) {
        self.mode.send_replace(Mode::Cut);
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

/// Copies both ways while the mode lets it; holds (reads nothing) while it is BlackHole.
async fn relay(
    mut client: TcpStream,
    upstream: SocketAddr,
    mut mode: watch::Receiver<Mode>,
    trap: Arc<Trap>,
) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        let current = *mode.borrow_and_update();
        if current == Mode::BlackHole {
            if mode.changed().await.is_err() {
                return;
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
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    hold().await;
                    if server_write.write_all(&up[..n]).await.is_err() { return }
                    if trap.springs_on(&up[..n]) { break }
                }
            },
            read = server_read.read(&mut down) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    hold().await;
                    if client_write.write_all(&down[..n]).await.is_err() { return }
                }
            },
            changed = mode.changed() => if changed.is_err() { return },
        }
    }
    // Sprung: the client gets a reset (linger 0) at once; the server gets a moment to act
    // on the request, then a plain close, so the request usually takes effect unheard.
    let _ = client.set_zero_linger();
    drop(client);
    tokio::time::sleep(Duration::from_millis(50)).await;
}
