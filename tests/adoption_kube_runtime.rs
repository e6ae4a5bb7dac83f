//! A kube-runtime operator fenced in a few lines (issue 35): two replicas of the elector
//! crate's sample operator (elector/examples/fenced_operator.rs: `run_while_leading` around its
//! `Controller`, writes through `fenced_client`) play the frozen-leader story of
//! tests/common/samples.rs against the real API server and the real fencing webhook.

use fencedlease_testkit as common;

#[tokio::test]
async fn a_frozen_leaders_stamped_write_is_refused_and_the_new_leaders_lands() {
    let bin = common::example_bin("fenced_operator");
    common::samples::frozen_leader_story(&bin, "kube-runtime").await;
}
