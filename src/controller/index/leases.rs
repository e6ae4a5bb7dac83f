//! What the lease index knows of the FencedLeases, and what a namespace needs done (pure: the
//! I/O is the parent module's). Each lease's state comes from a metadata watch: whether it
//! carries [`LEASE_INDEX_FINALIZER`] and whether it is being deleted. A renewal changes neither,
//! so it makes no work.

use std::collections::{BTreeMap, BTreeSet};

use kube::core::PartialObjectMeta;
use kube::runtime::watcher::Event;

use crate::api::{FencedLease, LEASE_INDEX_FINALIZER};

/// The most bytes one namespace's index holds. Kubernetes allows 256 KiB of annotations per
/// object; the rest is left to the namespace's other annotations. Names past it, in name order,
/// are left out (a warning says how many), and writes naming them are refused.
pub(crate) const INDEX_MAX_BYTES: usize = 192 * 1024;

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

/// What the active controller does with the leases' finalizer and the namespaces' indexes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// Policy mode: put the finalizer on every lease, list the leases that carry it and are not
    /// being deleted, and take it off a deleted lease once the index no longer lists it.
    Keep,
    /// Webhook mode (no index): take the finalizer off every lease that carries it, so that
    /// deleting a lease or its namespace never waits for a controller.
    Release,
}

/// One lease as the index sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) resource_version: Option<String>,
    pub(crate) finalizers: Vec<String>,
    pub(crate) deleting: bool,
}

impl Seen {
    pub(crate) fn of(m: &PartialObjectMeta<FencedLease>) -> Seen {
        Seen {
            resource_version: m.metadata.resource_version.clone(),
            finalizers: m.metadata.finalizers.clone().unwrap_or_default(),
            deleting: m.metadata.deletion_timestamp.is_some(),
        }
    }

    /// Whether it carries the index's finalizer.
    pub(crate) fn guarded(&self) -> bool {
        self.finalizers.iter().any(|f| f == LEASE_INDEX_FINALIZER)
    }

    /// Whether the index may list it: only a lease that cannot vanish while no controller runs.
    fn listable(&self) -> bool {
        self.guarded() && !self.deleting
    }

    /// What the index acts on (a renewal changes neither).
    fn state(&self) -> (bool, bool) {
        (self.guarded(), self.deleting)
    }

    /// Its finalizers with the index's put on (`on`) or taken off, the others kept in order.
    pub(crate) fn finalizers_with(&self, on: bool) -> Vec<String> {
        let mut f: Vec<String> = self
            .finalizers
            .iter()
            .filter(|f| *f != LEASE_INDEX_FINALIZER)
            .cloned()
            .collect();
        if on {
            f.push(LEASE_INDEX_FINALIZER.to_string());
        }
        f
    }
}

/// What one namespace needs, in this order: the finalizer put on the leases of `guard` (before
/// the index may list them), the index written (`Role::Keep`), then the finalizer taken off the
/// leases of `release` (after the index no longer lists them).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) guard: Vec<String>,
    pub(crate) write_index: bool,
    pub(crate) release: Vec<String>,
}

/// Whether `old` is a later version of the lease than `new` (resourceVersions compared as the
/// numbers Kubernetes' etcd makes them; unreadable ones are never later).
fn newer(old: &Seen, new: &Seen) -> bool {
    let num = |s: &Seen| s.resource_version.as_deref()?.parse::<u64>().ok();
    matches!((num(old), num(new)), (Some(o), Some(n)) if o > n)
}

/// What a watch event changed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Changed {
    Nothing,
    /// These namespaces' leases may need work.
    Namespaces(BTreeSet<String>),
    /// A (re)list ended: every namespace may have changed, also ones no longer seen.
    Relisted(BTreeSet<String>),
}

type ByNamespace = BTreeMap<String, BTreeMap<String, Seen>>;

/// The FencedLeases by namespace and name, as a metadata watch reports them.
#[derive(Debug, Default)]
pub(crate) struct LeaseNames {
    leases: ByNamespace,
    relisting: Option<ByNamespace>,
    /// The controller's own election lease (namespace, name): never listed, never held by the
    /// finalizer, so that `helm uninstall` can let it go with no controller left.
    ignored: Option<(String, String)>,
}

