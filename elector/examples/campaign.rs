//! A minimal kube-rs program that campaigns for a FencedLease and prints its token whenever its
//! leadership changes, until Ctrl-C (then it releases the lease).
//!
//! ```sh
//! cargo run -p fencedlease-elector --example campaign -- NAMESPACE LEASE IDENTITY
//! ```
//!
//! Run two or three with different identities on the same lease: one leads; stop it and
//! another leads with a larger token. The lease is created (15 s) if it does not exist; the
//! FencedLease CRD must be installed.

use fencedlease_elector::{Elector, ElectorConfig, LeaderState};
use tokio::time::Instant;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(namespace), Some(lease), Some(identity)) = (args.next(), args.next(), args.next())
    else {
        return Err("usage: campaign NAMESPACE LEASE IDENTITY".into());
    };
    let client = kube::Client::try_default().await?;
    let mut cfg = ElectorConfig::new(namespace, lease, identity);
    cfg.create_with_duration = Some(15);
    let (elector, handle) = Elector::new(client, cfg)?;
    // The elector campaigns until Ctrl-C, then releases the lease if it holds it.
    let campaign = tokio::spawn(elector.run(async {
        let _ = tokio::signal::ctrl_c().await;
    }));

    // Renewals update `valid_until` on the channel too: print only what changed in substance.
    let mut state = handle.state.clone();
    let mut last = String::new();
    loop {
        let line = {
            let current = state.borrow_and_update();
            // leading_token checks valid_until: a claim that ran out counts as none.
            match (&*current, current.leading_token(Instant::now())) {
                (_, Some(token)) => format!("leading with token {token}"),
                (LeaderState::Following { holder, token }, None) => {
                    format!("following: holder {holder:?}, token {token:?}")
                }
                _ => "not leading".to_string(),
            }
        };
        if line != last {
            println!("{line}");
            last = line;
        }
        if state.changed().await.is_err() {
            break; // the elector stopped
        }
    }
    campaign.await??;
    Ok(())
}
