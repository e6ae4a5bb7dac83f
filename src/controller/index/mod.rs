//! Policy mode's lease index: the names of each namespace's FencedLeases, in an annotation of the
//! namespace ([`LEASE_INDEX_ANNOTATION`], `/a/b/`), kept by the active controller.
//!
//! The chart's one fencing binding judges a write by the lease its label names, one parameter
//! per lease of the namespace; a write naming a lease that does not exist finds no parameter
//! and nothing refuses it. The chart's index policy closes that: it refuses a labelled write
//! whose lease the index does not list (the API server reads namespaces from its own cache, so
//! the check costs one string search per write). A lag in listing a new lease refuses its
//! writes until it is listed (retry). A lag in dropping a deleted lease would admit, so a lease
//! is listed only once it carries [`LEASE_INDEX_FINALIZER`]: deleting it then only marks it (the
//! API server raises its generation, so every token it handed out is stale) and it stays, judged
//! as before, until the controller has written an index without it; only then does the
//! controller take the finalizer off. A controller that is down holds deletions, never opens a
//! window. Only the controller may change the annotation (the chart's guard), and it writes on
//! the version it read, so that a write of an earlier term cannot put back a name it dropped.
//! In webhook mode ([`Role::Release`]) the controller writes no index and takes the finalizer
//! off every lease.

mod leases;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ListParams, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::api::{
    FencedLease, FIELD_MANAGER, INDEX_GUARD_LABEL, LEASE_INDEX_ANNOTATION, LEASE_INDEX_FINALIZER,
};
use leases::{Changed, LeaseNames, Seen};
pub(crate) use leases::{Role, INDEX_MAX_BYTES};

/// How long the index gathers changes before it writes: leases created together make one
/// write per namespace, not one each.
const INDEX_DEBOUNCE: Duration = Duration::from_millis(50);

/// How long a failed write or read waits before the next try; a namespace whose writes keep
/// failing waits twice as long each time, up to [`INDEX_RETRY_MAX`].
const INDEX_RETRY: Duration = Duration::from_secs(1);
const INDEX_RETRY_MAX: Duration = Duration::from_secs(60);

/// How many finalizer patches one namespace's work keeps in flight at once: an upgrade to a
/// release with the finalizer puts it on every lease, and one after another 10,000 leases would
/// hold the namespace's first index back for 10,000 round trips.
const FINALIZER_PATCHES_IN_FLIGHT: usize = 16;

/// How long a namespace waits after its `failures`-th failed write in a row (1, 2, 4 ... 60 s).
fn retry_after(failures: u32) -> Duration {
    let doubled = INDEX_RETRY.saturating_mul(1 << failures.saturating_sub(1).min(6));
    doubled.min(INDEX_RETRY_MAX)
}

/// What the index task works on: the watched namespace (all when `None`), what it does
/// (`role`), and the controller's own election lease (namespace, name), which it leaves alone.
pub(super) struct Scope {
    pub(super) namespace: Option<String>,
    pub(super) role: Role,
    pub(super) own_lease: (String, String),
}

/// Keeps the index of every namespace of `scope`, or only releases the finalizer, until
/// aborted: the active controller runs it for its term.
pub(super) async fn keep_index(client: Client, scope: Scope) {
    let Scope {
        namespace,
        role,
        own_lease,
    } = scope;
    let api: Api<PartialObjectMeta<FencedLease>> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    // Consistent lists (not any_semantic): a relist from a lagging cache could list a lease
    // already deleted, and put it back in the index.
    let events = watcher::watcher(api, watcher::Config::default()).default_backoff();
    futures::pin_mut!(events);
    let mut ix = Indexer::new(client, namespace, role);
    ix.leases = LeaseNames::ignoring(&own_lease.0, &own_lease.1);
    loop {
        let at = ix.flush_at;
        tokio::select! {
            ev = events.next() => match ev {
                Some(Ok(e)) => ix.seen(&e),
                Some(Err(e)) => warn!(error = %e, "watching FencedLeases for the lease index failed; retrying"),
                None => {
                    tracing::error!("the FencedLease watch of the lease index ended: no index is written until the next term");
                    return;
                }
            },
            () = sleep_until(at), if at.is_some() => ix.flush().await,
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at).await;
    }
}

