//! Sidecar injection as pure functions: [`inject`] decides whether and what to add to a pod (or
//! refuses, with a message for its author), and [`patch`] turns that into explicit JSON Patch
//! `add` operations against the pod as sent. Idempotent: an injected pod is left alone.

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation};
use serde::de::{IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::admission::OurKeys;

use crate::api::{
    valid_name, API_SECRET_ENV, API_SECRET_FILE, DEFAULT_LEASE_DURATION_SECONDS,
    DURATION_ANNOTATION, HEALTH_ANNOTATION, INJECT_ANNOTATION, LEASE_ANNOTATION,
    MAX_LEASE_DURATION_SECONDS, MIN_LEASE_DURATION_SECONDS, PORT_ANNOTATION, PROXY_ANNOTATION,
    PROXY_KUBECONFIG_ENV, PROXY_KUBECONFIG_FILE, READY_ANNOTATION, RESOURCE_ANNOTATIONS,
};

/// Why a pod is refused injection. Each message is for the pod's author: what is wrong and what
/// to write instead.
#[derive(Debug, thiserror::Error)]
pub(super) enum InjectError {
    #[error("the pod has no spec")]
    NoSpec,
    #[error(
        "fencedlease: refusing to inject the sidecar into a hostNetwork pod: its 127.0.0.1 is the \
         node's, so any process on the node could read the fencing token from the sidecar's API \
         and write with it through the sidecar's API proxy. Run the workload without \
         hostNetwork, or opt the pod out with the label {INJECT_ANNOTATION}: \"false\" and run \
         its command under `fencedlease campaign --lease LEASE -- CMD` (the token then goes to \
         the command alone, in its environment)"
    )]
    HostNetwork,
    #[error(
        "fencedlease: the pod has {0} containers; the sidecar is injected into pods of at \
         most {MAX_APP_CONTAINERS} (each container gets the token's environment and volume)"
    )]
    TooManyContainers(usize),
    #[error("fencedlease: annotation {LEASE_ANNOTATION}={0:?} is not a valid FencedLease name (lowercase letters, digits, '-' and '.')")]
    LeaseName(String),
    #[error("fencedlease: annotation {DURATION_ANNOTATION}={0:?} must be a whole number of seconds from {MIN_LEASE_DURATION_SECONDS} to {MAX_LEASE_DURATION_SECONDS}")]
    Duration(String),
    #[error("fencedlease: annotation {PORT_ANNOTATION}={0:?} must be a port from {MIN_SIDECAR_PORT} to {MAX_SIDECAR_PORT} (the sidecar also uses the next two)")]
    Port(String),
    #[error("fencedlease: annotation {key}={value:?} must be \"true\" or \"false\"")]
    Flag { key: &'static str, value: String },
    #[error("fencedlease: annotation {HEALTH_ANNOTATION}: {0}")]
    HealthUrl(#[from] crate::probe::BadUrl),
    #[error("fencedlease: annotation {key}={value:?} must be a quantity such as \"250m\" or \"64Mi\", or \"none\"")]
    Resource { key: &'static str, value: String },
}

/// Why `--sidecar-resources` is refused.
#[derive(Debug, thiserror::Error)]
pub(super) enum ResourcesError {
    #[error("not JSON ({0}); e.g. '{{\"requests\":{{\"cpu\":\"10m\"}}}}'")]
    NotJson(serde_json::Error),
    #[error("must be a JSON object")]
    NotAnObject,
    #[error("{0:?}: only \"requests\" and \"limits\" are allowed")]
    Section(String),
    #[error("{0} must be an object")]
    SectionNotAnObject(String),
    #[error("{section}.{name}: only cpu and memory are allowed")]
    Name { section: String, name: String },
    #[error("{section}.{name}: {value} is not a quantity such as \"250m\" or \"64Mi\"")]
    Quantity {
        section: String,
        name: String,
        value: Value,
    },
}

/// Why the webhook cannot read a pod from an AdmissionReview.
#[derive(Debug, thiserror::Error)]
pub(super) enum PodError {
    #[error("it is not a JSON object")]
    NotAnObject,
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("{field} is {got:?}, not {want:?}")]
    NotAPod {
        field: &'static str,
        got: String,
        want: &'static str,
    },
}

/// The range of the sidecar's API port a pod may choose: the sidecar also takes the next two
/// (the proxy and the probe ports).
pub(super) const MIN_SIDECAR_PORT: u16 = 1024;
/// See [`MIN_SIDECAR_PORT`].
pub(super) const MAX_SIDECAR_PORT: u16 = 65533;

/// The name of the sidecar's probe port (/healthz, /readyz, and /metrics without the token),
/// which the chart's PodMonitor scrapes.
pub const PROBE_PORT_NAME: &str = "fencedlease";
/// Name of the injected container and of the token volume.
pub use crate::api::SIDECAR_CONTAINER as CONTAINER;
pub(super) const VOLUME: &str = "fencedlease-token";
/// The sidecar's defaults, which the injected container relies on.
pub(super) use crate::api::{SIDECAR_PORT as DEFAULT_PORT, TOKEN_DIR};

/// How to build the sidecar container.
#[derive(Clone, Debug)]
pub(super) struct InjectConfig {
    pub image: String,
    pub image_pull_policy: String,
    /// The server runs sidecars natively (1.29 and later: an init container with
    /// `restartPolicy: Always`).
    pub native_sidecars: bool,
    /// The sidecar's `resources` unless the pod's annotations say otherwise (checked by
    /// [`parse_resources`]).
    pub resources: Value,
    /// The sidecar's `runAsUser`; None leaves it to the pod (OpenShift's restricted SCC assigns
    /// one from the namespace's range).
    pub run_as_user: Option<i64>,
    /// The sidecar's log format.
    pub log_format: crate::runtime::logging::LogFormat,
}

/// The sidecar's resources when the webhook is given none: small requests, a memory limit, and
/// a CPU limit of 200m (a CPU limit can throttle renewals on a busy node: the chart drops it).
pub(super) fn default_resources() -> Value {
    json!({
        "requests": {"cpu": "10m", "memory": "16Mi"},
        "limits": {"cpu": "200m", "memory": "64Mi"},
    })
}

/// Is `s` a Kubernetes quantity as the sidecar's resources take one: a plain decimal number
/// with at most one suffix (m, k, M, G, T, P, E, Ki, Mi, Gi, Ti, Pi, Ei), e.g. `250m`, `64Mi`,
/// `0.5`? (Exponent forms are refused: nobody writes them here.)
pub(super) fn is_quantity(s: &str) -> bool {
    const SUFFIXES: [&str; 13] = [
        "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "m", "k", "M", "G", "T", "P", "E",
    ];
    let number = SUFFIXES
        .iter()
        .find_map(|suf| s.strip_suffix(suf))
        .unwrap_or(s);
    let mut parts = number.splitn(2, '.');
    let whole = parts.next().unwrap_or("");
    let frac = parts.next();
    let digits = |p: &str| !p.is_empty() && p.len() <= 18 && p.bytes().all(|b| b.is_ascii_digit());
    digits(whole) && frac.is_none_or(digits)
}

/// Checks `--sidecar-resources`: a JSON object with only `requests` and `limits`, each mapping
/// `cpu` and/or `memory` to a quantity.
pub(super) fn parse_resources(raw: &str) -> Result<Value, ResourcesError> {
    use ResourcesError as E;
    let v: Value = serde_json::from_str(raw).map_err(E::NotJson)?;
    let obj = v.as_object().ok_or(E::NotAnObject)?;
    for (section, entries) in obj {
        if section != "requests" && section != "limits" {
            return Err(E::Section(section.clone()));
        }
        let entries = entries
            .as_object()
            .ok_or_else(|| E::SectionNotAnObject(section.clone()))?;
        for (name, q) in entries {
            let at = || (section.clone(), name.clone());
            if name != "cpu" && name != "memory" {
                let (section, name) = at();
                return Err(E::Name { section, name });
            }
            if !q.as_str().is_some_and(is_quantity) {
                let (section, name) = at();
                let value = q.clone();
                return Err(E::Quantity {
                    section,
                    name,
                    value,
                });
            }
        }
    }
    Ok(v)
}

/// The sidecar's resources for this pod: `default`, with each resource annotation the pod has
/// replacing (or, with `none`, removing) its entry.
fn sidecar_resources(pod: &PodIn, default: &Value) -> Result<Value, InjectError> {
    let mut out = default.clone();
    for (key, section, name) in RESOURCE_ANNOTATIONS {
        let Some(v) = annotation(pod, key) else {
            continue;
        };
        if v == "none" {
            if let Some(m) = out.get_mut(section).and_then(Value::as_object_mut) {
                m.remove(name);
            }
        } else if is_quantity(v) {
            out[section][name] = json!(v);
        } else {
            let value = v.to_string();
            return Err(InjectError::Resource { key, value });
        }
    }
    Ok(out)
}

/// What injection decided.
#[derive(Debug, PartialEq)]
pub(super) enum Injection {
    /// Nothing to do, and why.
    Skip(&'static str),
    /// Add these to the pod ([`patch`] says where).
    Inject(Box<Additions>),
}

/// What injection adds to a pod.
#[derive(Debug, PartialEq)]
pub(super) struct Additions {
    /// The sidecar container (with `restartPolicy: Always` when native).
    pub sidecar: Value,
    /// A native sidecar, first among the init containers; else the last container.
    pub native: bool,
    /// Appended to every app container's `env`.
    pub env: Vec<Value>,
    /// Appended to every app container's `volumeMounts`.
    pub mount: Value,
    /// Appended to the pod's `volumes`.
    pub volume: Value,
}

/// The most app containers a pod may have for the sidecar to be injected. The patch adds the
/// token's environment and volume to each: ~400 bytes of patch a container, ~1.4 KB of answer
/// (kube writes the patch as a JSON array of numbers). At this many the answer is ~350 KB
/// (measured, with the proxy); without a bound, a 0.5 MiB pod of 175,000 empty containers
/// made a 203 MB answer, and Kubernetes calls mutating webhooks before it validates a pod.
pub(super) const MAX_APP_CONTAINERS: usize = 256;

/// What injection reads of a pod, and nothing more: its `fencedlease.io/` labels and
/// annotations, and the shape of its spec. Everything else is skipped as the pod is read, so
/// a pod costs less memory than its JSON whatever it holds (a typed `Pod` costs ~2 KiB per
/// empty container, a `serde_json::Value` some 20 times the bytes of empty arrays). The patch
/// is made against the pod as sent, so fields this build does not know are kept all the same.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PodIn {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    metadata: MetaIn,
    #[serde(default)]
    spec: Option<SpecIn>,
}

#[derive(Debug, Default, Deserialize)]
struct MetaIn {
    #[serde(default)]
    labels: Option<OurKeys>,
    #[serde(default)]
    annotations: Option<OurKeys>,
}

/// The pod's spec as injection and [`patch`] read it. An array member absent or `null` is
/// `None` (Kubernetes reads null as absent).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecIn {
    #[serde(default)]
    host_network: Option<bool>,
    #[serde(default)]
    containers: Option<Vec<ContainerIn>>,
    #[serde(default)]
    init_containers: Option<Vec<ContainerIn>>,
    #[serde(default)]
    volumes: Option<Listed>,
}

