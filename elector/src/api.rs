//! The `FencedLease` custom resource (`fencedlease.io/v1alpha1`).
//!
//! Doc comments on these types are user-facing: they become the `kubectl explain` text.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Spells a key of ours: the API group, a slash and `$name`. Every `fencedlease.io/` label and
/// annotation below is built with it, so the prefix is written once.
macro_rules! key {
    ($name:literal) => {
        concat!("fencedlease.io/", $name)
    };
}

/// API group of every fencedlease resource.
pub const GROUP: &str = "fencedlease.io";
/// The prefix of every label and annotation of ours (`fencedlease.io/`).
pub const KEY_PREFIX: &str = key!("");

// Labels and annotations: every `fencedlease.io/` key the product reads or writes is defined
// here, once.

/// Label on a protected object naming the FencedLease (same namespace) that guards it.
pub const LEASE_LABEL: &str = key!("lease");
/// Pod annotation naming the FencedLease (in the pod's namespace) the pod campaigns for: the
/// same key as [`LEASE_LABEL`], used on pods as an annotation.
pub const LEASE_ANNOTATION: &str = LEASE_LABEL;
/// Annotation carrying the writer's fencing token (the lease's `metadata.generation`).
pub const TOKEN_ANNOTATION: &str = key!("token");
/// Annotation carrying the lease UID the token belongs to (tokens restart on a re-created lease).
pub const LEASE_UID_ANNOTATION: &str = key!("lease-uid");
/// Annotation carrying a value new on every write (a UUID, say): the proof that the write
/// presented its token itself rather than inheriting the stored one.
pub const WRITE_ID_ANNOTATION: &str = key!("write-id");
/// Annotation announcing a delete of a protected object: a fenced update sets it to that same
/// update's [`WRITE_ID_ANNOTATION`], then the delete follows. A protected object is deleted only
/// while its last write announced the delete under the lease's current token, so a replaced
/// holder can neither announce a delete nor carry out one it announced before it was replaced.
pub const DELETE_INTENT_ANNOTATION: &str = key!("delete-intent");
/// Annotation on a FencedLease naming the process that holds it: written by the elector with
/// every acquisition, beside `spec.holderIdentity`. A tenure belongs to one process, so a
/// second process of the same identity (a StatefulSet pod re-created under its name) never
/// takes the first one's token for its own, nor the first one the second's.
pub const INCARNATION_ANNOTATION: &str = key!("holder-incarnation");
/// Annotation on a Namespace choosing the fencing mode for the protected objects in it:
/// `enforce` (default) or `warn`. Annotations on the protected objects themselves choose
/// nothing.
pub const MODE_ANNOTATION: &str = key!("fencing");
/// Label the controller moves to the pod that holds a lease (for Services that select the
/// leader).
pub const ROLE_LABEL: &str = key!("role");
/// The value of [`ROLE_LABEL`] on the pod that holds the lease.
pub const LEADER_ROLE: &str = "leader";

/// The FencedLease a pod campaigns for: its [`LEASE_ANNOTATION`], set at injection.
pub fn lease_of(pod: &ObjectMeta) -> Option<&str> {
    pod.annotations
        .as_ref()?
        .get(LEASE_ANNOTATION)
        .map(String::as_str)
}
/// Pod annotation naming the container that campaigns, for pods that run `fencedlease
/// campaign` themselves (default: the injected sidecar's name).
pub const CAMPAIGN_CONTAINER_ANNOTATION: &str = key!("campaign-container");
/// `"false"`, as a pod label or annotation, opts the pod out of injection.
pub const INJECT_ANNOTATION: &str = key!("inject");
/// Pod annotation: the injected sidecar's lease duration in seconds.
pub const DURATION_ANNOTATION: &str = key!("lease-duration");
/// Pod annotation: the injected sidecar's loopback API port.
pub const PORT_ANNOTATION: &str = key!("port");
/// Pod annotation: `"true"` makes the pod ready only while it leads.
pub const READY_ANNOTATION: &str = key!("ready-only-when-leader");
/// Pod annotation: the app's health URL, which the sidecar checks before it campaigns.
pub const HEALTH_ANNOTATION: &str = key!("app-health-url");
/// Pod annotation: `"true"` also runs the Kubernetes API proxy, on the sidecar port plus one.
pub const PROXY_ANNOTATION: &str = key!("proxy");
/// Pod annotations overriding the sidecar's resources: (annotation, requests|limits,
/// cpu|memory). The value is a Kubernetes quantity, or `none` to leave that entry out.
pub const RESOURCE_ANNOTATIONS: [(&str, &str, &str); 4] = [
    (key!("sidecar-cpu-request"), "requests", "cpu"),
    (key!("sidecar-memory-request"), "requests", "memory"),
    (key!("sidecar-cpu-limit"), "limits", "cpu"),
    (key!("sidecar-memory-limit"), "limits", "memory"),
];
/// Label on the ValidatingAdmissionPolicy objects of the policy mode: a hash of what they say.
pub const POLICY_LABEL: &str = key!("policy");
/// Label on the lease index's guard (a ValidatingAdmissionPolicy, `"true"`): its presence says a
/// release runs policy mode in the cluster (one may), and a controller in webhook mode then
/// leaves [`LEASE_INDEX_FINALIZER`] to that release's controller.
pub const INDEX_GUARD_LABEL: &str = key!("index-guard");
/// Namespace annotation, policy mode: the names of the namespace's FencedLeases, each between
/// slashes (`/a/b/`), kept by the active controller. The chart's index policy refuses a labelled
/// write whose lease it does not list; only the controller may change it.
pub const LEASE_INDEX_ANNOTATION: &str = key!("leases");
/// Finalizer on FencedLeases, policy mode: the active controller puts it on a lease before its
/// namespace's lease index lists it, and takes it off a deleted lease only once the index no
/// longer lists it. So a lease deleted while no controller runs stays, being deleted, until one
/// does: a lease being deleted elects nobody and the fence refuses every write it would judge.
/// A controller in webhook mode takes it off, unless a release runs policy mode.
pub const LEASE_INDEX_FINALIZER: &str = key!("lease-index");
/// Annotation on the webhook's certificate Secret: when its serving certificate expires.
pub const NOT_AFTER_ANNOTATION: &str = key!("not-after");
/// Annotation on the webhook's certificate Secret: the host names its certificate is for.
pub const HOSTS_ANNOTATION: &str = key!("hosts");

