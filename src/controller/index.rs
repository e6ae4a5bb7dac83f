//! Policy mode's lease index: the names of each namespace's FencedLeases, in an annotation of the
//! namespace ([`LEASE_INDEX_ANNOTATION`], `/a/b/`), kept by the active controller.
//!
//! The chart's one fencing binding judges a write by the lease its label names, one parameter
//! per lease of the namespace; a write naming a lease that does not exist finds no parameter
//! and nothing refuses it. The chart's index policy closes that: it refuses a labelled write
//! whose lease the index does not list (the API server reads namespaces from its own cache, so
//! the check costs one string search per write). A lag in listing a new lease refuses its
//! writes until it is listed (retry). A lag in dropping a deleted lease is the one that admits:
//! until the index drops it, a write naming it finds no parameter and passes unchecked (while
//! the controller is down, for as long as it is down; the book names the window). Only the
//! controller may change the annotation (the chart's guard), and it writes on the version it
//! read, so that a write of an earlier term cannot put back a name it dropped.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ListParams, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::api::{FencedLease, FIELD_MANAGER, LEASE_INDEX_ANNOTATION};

/// The most bytes one namespace's index holds. Kubernetes allows 256 KiB of annotations per
/// object; the rest is left to the namespace's other annotations. Names past it, in name order,
/// are left out (a warning says how many), and writes naming them are refused.
pub(crate) const INDEX_MAX_BYTES: usize = 192 * 1024;

/// How long the index gathers changes before it writes: leases created together make one
/// write per namespace, not one each.
const INDEX_DEBOUNCE: Duration = Duration::from_millis(50);

/// How long a failed write or read waits before the next try; a namespace whose writes keep
/// failing waits twice as long each time, up to [`INDEX_RETRY_MAX`].
const INDEX_RETRY: Duration = Duration::from_secs(1);
const INDEX_RETRY_MAX: Duration = Duration::from_secs(60);

/// How long a namespace waits after its `failures`-th failed write in a row (1, 2, 4 ... 60 s).
fn retry_after(failures: u32) -> Duration {
    let doubled = INDEX_RETRY.saturating_mul(1 << failures.saturating_sub(1).min(6));
    doubled.min(INDEX_RETRY_MAX)
}

/// The index of `names` (in name order): each between slashes, as many as fit in
/// [`INDEX_MAX_BYTES`]; and how many were left out.
pub(crate) fn index_value<'a>(names: impl IntoIterator<Item = &'a String>) -> (String, usize) {
    let mut value = String::from("/");
    let mut left_out = 0;
    for name in names {
        if left_out > 0 || value.len() + name.len() + 1 > INDEX_MAX_BYTES {
            left_out += 1;
            continue;
        }
        value.push_str(name);
        value.push('/');
    }
    (value, left_out)
}

/// Whether `index` lists lease `name`: what the chart's index policy checks, in CEL
/// (`index.contains('/' + name + '/')`). Lease names hold no slash.
#[cfg(test)]
fn lists(index: &str, name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && index.contains(&format!("/{name}/"))
}

/// What a watch event changed in the names.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Changed {
    Nothing,
    /// These namespaces' names may have changed.
    Namespaces(BTreeSet<String>),
    /// A (re)list ended: every namespace may have changed, also ones no longer seen.
    Relisted(BTreeSet<String>),
}

/// The FencedLeases' names by namespace, as a metadata watch reports them.
#[derive(Debug, Default)]
pub(crate) struct LeaseNames {
    names: BTreeMap<String, BTreeSet<String>>,
    relisting: Option<BTreeMap<String, BTreeSet<String>>>,
}

fn key(m: &PartialObjectMeta<FencedLease>) -> Option<(String, String)> {
    Some((m.metadata.namespace.clone()?, m.metadata.name.clone()?))
}

