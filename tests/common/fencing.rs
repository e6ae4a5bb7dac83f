//! Helpers for the fencing tests: a held lease, moving it, and fenced or unfenced writes that
//! report the API server's refusal as (code, message); the stage they play on, guarded by the
//! webhook or by the fencing policy.

use std::fmt::Debug;
use std::time::Duration;

use fencedlease::api::{FencedLease, FencedLeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde::de::DeserializeOwned;

use super::apiproxy::ApiProxy;
use super::policy::PolicyFence;
use super::webhook::{Webhook, WebhookOpts};
use super::TestNamespace;

pub const LEASE: &str = "fencedlease.io/lease";
pub const TOKEN: &str = "fencedlease.io/token";
pub const UID: &str = "fencedlease.io/lease-uid";
pub const WRITE_ID: &str = "fencedlease.io/write-id";
pub const DELETE_INTENT: &str = "fencedlease.io/delete-intent";

/// A lease's token and uid as a holder knows them.
#[derive(Clone, Debug)]
pub struct Held {
    pub token: i64,
    pub uid: String,
}

/// Creates lease `name` held by `holder`.
pub async fn held_lease(client: &Client, ns: &str, name: &str, holder: &str) -> Held {
    held_lease_for(client, ns, name, holder, None).await
}

/// Creates lease `name` held by `holder`, for `seconds` (None: the CRD's default).
pub async fn held_lease_for(
    client: &Client,
    ns: &str,
    name: &str,
    holder: &str,
    seconds: Option<i32>,
) -> Held {
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some(holder.into());
    if let Some(s) = seconds {
        spec.lease_duration_seconds = s;
    }
    let l = Api::<FencedLease>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &FencedLease::new(name, spec))
        .await
        .unwrap_or_else(|e| panic!("creating lease {ns}/{name}: {e}"));
    Held {
        token: l.token().expect("generation"),
        uid: l.metadata.uid.clone().expect("uid"),
    }
}

/// Creates lease `name`, held by nobody.
pub async fn free_lease(client: &Client, ns: &str, name: &str) -> Held {
    let l = Api::<FencedLease>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &FencedLease::new(name, FencedLeaseSpec::free()),
        )
        .await
        .unwrap_or_else(|e| panic!("creating lease {ns}/{name}: {e}"));
    Held {
        token: l.token().expect("generation"),
        uid: l.metadata.uid.clone().expect("uid"),
    }
}

/// Hands lease `name` to `holder` (a spec write: the token goes up).
pub async fn move_lease(client: &Client, ns: &str, name: &str, holder: &str) -> Held {
    let api = Api::<FencedLease>::namespaced(client.clone(), ns);
    let patch = serde_json::json!({"spec": {"holderIdentity": holder}});
    let l = api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("moving lease {ns}/{name} to {holder}: {e}"));
    Held {
        token: l.token().expect("generation"),
        uid: l.metadata.uid.clone().expect("uid"),
    }
}

/// The annotations a writer presents: its token, the lease uid and a new write id.
pub fn stamp(h: &Held) -> serde_json::Value {
    serde_json::json!({TOKEN: h.token.to_string(), UID: h.uid, WRITE_ID: super::new_write_id()})
}

/// A refusal as the API server answered it.
pub type Refused = (u16, String);

fn refusal(e: kube::Error) -> Refused {
    match e {
        kube::Error::Api(s) => (s.code, s.message),
        other => (0, other.to_string()),
    }
}

/// A merge patch; the refusal if any.
pub async fn merge<K>(api: &Api<K>, name: &str, patch: serde_json::Value) -> Result<K, Refused>
where
    K: Clone + DeserializeOwned + Debug,
{
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(refusal)
}

/// A fenced merge patch: `patch` plus the writer's stamp.
pub async fn fenced_merge<K>(
    api: &Api<K>,
    name: &str,
    h: &Held,
    mut patch: serde_json::Value,
) -> Result<K, Refused>
where
    K: Clone + DeserializeOwned + Debug,
{
    patch["metadata"]["annotations"] = stamp(h);
    merge(api, name, patch).await
}

/// The stamp of an update that announces a delete: the delete intent is its own write id.
pub fn announcing(h: &Held) -> serde_json::Value {
    let mut s = stamp(h);
    s[DELETE_INTENT] = s[WRITE_ID].clone();
    s
}

/// Announces a delete of `name` under `h` (a fenced merge patch); the refusal if any.
pub async fn announce_delete<K>(api: &Api<K>, name: &str, h: &Held) -> Result<K, Refused>
where
    K: Clone + DeserializeOwned + Debug,
{
    merge(
        api,
        name,
        serde_json::json!({"metadata": {"annotations": announcing(h)}}),
    )
    .await
}

