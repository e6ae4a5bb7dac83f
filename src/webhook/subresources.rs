//! Which subresource writes the fencing judges, and how: one table. The webhook's parsing
//! follows it ([`route`]); the chart's webhook rules (`templates/webhooks.yaml`, through
//! `fencedlease.judgedSubresources`) and the policy's (`templates/fencing-policy.yaml`) cannot
//! read Rust, so tests/chart_subresources.rs renders them and checks them against [`TABLE`], and
//! the test webhook of tests/common/webhook.rs registers its rules from it.
//!
//! To protect a new subresource: add a row here, then the chart's helper; the test says what
//! the chart lacks.

use kube::core::admission::Operation;

use crate::webhook::decision::Denial;

/// How a write to a subresource is judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Judged {
    /// The write carries the object itself, labels and annotations included: judged like a
    /// write to the object, by the object's own stamp. Routed by the fencing webhook's
    /// objectSelector, and by the policy.
    LikeTheObject,
    /// The write carries an object with no labels of its own (a Scale, a Binding), so no token
    /// can be presented with it: the webhook reads the object it acts on (the parent) and
    /// refuses the write when that object is protected. Routed by the second webhook, which has
    /// no objectSelector; the policy cannot read a third object, so it does not judge these.
    ByItsParent(Via),
}

/// The writes judged by their parent (see [`Judged::ByItsParent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// An update of `/scale` (a Scale object) of any fenced type: changes the replicas.
    Scale,
    /// A pod's binding to a node (`pods/binding`, or a Binding created through the legacy
    /// `bindings` resource): only the scheduler, exempt, binds a protected pod.
    Binding,
}

impl Via {
    /// The subresource as a refusal's message names it.
    pub(super) fn path(self) -> &'static str {
        match self {
            Via::Scale => "scale",
            Via::Binding => "binding",
        }
    }

    /// What a refusal counts as.
    pub(super) fn denial(self) -> Denial {
        match self {
            Via::Scale => Denial::Scale,
            Via::Binding => Denial::Binding,
        }
    }
}

/// The types a row applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applies {
    /// Every fenced type (`fencing.resources`).
    EveryFencedType,
    /// Pods, when pods are fenced.
    Pods,
}

/// One judged subresource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Subresource {
    pub applies: Applies,
    /// The resource as a webhook rule names it, `*` standing for the fenced type: `*/status`,
    /// `pods/binding`; `bindings` is the legacy resource that binds a pod.
    pub rule: &'static str,
    /// The operation the rule routes (`UPDATE` or `CREATE`).
    pub operation: &'static str,
    pub judged: Judged,
}

/// Every subresource the fencing judges. A subresource not listed is not judged: its writes
/// are not sent to the webhook.
pub const TABLE: &[Subresource] = &[
    Subresource {
        applies: Applies::EveryFencedType,
        rule: "*/status",
        operation: "UPDATE",
        judged: Judged::LikeTheObject,
    },
    Subresource {
        applies: Applies::Pods,
        rule: "pods/ephemeralcontainers",
        operation: "UPDATE",
        judged: Judged::LikeTheObject,
    },
    Subresource {
        applies: Applies::Pods,
        rule: "pods/resize",
        operation: "UPDATE",
        judged: Judged::LikeTheObject,
    },
    Subresource {
        applies: Applies::EveryFencedType,
        rule: "*/scale",
        operation: "UPDATE",
        judged: Judged::ByItsParent(Via::Scale),
    },
    Subresource {
        applies: Applies::Pods,
        rule: "pods/binding",
        operation: "CREATE",
        judged: Judged::ByItsParent(Via::Binding),
    },
    Subresource {
        applies: Applies::Pods,
        rule: "bindings",
        operation: "CREATE",
        judged: Judged::ByItsParent(Via::Binding),
    },
];

impl Subresource {
    /// The rule's resource for the fenced type `resource`, or None when the row does not apply
    /// to it (pods' rows for another type).
    pub fn rule_for(&self, group: &str, resource: &str) -> Option<String> {
        let pods = group.is_empty() && matches!(resource, "pods" | "*");
        match self.applies {
            Applies::Pods if !pods => None,
            Applies::Pods => Some(self.rule.to_string()),
            Applies::EveryFencedType => Some(self.rule.replacen('*', resource, 1)),
        }
    }

    /// Whether a review's (group, resource, subresource, operation) is this row's.
    fn matches(&self, group: &str, resource: &str, sub: Option<&str>, op: &Operation) -> bool {
        let op_ok = match op {
            Operation::Create => self.operation == "CREATE",
            Operation::Update => self.operation == "UPDATE",
            _ => false,
        };
        let (parent, name) = match self.rule.split_once('/') {
            Some((p, n)) => (p, Some(n)),
            None => (self.rule, None),
        };
        let parent_ok = match self.applies {
            Applies::EveryFencedType => parent == "*",
            Applies::Pods => group.is_empty() && parent == resource,
        };
        op_ok && parent_ok && name == sub
    }
}

/// How a write to `resource`'s subresource `sub` is judged: None when it is not in the table
/// (a write to the object itself, `sub` None, is judged like the object; anything else the
/// webhook is not sent).
pub fn route(group: &str, resource: &str, sub: Option<&str>, op: &Operation) -> Option<Judged> {
    TABLE
        .iter()
        .find(|s| s.matches(group, resource, sub, op))
        .map(|s| s.judged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_write_is_routed_by_its_row() {
        let (c, u, d) = (Operation::Create, Operation::Update, Operation::Delete);
        let like = Some(Judged::LikeTheObject);
        let scale = Some(Judged::ByItsParent(Via::Scale));
        let binding = Some(Judged::ByItsParent(Via::Binding));
        type Row<'a> = (
            &'a str,
            &'a str,
            Option<&'a str>,
            &'a Operation,
            Option<Judged>,
        );
        let table: &[Row] = &[
            ("apps", "deployments", Some("scale"), &u, scale),
            ("", "replicationcontrollers", Some("scale"), &u, scale),
            ("example.com", "widgets", Some("scale"), &u, scale),
            ("apps", "deployments", Some("scale"), &c, None),
            ("", "pods", Some("binding"), &c, binding),
            ("", "bindings", None, &c, binding),
            ("example.com", "bindings", None, &c, None),
            ("", "pods", Some("binding"), &u, None),
            ("", "pods", Some("ephemeralcontainers"), &u, like),
            ("", "pods", Some("resize"), &u, like),
            ("", "pods", Some("status"), &u, like),
            ("apps", "deployments", Some("status"), &u, like),
            ("example.com", "pods", Some("resize"), &u, None),
            ("", "configmaps", Some("resize"), &u, None),
            ("", "pods", Some("status"), &d, None),
            ("", "pods", Some("eviction"), &c, None),
            ("", "pods", None, &u, None),
        ];
        for (group, resource, sub, op, want) in table {
            assert_eq!(
                route(group, resource, *sub, op),
                *want,
                "{group}/{resource}/{sub:?} {op:?}"
            );
        }
    }

    #[test]
    fn rules_name_the_fenced_type_and_pods_rows_apply_to_pods_only() {
        let rules = |group: &str, resource: &str| -> Vec<String> {
            TABLE
                .iter()
                .filter_map(|s| s.rule_for(group, resource))
                .collect()
        };
        assert_eq!(
            rules("apps", "deployments"),
            ["deployments/status", "deployments/scale"]
        );
        assert_eq!(
            rules("", "pods"),
            [
                "pods/status",
                "pods/ephemeralcontainers",
                "pods/resize",
                "pods/scale",
                "pods/binding",
                "bindings"
            ]
        );
    }
}