impl LeaseNames {
    /// Names ignoring lease `ns/name`.
    pub(crate) fn ignoring(ns: &str, name: &str) -> LeaseNames {
        LeaseNames {
            ignored: Some((ns.to_string(), name.to_string())),
            ..LeaseNames::default()
        }
    }

    fn key(&self, m: &PartialObjectMeta<FencedLease>) -> Option<(String, String)> {
        let key = (m.metadata.namespace.clone()?, m.metadata.name.clone()?);
        (self.ignored.as_ref() != Some(&key)).then_some(key)
    }

    /// Applies one watch event.
    pub(crate) fn apply(&mut self, event: &Event<PartialObjectMeta<FencedLease>>) -> Changed {
        match event {
            Event::Init => {
                self.relisting = Some(BTreeMap::new());
                Changed::Nothing
            }
            Event::InitApply(m) => {
                if let (Some((ns, name)), Some(all)) = (self.key(m), self.relisting.as_mut()) {
                    all.entry(ns).or_default().insert(name, Seen::of(m));
                }
                Changed::Nothing
            }
            Event::InitDone => {
                let new = self.relisting.take().unwrap_or_default();
                let old = std::mem::replace(&mut self.leases, new);
                Changed::Relisted(old.into_keys().chain(self.leases.keys().cloned()).collect())
            }
            Event::Apply(m) => self.change(m, true),
            Event::Delete(m) => self.change(m, false),
        }
    }

    /// Records a lease as an answer of the API server has it (present) or its absence.
    pub(crate) fn change(&mut self, m: &PartialObjectMeta<FencedLease>, present: bool) -> Changed {
        let Some((ns, name)) = self.key(m) else {
            return Changed::Nothing;
        };
        let leases = self.leases.entry(ns.clone()).or_default();
        let (before, after) = if present {
            let seen = Seen::of(m);
            if leases.get(&name).is_some_and(|old| newer(old, &seen)) {
                return Changed::Nothing; // an event older than what a patch's answer told us
            }
            let after = Some(seen.state());
            (leases.insert(name, seen).map(|s| s.state()), after)
        } else {
            (leases.remove(&name).map(|s| s.state()), None)
        };
        if before == after {
            Changed::Nothing
        } else {
            Changed::Namespaces([ns].into())
        }
    }

    /// Lease `ns/name`, as last seen.
    pub(crate) fn get(&self, ns: &str, name: &str) -> Option<&Seen> {
        self.leases.get(ns)?.get(name)
    }

    /// The index namespace `ns` should carry, and how many names it leaves out.
    pub(crate) fn index_of(&self, ns: &str) -> (String, usize) {
        let leases = self.leases.get(ns).into_iter().flatten();
        index_value(leases.filter(|(_, s)| s.listable()).map(|(name, _)| name))
    }