/// A container as injection reads it, in one byte (an empty container is three bytes of
/// JSON): is it the sidecar, and are its `env` and `volumeMounts` arrays?
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(from = "ContainerFields")]
struct ContainerIn(u8);

impl ContainerIn {
    const SIDECAR: u8 = 1;
    const ENV: u8 = 2;
    const MOUNTS: u8 = 4;

    fn is_sidecar(self) -> bool {
        self.0 & Self::SIDECAR != 0
    }
    fn has_env(self) -> bool {
        self.0 & Self::ENV != 0
    }
    fn has_mounts(self) -> bool {
        self.0 & Self::MOUNTS != 0
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ContainerFields {
    #[serde(default)]
    name: Option<SidecarName>,
    #[serde(default)]
    env: Option<Listed>,
    #[serde(default)]
    volume_mounts: Option<Listed>,
}

impl From<ContainerFields> for ContainerIn {
    fn from(c: ContainerFields) -> ContainerIn {
        let bit = |on: bool, b: u8| if on { b } else { 0 };
        ContainerIn(
            bit(c.name.is_some_and(|n| n.0), ContainerIn::SIDECAR)
                | bit(c.env.is_some(), ContainerIn::ENV)
                | bit(c.volume_mounts.is_some(), ContainerIn::MOUNTS),
        )
    }
}

/// A container's name, read without keeping it: is it [`CONTAINER`]?
struct SidecarName(bool);

impl<'de> Deserialize<'de> for SidecarName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl Visitor<'_> for Visit {
            type Value = SidecarName;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a container name")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<SidecarName, E> {
                Ok(SidecarName(v == CONTAINER))
            }
        }
        d.deserialize_str(Visit)
    }
}

/// An array whose elements are skipped as they are read: only that it is one matters.
#[derive(Debug)]
struct Listed;

impl<'de> Deserialize<'de> for Listed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = Listed;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Listed, A::Error> {
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Listed)
            }
        }
        d.deserialize_seq(Visit)
    }
}

impl PodIn {
    /// Reads a pod from its JSON: an object, whose `apiVersion` and `kind`, when given, are a
    /// Pod's.
    pub(super) fn from_json(json: &str) -> Result<PodIn, PodError> {
        if !json.trim_start().starts_with('{') {
            return Err(PodError::NotAnObject);
        }
        let pod: PodIn = serde_json::from_str(json)?;
        for (field, got, want) in [
            ("apiVersion", &pod.api_version, "v1"),
            ("kind", &pod.kind, "Pod"),
        ] {
            if let Some(got) = got.as_deref().filter(|g| *g != want) {
                let got = got.to_string();
                return Err(PodError::NotAPod { field, got, want });
            }
        }
        Ok(pod)
    }
}

