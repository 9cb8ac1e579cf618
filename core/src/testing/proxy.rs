//! A TCP proxy tests put between a client and a service, to break the link on purpose:
//! `cut` drops every connection and refuses new ones (a service gone, with resets);
//! `black_hole` keeps connections open but forwards nothing (a link gone silent, no reset:
//! only heartbeats notice); `restore` heals both.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pass,
    Cut,
    BlackHole,
}

pub struct Proxy {
    pub port: u16,
    mode: watch::Sender<Mode>,
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
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn({
            let mode = mode.clone();
            let connections = connections.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    if *mode.borrow() == Mode::Cut {
                        continue; // dropped: the client sees its connection closed
                    }
                    let relay = tokio::spawn(relay(client, upstream, mode.subscribe()));
                    let mut all = connections.lock().unwrap_or_else(|p| p.into_inner());
                    all.retain(|r| !r.is_finished());
                    all.push(relay);
                }
            }
        });
        Proxy {
            port,
            mode,
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

/// Copies both ways while the mode is Pass; holds (reads nothing) while it is BlackHole.
async fn relay(mut client: TcpStream, upstream: SocketAddr, mut mode: watch::Receiver<Mode>) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        if *mode.borrow_and_update() == Mode::BlackHole {
            if mode.changed().await.is_err() {
                return;
            }
            continue;
        }
        tokio::select! {
            read = client_read.read(&mut up) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => if server_write.write_all(&up[..n]).await.is_err() { return },
            },
            read = server_read.read(&mut down) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => if client_write.write_all(&down[..n]).await.is_err() { return },
            },
            changed = mode.changed() => if changed.is_err() { return },
        }
    }
}