/// The index writer's state for one term.
struct Indexer {
    client: Client,
    namespace: Option<String>,
    role: Role,
    leases: LeaseNames,
    /// How many indexes this term wrote.
    writes: u64,
    /// Namespaces whose index or leases may need work.
    dirty: BTreeSet<String>,
    /// Whether to look for namespaces whose index lists leases this term has not seen.
    sweep: bool,
    flush_at: Option<Instant>,
    /// Namespaces whose last work failed: how many times in a row, and when to try again.
    failing: BTreeMap<String, (u32, Instant)>,
    /// How many names each full namespace's index left out, when last said.
    full: BTreeMap<String, usize>,
    /// Webhook mode: whether another release's policy mode was last seen (said once).
    deferring: bool,
    /// Webhook mode: whether another release runs policy mode, as looked up in this flush (one
    /// look per flush, however many namespaces have leases to release).
    looked: Option<bool>,
}

/// How a namespace's work ended.
enum Settled {
    Done,
    /// Webhook mode, with a release in policy mode: its controller keeps the finalizer.
    Deferred,
}

impl Indexer {
    fn new(client: Client, namespace: Option<String>, role: Role) -> Indexer {
        Indexer {
            client,
            namespace,
            role,
            leases: LeaseNames::default(),
            writes: 0,
            dirty: BTreeSet::new(),
            sweep: false,
            flush_at: None,
            failing: BTreeMap::new(),
            full: BTreeMap::new(),
            deferring: false,
            looked: None,
        }
    }

    fn seen(&mut self, event: &Event<PartialObjectMeta<FencedLease>>) {
        match self.leases.apply(event) {
            Changed::Nothing => return,
            Changed::Namespaces(ns) => self.dirty.extend(ns),
            Changed::Relisted(ns) => {
                self.dirty.extend(ns);
                self.sweep = self.role == Role::Keep;
            }
        }
        // Within the debounce, or sooner if a retry was due sooner; never pushed back.
        let soon = Instant::now() + INDEX_DEBOUNCE;
        self.flush_at = Some(self.flush_at.map_or(soon, |at| at.min(soon)));
    }

    /// Does every dirty namespace's work; what fails is tried again later.
    async fn flush(&mut self) {
        self.flush_at = None;
        self.looked = None;
        if self.sweep {
            match self.indexed_namespaces().await {
                Ok(found) => {
                    self.sweep = false;
                    self.dirty.extend(found);
                }
                Err(e) => {
                    warn!(error = %e, "could not read the namespaces' lease indexes; retrying")
                }
            }
        }
        let now = Instant::now();
        for ns in std::mem::take(&mut self.dirty) {
            if self.failing.get(&ns).is_some_and(|(_, at)| *at > now) {
                self.dirty.insert(ns); // not yet: it failed a moment ago
                continue;
            }
            match self.settle(&ns).await {
                Ok(Settled::Done) => {
                    self.failing.remove(&ns);
                }
                Ok(Settled::Deferred) => {
                    // Looked at again later: the other release may leave policy mode.
                    self.failing.insert(ns.clone(), (0, now + INDEX_RETRY_MAX));
                    self.dirty.insert(ns);
                }
                Err(e) => self.failed(ns, &e),
            }
        }
        // The next try: the soonest a dirty namespace may be tried (a failing one at its time).
        let soonest = Instant::now() + INDEX_RETRY;
        let next = self.dirty.iter().map(|ns| {
            self.failing
                .get(ns)
                .map_or(soonest, |(_, at)| (*at).max(soonest))
        });
        self.flush_at = if self.sweep {
            Some(soonest)
        } else {
            next.min()
        };
    }

    /// Namespace `ns`'s work, in the order that never lists a lease that could vanish unseen:
    /// the finalizer put on new leases, the index written, the finalizer taken off deleted ones.
    async fn settle(&mut self, ns: &str) -> Result<Settled, kube::Error> {
        let plan = self.leases.plan(ns, self.role);
        if self.role == Role::Release
            && !plan.release.is_empty()
            && self.policy_mode_elsewhere().await?
        {
            return Ok(Settled::Deferred);
        }
        self.set_finalizers(ns, &plan.guard, true).await?;
        if plan.write_index {
            self.write(ns).await?;
        }
        self.set_finalizers(ns, &plan.release, false).await?;
        Ok(Settled::Done)
    }