/// Is this a valid Kubernetes object name (DNS-1123 subdomain)?
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

// What an app can rely on in an injected pod.

/// The name of the injected sidecar container (and the default campaigning container, see
/// [`CAMPAIGN_CONTAINER_ANNOTATION`]).
pub const SIDECAR_CONTAINER: &str = "fencedlease";
/// The sidecar's default loopback API port (`http://127.0.0.1:8787`).
pub const SIDECAR_PORT: u16 = 8787;
/// The folder of the token files (`token`, `lease-uid`) in an injected pod's containers.
pub const TOKEN_DIR: &str = "/var/run/fencedlease";
/// The file in [`TOKEN_DIR`] that holds the pod's API secret: the sidecar's API (but its health
/// endpoints) and its Kubernetes API proxy answer only requests that send its contents as
/// `Authorization: Bearer SECRET`, so that a port-forward to the pod gets neither the token nor
/// the pod's write rights. The sidecar writes it at start and keeps it for the pod's life.
pub const API_SECRET_FILE: &str = "api-secret";
/// The environment variable that names the secret's path in an injected pod's app containers.
pub const API_SECRET_ENV: &str = "FENCEDLEASE_API_SECRET_FILE";
/// The file in [`TOKEN_DIR`] with the kubeconfig of the sidecar's Kubernetes API proxy (when
/// it runs one): its https:// address, its CA and the API secret, for standard clients.
pub const PROXY_KUBECONFIG_FILE: &str = "kubeconfig";
/// The environment variable that names that kubeconfig in an injected pod's app containers.
pub const PROXY_KUBECONFIG_ENV: &str = "FENCEDLEASE_KUBECONFIG";
/// The field manager of the controller's writes (server-side apply, status patches), also its
/// `app.kubernetes.io/managed-by` value on what it creates.
pub const FIELD_MANAGER: &str = "fencedlease-controller";
/// Default `spec.leaseDurationSeconds`.
pub const DEFAULT_LEASE_DURATION_SECONDS: i32 = 15;
/// Lower bound of `spec.leaseDurationSeconds`, enforced by the CRD schema.
pub const MIN_LEASE_DURATION_SECONDS: i32 = 1;
/// Upper bound of `spec.leaseDurationSeconds`, enforced by the CRD schema.
pub const MAX_LEASE_DURATION_SECONDS: i32 = 3600;