impl LeaseNames {
    /// Applies one watch event.
    pub(crate) fn apply(&mut self, event: &Event<PartialObjectMeta<FencedLease>>) -> Changed {
        match event {
            Event::Init => {
                self.relisting = Some(BTreeMap::new());
                Changed::Nothing
            }
            Event::InitApply(m) => {
                if let (Some(names), Some((ns, name))) = (self.relisting.as_mut(), key(m)) {
                    names.entry(ns).or_default().insert(name);
                }
                Changed::Nothing
            }
            Event::InitDone => {
                let new = self.relisting.take().unwrap_or_default();
                let old = std::mem::replace(&mut self.names, new);
                Changed::Relisted(old.into_keys().chain(self.names.keys().cloned()).collect())
            }
            Event::Apply(m) => self.change(m, true),
            Event::Delete(m) => self.change(m, false),
        }
    }

    fn change(&mut self, m: &PartialObjectMeta<FencedLease>, present: bool) -> Changed {
        let Some((ns, name)) = key(m) else {
            return Changed::Nothing;
        };
        let names = self.names.entry(ns.clone()).or_default();
        let changed = if present {
            names.insert(name)
        } else {
            names.remove(&name)
        };
        if changed {
            Changed::Namespaces([ns].into())
        } else {
            Changed::Nothing
        }
    }

    /// The index namespace `ns` should carry, and how many names it leaves out.
    pub(crate) fn index_of(&self, ns: &str) -> (String, usize) {
        index_value(self.names.get(ns).into_iter().flatten())
    }
}

/// Keeps the index of every watched namespace (`namespace`: only that one) until aborted:
/// the active controller runs it for its term.
pub(super) async fn keep_index(client: Client, namespace: Option<String>) {
    let api: Api<PartialObjectMeta<FencedLease>> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    // Consistent lists (not any_semantic): a relist from a lagging cache could list a lease
    // already deleted, and put it back in the index.
    let events = watcher::watcher(api, watcher::Config::default()).default_backoff();
    futures::pin_mut!(events);
    let mut ix = Indexer::new(client, namespace);
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
    leases: LeaseNames,
    /// How many indexes this term wrote.
    writes: u64,
    /// Namespaces whose index may be out of date.
    dirty: BTreeSet<String>,
    /// Whether to look for namespaces whose index lists leases this term has not seen.
    sweep: bool,
    flush_at: Option<Instant>,
    /// Namespaces whose last writes failed: how many in a row, and when to try again.
    failing: BTreeMap<String, (u32, Instant)>,
    /// How many names each full namespace's index left out, when last said.
    full: BTreeMap<String, usize>,
}

impl Indexer {
    fn new(client: Client, namespace: Option<String>) -> Indexer {
        Indexer {
            client,
            namespace,
            leases: LeaseNames::default(),
            writes: 0,
            dirty: BTreeSet::new(),
            sweep: false,
            flush_at: None,
            failing: BTreeMap::new(),
            full: BTreeMap::new(),
        }
    }

    fn seen(&mut self, event: &Event<PartialObjectMeta<FencedLease>>) {
        match self.leases.apply(event) {
            Changed::Nothing => return,
            Changed::Namespaces(ns) => self.dirty.extend(ns),
            Changed::Relisted(ns) => {
                self.dirty.extend(ns);
                self.sweep = true;
            }
        }
        // Within the debounce, or sooner if a retry was due sooner; never pushed back.
        let soon = Instant::now() + INDEX_DEBOUNCE;
        self.flush_at = Some(self.flush_at.map_or(soon, |at| at.min(soon)));
    }

