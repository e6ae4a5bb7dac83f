//! The connection gate: slots overall and per peer address, and a bounded queue of
//! connections that wait for one.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::conn::{connection, Ctx};
use super::limits::Limits;

/// The connection slots of each peer address: a semaphore per address, so that a slot given
/// back goes to the connection that has waited longest (tokio's semaphore is fair, and a new
/// connection's `try_acquire` cannot take a slot a waiting one was given).
#[derive(Clone, Debug)]
pub(super) struct PeerSlots {
    max: usize,
    pub(super) peers: Arc<Mutex<HashMap<IpAddr, Arc<Semaphore>>>>,
}

/// A peer's slot, given back when dropped.
pub(super) struct PeerSlot {
    permit: Option<OwnedSemaphorePermit>,
    ip: IpAddr,
    slots: PeerSlots,
}

impl PeerSlots {
    pub(super) fn new(max: usize) -> PeerSlots {
        PeerSlots {
            max,
            peers: Arc::default(),
        }
    }

    /// The semaphore of `ip`, made on first use.
    fn of(&self, ip: IpAddr) -> (IpAddr, Arc<Semaphore>) {
        let ip = ip.to_canonical(); // an IPv4 peer on a dual-stack socket is still that peer
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let max = self.max.min(Semaphore::MAX_PERMITS);
        let sem = peers
            .entry(ip)
            .or_insert_with(|| Arc::new(Semaphore::new(max)));
        (ip, sem.clone())
    }

    fn slot(&self, ip: IpAddr, permit: OwnedSemaphorePermit) -> PeerSlot {
        PeerSlot {
            permit: Some(permit),
            ip,
            slots: self.clone(),
        }
    }

    /// A slot for `ip` now, if one is free and no connection of `ip` waits for one.
    pub(super) fn take(&self, ip: IpAddr) -> Option<PeerSlot> {
        let (ip, sem) = self.of(ip);
        let permit = sem.clone().try_acquire_owned().ok();
        let slot = permit.map(|p| self.slot(ip, p));
        if slot.is_none() {
            self.forget_if_unused(ip, sem);
        }
        slot
    }

    /// A slot for `ip`, waiting (in turn) for one to be given back until `deadline`.
    pub(super) async fn take_by(&self, ip: IpAddr, deadline: Instant) -> Option<PeerSlot> {
        let (ip, sem) = self.of(ip);
        let permit = tokio::time::timeout_at(deadline, sem.clone().acquire_owned()).await;
        match permit {
            Ok(Ok(p)) => Some(self.slot(ip, p)),
            _ => {
                self.forget_if_unused(ip, sem);
                None
            }
        }
    }

    /// Drops `ip`'s semaphore from the map once nobody holds or waits for a slot of it, so
    /// that the map holds only addresses with connections.
    fn forget_if_unused(&self, ip: IpAddr, sem: Arc<Semaphore>) {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        // Two references: the map's and `sem`; a waiter holds a third while it waits.
        if sem.available_permits() == self.max.min(Semaphore::MAX_PERMITS)
            && Arc::strong_count(&sem) == 2
        {
            peers.remove(&ip);
        }
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        // The semaphore outlives the permit: take it before the permit goes.
        let sem = self.permit.as_ref().map(|p| p.semaphore().clone());
        drop(self.permit.take());
        if let Some(sem) = sem {
            self.slots.forget_if_unused(self.ip, sem);
        }
    }
}

/// Where a connection gets its slots: the server's and its peer's.
#[derive(Clone)]
pub(super) struct Gate {
    pub(super) slots: Arc<Semaphore>,
    pub(super) peers: PeerSlots,
    pub(super) wait: Duration,
    pub(super) open: Gauge,
}

impl Gate {
    /// Both slots at once, if both are free.
    fn now(&self, ip: IpAddr) -> Option<Slot> {
        let peer = self.peers.take(ip)?;
        let server = self.slots.clone().try_acquire_owned().ok()?;
        Some(self.slot(server, peer))
    }

    /// Both slots, waiting up to [`Limits::slot_wait`] (the peer's first), or the bound that
    /// stayed full; `Err("shutdown")` if the server stops meanwhile.
    async fn by(&self, ip: IpAddr, stop: &CancellationToken) -> Result<Slot, &'static str> {
        let deadline = Instant::now() + self.wait;
        let take = async {
            let peer = self.peers.take_by(ip, deadline).await.ok_or("peer_full")?;
            let server = tokio::time::timeout_at(deadline, self.slots.clone().acquire_owned())
                .await
                .map_err(|_| "server_full")?
                .map_err(|_| "shutdown")?;
            Ok(self.slot(server, peer))
        };
        tokio::select! {
            biased;
            _ = stop.cancelled() => Err("shutdown"),
            taken = take => taken,
        }
    }

    fn slot(&self, server: OwnedSemaphorePermit, peer: PeerSlot) -> Slot {
        self.open.inc();
        Slot {
            _server: server,
            _peer: peer,
            open: self.open.clone(),
        }
    }
}

/// What one connection holds of the server's capacity, given back when dropped.
pub(super) struct Slot {
    _server: OwnedSemaphorePermit,
    _peer: PeerSlot,
    open: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// The places in the queue for a slot: [`Limits::max_waiting`] in all,
/// [`Limits::max_waiting_per_peer`] for one address.
#[derive(Clone)]
pub(super) struct Queue {
    all: Arc<Semaphore>,
    peers: PeerSlots,
    /// Connections in the queue now (a metric).
    waiting: Gauge,
}

/// A place in the queue, given back when dropped.
pub(super) struct Place {
    _all: OwnedSemaphorePermit,
    _peer: PeerSlot,
    waiting: Gauge,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.waiting.dec();
    }
}

impl Queue {
    pub(super) fn new(limits: &Limits, waiting: Gauge) -> Queue {
        let all = limits.max_waiting.min(Semaphore::MAX_PERMITS);
        Queue {
            all: Arc::new(Semaphore::new(all)),
            peers: PeerSlots::new(limits.max_waiting_per_peer),
            waiting,
        }
    }

    /// A place for a connection of `ip`, if its address and the queue have room.
    fn place(&self, ip: IpAddr) -> Option<Place> {
        let peer = self.peers.take(ip)?;
        let all = self.all.clone().try_acquire_owned().ok()?;
        self.waiting.inc();
        Some(Place {
            _all: all,
            _peer: peer,
            waiting: self.waiting.clone(),
        })
    }
}

/// Serves an accepted connection: at once if both its slots are free; else, if the queue has a
/// place for it, once they are within [`Limits::slot_wait`]; else it is closed.
pub(super) fn admit(
    tcp: TcpStream,
    peer: SocketAddr,
    gate: &Gate,
    queue: &Queue,
    ctx: &Arc<Ctx>,
    stop: CancellationToken,
) {
    if let Some(slot) = gate.now(peer.ip()) {
        tokio::spawn(connection(tcp, peer, ctx.clone(), stop, slot));
        return;
    }
    let Some(place) = queue.place(peer.ip()) else {
        return ctx.metrics.refused("queue_full"); // dropping the connection closes it
    };
    let (gate, ctx) = (gate.clone(), ctx.clone());
    tokio::spawn(async move {
        let slot = gate.by(peer.ip(), &stop).await;
        drop(place);
        match slot {
            Ok(slot) => connection(tcp, peer, ctx, stop, slot).await,
            Err(reason) => ctx.metrics.refused(reason),
        }
    });
}
