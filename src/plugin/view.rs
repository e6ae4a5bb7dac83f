//! What `status` and `who` show, decided from fetched objects without I/O.

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde::Serialize;

use crate::api::{lease_of, FencedLease, LEADER_ROLE, ROLE_LABEL};

/// One lease as `status` shows it (and prints with `-o json`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct LeaseRow {
    pub namespace: String,
    pub name: String,
    pub holder: Option<String>,
    /// The holder's fencing token; None while the lease is free or the new holder has not
    /// renewed yet (it does not act as leader before that).
    pub token: Option<i64>,
    /// Seconds since `status.renewTime` (the holder's clock: informational).
    pub renewed_seconds_ago: Option<i64>,
    pub lease_duration_seconds: i32,
    pub preferred_holder: Option<String>,
    pub candidates: Vec<Candidate>,
    pub conditions: Vec<ConditionRow>,
}

/// A pod annotated for the lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Candidate {
    pub name: String,
    pub ready: bool,
    /// Carries the leader label the controller moves to the holder's pod.
    pub leader: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ConditionRow {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
}

/// The token of the current holder: `status.token` when the status names the spec's holder.
pub(super) fn held_token(lease: &FencedLease) -> Option<i64> {
    let holder = lease.holder()?;
    let status = lease.status.as_ref()?;
    (status.holder_identity.as_deref() == Some(holder))
        .then_some(status.token)
        .flatten()
}

fn condition_true(lease: &FencedLease, type_: &str) -> bool {
    lease.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == type_ && c.status == "True")
    })
}