/// A delete, as it is sent (no announcement); the refusal if any.
pub async fn delete<K>(api: &Api<K>, name: &str) -> Result<(), Refused>
where
    K: Clone + DeserializeOwned + Debug,
{
    api.delete(name, &Default::default())
        .await
        .map(|_| ())
        .map_err(refusal)
}

/// The holder's delete: announced under `h`, then sent.
pub async fn fenced_delete<K>(api: &Api<K>, name: &str, h: &Held) -> Result<(), Refused>
where
    K: Clone + DeserializeOwned + Debug,
{
    announce_delete(api, name, h).await?;
    delete(api, name).await
}

/// Creates an object from JSON; the refusal if any.
pub async fn create<K>(api: &Api<K>, obj: serde_json::Value) -> Result<K, Refused>
where
    K: Clone + DeserializeOwned + Debug + serde::Serialize,
{
    let o: K = serde_json::from_value(obj).expect("object literal");
    api.create(&PostParams::default(), &o)
        .await
        .map_err(refusal)
}

/// Metadata of an object protected by `lease`, stamped by `h`.
pub fn protected_meta(name: &str, lease: &str, h: &Held) -> serde_json::Value {
    serde_json::json!({"name": name, "labels": {LEASE: lease}, "annotations": stamp(h)})
}

/// Asserts a refusal with `code` whose message contains `want`.
pub fn assert_refused<K: Debug>(what: &str, r: Result<K, Refused>, code: u16, want: &str) {
    match r {
        Err((c, m)) => assert!(
            c == code && m.contains(want),
            "{what}: want {code} with {want:?}, got {c}: {m}"
        ),
        Ok(o) => panic!("{what}: must be refused ({want:?}), but it was accepted: {o:?}"),
    }
}

/// Who judges the protected writes of a test.
pub enum Guard {
    /// The test's own `fencedlease webhook` (refusals are 403, as the policy's).
    Webhook(Webhook),
    /// The chart's ValidatingAdmissionPolicy and its binding, no webhook and no controller
    /// (refusals are 403).
    Policy(PolicyFence),
}

/// The stage of most fencing tests: a namespace of the test's own with its own guard (a
/// webhook, or the fencing policy), lease "inv" held by pod-a, and ConfigMap "inv" protected by
/// it, created with pod-a's token.
pub struct Protected {
    pub client: Client,
    pub ns: TestNamespace,
    pub wh: Guard,
    pub cms: Api<ConfigMap>,
    pub a: Held,
    /// With `through_proxy`: the proxy between the webhook and the API server.
    pub proxy: Option<ApiProxy>,
    /// Policy mode with the controller stopped once lease "inv" is listed.
    stopped: bool,
}

impl Protected {
    /// Guarded by the webhook.
    pub async fn new(name: &str, through_proxy: bool) -> Protected {
        let client = super::client().await;
        super::ensure_crd();
        let ns = TestNamespace::new(&client, name).await;
        let dir = super::procs::scratch_dir(name);
        let proxy = through_proxy.then(|| ApiProxy::start(&dir));
        let opts = WebhookOpts {
            kubeconfig: proxy.as_ref().map(|p| p.kubeconfig.clone()),
            ..Default::default()
        };
        let wh = Webhook::start_with(&client, &dir, &ns.name, opts).await;
        Protected::stage(client, ns, Guard::Webhook(wh), proxy).await
    }

    /// Guarded by the fencing policy (policy mode), with no webhook at all.
    pub async fn with_policy(name: &str) -> Protected {
        let client = super::client().await;
        super::ensure_crd();
        let ns = TestNamespace::new(&client, name).await;
        let dir = super::procs::scratch_dir(name);
        let policy = PolicyFence::start(&client, &dir, &ns.name).await;
        Protected::stage(client, ns, Guard::Policy(policy), None).await
    }

    /// Guarded by the policy, with the controller stopped once lease "inv" is listed: the API
    /// server alone judges what follows (a lease a story creates starts the controller until it
    /// is listed, [`Protected::judges`]).
    pub async fn with_policy_stopped(name: &str) -> Protected {
        let mut p = Protected::with_policy(name).await;
        p.policy().stop_controller();
        p.stopped = true;
        p
    }