fn annotation<'a>(pod: &'a PodIn, key: &str) -> Option<&'a str> {
    pod.metadata.annotations.as_ref().and_then(|a| a.get(key))
}

/// Has the pod opted out, with the label (as the chart's registration expects) or the annotation?
fn opted_out(pod: &PodIn) -> bool {
    let label = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(INJECT_ANNOTATION));
    label == Some("false") || annotation(pod, INJECT_ANNOTATION) == Some("false")
}

/// Refuses a pod on the node's network (`hostNetwork: true`). Its loopback is the node's: every
/// process on the node could read the token from the sidecar's API on 127.0.0.1 and write with
/// the pod's token through the sidecar's API proxy.
pub(super) fn refuse_host_network(host_network: Option<bool>) -> Result<(), InjectError> {
    match host_network {
        Some(true) => Err(InjectError::HostNetwork),
        _ => Ok(()),
    }
}

/// The pod's injection options, read from its annotations.
struct Options<'a> {
    lease: &'a str,
    duration: i32,
    port: u16,
    ready_only_when_leader: bool,
    health: Option<&'a str>,
    proxy_port: Option<u16>,
    probe_port: u16,
}

/// A `"true"`/`"false"` annotation, false when absent.
fn flag(pod: &PodIn, key: &'static str) -> Result<bool, InjectError> {
    match annotation(pod, key) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(v) => Err(InjectError::Flag {
            key,
            value: v.to_string(),
        }),
    }
}

/// Reads and checks the annotations; errors are messages for the pod's author.
fn options<'a>(pod: &'a PodIn, lease: &'a str) -> Result<Options<'a>, InjectError> {
    if !valid_name(lease) {
        return Err(InjectError::LeaseName(lease.to_string()));
    }
    let duration = match annotation(pod, DURATION_ANNOTATION) {
        None => DEFAULT_LEASE_DURATION_SECONDS,
        Some(v) => v
            .parse::<i32>()
            .ok()
            .filter(|d| (MIN_LEASE_DURATION_SECONDS..=MAX_LEASE_DURATION_SECONDS).contains(d))
            .ok_or_else(|| InjectError::Duration(v.to_string()))?,
    };
    let port = match annotation(pod, PORT_ANNOTATION) {
        None => DEFAULT_PORT,
        Some(v) => v
            .parse::<u16>()
            .ok()
            .filter(|p| (MIN_SIDECAR_PORT..=MAX_SIDECAR_PORT).contains(p))
            .ok_or_else(|| InjectError::Port(v.to_string()))?,
    };
    let ready_only_when_leader = flag(pod, READY_ANNOTATION)?;
    // The port is at most MAX_SIDECAR_PORT, so both ports above it exist.
    let proxy_port = flag(pod, PROXY_ANNOTATION)?.then_some(port + 1);
    let probe_port = port + 2;
    let health = annotation(pod, HEALTH_ANNOTATION);
    if let Some(url) = health {
        crate::probe::parse_http_url(url)?;
    }
    Ok(Options {
        lease,
        duration,
        port,
        ready_only_when_leader,
        health,
        proxy_port,
        probe_port,
    })
}

/// Decides the injection. Errors are messages for the pod's author.
pub(super) fn inject(pod: &PodIn, cfg: &InjectConfig) -> Result<Injection, InjectError> {
    let Some(lease) = annotation(pod, LEASE_ANNOTATION) else {
        return Ok(Injection::Skip("no lease annotation"));
    };
    if opted_out(pod) {
        return Ok(Injection::Skip("opted out"));
    }
    let spec = pod.spec.as_ref().ok_or(InjectError::NoSpec)?;
    refuse_host_network(spec.host_network)?;
    let containers = spec.containers.as_deref().unwrap_or_default();
    let already = containers.iter().any(|c| c.is_sidecar())
        || spec
            .init_containers
            .as_ref()
            .is_some_and(|ic| ic.iter().any(|c| c.is_sidecar()));
    if already {
        return Ok(Injection::Skip("already injected"));
    }
    if containers.len() > MAX_APP_CONTAINERS {
        return Err(InjectError::TooManyContainers(containers.len()));
    }
    let o = options(pod, lease)?;
    let url = format!("http://127.0.0.1:{}", o.port);
    // App containers learn where the sidecar and the token file are.
    let mut env = vec![
        json!({"name": "FENCEDLEASE_URL", "value": url}),
        json!({"name": "FENCEDLEASE_TOKEN_FILE", "value": format!("{TOKEN_DIR}/token")}),
        json!({"name": API_SECRET_ENV, "value": format!("{TOKEN_DIR}/{API_SECRET_FILE}")}),
    ];
    if let Some(pp) = o.proxy_port {
        env.push(
            json!({"name": "FENCEDLEASE_KUBE_PROXY", "value": format!("https://127.0.0.1:{pp}")}),
        );
        env.push(json!({"name": PROXY_KUBECONFIG_ENV,
                        "value": format!("{TOKEN_DIR}/{PROXY_KUBECONFIG_FILE}")}));
    }
    let resources = sidecar_resources(pod, &cfg.resources)?;
    Ok(Injection::Inject(Box::new(Additions {
        sidecar: sidecar(&o, cfg, resources),
        native: cfg.native_sidecars,
        env,
        mount: json!({"name": VOLUME, "mountPath": TOKEN_DIR, "readOnly": true}),
        volume: json!({"name": VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}),
    })))
}

/// The sidecar container.
fn sidecar(o: &Options, cfg: &InjectConfig, resources: Value) -> Value {
    let url = format!("http://127.0.0.1:{}", o.port);
    let mut args = vec![
        "sidecar".to_string(),
        "--lease".into(),
        o.lease.to_string(),
        "--listen".into(),
        format!("127.0.0.1:{}", o.port),
        "--lease-duration".into(),
        o.duration.to_string(),
        "--token-dir".into(),
        TOKEN_DIR.into(),
    ];
    if o.ready_only_when_leader {
        args.push("--ready-only-when-leader".into());
    }
    if let Some(h) = o.health {
        args.extend(["--app-health-url".into(), h.to_string()]);
    }
    if let Some(pp) = o.proxy_port {
        args.extend(["--proxy-listen".into(), format!("127.0.0.1:{pp}")]);
    }
    // Kubelet probes the pod IP, where only the probe endpoint listens (/healthz and /readyz,
    // no token). Readiness is an HTTP probe: when the pod is frozen, the kernel still accepts
    // the connection but nothing answers, the probe times out and the pod turns unready (an exec
    // probe would hang in the frozen cgroup and kubelet would keep the last result).
    // Liveness stays an exec probe from inside: a frozen pod is not restarted (that could not
    // stop it anyway); a hung sidecar is.
    args.extend(["--probe-listen".into(), format!("[::]:{}", o.probe_port)]);
    let timing = json!({"periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 3});
    let with_timing = |mut probe: Value| {
        if let (Some(p), Some(t)) = (probe.as_object_mut(), timing.as_object()) {
            p.extend(t.clone());
        }
        probe
    };
    let liveness = with_timing(
        json!({"exec": {"command": ["fencedlease", "probe", format!("{url}/healthz")]}}),
    );
    let readiness = with_timing(json!({"httpGet": {"path": "/readyz", "port": o.probe_port}}));
    let mut sidecar = json!({
        "name": CONTAINER,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "args": args,
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": crate::runtime::logging::FORMAT_ENV, "value": cfg.log_format.as_str()},
        ],
        "resources": resources,
        // Everything Pod Security's `restricted` level asks of a container, seccomp included:
        // an app that meets the level stays within it once the sidecar is added.
        "securityContext": {
            "runAsNonRoot": true, "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": VOLUME, "mountPath": TOKEN_DIR}],
        // Named for the chart's PodMonitor: /metrics there leaves the token out.
        "ports": [{"name": PROBE_PORT_NAME, "containerPort": o.probe_port, "protocol": "TCP"}],
        "livenessProbe": liveness,
        "readinessProbe": readiness,
    });
    if let Some(uid) = cfg.run_as_user {
        sidecar["securityContext"]["runAsUser"] = json!(uid);
    }
    if cfg.native_sidecars {
        // A native sidecar starts before the app; with a startup probe the kubelet also waits
        // until its endpoints listen (the probe endpoint is bound last), so the app's first
        // request for the token finds the API up.
        sidecar["restartPolicy"] = json!("Always");
        sidecar["startupProbe"] = json!({
            "httpGet": {"path": "/healthz", "port": o.probe_port},
            "periodSeconds": 1, "timeoutSeconds": 2, "failureThreshold": 60,
        });
    }
    sidecar
}

