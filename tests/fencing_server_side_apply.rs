//! Server-side apply (what `kubectl apply --server-side`, Flux and Argo CD's SSA mode send) is
//! fenced like any other write: the webhook judges the object the apply would store, so an
//! apply presents a token only when the applied configuration carries one, with a new write id.
//! The story is shared with policy mode (`tests/common/stories.rs`, `tests/fencing_policy.rs`).

use fencedlease_testkit as common;

use common::fencing::Protected;

#[tokio::test]
async fn server_side_apply_is_fenced_like_any_write() {
    let p = Protected::new("ssa", false).await;
    common::stories::server_side_apply_is_fenced(&p).await;
}