    async fn stage(
        client: Client,
        ns: TestNamespace,
        guard: Guard,
        proxy: Option<ApiProxy>,
    ) -> Protected {
        // Policy mode runs a controller (it keeps the lease index), which would revoke a lease
        // nobody renews once its duration ran out: an hour outlasts any story.
        let seconds = matches!(guard, Guard::Policy(_)).then_some(3600);
        let a = held_lease_for(&client, &ns.name, "inv", "pod-a", seconds).await;
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
        let p = Protected {
            client,
            ns,
            wh: guard,
            cms,
            a,
            proxy,
            stopped: false,
        };
        p.judges("inv").await;
        let cm = serde_json::json!({"metadata": protected_meta("inv", "inv", &p.a), "data": {"by": "a"}});
        create(&p.cms, cm)
            .await
            .expect("A creates the object with its token");
        p
    }

    pub fn proxy(&self) -> &ApiProxy {
        self.proxy.as_ref().expect("started with through_proxy")
    }

    /// The webhook (panics in policy mode).
    pub fn webhook(&self) -> &Webhook {
        match &self.wh {
            Guard::Webhook(w) => w,
            Guard::Policy(_) => panic!("this test runs in policy mode: no webhook"),
        }
    }

    /// The fencing policy (panics with the webhook).
    pub fn policy(&self) -> &PolicyFence {
        match &self.wh {
            Guard::Policy(p) => p,
            Guard::Webhook(_) => panic!("this test runs with the webhook: no policy"),
        }
    }

    pub fn policy_mode(&self) -> bool {
        matches!(self.wh, Guard::Policy(_))
    }

    /// The HTTP status of a fencing refusal under this guard: the same in both modes.
    pub fn code(&self) -> u16 {
        fencedlease::stamp::REFUSAL_CODE
    }

    /// Waits until writes labelled for `lease` are judged (at once with the webhook; in policy
    /// mode once the API server's view of the FencedLeases has the lease).
    /// In policy mode with the controller stopped ([`Protected::with_policy_stopped`]), the
    /// controller runs only until it has listed the lease: a new lease is refused until listed.
    pub async fn judges(&self, lease: &str) {
        if self.policy_mode() {
            if self.stopped {
                self.policy().start_controller();
            }
            super::policy::wait_judged(
                &self.client,
                &self.ns.name,
                lease,
                std::time::Duration::from_secs(30),
            )
            .await;
            if self.stopped {
                self.policy().stop_controller();
            }
        }
    }

    /// Waits until the guard sees `h` as the current token of lease "inv": a server-side dry
    /// run of a create stamped with it is allowed. The webhook reads the lease afresh, so at
    /// once; the policy judges on the API server's informer's view of the lease, which follows
    /// the lease a little behind (the book, docs/src/policy-mode.md).
    pub async fn sees(&self, h: &Held) {
        let cms = self.cms.clone();
        let what = format!("the guard to see token {} of lease inv", h.token);
        super::eventually(std::time::Duration::from_secs(10), &what, || async {
            let probe: ConfigMap = serde_json::from_value(
                serde_json::json!({"metadata": protected_meta("sees-probe", "inv", h)}),
            )
            .ok()?;
            let dry = PostParams {
                dry_run: true,
                ..Default::default()
            };
            cms.create(&dry, &probe).await.ok().map(|_| ())
        })
        .await;
    }
}

/// Does `act`, then follows lease `name` on a watch from just before it until its holder
/// satisfies `until`; returns the holders seen in order (None: free). A handover by release
/// shows a None before the new holder; a takeover after expiry does not. The 30 s ceiling only
/// stops a hung test.
pub async fn holders_until(
    api: &Api<FencedLease>,
    name: &str,
    until: impl Fn(Option<&str>) -> bool,
    act: impl std::future::Future<Output = ()>,
) -> Vec<Option<String>> {
    use futures::{StreamExt, TryStreamExt};
    use kube::api::{WatchEvent, WatchParams};
    let from = api
        .get(name)
        .await
        .expect("the lease")
        .metadata
        .resource_version
        .expect("a resourceVersion");
    let wp = WatchParams::default().fields(&format!("metadata.name={name}"));
    let mut events = api
        .watch(&wp, &from)
        .await
        .expect("watch the lease")
        .boxed();
    act.await;
    let follow = async {
        let mut seen = Vec::new();
        while let Some(ev) = events.try_next().await.expect("the lease's watch") {
            if let WatchEvent::Modified(l) | WatchEvent::Added(l) = ev {
                let h = l.holder().map(str::to_string);
                let done = until(h.as_deref());
                seen.push(h);
                if done {
                    return seen;
                }
            }
        }
        panic!("the lease's watch ended first: holders seen {seen:?}")
    };
    tokio::time::timeout(Duration::from_secs(30), follow)
        .await
        .unwrap_or_else(|_| panic!("lease {name} never reached the awaited holder (30 s ceiling)"))
}