fn is_ready(pod: &Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn is_leader(pod: &Pod) -> bool {
    pod.labels().get(ROLE_LABEL).map(String::as_str) == Some(LEADER_ROLE)
}

/// The pods of `pods` that campaign for `lease` (same namespace, `fencedlease.io/lease`
/// annotation naming it), by name.
pub(super) fn candidates(lease: &FencedLease, pods: &[Pod]) -> Vec<Candidate> {
    let ns = lease.namespace();
    let name = lease.name_any();
    let mut out: Vec<Candidate> = pods
        .iter()
        .filter(|p| p.namespace() == ns && lease_of(&p.metadata) == Some(name.as_str()))
        .map(|p| Candidate {
            name: p.name_any(),
            ready: is_ready(p),
            leader: is_leader(p),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The row for one lease, at `now`.
pub(super) fn lease_row(lease: &FencedLease, pods: &[Pod], now: Timestamp) -> LeaseRow {
    let status = lease.status.clone().unwrap_or_default();
    let renewed_seconds_ago = status.renew_time.as_ref().map(|t| {
        let ago = now.as_second() - t.0.as_second();
        ago.max(0)
    });
    LeaseRow {
        namespace: lease.namespace().unwrap_or_default(),
        name: lease.name_any(),
        holder: lease.holder().map(str::to_string),
        token: held_token(lease),
        renewed_seconds_ago,
        lease_duration_seconds: lease.spec.lease_duration_seconds,
        preferred_holder: lease
            .spec
            .preferred_holder
            .clone()
            .filter(|p| !p.is_empty()),
        candidates: candidates(lease, pods),
        conditions: status
            .conditions
            .iter()
            .map(|c| ConditionRow {
                type_: c.type_.clone(),
                status: c.status.clone(),
                reason: c.reason.clone(),
                message: c.message.clone(),
            })
            .collect(),
    }
}

/// Rows for all leases, sorted by namespace and name.
pub(super) fn lease_rows(leases: &[FencedLease], pods: &[Pod], now: Timestamp) -> Vec<LeaseRow> {
    let mut rows: Vec<LeaseRow> = leases.iter().map(|l| lease_row(l, pods, now)).collect();
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    rows
}

/// A duration as kubectl prints ages: `42s`, `3m5s`, `2h7m`, `4d3h`.
pub(super) fn age(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86400, s % 86400 / 3600),
    }
}

fn candidate_cell(c: &[Candidate]) -> String {
    if c.is_empty() {
        return "<none>".into();
    }
    let one = |c: &Candidate| {
        let ready = if c.ready { "ready" } else { "not ready" };
        let leader = if c.leader { ", leader" } else { "" };
        format!("{} ({ready}{leader})", c.name)
    };
    c.iter().map(one).collect::<Vec<_>>().join(", ")
}

fn conditions_cell(row: &LeaseRow) -> String {
    let held: Vec<&str> = row
        .conditions
        .iter()
        .filter(|c| c.status == "True")
        .map(|c| c.type_.as_str())
        .collect();
    if held.is_empty() {
        "<none>".into()
    } else {
        held.join(",")
    }
}

fn cells(row: &LeaseRow, with_namespace: bool) -> Vec<String> {
    let dash = || "-".to_string();
    let mut out = Vec::with_capacity(8);
    if with_namespace {
        out.push(row.namespace.clone());
    }
    out.push(row.name.clone());
    out.push(row.holder.clone().unwrap_or_else(|| "<free>".into()));
    out.push(row.token.map_or_else(dash, |t| t.to_string()));
    out.push(
        row.renewed_seconds_ago
            .map_or_else(dash, |s| format!("{} ago", age(s))),
    );
    out.push(format!("{}s", row.lease_duration_seconds));
    out.push(conditions_cell(row));
    out.push(candidate_cell(&row.candidates));
    out
}

/// The `status` table: one line per lease, columns padded (the last one is not).
pub(super) fn table(rows: &[LeaseRow], with_namespace: bool) -> String {
    let mut header = vec![
        "NAME",
        "HOLDER",
        "TOKEN",
        "RENEWED",
        "DURATION",
        "CONDITIONS",
        "CANDIDATES",
    ];
    if with_namespace {
        header.insert(0, "NAMESPACE");
    }
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    lines.extend(rows.iter().map(|r| cells(r, with_namespace)));
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            lines
                .iter()
                .map(|l| l[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for line in &lines {
        let last = line.len() - 1;
        for (i, cell) in line.iter().enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}   ", w = widths[i]));
            }
        }
        out.push('\n');
    }
    out
}

/// Why `who` has no holder to name.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoHolder {
    #[error("nobody holds lease {0}")]
    Free(String),
    #[error("{holder} is taking lease {lease} over and has not renewed yet (no token yet); ask again in a moment")]
    Acquiring { lease: String, holder: String },
    #[error("{holder} held lease {lease} with token {token} but stopped renewing (Expired); it is revoked or taken over soon")]
    Expired {
        lease: String,
        holder: String,
        token: i64,
    },
}

