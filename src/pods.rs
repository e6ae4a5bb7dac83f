//! Which pods belong to which FencedLease, and which of them carry the leader label.
//!
//! The controller moves `fencedlease.io/role: leader` to the pod that holds a lease. Asking the
//! API server which pods are labelled on every change of holder costs a LIST per lease, which
//! after a restart with 10,000 leases is 10,000 LISTs before any status is written. Instead the
//! controller keeps this index, fed by one metadata-only watch of pods: a label move is decided
//! without a request, and a request is made only when a label has to change.
//!
//! The index is pure (no I/O): it takes watch events and answers questions, so it is tested
//! without a server.

use std::collections::{BTreeSet, HashMap};

use k8s_openapi::api::core::v1::Pod;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::Event;

use crate::webhook::inject::LEASE_ANNOTATION;

/// Label on the pod that holds a lease (for Services that select the leader).
pub const ROLE_LABEL: &str = "fencedlease.io/role";

/// (namespace, name)
pub type Key = (String, String);

#[derive(Clone, Debug, PartialEq, Eq)]
struct PodInfo {
    /// The FencedLease the pod campaigns for (its `fencedlease.io/lease` annotation).
    lease: String,
    /// Whether it carries `fencedlease.io/role: leader`.
    leader: bool,
}

/// What to change so that exactly the holder's pod carries the leader label.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelPlan {
    /// Pods of the lease that carry the label but do not hold the lease: unlabel these first.
    pub unlabel: Vec<String>,
    /// The holder's pod, when it belongs to the lease and is not labelled yet.
    pub label: Option<String>,
}

impl LabelPlan {
    pub fn is_empty(&self) -> bool {
        self.unlabel.is_empty() && self.label.is_none()
    }
}

/// The index. Pods without the lease annotation are not kept.
#[derive(Debug, Default)]
pub struct PodIndex {
    pods: HashMap<Key, PodInfo>,
    /// (namespace, lease) -> names of its pods.
    by_lease: HashMap<Key, BTreeSet<String>>,
    /// Pods seen so far during a (re)list; swapped in when the list is complete.
    listing: Option<HashMap<Key, PodInfo>>,
    /// A complete list has been seen: until then the index answers nothing, because acting
    /// on part of the pods could label a new holder while an unseen old one is still labelled.
    ready: bool,
}

fn info_of(pod: &PartialObjectMeta<Pod>) -> Option<(Key, Option<PodInfo>)> {
    let m = &pod.metadata;
    let key = (m.namespace.clone()?, m.name.clone()?);
    let lease = m
        .annotations
        .as_ref()
        .and_then(|a| a.get(LEASE_ANNOTATION))
        .cloned();
    let leader = m
        .labels
        .as_ref()
        .and_then(|l| l.get(ROLE_LABEL))
        .is_some_and(|v| v == "leader");
    Some((key, lease.map(|lease| PodInfo { lease, leader })))
}

/// Drops what the index never reads, so that a watch of every pod in a large cluster stays
/// small in memory: only the lease annotation and the role label are kept.
pub fn slim(pod: &mut PartialObjectMeta<Pod>) {
    let m = &mut pod.metadata;
    m.managed_fields = None;
    m.owner_references = None;
    m.finalizers = None;
    if let Some(a) = m.annotations.as_mut() {
        a.retain(|k, _| k == LEASE_ANNOTATION);
    }
    if let Some(l) = m.labels.as_mut() {
        l.retain(|k, _| k == ROLE_LABEL);
    }
}

impl PodIndex {
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// Number of pods that belong to some lease.
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Applies a watch event. Returns the leases, as (namespace, lease name), whose pods
    /// changed in a way that may call for a label move: the controller looks at them again.
    pub fn apply(&mut self, event: &Event<PartialObjectMeta<Pod>>) -> Vec<Key> {
        match event {
            Event::Init => {
                self.listing = Some(HashMap::new());
                Vec::new()
            }
            Event::InitApply(pod) => {
                if let Some((key, Some(info))) = info_of(pod) {
                    self.listing
                        .get_or_insert_with(HashMap::new)
                        .insert(key, info);
                }
                Vec::new()
            }
            Event::InitDone => {
                let listed = self.listing.take().unwrap_or_default();
                let old = std::mem::replace(&mut self.pods, listed);
                self.by_lease.clear();
                for ((ns, name), info) in &self.pods {
                    self.by_lease
                        .entry((ns.clone(), info.lease.clone()))
                        .or_default()
                        .insert(name.clone());
                }
                let mut changed = BTreeSet::new();
                if !self.ready {
                    // First complete view: every lease with pods may need its label set.
                    changed.extend(
                        self.pods
                            .iter()
                            .map(|((ns, _), i)| (ns.clone(), i.lease.clone())),
                    );
                } else {
                    for (key, info) in &self.pods {
                        if old.get(key) != Some(info) {
                            changed.insert((key.0.clone(), info.lease.clone()));
                        }
                    }
                    for (key, info) in &old {
                        if self.pods.get(key) != Some(info) {
                            changed.insert((key.0.clone(), info.lease.clone()));
                        }
                    }
                }
                self.ready = true;
                changed.into_iter().collect()
            }
            Event::Apply(pod) => match info_of(pod) {
                Some((key, Some(info))) => {
                    let mut changed = Vec::new();
                    let new_lease = (key.0.clone(), info.lease.clone());
                    match self.remove(&key) {
                        Some(old) if old == info => {}
                        Some(old) => {
                            if old.lease != info.lease {
                                changed.push((key.0.clone(), old.lease));
                            }
                            changed.push(new_lease.clone());
                        }
                        None => changed.push(new_lease.clone()),
                    }
                    self.by_lease
                        .entry(new_lease)
                        .or_default()
                        .insert(key.1.clone());
                    self.pods.insert(key, info);
                    changed
                }
                // The annotation was removed, or the pod never had one.
                Some((key, None)) => self
                    .remove(&key)
                    .map(|old| vec![(key.0, old.lease)])
                    .unwrap_or_default(),
                None => Vec::new(),
            },
            Event::Delete(pod) => match info_of(pod) {
                Some((key, _)) => self
                    .remove(&key)
                    .map(|old| vec![(key.0, old.lease)])
                    .unwrap_or_default(),
                None => Vec::new(),
            },
        }
    }