    /// Webhook mode: whether a release runs policy mode in the cluster (its lease index guard
    /// exists). Its controller keeps the finalizer, which this one must then leave alone: taken
    /// off while that controller is down, a deleted lease would vanish while still listed. A
    /// server without admission policies has no policy mode.
    async fn policy_mode_elsewhere(&mut self) -> Result<bool, kube::Error> {
        if let Some(found) = self.looked {
            return Ok(found);
        }
        let api: Api<ValidatingAdmissionPolicy> = Api::all(self.client.clone());
        let guards = ListParams::default()
            .labels(&format!("{INDEX_GUARD_LABEL}=true"))
            .limit(1);
        let found = match api.list_metadata(&guards).await {
            Ok(l) => !l.items.is_empty(),
            Err(kube::Error::Api(s)) if s.code == 404 => false,
            Err(e) => return Err(e),
        };
        if found && !self.deferring {
            info!("a release runs policy mode in this cluster (its lease index guard exists): leaving the finalizer {LEASE_INDEX_FINALIZER} on the leases to its controller");
        }
        self.deferring = found;
        self.looked = Some(found);
        Ok(found)
    }

    /// Counts a failed try at namespace `ns`, says so at the 1st, 2nd, 4th ... in a row, and
    /// keeps it dirty for its next try.
    fn failed(&mut self, ns: String, e: &kube::Error) {
        let count = self.failing.get(&ns).map_or(1, |(n, _)| n + 1);
        let wait = retry_after(count);
        if count.is_power_of_two() {
            warn!(namespace = %ns, error = %e, failures = count, retry_in_s = wait.as_secs(), "could not write the namespace's lease index or its leases' finalizer ({LEASE_INDEX_FINALIZER}): writes naming its new leases are refused, and its deleted leases stay, until it is written (the controller needs get and patch on namespaces and fencedleases; a namespace's annotations may hold 256 KiB in all)");
        }
        self.failing
            .insert(ns.clone(), (count, Instant::now() + wait));
        self.dirty.insert(ns);
    }

