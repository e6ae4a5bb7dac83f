//! Fencing hole 3: a write must present its token itself. The token stored on the object by an
//! earlier write (kubectl label, annotate, edit, a tool or code path that does not stamp) does
//! not count: an update passes only with a new `fencedlease.io/write-id` beside the token. The
//! story is shared with policy mode (`tests/common/stories.rs`, `tests/fencing_policy.rs`).

use fencedlease_testkit as common;

use common::fencing::Protected;

#[tokio::test]
async fn hole_3_an_update_that_does_not_present_a_token_is_refused_though_the_object_carries_the_current_one(
) {
    let p = Protected::new("hole3", false).await;
    common::stories::a_write_must_present_its_token(&p).await;
}