    fn remove(&mut self, key: &Key) -> Option<PodInfo> {
        let old = self.pods.remove(key)?;
        let lease = (key.0.clone(), old.lease.clone());
        if let Some(set) = self.by_lease.get_mut(&lease) {
            set.remove(&key.1);
            if set.is_empty() {
                self.by_lease.remove(&lease);
            }
        }
        Some(old)
    }

    /// What to change so that only the holder's pod (if it is a pod of this lease) carries the
    /// leader label. `None` until the index has seen a complete list of pods.
    pub fn plan(&self, namespace: &str, lease: &str, holder: Option<&str>) -> Option<LabelPlan> {
        if !self.ready {
            return None;
        }
        let mut plan = LabelPlan::default();
        let Some(names) = self
            .by_lease
            .get(&(namespace.to_string(), lease.to_string()))
        else {
            return Some(plan);
        };
        for name in names {
            let Some(info) = self.pods.get(&(namespace.to_string(), name.clone())) else {
                continue;
            };
            let is_holder = Some(name.as_str()) == holder;
            if info.leader && !is_holder {
                plan.unlabel.push(name.clone());
            } else if !info.leader && is_holder {
                plan.label = Some(name.clone());
            }
        }
        Some(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    fn pod(ns: &str, name: &str, lease: Option<&str>, leader: bool) -> PartialObjectMeta<Pod> {
        let mut annotations = std::collections::BTreeMap::new();
        if let Some(l) = lease {
            annotations.insert(LEASE_ANNOTATION.to_string(), l.to_string());
        }
        annotations.insert("other".to_string(), "x".to_string());
        let mut labels = std::collections::BTreeMap::new();
        if leader {
            labels.insert(ROLE_LABEL.to_string(), "leader".to_string());
        }
        labels.insert("app".to_string(), "db".to_string());
        PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                annotations: Some(annotations),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            _phantom: Default::default(),
        }
    }

    fn key(ns: &str, lease: &str) -> Key {
        (ns.into(), lease.into())
    }

    fn listed(pods: Vec<PartialObjectMeta<Pod>>) -> PodIndex {
        let mut idx = PodIndex::default();
        idx.apply(&Event::Init);
        for p in pods {
            idx.apply(&Event::InitApply(p));
        }
        idx.apply(&Event::InitDone);
        idx
    }

    #[test]
    fn answers_nothing_before_a_complete_list() {
        let mut idx = PodIndex::default();
        assert_eq!(idx.plan("ns", "db", Some("a")), None);
        idx.apply(&Event::Init);
        idx.apply(&Event::InitApply(pod("ns", "a", Some("db"), false)));
        assert_eq!(idx.plan("ns", "db", Some("a")), None, "still listing");
        let changed = idx.apply(&Event::InitDone);
        assert_eq!(changed, vec![key("ns", "db")]);
        assert_eq!(
            idx.plan("ns", "db", Some("a")),
            Some(LabelPlan {
                unlabel: vec![],
                label: Some("a".into())
            })
        );
    }

    #[test]
    fn moves_the_label_from_old_holder_to_new() {
        let idx = listed(vec![
            pod("ns", "a", Some("db"), true),
            pod("ns", "b", Some("db"), false),
            pod("ns", "c", Some("db"), false),
        ]);
        assert_eq!(
            idx.plan("ns", "db", Some("b")),
            Some(LabelPlan {
                unlabel: vec!["a".into()],
                label: Some("b".into())
            })
        );
        // Holder unchanged and labelled: nothing to do.
        assert!(idx
            .plan("ns", "db", Some("a"))
            .is_some_and(|p| p.is_empty()));
        // Nobody holds: the label comes off.
        assert_eq!(
            idx.plan("ns", "db", None),
            Some(LabelPlan {
                unlabel: vec!["a".into()],
                label: None
            })
        );
        // A holder that is not a pod of the lease (a process outside the cluster) gets no label.
        assert_eq!(
            idx.plan("ns", "db", Some("laptop")),
            Some(LabelPlan {
                unlabel: vec!["a".into()],
                label: None
            })
        );
    }

    #[test]
    fn leases_and_namespaces_are_kept_apart() {
        let idx = listed(vec![
            pod("ns", "a", Some("db"), true),
            pod("ns", "q", Some("queue"), true),
            pod("other", "a", Some("db"), false),
            pod("ns", "plain", None, true),
        ]);
        assert_eq!(idx.len(), 3, "the pod without the annotation is not kept");
        assert_eq!(
            idx.plan("other", "db", Some("a")),
            Some(LabelPlan {
                unlabel: vec![],
                label: Some("a".into())
            })
        );
        assert!(idx
            .plan("ns", "queue", Some("q"))
            .is_some_and(|p| p.is_empty()));
        assert!(idx
            .plan("ns", "none", Some("a"))
            .is_some_and(|p| p.is_empty()));
    }

    #[test]
    fn watch_events_keep_the_index_current() {
        let mut idx = listed(vec![pod("ns", "a", Some("db"), false)]);
        // Our own label patch comes back as an Apply: the lease is looked at again.
        assert_eq!(
            idx.apply(&Event::Apply(pod("ns", "a", Some("db"), true))),
            vec![key("ns", "db")]
        );
        assert!(idx
            .plan("ns", "db", Some("a"))
            .is_some_and(|p| p.is_empty()));
        // An update that changes nothing we keep (other labels, status) triggers nothing.
        assert_eq!(
            idx.apply(&Event::Apply(pod("ns", "a", Some("db"), true))),
            Vec::<Key>::new()
        );
        // A new pod.
        assert_eq!(
            idx.apply(&Event::Apply(pod("ns", "b", Some("db"), false))),
            vec![key("ns", "db")]
        );
        // A pod moved to another lease: both leases are looked at.
        assert_eq!(
            idx.apply(&Event::Apply(pod("ns", "a", Some("queue"), true))),
            vec![key("ns", "db"), key("ns", "queue")]
        );
        assert_eq!(
            idx.plan("ns", "db", Some("b")),
            Some(LabelPlan {
                unlabel: vec![],
                label: Some("b".into())
            })
        );
        // Annotation removed: the pod leaves the index.
        assert_eq!(
            idx.apply(&Event::Apply(pod("ns", "a", None, true))),
            vec![key("ns", "queue")]
        );
        assert!(idx.plan("ns", "queue", None).is_some_and(|p| p.is_empty()));
        // Deleted.
        assert_eq!(
            idx.apply(&Event::Delete(pod("ns", "b", Some("db"), false))),
            vec![key("ns", "db")]
        );
        assert!(idx.is_empty());
        // Deleting what was never indexed is nothing.
        assert_eq!(
            idx.apply(&Event::Delete(pod("ns", "zz", None, false))),
            Vec::<Key>::new()
        );
    }

    #[test]
    fn a_relist_reports_only_what_changed_and_drops_the_vanished() {
        let mut idx = listed(vec![
            pod("ns", "a", Some("db"), true),
            pod("ns", "b", Some("db"), false),
            pod("ns", "q", Some("queue"), false),
        ]);
        idx.apply(&Event::Init);
        idx.apply(&Event::InitApply(pod("ns", "b", Some("db"), false)));
        idx.apply(&Event::InitApply(pod("ns", "q", Some("queue"), false)));
        // During the relist the old view still answers.
        assert!(idx
            .plan("ns", "db", Some("a"))
            .is_some_and(|p| p.is_empty()));
        // "a" vanished while the watch was down.
        assert_eq!(idx.apply(&Event::InitDone), vec![key("ns", "db")]);
        assert_eq!(
            idx.plan("ns", "db", Some("b")),
            Some(LabelPlan {
                unlabel: vec![],
                label: Some("b".into())
            })
        );
    }

    #[test]
    fn slim_keeps_only_what_the_index_reads() {
        let mut p = pod("ns", "a", Some("db"), true);
        slim(&mut p);
        let a = p.metadata.annotations.as_ref().map(|a| a.len());
        let l = p.metadata.labels.as_ref().map(|l| l.len());
        assert_eq!((a, l), (Some(1), Some(1)));
        let mut idx = listed(vec![p]);
        assert_eq!(idx.len(), 1);
        assert!(idx
            .plan("ns", "db", Some("a"))
            .is_some_and(|p| p.is_empty()));
        assert_eq!(
            idx.apply(&Event::Delete(pod("ns", "a", Some("db"), true))),
            vec![key("ns", "db")]
        );
    }
}
