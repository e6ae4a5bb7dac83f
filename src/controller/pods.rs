//! Which pods belong to which FencedLease, which of them carry the leader label, and what
//! Kubernetes says of their lives (for [`crate::controller::holder`]).
//!
//! The controller moves `fencedlease.io/role: leader` to the pod that holds a lease. Asking the
//! API server which pods are labelled on every change of holder costs a LIST per lease, which
//! after a restart with 10,000 leases is 10,000 LISTs before any status is written. Instead the
//! controller keeps this index, fed by one watch of pods: a label move is decided without a
//! request, and a request is made only when a label has to change. The same index says whether
//! a holder's pod is gone, finished, or its campaigning container stopped or restarted; each pod
//! is slimmed to those few fields as it arrives, so a watch of every pod stays small in memory.
//!
//! "Gone" needs memory: a pod of a lease that is deleted leaves a tombstone (a bounded number,
//! the oldest dropped), removed when a pod of that name appears again. A controller that starts
//! after the deletion has no tombstone, and the lease is waited out.
//!
//! The index is pure (no I/O): it takes watch events and answers questions, so it is tested
//! without a server.

use std::collections::{BTreeSet, HashMap, VecDeque};

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::runtime::watcher::Event;

use crate::api::SIDECAR_CONTAINER as CONTAINER;
use crate::api::{
    lease_of, CAMPAIGN_CONTAINER_ANNOTATION, LEADER_ROLE, LEASE_ANNOTATION, ROLE_LABEL,
};
use crate::controller::holder::{Campaigner, Finished, HolderPod, PodState};

/// How many deleted pods the index remembers as gone.
pub(crate) const MAX_TOMBSTONES: usize = 4096;

/// (namespace, name)
pub(crate) type Key = (String, String);

#[derive(Clone, Debug, PartialEq, Eq)]
struct PodInfo {
    /// The FencedLease the pod campaigns for (its `fencedlease.io/lease` annotation).
    lease: String,
    /// Whether it carries `fencedlease.io/role: leader`.
    leader: bool,
    /// What Kubernetes says of its life.
    state: PodState,
}

/// What to change so that exactly the holder's pod carries the leader label.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct LabelPlan {
    /// Pods of the lease that carry the label but do not hold the lease: unlabel these first.
    pub unlabel: Vec<String>,
    /// The holder's pod, when it belongs to the lease and is not labelled yet.
    pub label: Option<String>,
}

impl LabelPlan {
    pub(crate) fn is_empty(&self) -> bool {
        self.unlabel.is_empty() && self.label.is_none()
    }
}

/// Deleted pods of leases, (namespace, name) -> lease, at most [`MAX_TOMBSTONES`].
#[derive(Debug, Default)]
struct Tombstones {
    lease_of: HashMap<Key, String>,
    /// Oldest first; every key in `lease_of` once.
    order: VecDeque<Key>,
}

impl Tombstones {
    fn bury(&mut self, key: Key, lease: String) {
        if self.lease_of.insert(key.clone(), lease).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > MAX_TOMBSTONES {
            if let Some(old) = self.order.pop_front() {
                self.lease_of.remove(&old);
            }
        }
    }

    /// A pod of that name exists (again).
    fn raise(&mut self, key: &Key) {
        if self.lease_of.remove(key).is_some() {
            self.order.retain(|k| k != key);
        }
    }
}

/// The index. Pods without the lease annotation are not kept.
#[derive(Debug, Default)]
pub(crate) struct PodIndex {
    pods: HashMap<Key, PodInfo>,
    /// (namespace, lease) -> names of its pods.
    by_lease: HashMap<Key, BTreeSet<String>>,
    /// Pods seen so far during a (re)list; swapped in when the list is complete.
    listing: Option<HashMap<Key, PodInfo>>,
    /// A complete list has been seen: until then the index answers nothing, because acting
    /// on part of the pods could label a new holder while an unseen old one is still labelled.
    ready: bool,
    gone: Tombstones,
}

/// The name of the container that campaigns in `pod`.
fn campaigning_container(pod: &Pod) -> &str {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(CAMPAIGN_CONTAINER_ANNOTATION))
        .map_or(CONTAINER, String::as_str)
}

