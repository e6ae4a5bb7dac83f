//! The one accept loop every server of this binary runs (the webhook's HTTPS server, the admin
//! and probe ports, the sidecar's API and its TLS proxy). Each server brings its own admission
//! step (what bounds it: a connection gate, a slot or a semaphore); the loop brings the rest,
//! the same for all: stop at `stop` (also while an admission step waits), no Nagle delay on
//! answers, and an accept error (out of file descriptors, say) logged and retried after a pause
//! instead of spinning or ending the server.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

/// How long the loop pauses after a failed accept before it tries again.
pub(crate) const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Accepts connections on `listener` until `stop` completes, handing each to `admit`. The loop
/// awaits `admit` before it accepts the next: a step that waits (for a slot, say) leaves the
/// connections behind it in the kernel's listen queue, where they cost this process nothing.
/// A step that serves the connection spawns a task for it and returns.
pub(crate) async fn accept_until<A, F>(
    listener: &TcpListener,
    server: &'static str,
    stop: impl Future<Output = ()>,
    mut admit: A,
) where
    A: FnMut(TcpStream, SocketAddr) -> F,
    F: Future<Output = ()>,
{
    tokio::pin!(stop);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(server, error = %e, "accept failed; retrying");
                    tokio::select! {
                        _ = &mut stop => return,
                        _ = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                    }
                }
            },
        };
        // Every server here answers a client that waits on the answer: no Nagle delay on a
        // reply that goes out in more than one write.
        if let Err(e) = tcp.set_nodelay(true) {
            debug!(server, %peer, error = %e, "could not set TCP_NODELAY");
        }
        tokio::select! {
            _ = &mut stop => return,
            () = admit(tcp, peer) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::{mpsc, Notify};

    use super::*;

    async fn listener() -> (TcpListener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        (l, addr)
    }

    #[tokio::test]
    async fn each_connection_is_admitted_in_turn_with_nodelay_and_stop_ends_the_loop() {
        let (l, addr) = listener().await;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let stop = Arc::new(Notify::new());
        let st = stop.clone();
        let task = tokio::spawn(async move {
            accept_until(&l, "test", st.notified(), |tcp, _| {
                let sent = tx.send(tcp.nodelay().expect("nodelay"));
                async move { sent.expect("the test listens") }
            })
            .await
        });
        for _ in 0..3 {
            let _c = TcpStream::connect(addr).await.expect("connect");
            let nodelay = rx.recv().await.expect("the connection is admitted");
            assert!(nodelay, "TCP_NODELAY is set before the admission step");
        }
        stop.notify_one();
        task.await.expect("the loop ends at stop");
    }

    /// Time is paused: if the loop missed `stop`, the runtime would jump to the guard's end at
    /// once and the test fail, instead of hanging.
    #[tokio::test(start_paused = true)]
    async fn stop_ends_the_loop_while_an_admission_step_waits() {
        let (l, addr) = listener().await;
        let entered = Arc::new(Notify::new());
        let stop = Arc::new(Notify::new());
        let (e, st) = (entered.clone(), stop.clone());
        let task = tokio::spawn(async move {
            accept_until(&l, "test", st.notified(), |_, _| {
                let e = e.clone();
                async move {
                    e.notify_one();
                    std::future::pending::<()>().await // a slot that never frees
                }
            })
            .await
        });
        let _c = TcpStream::connect(addr).await.expect("connect");
        entered.notified().await;
        stop.notify_one();
        let guard = Duration::from_secs(3600);
        let ended = tokio::time::timeout(guard, task).await;
        assert!(
            ended.is_ok(),
            "the loop must end at stop while a step waits"
        );
    }
}