/// A JSON Pointer from its tokens (member names, array indexes).
fn pointer(tokens: &[&str]) -> PointerBuf {
    PointerBuf::from_tokens(tokens.iter().copied())
}

fn add(path: PointerBuf, value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation { path, value })
}

/// Adds `items` at the end of the array at `path`: one `add` at `path/-` per item when the pod
/// has the array (`listed`), else one `add` creating it (the member is absent, or null, which
/// Kubernetes reads as absent).
fn append(ops: &mut Vec<PatchOperation>, path: PointerBuf, listed: bool, items: &[Value]) {
    if listed {
        for item in items {
            let mut end = path.clone();
            end.push_back("-");
            ops.push(add(end, item.clone()));
        }
    } else {
        ops.push(add(path, Value::Array(items.to_vec())));
    }
}

/// The JSON Patch that makes `additions` to `pod`, the pod exactly as the API server sent it
/// (fields unknown to this build included), for a pod that [`inject`] accepted. Only `add`
/// operations: each appends to an array (`/-`), puts the native sidecar first among the init
/// containers (`/spec/initContainers/0`, an insertion), or creates a member the pod lacks.
/// Nothing the pod's author wrote is replaced, reordered or dropped.
pub(super) fn patch(pod: &PodIn, additions: &Additions) -> Patch {
    use std::slice::from_ref;
    let spec = pod.spec.as_ref();
    let containers = spec.and_then(|s| s.containers.as_deref());
    let mut ops = Vec::new();
    for (i, c) in containers.into_iter().flatten().enumerate() {
        let member = |name: &str| pointer(&["spec", "containers", &i.to_string(), name]);
        append(&mut ops, member("env"), c.has_env(), &additions.env);
        let mount = from_ref(&additions.mount);
        append(&mut ops, member("volumeMounts"), c.has_mounts(), mount);
    }
    let volumes = spec.is_some_and(|s| s.volumes.is_some());
    let volume = from_ref(&additions.volume);
    append(&mut ops, pointer(&["spec", "volumes"]), volumes, volume);
    let sidecar = from_ref(&additions.sidecar);
    let inits = spec.is_some_and(|s| s.init_containers.is_some());
    match (additions.native, inits) {
        (false, _) => {
            let at = pointer(&["spec", "containers"]);
            append(&mut ops, at, containers.is_some(), sidecar);
        }
        (true, true) => {
            let first = pointer(&["spec", "initContainers", "0"]);
            ops.push(add(first, additions.sidecar.clone()));
        }
        (true, false) => append(
            &mut ops,
            pointer(&["spec", "initContainers"]),
            false,
            sidecar,
        ),
    }
    Patch(ops)
}

/// Does a server of this version run native sidecars? (`major`/`minor` as /version reports
/// them; minor may carry a `+`.)
pub(super) fn supports_native_sidecars(major: &str, minor: &str) -> bool {
    let num = |s: &str| s.trim_end_matches('+').parse::<u32>().ok();
    match (num(major), num(minor)) {
        (Some(1), Some(m)) => m >= 29,
        (Some(maj), _) => maj > 1,
        _ => false,
    }
}

/// The parts of a mutating AdmissionReview that injection reads: the fields every review has
/// (required, as in kube's types, but skipped unread), the request's uid, and its object
/// borrowed as raw JSON, to be read as a [`PodIn`]. Nothing of the rest is built.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn<'a> {
    api_version: String,
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    #[serde(borrow, default)]
    request: Option<RequestIn<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestIn<'a> {
    uid: String,
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    #[serde(rename = "resource")]
    _resource: IgnoredAny,
    #[serde(rename = "operation")]
    _operation: IgnoredAny,
    #[serde(rename = "userInfo")]
    _user_info: IgnoredAny,
    #[serde(borrow, default)]
    object: Option<&'a RawValue>,
}