/// The status of the container that campaigns (a container or, for a native sidecar, an init
/// container).
fn campaigner_status(pod: &Pod) -> Option<&ContainerStatus> {
    let name = campaigning_container(pod);
    let status = pod.status.as_ref()?;
    let lists = [&status.container_statuses, &status.init_container_statuses];
    lists
        .into_iter()
        .flatten()
        .flatten()
        .find(|c| c.name == name)
}

fn campaigner(pod: &Pod) -> Campaigner {
    let Some(c) = campaigner_status(pod) else {
        return Campaigner::Unknown;
    };
    let state = c.state.as_ref();
    if let Some(since) = state
        .and_then(|s| s.running.as_ref())
        .and_then(|r| r.started_at.as_ref())
    {
        return Campaigner::Running { since: since.0 };
    }
    let terminated = state.and_then(|s| s.terminated.as_ref()).or_else(|| {
        // Waiting to restart after a run that ended.
        let waiting = state.is_some_and(|s| s.waiting.is_some());
        waiting
            .then(|| c.last_state.as_ref()?.terminated.as_ref())
            .flatten()
    });
    match terminated.and_then(|t| t.finished_at.as_ref()) {
        Some(finished) => Campaigner::Stopped {
            finished: finished.0,
        },
        None => Campaigner::Unknown,
    }
}

/// What Kubernetes says of a pod's life, as [`crate::controller::holder`] reads it.
pub(crate) fn pod_state(pod: &Pod) -> PodState {
    let finished = match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
        Some("Failed") => Some(Finished::Failed),
        Some("Succeeded") => Some(Finished::Succeeded),
        _ => None,
    };
    PodState {
        finished,
        deleting: pod.metadata.deletion_timestamp.is_some(),
        campaigner: campaigner(pod),
    }
}

fn info_of(pod: &Pod) -> Option<(Key, Option<PodInfo>)> {
    let m = &pod.metadata;
    let key = (m.namespace.clone()?, m.name.clone()?);
    let leader = m
        .labels
        .as_ref()
        .and_then(|l| l.get(ROLE_LABEL))
        .is_some_and(|v| v == LEADER_ROLE);
    let info = lease_of(&pod.metadata).map(|lease| PodInfo {
        lease: lease.to_string(),
        leader,
        state: pod_state(pod),
    });
    Some((key, info))
}

/// Drops what the index never reads, so that a watch of every pod in a large cluster stays
/// small in memory: the lease and campaign-container annotations, the role label, the
/// deletionTimestamp, the phase and the campaigning container's status are kept.
pub(crate) fn slim(pod: &mut Pod) {
    let keep = campaigning_container(pod).to_string();
    pod.spec = None;
    let m = &mut pod.metadata;
    m.managed_fields = None;
    m.owner_references = None;
    m.finalizers = None;
    if let Some(a) = m.annotations.as_mut() {
        a.retain(|k, _| k == LEASE_ANNOTATION || k == CAMPAIGN_CONTAINER_ANNOTATION);
    }
    if let Some(l) = m.labels.as_mut() {
        l.retain(|k, _| k == ROLE_LABEL);
    }
    if let Some(s) = pod.status.as_mut() {
        let only = |list: &mut Option<Vec<ContainerStatus>>| {
            if let Some(l) = list.as_mut() {
                l.retain(|c| c.name == keep);
            }
        };
        only(&mut s.container_statuses);
        only(&mut s.init_container_statuses);
        s.ephemeral_container_statuses = None;
        s.conditions = None;
        s.pod_ips = None;
        s.message = None;
        s.reason = None;
    }
}