    /// Puts the index's finalizer on the leases `names` of `ns` (`on`) or takes it off, up to
    /// [`FINALIZER_PATCHES_IN_FLIGHT`] at once (an upgrade puts it on every lease once), and
    /// records what each answer says. The first error is returned once every patch has ended.
    async fn set_finalizers(
        &mut self,
        ns: &str,
        names: &[String],
        on: bool,
    ) -> Result<(), kube::Error> {
        let api: Api<FencedLease> = Api::namespaced(self.client.clone(), ns);
        let todo: Vec<(String, Seen)> = names
            .iter()
            .filter_map(|n| Some((n.clone(), self.leases.get(ns, n)?.clone())))
            .collect();
        let answers: Vec<_> = futures::stream::iter(todo)
            .map(|(name, seen)| {
                let api = api.clone();
                async move { Self::set_finalizer(&api, ns, &name, seen, on).await }
            })
            .buffer_unordered(FINALIZER_PATCHES_IN_FLIGHT)
            .collect()
            .await;
        let mut first = None;
        for (read, outcome) in answers {
            if let Some(m) = read {
                self.leases.change(&m, true);
            }
            match (outcome, &first) {
                (Ok(()), _) => {}
                (Err(e), None) => first = Some(e),
                (Err(e), Some(_)) => {
                    warn!(namespace = %ns, on, "another of the lease index's finalizer patches failed as well: {e}");
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Puts the index's finalizer on one lease (`on`) or takes it off, on the version last seen
    /// (a merge patch replaces the whole list, so it must not overwrite anyone else's change); a
    /// conflict reads the lease again and tries once more. Gives the lease's metadata as last
    /// read or written, if any (none: nothing to do, or the lease is gone), to record even when
    /// the patch then failed, and how the patch ended.
    async fn set_finalizer(
        api: &Api<FencedLease>,
        ns: &str,
        name: &str,
        mut seen: Seen,
        on: bool,
    ) -> (
        Option<PartialObjectMeta<FencedLease>>,
        Result<(), kube::Error>,
    ) {
        let mut read = None;
        for attempt in 0..2 {
            // Done already, or no longer wanted (no finalizer may be added to a lease being
            // deleted).
            if seen.guarded() == on || (on && seen.deleting) {
                break;
            }
            match Self::patch_finalizers(api, name, &seen, on).await {
                Ok(m) => {
                    debug!(namespace = %ns, lease = %name, on, "set the lease index's finalizer");
                    return (Some(m), Ok(()));
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return (None, Ok(())),
                Err(kube::Error::Api(s)) if s.code == 409 && attempt == 0 => {
                    match api.get_metadata_opt(name).await {
                        Ok(Some(m)) => {
                            seen = Seen::of(&m);
                            read = Some(m);
                        }
                        Ok(None) => return (None, Ok(())),
                        Err(e) => return (None, Err(e)),
                    };
                }
                Err(e) => return (read, Err(e)),
            }
        }
        (read, Ok(()))
    }

    async fn patch_finalizers(
        api: &Api<FencedLease>,
        name: &str,
        seen: &Seen,
        on: bool,
    ) -> Result<PartialObjectMeta<FencedLease>, kube::Error> {
        let patch = serde_json::json!({"metadata": {
            "resourceVersion": seen.resource_version,
            "finalizers": seen.finalizers_with(on),
        }});
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        api.patch_metadata(name, &pp, &Patch::Merge(&patch)).await
    }

    /// The namespaces (of this controller's scope) that carry an index.
    async fn indexed_namespaces(&self) -> Result<Vec<String>, kube::Error> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let all = match &self.namespace {
            Some(ns) => api.get_metadata_opt(ns).await?.into_iter().collect(),
            None => api.list_metadata(&ListParams::default()).await?.items,
        };
        Ok(all
            .into_iter()
            .filter(|n| {
                let a = n.metadata.annotations.as_ref();
                a.is_some_and(|a| a.contains_key(LEASE_INDEX_ANNOTATION))
            })
            .filter_map(|n| n.metadata.name)
            .collect())
    }

    /// Writes namespace `ns`'s index unless it already says what it should. It reads the
    /// namespace first (a quorum read) and writes on that version only: a write of an earlier
    /// term still in flight, or anyone else's, makes this one fail (409) and be tried again on
    /// what is there then, rather than be overwritten or overwrite it.
    async fn write(&mut self, ns: &str) -> Result<(), kube::Error> {
        let (value, left_out) = self.leases.index_of(ns);
        if left_out > 0 && self.full.insert(ns.to_string(), left_out) != Some(left_out) {
            warn!(namespace = %ns, left_out, max_bytes = INDEX_MAX_BYTES, "the namespace's lease index is full: writes naming the leases left out (last in name order) are refused; spread the leases over more namespaces");
        } else if left_out == 0 {
            self.full.remove(ns);
        }
        let api: Api<Namespace> = Api::all(self.client.clone());
        let Some(now) = api.get_metadata_opt(ns).await? else {
            return Ok(()); // gone: nothing to index
        };
        let current = now
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(LEASE_INDEX_ANNOTATION));
        if current == Some(&value) {
            return Ok(());
        }
        let patch = serde_json::json!({"metadata": {
            "resourceVersion": now.metadata.resource_version,
            "annotations": {LEASE_INDEX_ANNOTATION: value},
        }});
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        match api.patch_metadata(ns, &pp, &Patch::Merge(&patch)).await {
            Ok(_) => {
                let listed = value.matches('/').count().saturating_sub(1);
                if self.writes == 0 {
                    info!(namespace = %ns, listed, "wrote the first lease index of this term");
                }
                debug!(namespace = %ns, listed, "wrote the namespace's lease index");
                self.writes += 1;
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::leases::tests::{lease, meta};
    use super::*;

    #[test]
    fn a_failing_namespace_waits_longer_each_time_up_to_a_minute() {
        let secs = |n| retry_after(n).as_secs();
        let waits: Vec<u64> = (1..=9).map(secs).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!((secs(0), secs(u32::MAX)), (1, 60));
    }

    /// Namespace `shop`'s metadata at resourceVersion `rv`, its index `index`.
    fn shop(rv: &str, index: &str) -> serde_json::Value {
        serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "shop", "resourceVersion": rv,
                "annotations": {LEASE_INDEX_ANNOTATION: index}}})
    }

    /// Checks that an index patch is on resourceVersion `rv` and writes `index`.
    fn on_version(
        rv: &'static str,
        index: &'static str,
    ) -> impl Fn(&serde_json::Value) -> Result<(), String> + Send + 'static {
        move |b| {
            let m = &b["metadata"];
            match (
                m["resourceVersion"].as_str(),
                m["annotations"][LEASE_INDEX_ANNOTATION].as_str(),
            ) {
                (Some(r), Some(i)) if r == rv && i == index => Ok(()),
                other => Err(format!(
                    "expected version {rv} and index {index}, got {other:?}"
                )),
            }
        }
    }

    #[tokio::test]
    async fn an_index_write_goes_on_the_version_it_read_and_a_conflict_reads_again() {
        use super::super::fixtures::{Script, Step};
        use hyper::Method;
        const NS: &str = "/api/v1/namespaces/shop";
        let conflict = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "Conflict", "code": 409, "message": "the object has been modified"});
        let script = Script::new(vec![
            Step::new(Method::GET, NS, 200, shop("7", "/old/")),
            // Someone wrote in between (an earlier term's write in flight, say): refused.
            Step::new(Method::PATCH, NS, 409, conflict).body(on_version("7", "/db/")),
            // Tried again: read again, and write on the version read then.
            Step::new(Method::GET, NS, 200, shop("9", "/old/other/")),
            Step::new(Method::PATCH, NS, 200, shop("10", "/db/")).body(on_version("9", "/db/")),
            // An index that already says what it should is not written.
            Step::new(Method::GET, NS, 200, shop("10", "/db/")),
        ]);
        let mut ix = Indexer::new(script.client(), None, Role::Keep);
        ix.seen(&Event::Apply(meta("shop", "db")));
        let e = ix.write("shop").await.expect_err("the conflict");
        assert!(matches!(&e, kube::Error::Api(s) if s.code == 409), "{e:?}");
        ix.failed("shop".into(), &e);
        assert!(ix.dirty.contains("shop") && ix.failing["shop"].0 == 1);
        ix.write("shop").await.expect("the second try");
        ix.write("shop").await.expect("nothing to write");
        assert_eq!(ix.writes, 1);
        script.finish();
    }