/// Answers one mutating AdmissionReview for a pod. Always returns a review.
pub(super) fn review(
    body: &[u8],
    cfg: &InjectConfig,
) -> (
    kube::core::admission::AdmissionReview<kube::core::DynamicObject>,
    &'static str,
) {
    let review: ReviewIn = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return (super::admission::unreadable(&e.to_string()), "invalid"),
    };
    let Some(req) = review.request else {
        return (super::admission::unreadable("it has no request"), "invalid");
    };
    let resp = super::admission::allowing(&review.api_version, &req.uid);
    let Some(object) = req.object else {
        return (resp.into_review(), "skipped");
    };
    // The pod's shape, read from the pod as sent, places the patch; its annotations decide.
    let pod = match PodIn::from_json(object.get()) {
        Ok(p) => p,
        Err(e) => {
            let msg = format!("fencedlease: cannot read the pod: {e}");
            return (resp.deny(msg).into_review(), "invalid");
        }
    };
    match inject(&pod, cfg) {
        Ok(Injection::Skip(_)) => (resp.into_review(), "skipped"),
        Err(msg) => (resp.deny(msg).into_review(), "refused"),
        Ok(Injection::Inject(additions)) => {
            match resp.clone().with_patch(patch(&pod, &additions)) {
                Ok(r) => (r.into_review(), "injected"),
                Err(e) => (
                    resp.deny(format!("fencedlease: cannot encode the patch: {e}"))
                        .into_review(),
                    "invalid",
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`inject`], with the refusal as its message (what the pod's author reads).
    fn judged(pod: &PodIn, cfg: &InjectConfig) -> Result<Injection, String> {
        inject(pod, cfg).map_err(|e| e.to_string())
    }
    use k8s_openapi::api::core::v1::Pod;
    use proptest::prelude::*;

    /// What injection reads of `raw`, a pod as the API server sends it.
    fn read(raw: &Value) -> PodIn {
        PodIn::from_json(&raw.to_string()).expect("a pod")
    }
    fn pod_json(annotations: Value) -> Value {
        json!({
            "metadata": {"name": "web-1", "annotations": annotations},
            "spec": {"containers": [{"name": "app", "image": "app:1"}]}
        })
    }
    fn pod(annotations: Value) -> PodIn {
        read(&pod_json(annotations))
    }
    fn cfg(native: bool) -> InjectConfig {
        InjectConfig {
            image: "fencedlease:0.1.0".into(),
            image_pull_policy: "IfNotPresent".into(),
            native_sidecars: native,
            resources: default_resources(),
            run_as_user: Some(65532),
            log_format: crate::runtime::logging::LogFormat::Text,
        }
    }
    /// What `inject` decides for `raw`, the pod as the API server sends it; its patch; and the
    /// pod with the patch applied.
    fn apply(raw: &Value, native: bool) -> (Additions, Patch, Value) {
        let read = read(raw);
        let additions = match judged(&read, &cfg(native)) {
            Ok(Injection::Inject(a)) => *a,
            other => panic!("expected an injection, got {other:?}"),
        };
        let ops = patch(&read, &additions);
        let mut out = raw.clone();
        json_patch::patch(&mut out, &ops).expect("the patch applies to the pod");
        (additions, ops, out)
    }
    fn injected(raw: &Value, native: bool) -> Value {
        apply(raw, native).2
    }

    #[test]
    fn ordinary_container_on_old_servers() {
        let v = injected(&pod_json(json!({LEASE_ANNOTATION: "db"})), false);
        let cs = v["spec"]["containers"].as_array().expect("containers");
        assert_eq!(cs.len(), 2);
        assert_eq!(cs[1]["name"], CONTAINER);
        assert!(v["spec"].get("initContainers").is_none());
        let args: Vec<&str> = cs[1]["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(&args[..3], ["sidecar", "--lease", "db"]);
        assert!(args.contains(&"127.0.0.1:8787"));
        // The app container gets the URL, the token file and the shared volume.
        let env = cs[0]["env"].as_array().expect("env");
        assert!(env
            .iter()
            .any(|e| e["name"] == "FENCEDLEASE_URL" && e["value"] == "http://127.0.0.1:8787"));
        // And where the pod's API secret is: the sidecar's API answers nothing else.
        assert!(env
            .iter()
            .any(|e| e["name"] == "FENCEDLEASE_API_SECRET_FILE"
                && e["value"] == "/var/run/fencedlease/api-secret"));
        assert_eq!(cs[0]["volumeMounts"][0]["readOnly"], true);
        assert_eq!(v["spec"]["volumes"][0]["name"], VOLUME);
        // Hardened.
        let sc = &cs[1]["securityContext"];
        assert_eq!(sc["runAsNonRoot"], true);
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
        assert!(cs[1]["resources"]["limits"]["memory"].is_string());
        // Probes: readiness over HTTP on the probe port (it fails while the pod is frozen);
        // liveness from inside, on the loopback API.
        assert!(args
            .windows(2)
            .any(|w| w == ["--probe-listen", "[::]:8789"]));
        assert_eq!(
            cs[1]["readinessProbe"]["httpGet"],
            json!({"path": "/readyz", "port": 8789})
        );
        assert_eq!(cs[1]["readinessProbe"]["timeoutSeconds"], 2);
        assert_eq!(
            cs[1]["livenessProbe"]["exec"]["command"][2],
            "http://127.0.0.1:8787/healthz"
        );
        assert_eq!(cs[1]["livenessProbe"]["periodSeconds"], 2);
    }

    #[test]
    fn native_sidecar_on_new_servers() {
        let v = injected(&pod_json(json!({LEASE_ANNOTATION: "db"})), true);
        assert_eq!(v["spec"]["containers"].as_array().map(Vec::len), Some(1));
        let ic = &v["spec"]["initContainers"][0];
        assert_eq!(ic["name"], CONTAINER);
        assert_eq!(ic["restartPolicy"], "Always");
        // The app starts only once the sidecar's endpoints answer.
        assert_eq!(
            ic["startupProbe"]["httpGet"],
            json!({"path": "/healthz", "port": 8789})
        );
        let ordinary = injected(&pod_json(json!({LEASE_ANNOTATION: "db"})), false);
        assert!(ordinary["spec"]["containers"][1]
            .get("startupProbe")
            .is_none());
    }

    #[test]
    fn idempotent_opt_out_and_untouched_without_annotation() {
        let once = read(&injected(&pod_json(json!({LEASE_ANNOTATION: "db"})), false));
        assert_eq!(
            judged(&once, &cfg(false)),
            Ok(Injection::Skip("already injected"))
        );
        let native = read(&injected(&pod_json(json!({LEASE_ANNOTATION: "db"})), true));
        assert_eq!(
            judged(&native, &cfg(true)),
            Ok(Injection::Skip("already injected"))
        );
        assert_eq!(
            judged(&pod(json!({})), &cfg(false)),
            Ok(Injection::Skip("no lease annotation"))
        );
        assert_eq!(
            judged(
                &pod(json!({LEASE_ANNOTATION: "db", INJECT_ANNOTATION: "false"})),
                &cfg(false)
            ),
            Ok(Injection::Skip("opted out"))
        );
    }

    #[test]
    fn host_network_pods_are_refused() {
        for (host_network, refused) in [(None, false), (Some(false), false), (Some(true), true)] {
            let got = refuse_host_network(host_network).map_err(|e| e.to_string());
            assert_eq!(
                got.is_err(),
                refused,
                "hostNetwork {host_network:?}: {got:?}"
            );
            if let Err(msg) = got {
                // Why, and what to do instead.
                for want in [
                    "hostNetwork",
                    "any process on the node",
                    "without hostNetwork",
                    "fencedlease.io/inject: \"false\"",
                    "fencedlease campaign",
                ] {
                    assert!(msg.contains(want), "{want:?} in {msg}");
                }
            }
        }
    }

    #[test]
    fn host_network_pods_asking_for_the_sidecar_are_refused_unless_opted_out() {
        let host = |labels: Value, annotations: Value| -> PodIn {
            read(&json!({
                "metadata": {"name": "web-1", "labels": labels, "annotations": annotations},
                "spec": {"hostNetwork": true, "containers": [{"name": "app", "image": "app:1"}]}
            }))
        };
        let lease = json!({LEASE_ANNOTATION: "db"});
        for (labels, annotations, want) in [
            (json!({}), lease.clone(), Err(())),
            (
                json!({}),
                json!({}),
                Ok(Injection::Skip("no lease annotation")),
            ),
            (
                json!({INJECT_ANNOTATION: "false"}),
                lease.clone(),
                Ok(Injection::Skip("opted out")),
            ),
            (
                json!({}),
                json!({LEASE_ANNOTATION: "db", INJECT_ANNOTATION: "false"}),
                Ok(Injection::Skip("opted out")),
            ),
            (json!({INJECT_ANNOTATION: "true"}), lease.clone(), Err(())),
        ] {
            for native in [false, true] {
                let got = judged(&host(labels.clone(), annotations.clone()), &cfg(native));
                match (&got, &want) {
                    (Err(msg), Err(())) => assert!(msg.contains("hostNetwork"), "{msg}"),
                    _ => assert_eq!(
                        got.as_ref().ok(),
                        want.as_ref().ok(),
                        "{labels} {annotations}"
                    ),
                }
            }
        }
    }

    #[test]
    fn options_and_bad_options() {
        let v = injected(
            &pod_json(
                json!({LEASE_ANNOTATION: "db", DURATION_ANNOTATION: "5", PORT_ANNOTATION: "9000",
                READY_ANNOTATION: "true", HEALTH_ANNOTATION: "http://127.0.0.1:8080/healthz"}),
            ),
            false,
        );
        let args: Vec<&str> = v["spec"]["containers"][1]["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        for want in [
            "5",
            "127.0.0.1:9000",
            "--ready-only-when-leader",
            "http://127.0.0.1:8080/healthz",
        ] {
            assert!(args.contains(&want), "{want} in {args:?}");
        }
        for (k, v) in [
            (DURATION_ANNOTATION, "0"),
            (DURATION_ANNOTATION, "15s"),
            (PORT_ANNOTATION, "80"),
            (PORT_ANNOTATION, "x"),
            (PORT_ANNOTATION, "65534"),
            (READY_ANNOTATION, "yes"),
            (HEALTH_ANNOTATION, "https://x"),
            (LEASE_ANNOTATION, "Bad_Name"),
            (PROXY_ANNOTATION, "1"),
        ] {
            let mut a = serde_json::Map::new();
            a.insert(LEASE_ANNOTATION.into(), json!("db"));
            a.insert(k.into(), json!(v));
            let err = judged(&pod(Value::Object(a)), &cfg(false)).expect_err("must refuse");
            assert!(err.contains(k), "{err}");
        }
    }

    #[test]
    fn a_pod_is_read_for_what_injection_needs_and_the_rest_skipped() {
        let mut annotations = serde_json::Map::new();
        for i in 0..500 {
            annotations.insert(format!("a{i}"), json!({"any": [i]}));
        }
        annotations.insert(LEASE_ANNOTATION.into(), json!("db"));
        let raw = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "annotations": annotations, "labels": {"app": [1]}},
            "spec": {"future": [[], {}, [[]]], "containers": [
                {"name": "app", "env": [{}, 1, "x"], "volumeMounts": null, "future": {}},
                {"name": CONTAINER},
                {"image": "x", "volumeMounts": []},
            ], "volumes": [], "hostNetwork": false},
        });
        let p = read(&raw);
        assert_eq!(
            p.metadata
                .annotations
                .as_ref()
                .map(|a| a.get(LEASE_ANNOTATION)),
            Some(Some("db"))
        );
        let cs = p
            .spec
            .as_ref()
            .and_then(|s| s.containers.as_deref())
            .expect("containers");
        let shape: Vec<(bool, bool, bool)> = cs
            .iter()
            .map(|c| (c.is_sidecar(), c.has_env(), c.has_mounts()))
            .collect();
        assert_eq!(
            shape,
            [
                (false, true, false),
                (true, false, false),
                (false, false, true)
            ]
        );
        // Every key injection reads is one of those kept.
        for key in [
            LEASE_ANNOTATION,
            INJECT_ANNOTATION,
            DURATION_ANNOTATION,
            PORT_ANNOTATION,
            READY_ANNOTATION,
            HEALTH_ANNOTATION,
            PROXY_ANNOTATION,
        ] {
            assert!(key.starts_with(crate::api::KEY_PREFIX), "{key}");
        }
        // What it reads must have the type Kubernetes gives it; the pod must be a Pod.
        for (bad, want) in [
            (json!({"apiVersion": "v2"}), "apiVersion"),
            (json!({"kind": "Secret"}), "kind"),
            (json!({"spec": {"containers": [{"env": {}}]}}), "an array"),
            (
                json!({"spec": {"containers": [{"name": 7}]}}),
                "a container name",
            ),
            (json!({"spec": {"containers": {}}}), "sequence"),
            (json!({"spec": {"hostNetwork": "yes"}}), "boolean"),
            (
                json!({"metadata": {"annotations": {LEASE_ANNOTATION: 1}}}),
                "string",
            ),
            (json!([]), "object"),
            (json!(null), "object"),
        ] {
            let err = PodIn::from_json(&bad.to_string())
                .expect_err("must not read")
                .to_string();
            assert!(err.contains(want), "{bad}: {err}");
        }
    }

    #[test]
    fn pods_with_more_containers_than_the_patch_may_cover_are_refused() {
        let with = |n: usize| {
            let cs: Vec<Value> = (0..n).map(|i| json!({"name": format!("c{i}")})).collect();
            let mut raw = pod_json(json!({LEASE_ANNOTATION: "db"}));
            raw["spec"]["containers"] = Value::from(cs);
            read(&raw)
        };
        let at_most = judged(&with(MAX_APP_CONTAINERS), &cfg(false));
        assert!(matches!(at_most, Ok(Injection::Inject(_))), "{at_most:?}");
        let err = judged(&with(MAX_APP_CONTAINERS + 1), &cfg(true)).expect_err("too many");
        assert!(
            err.contains(&format!("{} containers", MAX_APP_CONTAINERS + 1)),
            "{err}"
        );
        // Pods that ask for nothing are not judged by it.
        let mut skipped = with(MAX_APP_CONTAINERS + 1);
        skipped.metadata.annotations = None;
        assert_eq!(
            judged(&skipped, &cfg(false)),
            Ok(Injection::Skip("no lease annotation"))
        );
    }

    /// An AdmissionReview creating `object`.
    fn review_of(object: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "shop", "operation": "CREATE", "userInfo": {"username": "x"},
                "object": object, "oldObject": null, "dryRun": false,
            }
        }))
        .expect("encode")
    }

    #[test]
    fn every_body_gets_a_review_that_says_what_happened() {
        let answer = |body: &[u8]| {
            let (r, label) = review(body, &cfg(false));
            (serde_json::to_value(&r).expect("encode"), label)
        };
        let (r, label) = answer(&review_of(pod_json(json!({LEASE_ANNOTATION: "db"}))));
        assert_eq!(label, "injected");
        assert_eq!(r["response"]["uid"], "u-1");
        assert_eq!(r["response"]["patchType"], "JSONPatch");
        assert_eq!(r["apiVersion"], "admission.k8s.io/v1");
        let (r, label) = answer(&review_of(pod_json(json!({}))));
        assert_eq!(
            (label, &r["response"]["allowed"]),
            ("skipped", &json!(true))
        );
        assert!(r["response"].get("patch").is_none());
        let (_, label) = answer(&review_of(Value::Null));
        assert_eq!(label, "skipped");
        let (r, label) = answer(&review_of(json!({"kind": "Secret"})));
        assert_eq!((label, &r["response"]["uid"]), ("invalid", &json!("u-1")));
        let msg = r["response"]["status"]["message"]
            .as_str()
            .unwrap_or_default();
        assert!(msg.contains("cannot read the pod"), "{msg}");
        let mut no_user = serde_json::from_slice::<Value>(&review_of(json!({}))).expect("json");
        no_user["request"]
            .as_object_mut()
            .map(|r| r.remove("userInfo"));
        let no_user = serde_json::to_vec(&no_user).expect("encode");
        let no_request = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#;
        for body in [&b"{"[..], b"[]", b"null", &no_request[..], &no_user] {
            let (r, label) = answer(body);
            assert_eq!(label, "invalid", "{}", String::from_utf8_lossy(body));
            assert_eq!(r["response"]["allowed"], false);
            let msg = r["response"]["status"]["message"]
                .as_str()
                .unwrap_or_default();
            assert!(msg.contains("cannot read the AdmissionReview"), "{msg}");
        }
    }

    #[test]
    fn server_versions() {
        assert!(!supports_native_sidecars("1", "20"));
        assert!(!supports_native_sidecars("1", "28+"));
        assert!(supports_native_sidecars("1", "29"));
        assert!(supports_native_sidecars("1", "33+"));
        assert!(supports_native_sidecars("2", "0"));
        assert!(!supports_native_sidecars("", "x"));
    }

    /// Is `new` just `old` with things added? Every member of an object kept (recursively), every
    /// array's elements kept in their order (recursively; new elements may come anywhere),
    /// scalars equal. Err names the first place where something was changed or dropped.
    fn only_additions(old: &Value, new: &Value, at: &str) -> Result<(), String> {
        match (old, new) {
            (Value::Object(o), Value::Object(n)) => o.iter().try_for_each(|(k, v)| {
                let here = format!("{at}/{k}");
                let now = n.get(k).ok_or_else(|| format!("{here} was dropped"))?;
                only_additions(v, now, &here)
            }),
            (Value::Array(o), Value::Array(n)) => {
                let mut rest = n.iter();
                o.iter().enumerate().try_for_each(|(i, v)| {
                    rest.find(|now| only_additions(v, now, "").is_ok())
                        .map(|_| ())
                        .ok_or_else(|| format!("{at}/{i} was changed, moved or dropped: {v}"))
                })
            }
            _ if old == new => Ok(()),
            _ => Err(format!("{at} was changed: {old} became {new}")),
        }
    }

    /// Every operation an `add` that inserts or creates, never one that replaces what `raw` has.
    fn only_insertions(ops: &Patch, raw: &Value) {
        for op in &ops.0 {
            let PatchOperation::Add(a) = op else {
                panic!("not an add: {op:?}")
            };
            let path = a.path.as_str();
            assert!(
                path.ends_with("/-")
                    || path == "/spec/initContainers/0"
                    || raw.pointer(path).is_none(),
                "{path} would replace what the pod has"
            );
        }
    }

    /// The oracle: `raw` with `a` made by hand, straight on the JSON.
    fn by_hand(raw: &Value, a: &Additions) -> Value {
        fn push(obj: &mut Value, key: &str, items: &[Value]) {
            let list = &mut obj[key];
            if !list.is_array() {
                *list = json!([]);
            }
            if let Value::Array(list) = list {
                list.extend_from_slice(items);
            }
        }
        let mut out = raw.clone();
        let spec = &mut out["spec"];
        if let Value::Array(cs) = &mut spec["containers"] {
            for c in cs.iter_mut() {
                push(c, "env", &a.env);
                push(c, "volumeMounts", std::slice::from_ref(&a.mount));
            }
        }
        push(spec, "volumes", std::slice::from_ref(&a.volume));
        if !a.native {
            push(spec, "containers", std::slice::from_ref(&a.sidecar));
        } else if let Value::Array(ics) = &mut spec["initContainers"] {
            ics.insert(0, a.sidecar.clone());
        } else {
            spec["initContainers"] = json!([a.sidecar]);
        }
        out
    }

    fn raw_pod(spec: Value) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "annotations": {LEASE_ANNOTATION: "db"}},
            "spec": spec,
        })
    }

    #[test]
    fn the_patch_inserts_and_appends_and_keeps_fields_this_build_does_not_know() {
        let future = json!({"nested": [1, {"deeper": true}], "s": "x"});
        let app = json!({"name": "app", "image": "app:1", "someFutureField": future,
            "env": [{"name": "A", "value": "1", "someFutureField": 1}]});
        let init = json!({"name": "migrate", "image": "m:1", "someFutureField": future});
        let vol = json!({"name": "data", "emptyDir": {}, "someFutureField": future});
        let spec = |inits: Option<Value>, vols: Option<Value>| {
            let mut s = json!({"containers": [app.clone(), {"name": "b", "image": "b:1"}],
                "someFutureField": future.clone()});
            if let Some(i) = inits {
                s["initContainers"] = i;
            }
            if let Some(v) = vols {
                s["volumes"] = v;
            }
            s
        };
        let apps = [
            "/spec/containers/0/env/-",
            "/spec/containers/0/env/-",
            "/spec/containers/0/env/-",
            "/spec/containers/0/volumeMounts",
            "/spec/containers/1/env",
            "/spec/containers/1/volumeMounts",
        ];
        for (spec, native, tail) in [
            (
                spec(None, None),
                false,
                ["/spec/volumes", "/spec/containers/-"],
            ),
            (
                spec(Some(json!([init])), Some(json!([vol]))),
                false,
                ["/spec/volumes/-", "/spec/containers/-"],
            ),
            (
                spec(None, None),
                true,
                ["/spec/volumes", "/spec/initContainers"],
            ),
            (
                spec(Some(json!([])), Some(json!([]))),
                true,
                ["/spec/volumes/-", "/spec/initContainers/0"],
            ),
            (
                spec(Some(json!([init, init])), Some(json!([vol]))),
                true,
                ["/spec/volumes/-", "/spec/initContainers/0"],
            ),
        ] {
            let raw = raw_pod(spec);
            let (additions, ops, out) = apply(&raw, native);
            let paths: Vec<&str> = ops.0.iter().map(|op| op.path().as_str()).collect();
            let want: Vec<&str> = apps.iter().chain(&tail).copied().collect();
            assert_eq!(paths, want, "native {native}: {raw}");
            only_insertions(&ops, &raw);
            only_additions(&raw, &out, "").unwrap_or_else(|e| panic!("{e}\n{out}"));
            assert_eq!(out, by_hand(&raw, &additions));
            if native {
                assert_eq!(out["spec"]["initContainers"][0]["name"], CONTAINER);
            }
        }
        // What a diff of typed pods lost: the typed pod has no such field.
        let typed: Pod =
            serde_json::from_value(raw_pod(spec(Some(json!([init])), None))).expect("a pod");
        let typed = serde_json::to_value(typed).expect("encode");
        assert!(typed
            .pointer("/spec/initContainers/0/someFutureField")
            .is_none());
    }

    /// A value of a field this build does not know.
    fn future_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "\\PC{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 12, 3, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
                proptest::collection::btree_map("[a-zA-Z]{1,6}", inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// `base` with 0 to 2 members this build does not know.
    fn with_future(base: Value) -> impl Strategy<Value = Value> {
        proptest::collection::btree_map("someFuture[A-Z][a-z]{0,5}", future_value(), 0..3).prop_map(
            move |extra| {
                let mut v = base.clone();
                if let Value::Object(o) = &mut v {
                    o.extend(extra);
                }
                v
            },
        )
    }

    /// Absent, or an array (maybe empty) of `item`s.
    fn maybe_list<S: Strategy<Value = Value>>(item: S) -> impl Strategy<Value = Option<Value>> {
        proptest::option::of(proptest::collection::vec(item, 0..3).prop_map(Value::from))
    }

    fn container(name: String) -> impl Strategy<Value = Value> {
        let env = ("[A-Z]{1,6}", "\\PC{0,6}")
            .prop_flat_map(|(n, v)| with_future(json!({"name": n, "value": v})));
        let mount = "[a-z]{1,5}"
            .prop_flat_map(|n| with_future(json!({"name": n, "mountPath": format!("/m/{n}")})));
        (maybe_list(env), maybe_list(mount)).prop_flat_map(move |(env, mounts)| {
            let mut c = json!({"name": name.clone(), "image": "img:1"});
            if let Some(e) = env {
                c["env"] = e;
            }
            if let Some(m) = mounts {
                c["volumeMounts"] = m;
            }
            with_future(c)
        })
    }

    fn containers(prefix: &'static str, n: usize) -> impl Strategy<Value = Vec<Value>> {
        (0..n)
            .map(|i| container(format!("{prefix}-{i}")))
            .collect::<Vec<_>>()
    }

    /// A pod asking for the sidecar as the API server would send it: 1 to 3 containers, maybe
    /// init containers and volumes (absent or arrays, maybe empty), fields this build does not
    /// know at every level we touch or pass.
    fn raw_pods() -> impl Strategy<Value = Value> {
        let apps = (1usize..4).prop_flat_map(|n| containers("app", n));
        let inits = proptest::option::of((0usize..3).prop_flat_map(|n| containers("init", n)));
        let volume =
            "[a-z]{1,5}".prop_flat_map(|n| with_future(json!({"name": n, "emptyDir": {}})));
        let proxy = any::<bool>();
        (apps, inits, maybe_list(volume), proxy).prop_flat_map(|(apps, inits, vols, proxy)| {
            let mut spec = json!({"containers": apps});
            if let Some(i) = inits {
                spec["initContainers"] = Value::from(i);
            }
            if let Some(v) = vols {
                spec["volumes"] = v;
            }
            let mut pod = raw_pod(Value::Null);
            pod["metadata"]["annotations"][PROXY_ANNOTATION] = json!(proxy.to_string());
            with_future(spec).prop_map(move |spec| {
                let mut p = pod.clone();
                p["spec"] = spec;
                p
            })
        })
    }

    proptest! {
        // FL_FUZZ_CASES=N for a deeper run (RELIABILITY.md).
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("FL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
        ))]
        #[test]
        fn the_patch_leaves_every_field_of_the_pod_as_written(
            raw in raw_pods(), native in any::<bool>()
        ) {
            let (additions, ops, out) = apply(&raw, native);
            only_insertions(&ops, &raw);
            if let Err(e) = only_additions(&raw, &out, "") {
                panic!("{e}\nbefore: {raw}\nafter: {out}");
            }
            prop_assert_eq!(&out, &by_hand(&raw, &additions));
        }
    }

    #[test]
    fn quantities_are_plain_numbers_with_one_suffix() {
        for ok in ["10m", "250m", "1", "0.5", "64Mi", "1Gi", "2k", "1.5G"] {
            assert!(is_quantity(ok), "{ok}");
        }
        for bad in [
            "", "m", "Mi", "1.", ".5", "-1", "1e3", "10 m", "1MiB", "1mm", "64mi", "x",
        ] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }

    #[test]
    fn the_resources_flag_takes_requests_and_limits_of_cpu_and_memory_only() {
        let ok = parse_resources(
            r#"{"requests":{"cpu":"10m","memory":"16Mi"},"limits":{"memory":"64Mi"}}"#,
        );
        assert_eq!(ok.unwrap()["limits"], json!({"memory": "64Mi"}));
        for (raw, says) in [
            ("cpu=10m", "not JSON"),
            ("[]", "JSON object"),
            (r#"{"claims":{}}"#, "only \"requests\" and \"limits\""),
            (r#"{"limits":"64Mi"}"#, "limits must be an object"),
            (
                r#"{"limits":{"nvidia.com/gpu":"1"}}"#,
                "only cpu and memory",
            ),
            (r#"{"limits":{"cpu":"lots"}}"#, "not a quantity"),
            (r#"{"limits":{"cpu":1}}"#, "not a quantity"),
        ] {
            let err = parse_resources(raw).unwrap_err().to_string();
            assert!(err.contains(says), "{raw}: {err}");
        }
    }

    #[test]
    fn pods_override_the_sidecars_resources_entry_by_entry() {
        let p = pod(json!({
            LEASE_ANNOTATION: "db",
            "fencedlease.io/sidecar-cpu-limit": "none",
            "fencedlease.io/sidecar-memory-limit": "128Mi",
        }));
        let Ok(Injection::Inject(a)) = judged(&p, &cfg(true)) else {
            panic!("expected an injection")
        };
        assert_eq!(
            a.sidecar["resources"],
            json!({"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "128Mi"}})
        );
        let bad =
            pod(json!({LEASE_ANNOTATION: "db", "fencedlease.io/sidecar-cpu-request": "a lot"}));
        let err = judged(&bad, &cfg(true)).unwrap_err();
        assert!(
            err.contains("fencedlease.io/sidecar-cpu-request") && err.contains("quantity"),
            "{err}"
        );
    }

    #[test]
    fn the_sidecars_uid_can_be_left_to_the_pod_and_its_log_format_follows_the_webhooks_flag() {
        let p = pod(json!({LEASE_ANNOTATION: "db"}));
        let mut c = cfg(false);
        c.run_as_user = None;
        c.log_format = crate::runtime::logging::LogFormat::Json;
        let Ok(Injection::Inject(a)) = judged(&p, &c) else {
            panic!("expected an injection")
        };
        let sc = &a.sidecar["securityContext"];
        assert!(sc.get("runAsUser").is_none(), "{sc}");
        assert_eq!(sc["runAsNonRoot"], json!(true));
        let env = a.sidecar["env"].as_array().unwrap();
        assert!(
            env.contains(&json!({"name": "FENCEDLEASE_LOG_FORMAT", "value": "json"})),
            "{env:?}"
        );
        let Ok(Injection::Inject(d)) = judged(&p, &cfg(false)) else {
            panic!("expected an injection")
        };
        assert_eq!(d.sidecar["securityContext"]["runAsUser"], json!(65532));
    }
}