/// The `who` line, `HOLDER TOKEN`, or why there is none.
pub(super) fn who(lease: &FencedLease) -> Result<String, NoHolder> {
    let name = format!(
        "{}/{}",
        lease.namespace().unwrap_or_default(),
        lease.name_any()
    );
    let Some(holder) = lease.holder() else {
        return Err(NoHolder::Free(name));
    };
    let holder = holder.to_string();
    let Some(token) = held_token(lease) else {
        return Err(NoHolder::Acquiring {
            lease: name,
            holder,
        });
    };
    if condition_true(lease, "Expired") {
        return Err(NoHolder::Expired {
            lease: name,
            holder,
            token,
        });
    }
    Ok(format!("{holder} {token}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{Condition, FencedLeaseSpec, FencedLeaseStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};

    fn lease(holder: Option<&str>, status_holder: Option<&str>, token: Option<i64>) -> FencedLease {
        let mut l = FencedLease::new("db", FencedLeaseSpec::free());
        l.metadata.namespace = Some("prod".into());
        l.spec.holder_identity = holder.map(str::to_string);
        l.status = Some(FencedLeaseStatus {
            holder_identity: status_holder.map(str::to_string),
            token,
            renew_time: Some(MicroTime("2026-01-01T00:00:00Z".parse().unwrap())),
            ..Default::default()
        });
        l
    }

    fn pod(ns: &str, name: &str, lease: &str, ready: bool, leader: bool) -> Pod {
        let ready = if ready { "True" } else { "False" };
        let mut labels = serde_json::Map::new();
        if leader {
            labels.insert(ROLE_LABEL.into(), LEADER_ROLE.into());
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": ns, "name": name, "labels": labels,
                         "annotations": {crate::api::LEASE_ANNOTATION: lease}},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}
        }))
        .unwrap()
    }

    fn condition(type_: &str, status: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: "R".into(),
            message: "m".into(),
            last_transition_time: Time("2026-01-01T00:00:00Z".parse().unwrap()),
            observed_generation: None,
        }
    }

    #[test]
    fn ages_read_like_kubectl() {
        assert_eq!(age(-3), "0s");
        assert_eq!(age(42), "42s");
        assert_eq!(age(185), "3m5s");
        assert_eq!(age(7620), "2h7m");
        assert_eq!(age(4 * 86400 + 3 * 3600 + 5), "4d3h");
    }

    #[test]
    fn the_token_is_the_holders_only_once_it_renewed() {
        assert_eq!(held_token(&lease(Some("a"), Some("a"), Some(7))), Some(7));
        // Just acquired: the status still names the previous holder.
        assert_eq!(held_token(&lease(Some("b"), Some("a"), Some(7))), None);
        assert_eq!(held_token(&lease(None, None, None)), None);
    }

    #[test]
    fn candidates_are_the_pods_annotated_for_this_lease_in_its_namespace() {
        let l = lease(Some("db-1"), Some("db-1"), Some(3));
        let pods = [
            pod("prod", "db-1", "db", true, true),
            pod("prod", "db-0", "db", false, false),
            pod("prod", "web-0", "web", true, false),
            pod("dev", "db-9", "db", true, false),
        ];
        let names: Vec<_> = candidates(&l, &pods).into_iter().map(|c| c.name).collect();
        assert_eq!(names, ["db-0", "db-1"]);
    }

    #[test]
    fn the_table_shows_holder_token_renewal_conditions_and_candidates() {
        let mut l = lease(Some("db-1"), Some("db-1"), Some(3));
        if let Some(s) = l.status.as_mut() {
            s.conditions = vec![condition("Held", "True"), condition("Expired", "False")];
        }
        let pods = [
            pod("prod", "db-1", "db", true, true),
            pod("prod", "db-0", "db", false, false),
        ];
        let now: Timestamp = "2026-01-01T00:00:04Z".parse().unwrap();
        let rows = lease_rows(&[l, lease(None, None, None)], &pods, now);
        let t = table(&rows, true);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[0].starts_with("NAMESPACE   NAME   HOLDER   TOKEN"),
            "{t}"
        );
        let held = lines.iter().find(|l| l.contains("db-1 (")).unwrap();
        for part in [
            "db-1",
            " 3 ",
            "4s ago",
            "15s",
            "Held ",
            "db-0 (not ready), db-1 (ready, leader)",
        ] {
            assert!(held.contains(part), "{part:?} missing from {held:?}");
        }
        assert!(
            !held.contains("Expired"),
            "only true conditions are listed: {held}"
        );
        assert!(t.contains("<free>"), "{t}");
    }

    #[test]
    fn who_names_the_holder_or_says_why_not() {
        assert_eq!(who(&lease(Some("a"), Some("a"), Some(7))).unwrap(), "a 7");
        assert_eq!(
            who(&lease(None, None, None)),
            Err(NoHolder::Free("prod/db".into()))
        );
        assert!(matches!(
            who(&lease(Some("b"), Some("a"), Some(7))),
            Err(NoHolder::Acquiring { .. })
        ));
        let mut expired = lease(Some("a"), Some("a"), Some(7));
        if let Some(s) = expired.status.as_mut() {
            s.conditions = vec![condition("Expired", "True")];
        }
        assert!(matches!(
            who(&expired),
            Err(NoHolder::Expired { token: 7, .. })
        ));
    }
}