/// CEL validation rules of the CRD (`x-kubernetes-validations`), as (rule, message): the API
/// server enforces them from Kubernetes 1.25 (GA in 1.29), and the CRD for older servers
/// (`fencedlease crd --without-validation-rules`) leaves them out. Every writer of the product
/// keeps them: the holder writes `holderIdentity`, `token` and `leaseDurationSeconds` together
/// with every renewal, the controller clears the three together when the lease is free, and
/// only the holder changes `leaseTransitions`, by adding one when it takes over.
///
/// This one: `status.holderIdentity` and `status.token` are set together.
pub const STATUS_HOLDER_AND_TOKEN_TOGETHER: (&str, &str) = (
    "has(self.holderIdentity) == has(self.token)",
    "status.holderIdentity and status.token must be set together: the token is the named holder's",
);
/// CEL rule of the CRD (see [`STATUS_HOLDER_AND_TOKEN_TOGETHER`]): `status.leaseDurationSeconds`
/// is set only with `status.holderIdentity`.
pub const STATUS_DURATION_NEEDS_HOLDER: (&str, &str) = (
    "!has(self.leaseDurationSeconds) || has(self.holderIdentity)",
    "status.leaseDurationSeconds needs status.holderIdentity: it is the duration that holder renewed under",
);
/// CEL rule of the CRD (see [`STATUS_HOLDER_AND_TOKEN_TOGETHER`]): `status.leaseTransitions`
/// never decreases.
pub const TRANSITIONS_NEVER_DECREASE: (&str, &str) = (
    "self >= oldSelf",
    "status.leaseTransitions counts changes of holder and never decreases",
);

fn default_lease_duration_seconds() -> i32 {
    DEFAULT_LEASE_DURATION_SECONDS
}

fn default_true() -> bool {
    true
}

/// The desired owner of a FencedLease. Every change here (taking, releasing or handing over the
/// lease) increases `metadata.generation`, which is the fencing token.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "fencedlease.io",
    version = "v1alpha1",
    kind = "FencedLease",
    plural = "fencedleases",
    singular = "fencedlease",
    shortname = "flease",
    namespaced,
    status = "FencedLeaseStatus",
    doc = "A lease with a fencing token: at most one holder at a time, and a token that strictly increases on every change of holder. Ownership changes are written to the spec, so metadata.generation increases with each one: that generation is the fencing token. Renewals are written to the status subresource and never change the token. Send the token with every write to the resource you protect, and let the resource refuse tokens lower than the highest it has seen.",
    printcolumn = r#"{"name":"Holder","type":"string","jsonPath":".spec.holderIdentity","description":"Who holds the lease now"}"#,
    printcolumn = r#"{"name":"Token","type":"integer","jsonPath":".status.token","description":"Fencing token of the current holder (metadata.generation at acquisition)"}"#,
    printcolumn = r#"{"name":"Duration","type":"integer","jsonPath":".spec.leaseDurationSeconds","description":"Lease duration in seconds"}"#,
    printcolumn = r#"{"name":"Renewed","type":"date","jsonPath":".status.renewTime","description":"When the holder last renewed"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct FencedLeaseSpec {
    /// Identity of the current holder. Empty or absent means the lease is free. Candidates set
    /// it to take the lease (with a resourceVersion precondition), and clear it to release the
    /// lease; each such change increases metadata.generation, which is the fencing token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_identity: Option<String>,

    /// How long the lease stays valid without a renewal, in seconds (1 to 3600, default 15).
    /// Candidates take over a lease whose holder has not renewed for this long, measured on
    /// their own clocks; the holder stops acting as leader a safety margin earlier. A change
    /// reaches the holder with its next renewal; until then everyone waits for the longer of
    /// the new duration and the one the holder renewed under (status.leaseDurationSeconds).
    #[serde(default = "default_lease_duration_seconds")]
    #[schemars(range(min = MIN_LEASE_DURATION_SECONDS, max = MAX_LEASE_DURATION_SECONDS))]
    pub lease_duration_seconds: i32,

    /// Identity of a candidate that should hold the lease. When set to someone other than the
    /// holder, the holder steps down and this candidate gets the first chance to acquire the
    /// lease (a handover). Other candidates wait one lease duration before they compete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_holder: Option<String>,

    /// Whether the controller revokes the lease as soon as it knows the holder is dead, instead
    /// of waiting out the lease (default true). Known dead means: the holder's identity names a
    /// pod in this namespace annotated `fencedlease.io/lease: <this lease>`, and that pod was
    /// deleted (seen by the running controller), or its phase is Failed or Succeeded, or the
    /// container that campaigns (the injected sidecar, or the container named by the pod's
    /// `fencedlease.io/campaign-container` annotation) terminated or restarted after the holder
    /// acquired. A pod that is merely not Ready, on a NotReady node, or being deleted gracefully
    /// is not dead. Early revocation is safe with fencing: it moves the token on, so an old
    /// holder that still runs writes with a stale token. Set false to make the lease duration the
    /// only clock.
    #[serde(default = "default_true")]
    pub revoke_on_holder_death: bool,
}

impl FencedLeaseSpec {
    /// A spec with the documented defaults: free, 15 s lease, no preferred holder, revoked when
    /// the holder is known dead.
    pub fn free() -> Self {
        FencedLeaseSpec {
            holder_identity: None,
            lease_duration_seconds: DEFAULT_LEASE_DURATION_SECONDS,
            preferred_holder: None,
            revoke_on_holder_death: true,
        }
    }
}