    /// Writes every dirty namespace's index that changed; what fails is tried again later.
    async fn flush(&mut self) {
        self.flush_at = None;
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
            match self.write(&ns).await {
                Ok(()) => {
                    self.failing.remove(&ns);
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

    /// Counts a failed write of namespace `ns`'s index, says so at the 1st, 2nd, 4th ... in a
    /// row, and keeps it dirty for its next try.
    fn failed(&mut self, ns: String, e: &kube::Error) {
        let count = self.failing.get(&ns).map_or(1, |(n, _)| n + 1);
        let wait = retry_after(count);
        if count.is_power_of_two() {
            warn!(namespace = %ns, error = %e, failures = count, retry_in_s = wait.as_secs(), "could not write the namespace's lease index: writes naming its new leases are refused until it is written (the controller needs get and patch on namespaces; a namespace's annotations may hold 256 KiB in all)");
        }
        self.failing
            .insert(ns.clone(), (count, Instant::now() + wait));
        self.dirty.insert(ns);
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
    use super::*;

    fn meta(ns: &str, name: &str) -> PartialObjectMeta<FencedLease> {
        use kube::core::PartialObjectMetaExt;
        k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            ..Default::default()
        }
        .into_response_partial()
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_index_lists_each_name_between_slashes_and_nothing_else() {
        let names = set(&["db", "inventory", "db-2"]);
        let (value, left) = index_value(&names);
        assert_eq!((value.as_str(), left), ("/db/db-2/inventory/", 0));
        for (name, listed) in [
            ("db", true),
            ("db-2", true),
            ("inventory", true),
            ("d", false),
            ("b", false),
            ("db-", false),
            ("inv", false),
            ("", false),
            ("db/db-2", false),
        ] {
            assert_eq!(lists(&value, name), listed, "{name:?}");
        }
        assert_eq!(index_value(&BTreeSet::new()), ("/".to_string(), 0));
        assert!(!lists("/", "a"));
    }

    #[test]
    fn a_full_index_leaves_out_the_last_names_and_stays_in_bounds() {
        let long: BTreeSet<String> = (0..2000)
            .map(|i| format!("{i:04}-{}", "x".repeat(250)))
            .collect();
        let (value, left) = index_value(&long);
        assert!(value.len() <= INDEX_MAX_BYTES, "{}", value.len());
        assert!(left > 0 && left < 2000, "{left}");
        let listed = value.matches('/').count() - 1;
        assert_eq!(listed + left, 2000);
        let first = long.iter().next().expect("first");
        let last = long.iter().last().expect("last");
        assert!(lists(&value, first) && !lists(&value, last));
    }

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
        let mut ix = Indexer::new(script.client(), None);
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

    #[test]
    fn watch_events_say_which_namespaces_changed() {
        let mut n = LeaseNames::default();
        assert_eq!(n.apply(&Event::Init), Changed::Nothing);
        assert_eq!(
            n.apply(&Event::InitApply(meta("shop", "db"))),
            Changed::Nothing
        );
        assert_eq!(n.apply(&Event::InitDone), Changed::Relisted(set(&["shop"])));
        assert_eq!(n.index_of("shop").0, "/db/");
        let changed = n.apply(&Event::Apply(meta("shop", "inv")));
        assert_eq!(changed, Changed::Namespaces(set(&["shop"])));
        // A renewal or any other update of a known lease changes no name.
        assert_eq!(
            n.apply(&Event::Apply(meta("shop", "inv"))),
            Changed::Nothing
        );
        assert_eq!(n.index_of("shop").0, "/db/inv/");
        assert_eq!(
            n.apply(&Event::Delete(meta("shop", "db"))),
            Changed::Namespaces(set(&["shop"]))
        );
        assert_eq!(n.index_of("shop").0, "/inv/");
        // A relist that no longer sees shop's leases: shop changed too (to an empty index).
        n.apply(&Event::Init);
        n.apply(&Event::InitApply(meta("bank", "ledger")));
        assert_eq!(
            n.index_of("shop").0,
            "/inv/",
            "the old names stand until the relist ends"
        );
        assert_eq!(
            n.apply(&Event::InitDone),
            Changed::Relisted(set(&["bank", "shop"]))
        );
        assert_eq!(
            (n.index_of("shop").0.as_str(), n.index_of("bank").0.as_str()),
            ("/", "/ledger/")
        );
    }
}