    /// Lease `name` of namespace shop as a metadata answer, at `rv`, with the index's
    /// finalizer (`guarded`).
    fn lease_answer(name: &str, rv: &str, guarded: bool, deleting: bool) -> serde_json::Value {
        let mut m = serde_json::to_value(lease("shop", name, rv, guarded, deleting))
            .expect("metadata serialises");
        m["apiVersion"] = "meta.k8s.io/v1".into();
        m["kind"] = "PartialObjectMetadata".into();
        m
    }

    /// Checks that a finalizer patch is on resourceVersion `rv` and says whether the index's
    /// finalizer is there (`on`), the other finalizer kept.
    fn finalizers(
        rv: &'static str,
        on: bool,
    ) -> impl Fn(&serde_json::Value) -> Result<(), String> + Send + 'static {
        move |b| {
            let m = &b["metadata"];
            let list: Vec<&str> = m["finalizers"]
                .as_array()
                .map(|a| a.iter().filter_map(|f| f.as_str()).collect())
                .unwrap_or_default();
            let ok = m["resourceVersion"].as_str() == Some(rv)
                && list.contains(&"example.com/other")
                && list.contains(&LEASE_INDEX_FINALIZER) == on;
            ok.then_some(())
                .ok_or(format!("expected version {rv}, ours {on}"))
        }
    }

    /// The order that never lists a lease that could vanish unseen: the finalizer goes on a new
    /// lease before the index lists it, and comes off a deleted lease only after an index
    /// without it is written. In webhook mode nothing but the finalizers is touched.
    #[tokio::test]
    async fn the_finalizer_goes_on_before_a_lease_is_listed_and_off_after_it_is_dropped() {
        use super::super::fixtures::{Script, Step};
        use hyper::Method;
        const NS: &str = "/api/v1/namespaces/shop";
        const LEASES: &str = "/apis/fencedlease.io/v1alpha1/namespaces/shop/fencedleases";
        let (new, old) = (format!("{LEASES}/new"), format!("{LEASES}/old"));
        let script = Script::new(vec![
            Step::new(
                Method::PATCH,
                &new,
                200,
                lease_answer("new", "2", true, false),
            )
            .body(finalizers("1", true)),
            Step::new(Method::GET, NS, 200, shop("7", "/old/")),
            Step::new(Method::PATCH, NS, 200, shop("8", "/new/")).body(on_version("7", "/new/")),
            Step::new(
                Method::PATCH,
                &old,
                200,
                lease_answer("old", "4", false, true),
            )
            .body(finalizers("3", false)),
        ]);
        let mut ix = Indexer::new(script.client(), None, Role::Keep);
        ix.seen(&Event::Apply(lease("shop", "new", "1", false, false)));
        ix.seen(&Event::Apply(lease("shop", "old", "3", true, true)));
        ix.flush().await;
        assert!(
            ix.dirty.is_empty() && ix.failing.is_empty(),
            "{:?}",
            ix.failing
        );
        script.finish();

        // Webhook mode: with no release in policy mode (no index guard), the finalizer comes
        // off a live lease too, and no index is read or written.
        const GUARDS: &str = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies";
        let guards = |n: usize| {
            let item = serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                "metadata": {"name": "other-fencedlease-fencing-index-guard"}});
            serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                "metadata": {}, "items": vec![item; n]})
        };
        let script = Script::new(vec![
            Step::new(Method::GET, GUARDS, 200, guards(0)),
            Step::new(
                Method::PATCH,
                &new,
                200,
                lease_answer("new", "3", false, false),
            )
            .body(finalizers("2", false)),
        ]);
        let mut ix = Indexer::new(script.client(), None, Role::Release);
        ix.seen(&Event::Apply(lease("shop", "new", "2", true, false)));
        ix.seen(&Event::Apply(lease("shop", "bare", "1", false, false)));
        ix.flush().await;
        assert!(
            ix.dirty.is_empty() && ix.failing.is_empty(),
            "{:?}",
            ix.failing
        );
        script.finish();

        // Another release runs policy mode (its guard exists): its controller keeps the
        // finalizer, and this one leaves it, to look again later. One look per flush, however
        // many namespaces have leases to release.
        let script = Script::new(vec![Step::new(Method::GET, GUARDS, 200, guards(1))]);
        let mut ix = Indexer::new(script.client(), None, Role::Release);
        ix.seen(&Event::Apply(lease("shop", "new", "2", true, true)));
        ix.seen(&Event::Apply(lease("cafe", "till", "5", true, false)));
        ix.flush().await;
        assert!(
            ["shop", "cafe"]
                .iter()
                .all(|ns| ix.dirty.contains(*ns) && ix.failing[*ns].0 == 0),
            "{:?}",
            ix.failing
        );
        assert!(ix.flush_at.is_some(), "looked at again");
        script.finish();
    }

    /// A finalizer patch that conflicts (the lease changed since it was seen: a renewal, say)
    /// reads the lease again and patches on the version read; if the lease is being deleted by
    /// then, no finalizer may be added, and none is: the lease is not listed.
    #[tokio::test]
    async fn a_conflicting_finalizer_patch_reads_again_and_a_lease_being_deleted_is_left() {
        use super::super::fixtures::{Script, Step};
        use hyper::Method;
        const NS: &str = "/api/v1/namespaces/shop";
        const LEASES: &str = "/apis/fencedlease.io/v1alpha1/namespaces/shop/fencedleases";
        let (a, b) = (format!("{LEASES}/a"), format!("{LEASES}/b"));
        let conflict = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "Conflict", "code": 409, "message": "the object has been modified"});
        // The two leases' patches run at once: their requests may interleave.
        let any = |step: Step| step.in_any_order();
        let script = Script::new(vec![
            any(Step::new(Method::PATCH, &a, 409, conflict.clone()).body(finalizers("1", true))),
            any(Step::new(
                Method::GET,
                &a,
                200,
                lease_answer("a", "5", false, false),
            )),
            any(
                Step::new(Method::PATCH, &a, 200, lease_answer("a", "6", true, false))
                    .body(finalizers("5", true)),
            ),
            any(Step::new(Method::PATCH, &b, 409, conflict).body(finalizers("1", true))),
            any(Step::new(
                Method::GET,
                &b,
                200,
                lease_answer("b", "7", false, true),
            )),
            Step::new(Method::GET, NS, 200, shop("7", "/")),
            Step::new(Method::PATCH, NS, 200, shop("8", "/a/")).body(on_version("7", "/a/")),
        ]);
        let mut ix = Indexer::new(script.client(), None, Role::Keep);
        ix.seen(&Event::Apply(lease("shop", "a", "1", false, false)));
        ix.seen(&Event::Apply(lease("shop", "b", "1", false, false)));
        ix.flush().await;
        assert!(
            ix.dirty.is_empty() && ix.failing.is_empty(),
            "{:?}",
            ix.failing
        );
        // What the re-read of b said is kept: being deleted, at version 7.
        let b = ix.leases.get("shop", "b").cloned();
        assert!(
            b.as_ref()
                .is_some_and(|b| b.deleting && b.resource_version.as_deref() == Some("7")),
            "{b:?}"
        );
        script.finish();
    }
}