/// The observed state of a FencedLease, kept by the holder (renewals) and by the controller
/// (conditions, expiry, transitions). `holderIdentity` and `token` are set together (the holder
/// writes both with every renewal; the controller clears both, and `leaseDurationSeconds`, when
/// the lease is free); servers from Kubernetes 1.25 refuse a status that breaks this.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": STATUS_HOLDER_AND_TOKEN_TOGETHER.0, "message": STATUS_HOLDER_AND_TOKEN_TOGETHER.1},
    {"rule": STATUS_DURATION_NEEDS_HOLDER.0, "message": STATUS_DURATION_NEEDS_HOLDER.1},
]))]
pub struct FencedLeaseStatus {
    /// The holder that `token` belongs to. Written by the holder when it acquires and renews.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_identity: Option<String>,

    /// The fencing token of the current holder: the metadata.generation its acquisition
    /// produced. Protected writes must carry exactly this token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<i64>,

    /// When the current holder acquired the lease (the holder's clock; informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquire_time: Option<MicroTime>,

    /// When the current holder last renewed (the holder's clock; informational). Candidates
    /// never compare it with their own clock: they only notice that it changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<MicroTime>,

    /// The lease duration, in seconds, that the holder named in `holderIdentity` last renewed
    /// under (written by the holder with every renewal). A holder cut off from the API server
    /// keeps acting on this duration, whatever the spec says meanwhile. So while it holds the
    /// lease, candidates and the controller wait for the longer of this and
    /// `spec.leaseDurationSeconds`: a shorter spec takes effect with the holder's next renewal,
    /// a longer one makes the others wait longer at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = MIN_LEASE_DURATION_SECONDS, max = MAX_LEASE_DURATION_SECONDS))]
    pub lease_duration_seconds: Option<i32>,

    /// When the lease expires unless renewed, as the controller observes it (the controller's
    /// clock; informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry_time: Option<Time>,

    /// How many times the lease has changed hands. It never decreases (servers from Kubernetes
    /// 1.25 refuse a status write that lowers it).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": TRANSITIONS_NEVER_DECREASE.0, "message": TRANSITIONS_NEVER_DECREASE.1},
    ]))]
    pub lease_transitions: i64,

    /// The metadata.generation this status was last reconciled against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// The lease's state in the Kubernetes style. Types: `Held` (someone holds a valid lease),
    /// `Expired` (the holder stopped renewing), `Released` (the lease is free),
    /// `HandoverPending` (a preferredHolder was asked for and has not taken over yet).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// One aspect of a FencedLease's state.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// The kind of condition: Held, Expired or Released.
    #[serde(rename = "type")]
    pub type_: String,
    /// True, False or Unknown.
    pub status: String,
    /// A CamelCase word for why the condition last changed.
    pub reason: String,
    /// A sentence for people on why the condition last changed.
    pub message: String,
    /// When the condition last changed status.
    pub last_transition_time: Time,
    /// The metadata.generation the condition was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

impl FencedLease {
    /// The fencing token: `metadata.generation`, which the API server increases on every spec
    /// change (and so on every change of holder).
    pub fn token(&self) -> Option<i64> {
        self.metadata.generation
    }

    /// `status.leaseDurationSeconds` when it belongs to the current holder (the status names
    /// the same holder as the spec); None while the lease is free, and between an acquisition
    /// and the new holder's first renewal (it does not act as leader before that).
    pub fn holder_lease_duration_seconds(&self) -> Option<i32> {
        let holder = self.holder()?;
        let status = self.status.as_ref()?;
        if status.holder_identity.as_deref() == Some(holder) {
            status.lease_duration_seconds
        } else {
            None
        }
    }

    /// The process that acquired the lease ([`INCARNATION_ANNOTATION`]), if recorded.
    pub fn holder_incarnation(&self) -> Option<&str> {
        self.metadata
            .annotations
            .as_ref()?
            .get(INCARNATION_ANNOTATION)
            .map(String::as_str)
    }

    /// Frees the lease in this copy: no holder, and no incarnation beside it (so that a later
    /// writer that names a holder without an incarnation never inherits the previous one's).
    pub fn clear_holder(&mut self) {
        self.spec.holder_identity = None;
        if let Some(a) = self.metadata.annotations.as_mut() {
            a.remove(INCARNATION_ANNOTATION);
        }
    }

    /// The current holder, treating an empty string as none.
    pub fn holder(&self) -> Option<&str> {
        self.spec
            .holder_identity
            .as_deref()
            .filter(|h| !h.is_empty())
    }
}