impl PodIndex {
    /// Number of pods that belong to some lease.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.pods.len()
    }

    /// Applies a watch event. Returns the leases, as (namespace, lease name), whose pods
    /// changed in a way that may call for a label move: the controller looks at them again.
    pub(crate) fn apply(&mut self, event: &Event<Pod>) -> Vec<Key> {
        match event {
            Event::Init => {
                self.listing = Some(HashMap::new());
                Vec::new()
            }
            Event::InitApply(pod) => {
                self.listed(pod);
                Vec::new()
            }
            Event::InitDone => self.list_done(),
            Event::Apply(pod) => self.applied(pod),
            Event::Delete(pod) => self.deleted(pod),
        }
    }

    /// A pod seen during a (re)list: kept aside until the list is complete.
    fn listed(&mut self, pod: &Pod) {
        if let Some((key, info)) = info_of(pod) {
            self.gone.raise(&key);
            let Some(info) = info else {
                return;
            };
            self.listing
                .get_or_insert_with(HashMap::new)
                .insert(key, info);
        }
    }

    /// The (re)list is complete: its pods replace the index. Returns the leases whose pods
    /// differ from before (all leases with pods, the first time).
    fn list_done(&mut self) -> Vec<Key> {
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
            // Deleted while the watch was down. (A pod listed again without the
            // annotation raised its tombstone already.)
            for (key, info) in old {
                if !self.pods.contains_key(&key) {
                    self.gone.bury(key, info.lease);
                }
            }
        }
        self.ready = true;
        changed.into_iter().collect()
    }

    /// A pod added or changed.
    fn applied(&mut self, pod: &Pod) -> Vec<Key> {
        match info_of(pod) {
            Some((key, Some(info))) => {
                self.gone.raise(&key);
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
            Some((key, None)) => {
                self.gone.raise(&key);
                self.remove(&key)
                    .map(|old| vec![(key.0, old.lease)])
                    .unwrap_or_default()
            }
            None => Vec::new(),
        }
    }

    /// A pod deleted: a pod of a lease leaves a tombstone.
    fn deleted(&mut self, pod: &Pod) -> Vec<Key> {
        match info_of(pod) {
            Some((key, info)) => {
                let old = self.remove(&key);
                let lease = old.map(|o| o.lease).or(info.map(|i| i.lease));
                let Some(lease) = lease else {
                    return Vec::new();
                };
                self.gone.bury(key.clone(), lease.clone());
                vec![(key.0, lease)]
            }
            None => Vec::new(),
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

    /// What the index knows of the pod named `holder` as a pod of `lease` in `namespace`.
    pub(crate) fn holder_pod(&self, namespace: &str, lease: &str, holder: &str) -> HolderPod {
        if !self.ready {
            return HolderPod::Unknown;
        }
        let key = (namespace.to_string(), holder.to_string());
        match self.pods.get(&key) {
            Some(info) if info.lease == lease => HolderPod::Present(info.state),
            Some(_) => HolderPod::NotAPod,
            None if self.gone.lease_of.get(&key).is_some_and(|l| l == lease) => HolderPod::Gone,
            None => HolderPod::NotAPod,
        }
    }

    /// What to change so that only the holder's pod (if it is a pod of this lease) carries the
    /// leader label. `None` until the index has seen a complete list of pods.
    pub(crate) fn plan(
        &self,
        namespace: &str,
        lease: &str,
        holder: Option<&str>,
    ) -> Option<LabelPlan> {
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

    fn pod(ns: &str, name: &str, lease: Option<&str>, leader: bool) -> Pod {
        let mut annotations = std::collections::BTreeMap::new();
        if let Some(l) = lease {
            annotations.insert(LEASE_ANNOTATION.to_string(), l.to_string());
        }
        annotations.insert("other".to_string(), "x".to_string());
        let mut labels = std::collections::BTreeMap::new();
        if leader {
            labels.insert(ROLE_LABEL.to_string(), LEADER_ROLE.to_string());
        }
        labels.insert("app".to_string(), "db".to_string());
        Pod {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                annotations: Some(annotations),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    fn key(ns: &str, lease: &str) -> Key {
        (ns.into(), lease.into())
    }

    fn listed(pods: Vec<Pod>) -> PodIndex {
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
        assert_eq!(idx.len(), 0);
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

    /// A pod of lease `db` whose status is `status` (JSON), with more than the index keeps.
    fn pod_with(name: &str, annotations: serde_json::Value, status: serde_json::Value) -> Pod {
        let mut a = serde_json::json!({LEASE_ANNOTATION: "db", "other": "x"});
        if let (Some(a), Some(more)) = (a.as_object_mut(), annotations.as_object()) {
            a.extend(more.clone());
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name, "annotations": a},
            "spec": {"containers": [{"name": "app", "image": "x"}]},
            "status": status,
        }))
        .expect("pod literal")
    }

    fn ts(s: &str) -> jiff::Timestamp {
        s.parse().expect("timestamp")
    }

    #[test]
    fn reads_the_life_of_the_campaigning_container() {
        let running = |at: &str| serde_json::json!({"running": {"startedAt": at}});
        let terminated = |at: &str| serde_json::json!({"terminated": {"exitCode": 1, "startedAt": "2027-01-01T00:00:00Z", "finishedAt": at}});
        let waiting = serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}});
        let status = |name: &str, state: serde_json::Value, last: serde_json::Value| {
            serde_json::json!({"phase": "Running", "containerStatuses": [
                {"name": "app", "ready": true, "restartCount": 0, "image": "x", "imageID": "",
                 "state": {"running": {"startedAt": "2027-01-01T00:00:00Z"}}},
                {"name": name, "ready": true, "restartCount": 1, "image": "x", "imageID": "",
                 "state": state, "lastState": last}]})
        };
        let named = serde_json::json!({CAMPAIGN_CONTAINER_ANNOTATION: "worker"});
        let none = serde_json::json!({});
        let at = "2027-01-01T00:05:00Z";
        // (annotations, status) -> what the index reads of the campaigner
        let table = [
            (
                none.clone(),
                status(CONTAINER, running(at), none.clone()),
                Campaigner::Running { since: ts(at) },
            ),
            (
                none.clone(),
                status(CONTAINER, terminated(at), none.clone()),
                Campaigner::Stopped { finished: ts(at) },
            ),
            (
                none.clone(),
                status(CONTAINER, waiting.clone(), terminated(at)),
                Campaigner::Stopped { finished: ts(at) },
            ),
            // Never ran yet.
            (
                none.clone(),
                status(CONTAINER, waiting.clone(), none.clone()),
                Campaigner::Unknown,
            ),
            // The app container is not the one that campaigns.
            (
                none.clone(),
                status("other", terminated(at), none.clone()),
                Campaigner::Unknown,
            ),
            // For `campaign` users the annotation names it.
            (
                named.clone(),
                status("worker", terminated(at), none.clone()),
                Campaigner::Stopped { finished: ts(at) },
            ),
            (
                named,
                status(CONTAINER, terminated(at), none.clone()),
                Campaigner::Unknown,
            ),
            // A native sidecar reports as an init container.
            (
                none.clone(),
                serde_json::json!({"initContainerStatuses": [
                    {"name": CONTAINER, "ready": true, "restartCount": 0, "image": "x",
                     "imageID": "", "state": running(at)}]}),
                Campaigner::Running { since: ts(at) },
            ),
            (none.clone(), none.clone(), Campaigner::Unknown),
        ];
        for (annotations, status, want) in table {
            let mut p = pod_with("a", annotations, status);
            assert_eq!(pod_state(&p).campaigner, want, "{:?}", p.status);
            // Slimming keeps what is read.
            slim(&mut p);
            assert_eq!(pod_state(&p).campaigner, want, "slimmed {:?}", p.status);
            let kept = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref());
            assert!(kept.is_none_or(|c| c.len() <= 1), "{kept:?}");
            assert!(p.spec.is_none());
        }
    }

    #[test]
    fn reads_phase_and_graceful_deletion() {
        for (phase, finished) in [
            ("Failed", Some(Finished::Failed)),
            ("Succeeded", Some(Finished::Succeeded)),
            ("Running", None),
            ("Pending", None),
            ("Unknown", None),
        ] {
            let mut p = pod_with(
                "a",
                serde_json::json!({}),
                serde_json::json!({"phase": phase}),
            );
            slim(&mut p);
            assert_eq!(pod_state(&p).finished, finished, "{phase}");
            assert!(!pod_state(&p).deleting);
        }
        let mut p = pod("ns", "a", Some("db"), false);
        p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            ts("2027-01-01T00:00:00Z"),
        ));
        slim(&mut p);
        assert!(pod_state(&p).deleting);
    }

    #[test]
    fn a_deleted_pod_of_a_lease_is_gone_until_one_of_its_name_appears() {
        let mut idx = PodIndex::default();
        assert_eq!(idx.holder_pod("ns", "db", "a"), HolderPod::Unknown);
        idx = listed(vec![
            pod("ns", "a", Some("db"), true),
            pod("ns", "q", Some("queue"), false),
            pod("ns", "plain", None, false),
        ]);
        assert!(matches!(
            idx.holder_pod("ns", "db", "a"),
            HolderPod::Present(_)
        ));
        // A pod of another lease, a pod of no lease, no pod at all: not a pod of this lease.
        for holder in ["q", "plain", "laptop"] {
            assert_eq!(
                idx.holder_pod("ns", "db", holder),
                HolderPod::NotAPod,
                "{holder}"
            );
        }
        idx.apply(&Event::Delete(pod("ns", "a", Some("db"), true)));
        assert_eq!(idx.holder_pod("ns", "db", "a"), HolderPod::Gone);
        assert_eq!(idx.holder_pod("other", "db", "a"), HolderPod::NotAPod);
        assert_eq!(idx.holder_pod("ns", "queue", "a"), HolderPod::NotAPod);
        // A new incarnation (a StatefulSet's): present again.
        idx.apply(&Event::Apply(pod("ns", "a", Some("db"), false)));
        assert!(matches!(
            idx.holder_pod("ns", "db", "a"),
            HolderPod::Present(_)
        ));
        // A pod of that name without the annotation is not this lease's either.
        idx.apply(&Event::Delete(pod("ns", "a", Some("db"), false)));
        idx.apply(&Event::Apply(pod("ns", "a", None, false)));
        assert_eq!(idx.holder_pod("ns", "db", "a"), HolderPod::NotAPod);
        // The deleted pod of a plain name is not remembered.
        idx.apply(&Event::Delete(pod("ns", "plain", None, false)));
        assert_eq!(idx.holder_pod("ns", "db", "plain"), HolderPod::NotAPod);
    }

    #[test]
    fn a_relist_buries_the_pods_that_vanished_and_raises_those_back() {
        let mut idx = listed(vec![
            pod("ns", "a", Some("db"), true),
            pod("ns", "b", Some("db"), false),
        ]);
        idx.apply(&Event::Delete(pod("ns", "c", Some("db"), false)));
        idx.apply(&Event::Init);
        idx.apply(&Event::InitApply(pod("ns", "b", Some("db"), false)));
        idx.apply(&Event::InitApply(pod("ns", "c", Some("db"), false)));
        idx.apply(&Event::InitDone);
        assert_eq!(idx.holder_pod("ns", "db", "a"), HolderPod::Gone);
        assert!(matches!(
            idx.holder_pod("ns", "db", "c"),
            HolderPod::Present(_)
        ));
    }

    #[test]
    fn tombstones_are_bounded_and_drop_the_oldest() {
        let mut idx = listed(vec![]);
        for i in 0..MAX_TOMBSTONES + 10 {
            idx.apply(&Event::Delete(pod(
                "ns",
                &format!("p{i}"),
                Some("db"),
                false,
            )));
        }
        assert_eq!(idx.gone.lease_of.len(), MAX_TOMBSTONES);
        assert_eq!(idx.gone.order.len(), MAX_TOMBSTONES);
        assert_eq!(idx.holder_pod("ns", "db", "p0"), HolderPod::NotAPod);
        assert_eq!(idx.holder_pod("ns", "db", "p9"), HolderPod::NotAPod);
        assert_eq!(idx.holder_pod("ns", "db", "p10"), HolderPod::Gone);
        // Deleted twice (two incarnations): one tombstone.
        idx.apply(&Event::Delete(pod("ns", "p10", Some("db"), false)));
        assert_eq!(idx.gone.order.len(), MAX_TOMBSTONES);
    }

    #[test]
    fn a_change_of_life_is_a_change_for_the_lease() {
        let mut idx = listed(vec![pod_with(
            "a",
            serde_json::json!({}),
            serde_json::json!({"phase": "Running"}),
        )]);
        let failed = pod_with(
            "a",
            serde_json::json!({}),
            serde_json::json!({"phase": "Failed"}),
        );
        assert_eq!(idx.apply(&Event::Apply(failed)), vec![key("ns", "db")]);
    }
}