    /// What namespace `ns` needs done, for a controller in `role`.
    pub(crate) fn plan(&self, ns: &str, role: Role) -> Plan {
        let names = |keep: &dyn Fn(&Seen) -> bool| -> Vec<String> {
            let leases = self.leases.get(ns).into_iter().flatten();
            leases
                .filter(|(_, s)| keep(s))
                .map(|(n, _)| n.clone())
                .collect()
        };
        match role {
            Role::Keep => Plan {
                guard: names(&|s| !s.guarded() && !s.deleting),
                write_index: true,
                release: names(&|s| s.guarded() && s.deleting),
            },
            Role::Release => Plan {
                guard: Vec::new(),
                write_index: false,
                release: names(&|s| s.guarded()),
            },
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use kube::core::PartialObjectMetaExt;

    pub(crate) fn meta(ns: &str, name: &str) -> PartialObjectMeta<FencedLease> {
        lease(ns, name, "1", true, false)
    }

    /// Lease `ns/name` at resourceVersion `rv`, with the index's finalizer (`guarded`) and
    /// being deleted (`deleting`).
    pub(crate) fn lease(
        ns: &str,
        name: &str,
        rv: &str,
        guarded: bool,
        deleting: bool,
    ) -> PartialObjectMeta<FencedLease> {
        let mut finalizers = vec!["example.com/other".to_string()];
        if guarded {
            finalizers.push(LEASE_INDEX_FINALIZER.into());
        }
        ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            resource_version: Some(rv.into()),
            finalizers: Some(finalizers),
            deletion_timestamp: deleting.then(|| Time("2026-12-07T00:00:00Z".parse().unwrap())),
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

    /// Only a lease with the finalizer and not being deleted is listed: one without it could be
    /// deleted while no controller runs, and its name would stay listed with nothing to judge.
    #[test]
    fn only_a_guarded_live_lease_is_listed_and_each_state_has_its_work() {
        let mut n = LeaseNames::default();
        for (name, guarded, deleting) in [
            ("new", false, false),
            ("live", true, false),
            ("gone", true, true),
            ("bare-gone", false, true),
        ] {
            n.apply(&Event::Apply(lease("shop", name, "1", guarded, deleting)));
        }
        assert_eq!(n.index_of("shop").0, "/live/");
        let keep = n.plan("shop", Role::Keep);
        assert_eq!(
            keep,
            Plan {
                guard: vec!["new".into()],
                write_index: true,
                release: vec!["gone".into()],
            }
        );
        let release = n.plan("shop", Role::Release);
        assert_eq!(
            release,
            Plan {
                guard: vec![],
                write_index: false,
                release: vec!["gone".into(), "live".into()],
            }
        );
        assert_eq!(n.plan("elsewhere", Role::Keep).guard.len(), 0);
        // The controller's own election lease is left alone.
        let mut n = LeaseNames::ignoring("fencedlease", "controller");
        let own = lease("fencedlease", "controller", "1", false, false);
        assert_eq!(n.apply(&Event::Apply(own)), Changed::Nothing);
        assert_eq!(
            n.plan("fencedlease", Role::Keep),
            Plan {
                write_index: true,
                ..Plan::default()
            }
        );
    }

    #[test]
    fn the_finalizer_is_put_on_and_taken_off_leaving_the_others() {
        let on = Seen::of(&lease("shop", "db", "1", true, false));
        let off = Seen::of(&lease("shop", "db", "1", false, false));
        let other = "example.com/other".to_string();
        assert_eq!(off.finalizers_with(true), on.finalizers);
        assert_eq!(on.finalizers_with(false), vec![other.clone()]);
        assert_eq!(on.finalizers_with(true), on.finalizers, "not twice");
        assert_eq!(off.finalizers_with(false), vec![other]);
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
        // A renewal (a new resourceVersion) changes nothing the index acts on; it is recorded.
        assert_eq!(
            n.apply(&Event::Apply(lease("shop", "inv", "2", true, false))),
            Changed::Nothing
        );
        assert_eq!(
            n.get("shop", "inv")
                .and_then(|s| s.resource_version.as_deref()),
            Some("2")
        );
        // An event older than what is known (a patch's answer came first): ignored.
        let older = lease("shop", "inv", "1", false, false);
        assert_eq!(n.apply(&Event::Apply(older)), Changed::Nothing);
        assert!(n.get("shop", "inv").is_some_and(|s| s.guarded()));
        // The finalizer taken off by someone, or the deletion begun: work.
        for (guarded, deleting) in [(false, false), (true, true)] {
            let m = lease("shop", "inv", "3", guarded, deleting);
            assert_eq!(
                n.apply(&Event::Apply(m)),
                Changed::Namespaces(set(&["shop"]))
            );
        }
        assert_eq!(
            n.index_of("shop").0,
            "/db/",
            "a lease being deleted is not listed"
        );
        assert_eq!(
            n.apply(&Event::Delete(meta("shop", "db"))),
            Changed::Namespaces(set(&["shop"]))
        );
        assert_eq!(n.index_of("shop").0, "/");
        // A relist that no longer sees shop's leases: shop changed too (to an empty index).
        n.apply(&Event::Apply(meta("shop", "pay")));
        n.apply(&Event::Init);
        n.apply(&Event::InitApply(meta("bank", "ledger")));
        assert_eq!(
            n.index_of("shop").0,
            "/pay/",
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
