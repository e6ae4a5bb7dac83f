//! A TCP proxy between one test process (the webhook, say) and the test API server, which can
//! freeze the connections open now (as a watch that dies silently looks from the client) or cut
//! every connection (a network partition from the API server, one way).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Open,
    /// Connections numbered below this forward nothing more (held open); newer ones forward.
    Freeze(u64),
    /// Every connection is closed and new ones are closed at once.
    Cut,
}

pub struct ApiProxy {
    pub kubeconfig: PathBuf,
    mode: watch::Sender<Mode>,
    next_id: Arc<AtomicU64>,
    /// Milliseconds by which connections opened from now on delay each answer chunk.
    delay_ms: Arc<AtomicU64>,
}

impl ApiProxy {
    /// Starts the proxy on its own thread (so that blocking calls in a test do not stall it)
    /// and writes a kubeconfig through it into `dir`.
    pub fn start(dir: &Path) -> ApiProxy {
        let kc_path = super::kubeconfig_path();
        let kc = std::fs::read_to_string(&kc_path).expect("read the test kubeconfig");
        let server = kc
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: https://"))
            .expect("a server: https:// line in the kubeconfig")
            .to_string();
        let upstream: SocketAddr = server.parse().expect("the server is an IP:port");
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let port = std_listener.local_addr().expect("addr").port();
        let (mode, rx) = watch::channel(Mode::Open);
        let next_id = Arc::new(AtomicU64::new(0));
        let ids = next_id.clone();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let delay = delay_ms.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("proxy runtime");
            rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener).expect("tokio listener");
                while let Ok((client, _)) = listener.accept().await {
                    let id = ids.fetch_add(1, Ordering::SeqCst);
                    let d = Duration::from_millis(delay.load(Ordering::SeqCst));
                    tokio::spawn(forward(id, client, upstream, rx.clone(), d));
                }
            });
        });
        let kubeconfig = dir.join("kubeconfig-through-proxy");
        let through = kc.replace(
            &format!("server: https://{server}"),
            &format!("server: https://127.0.0.1:{port}"),
        );
        std::fs::write(&kubeconfig, through).expect("write proxied kubeconfig");
        ApiProxy {
            kubeconfig,
            mode,
            next_id,
            delay_ms,
        }
    }

    /// Every connection open now goes silent (its watch sees no more events); new ones work.
    pub fn freeze_open_connections(&self) {
        let below = self.next_id.load(Ordering::SeqCst);
        self.mode.send_replace(Mode::Freeze(below));
    }

    /// Connections opened from now on hold each chunk of the API server's answers for `delay`
    /// (a slow API server: every read takes at least that long).
    pub fn slow_new_connections(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).expect("a delay in milliseconds");
        self.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Closes every connection and refuses new ones.
    pub fn cut(&self) {
        self.mode.send_replace(Mode::Cut);
    }

    /// New connections forward again (frozen ones were closed by `cut`, or stay frozen).
    pub fn restore(&self) {
        self.mode.send_replace(Mode::Open);
    }
}

async fn forward(
    id: u64,
    mut client: TcpStream,
    upstream: SocketAddr,
    mut rx: watch::Receiver<Mode>,
    delay: Duration,
) {
    if *rx.borrow_and_update() == Mode::Cut {
        return;
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let frozen = {
        let copy = copy_both_ways(&mut client, &mut server, delay);
        tokio::pin!(copy);
        loop {
            tokio::select! {
                _ = &mut copy => break false,
                changed = rx.changed() => {
                    if changed.is_err() {
                        break false;
                    }
                    match *rx.borrow_and_update() {
                        Mode::Cut => break false,
                        Mode::Freeze(below) if id < below => break true,
                        _ => {}
                    }
                }
            }
        }
    };
    // Frozen: both sockets stay open and silent until the proxy cuts them.
    if !frozen {
        return;
    }
    while rx.changed().await.is_ok() {
        if *rx.borrow_and_update() == Mode::Cut {
            return;
        }
    }
}

/// Copies both ways until either side is done; with a delay, holds each chunk from the server
/// that long before passing it on.
async fn copy_both_ways(client: &mut TcpStream, server: &mut TcpStream, delay: Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if delay.is_zero() {
        let _ = tokio::io::copy_bidirectional(client, server).await;
        return;
    }
    let (mut client_rd, mut client_wr) = client.split();
    let (mut server_rd, mut server_wr) = server.split();
    let up = tokio::io::copy(&mut client_rd, &mut server_wr);
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match server_rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    tokio::time::sleep(delay).await;
                    if client_wr.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}
