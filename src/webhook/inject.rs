//! Sidecar injection as a pure function: a pod in, the same pod with the `fencedlease` sidecar
//! out (or a clear refusal of bad annotations). Idempotent: an injected pod is left alone.

use k8s_openapi::api::core::v1::{Pod, PodSpec};
use serde_json::{json, Value};

/// Pod annotation naming the FencedLease (in the pod's namespace) to campaign for.
pub const LEASE_ANNOTATION: &str = "fencedlease.io/lease";
/// `"false"`, as a label or an annotation, opts a pod out of injection. (The Helm chart's
/// registration also skips pods with the label, so they do not even reach the webhook.)
pub const INJECT_ANNOTATION: &str = "fencedlease.io/inject";
pub const DURATION_ANNOTATION: &str = "fencedlease.io/lease-duration";
pub const PORT_ANNOTATION: &str = "fencedlease.io/port";
pub const READY_ANNOTATION: &str = "fencedlease.io/ready-only-when-leader";
pub const HEALTH_ANNOTATION: &str = "fencedlease.io/app-health-url";
/// `"true"` also runs the Kubernetes API proxy, on the sidecar port plus one.
pub const PROXY_ANNOTATION: &str = "fencedlease.io/proxy";
/// Name of the injected container and of the token volume.
pub const CONTAINER: &str = "fencedlease";
pub const VOLUME: &str = "fencedlease-token";
pub const TOKEN_DIR: &str = "/var/run/fencedlease";
pub const DEFAULT_PORT: u16 = 8787;

/// How to build the sidecar container.
#[derive(Clone, Debug)]
pub struct InjectConfig {
    pub image: String,
    pub image_pull_policy: String,
    /// The server runs sidecars natively (1.29 and later: an init container with
    /// `restartPolicy: Always`).
    pub native_sidecars: bool,
}

/// What injection decided.
#[derive(Debug, PartialEq)]
pub enum Injection {
    /// Nothing to do, and why.
    Skip(&'static str),
    /// The pod with the sidecar.
    Inject(Box<Value>),
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Has the pod opted out, with the label (as the chart's registration expects) or the annotation?
fn opted_out(pod: &Pod) -> bool {
    let label = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(INJECT_ANNOTATION));
    label.map(String::as_str) == Some("false")
        || annotation(pod, INJECT_ANNOTATION) == Some("false")
}

/// Refuses a pod on the node's network (`hostNetwork: true`). Its loopback is the node's: every
/// process on the node could read the token from the sidecar's API on 127.0.0.1 and write with
/// the pod's token through the sidecar's API proxy.
pub fn refuse_host_network(spec: &PodSpec) -> Result<(), String> {
    if spec.host_network != Some(true) {
        return Ok(());
    }
    Err(format!(
        "fencedlease: refusing to inject the sidecar into a hostNetwork pod: its 127.0.0.1 is the \
         node's, so any process on the node could read the fencing token from the sidecar's API \
         and write with it through the sidecar's API proxy. Run the workload without \
         hostNetwork, or opt the pod out with the label {INJECT_ANNOTATION}: \"false\" and run \
         its command under `fencedlease campaign --lease LEASE -- CMD` (the token then goes to \
         the command alone, in its environment)"
    ))
}

/// Is this a valid Kubernetes object name (DNS-1123 subdomain)?
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// Decides and builds the injection. Errors are messages for the pod's author.
pub fn inject(pod: &Pod, cfg: &InjectConfig) -> Result<Injection, String> {
    let Some(lease) = annotation(pod, LEASE_ANNOTATION) else {
        return Ok(Injection::Skip("no lease annotation"));
    };
    if opted_out(pod) {
        return Ok(Injection::Skip("opted out"));
    }
    let spec = pod.spec.as_ref().ok_or("the pod has no spec")?;
    refuse_host_network(spec)?;
    let already = spec.containers.iter().any(|c| c.name == CONTAINER)
        || spec
            .init_containers
            .as_ref()
            .is_some_and(|ic| ic.iter().any(|c| c.name == CONTAINER));
    if already {
        return Ok(Injection::Skip("already injected"));
    }
    if !valid_name(lease) {
        return Err(format!(
            "fencedlease: annotation {LEASE_ANNOTATION}={lease:?} is not a valid FencedLease name (lowercase letters, digits, '-' and '.')"
        ));
    }
    let duration = match annotation(pod, DURATION_ANNOTATION) {
        None => 15,
        Some(v) => v
            .parse::<i32>()
            .ok()
            .filter(|d| (1..=3600).contains(d))
            .ok_or_else(|| format!("fencedlease: annotation {DURATION_ANNOTATION}={v:?} must be a whole number of seconds from 1 to 3600"))?,
    };
    let port = match annotation(pod, PORT_ANNOTATION) {
        None => DEFAULT_PORT,
        Some(v) => v
            .parse::<u16>()
            .ok()
            .filter(|p| (1024..=65533).contains(p))
            .ok_or_else(|| format!("fencedlease: annotation {PORT_ANNOTATION}={v:?} must be a port from 1024 to 65533 (the sidecar also uses the next two)"))?,
    };
    let ready_only_when_leader = match annotation(pod, READY_ANNOTATION) {
        None | Some("false") => false,
        Some("true") => true,
        Some(v) => {
            return Err(format!(
                "fencedlease: annotation {READY_ANNOTATION}={v:?} must be \"true\" or \"false\""
            ))
        }
    };
    let proxy = match annotation(pod, PROXY_ANNOTATION) {
        None | Some("false") => false,
        Some("true") => true,
        Some(v) => {
            return Err(format!(
                "fencedlease: annotation {PROXY_ANNOTATION}={v:?} must be \"true\" or \"false\""
            ))
        }
    };
    let proxy_port = port.checked_add(1).ok_or_else(|| {
        format!(
            "fencedlease: annotation {PORT_ANNOTATION}: no room for the proxy port above {port}"
        )
    });
    let proxy_port = if proxy { Some(proxy_port?) } else { None };
    let probe_port = port.checked_add(2).ok_or_else(|| {
        format!(
            "fencedlease: annotation {PORT_ANNOTATION}: no room for the probe port two above {port}"
        )
    })?;
    let health = annotation(pod, HEALTH_ANNOTATION);
    if let Some(url) = health {
        crate::sidecar::parse_http_url(url)
            .map_err(|e| format!("fencedlease: annotation {HEALTH_ANNOTATION}: {e}"))?;
    }

    let url = format!("http://127.0.0.1:{port}");
    let mut args = vec![
        "sidecar".to_string(),
        "--lease".into(),
        lease.to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--lease-duration".into(),
        duration.to_string(),
        "--token-dir".into(),
        TOKEN_DIR.into(),
    ];
    if ready_only_when_leader {
        args.push("--ready-only-when-leader".into());
    }
    if let Some(h) = health {
        args.extend(["--app-health-url".into(), h.to_string()]);
    }
    if let Some(pp) = proxy_port {
        args.extend(["--proxy-listen".into(), format!("127.0.0.1:{pp}")]);
    }
    // Kubelet probes the pod IP, where only the probe endpoint listens (/healthz and /readyz,
    // no token). Readiness is an HTTP probe: when the pod is frozen, the kernel still accepts
    // the connection but nothing answers, the probe times out and the pod turns unready (an exec
    // probe would hang in the frozen cgroup and kubelet would keep the last result).
    // Liveness stays an exec probe from inside: a frozen pod is not restarted (that could not
    // stop it anyway); a hung sidecar is.
    args.extend(["--probe-listen".into(), format!("[::]:{probe_port}")]);
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
    let readiness = with_timing(json!({"httpGet": {"path": "/readyz", "port": probe_port}}));
    let mut sidecar = json!({
        "name": CONTAINER,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "args": args,
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
        "resources": {
            "requests": {"cpu": "10m", "memory": "16Mi"},
            "limits": {"cpu": "200m", "memory": "64Mi"},
        },
        "securityContext": {
            "runAsNonRoot": true, "runAsUser": 65532, "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": VOLUME, "mountPath": TOKEN_DIR}],
        "livenessProbe": liveness,
        "readinessProbe": readiness,
    });

    let mut out = serde_json::to_value(pod)
        .map_err(|e| format!("fencedlease: cannot encode the pod: {e}"))?;
    let spec = out
        .get_mut("spec")
        .and_then(Value::as_object_mut)
        .ok_or("the pod has no spec")?;
    // App containers learn where the sidecar and the token file are.
    if let Some(Value::Array(containers)) = spec.get_mut("containers") {
        for c in containers.iter_mut() {
            let Some(c) = c.as_object_mut() else { continue };
            let env = c.entry("env").or_insert_with(|| json!([]));
            if let Value::Array(env) = env {
                env.push(json!({"name": "FENCEDLEASE_URL", "value": url}));
                env.push(json!({"name": "FENCEDLEASE_TOKEN_FILE", "value": format!("{TOKEN_DIR}/token")}));
                if let Some(pp) = proxy_port {
                    env.push(json!({"name": "FENCEDLEASE_KUBE_PROXY", "value": format!("http://127.0.0.1:{pp}")}));
                }
            }
            let mounts = c.entry("volumeMounts").or_insert_with(|| json!([]));
            if let Value::Array(mounts) = mounts {
                mounts.push(json!({"name": VOLUME, "mountPath": TOKEN_DIR, "readOnly": true}));
            }
        }
    }
    let volumes = spec.entry("volumes").or_insert_with(|| json!([]));
    if let Value::Array(v) = volumes {
        v.push(json!({"name": VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}));
    }
    if cfg.native_sidecars {
        sidecar["restartPolicy"] = json!("Always");
        let inits = spec.entry("initContainers").or_insert_with(|| json!([]));
        if let Value::Array(inits) = inits {
            inits.insert(0, sidecar);
        }
    } else {
        let containers = spec.entry("containers").or_insert_with(|| json!([]));
        if let Value::Array(containers) = containers {
            containers.push(sidecar);
        }
    }
    Ok(Injection::Inject(Box::new(out)))
}

/// Does a server of this version run native sidecars? (`major`/`minor` as /version reports
/// them; minor may carry a `+`.)
pub fn supports_native_sidecars(major: &str, minor: &str) -> bool {
    let num = |s: &str| s.trim_end_matches('+').parse::<u32>().ok();
    match (num(major), num(minor)) {
        (Some(1), Some(m)) => m >= 29,
        (Some(maj), _) => maj > 1,
        _ => false,
    }
}

/// Answers one mutating AdmissionReview for a pod. Always returns a review.
pub fn review(
    body: &[u8],
    cfg: &InjectConfig,
) -> (
    kube::core::admission::AdmissionReview<kube::core::DynamicObject>,
    &'static str,
) {
    use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
    let review: AdmissionReview<kube::core::DynamicObject> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return (super::admission::unreadable(&e.to_string()), "invalid"),
    };
    let req: AdmissionRequest<kube::core::DynamicObject> = match review.try_into() {
        Ok(r) => r,
        Err(_) => return (super::admission::unreadable("it has no request"), "invalid"),
    };
    let resp = AdmissionResponse::from(&req);
    let Some(obj) = req.object.as_ref() else {
        return (resp.into_review(), "skipped");
    };
    let original = match serde_json::to_value(obj) {
        Ok(v) => v,
        Err(e) => {
            return (
                resp.deny(format!("fencedlease: cannot read the pod: {e}"))
                    .into_review(),
                "invalid",
            )
        }
    };
    let pod: Pod = match serde_json::from_value(original.clone()) {
        Ok(p) => p,
        Err(e) => {
            return (
                resp.deny(format!("fencedlease: cannot read the pod: {e}"))
                    .into_review(),
                "invalid",
            )
        }
    };
    match inject(&pod, cfg) {
        Ok(Injection::Skip(_)) => (resp.into_review(), "skipped"),
        Err(msg) => (resp.deny(msg).into_review(), "refused"),
        Ok(Injection::Inject(new)) => {
            // Diff against the typed pod, which `inject` built `new` from: fields the typed Pod
            // does not know are in neither, so the patch leaves them alone.
            let base = match serde_json::to_value(&pod) {
                Ok(b) => b,
                Err(e) => {
                    return (
                        resp.deny(format!("fencedlease: cannot encode the pod: {e}"))
                            .into_review(),
                        "invalid",
                    )
                }
            };
            let patch = json_patch::diff(&base, &new);
            match resp.clone().with_patch(patch) {
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

    fn pod(annotations: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "web-1", "annotations": annotations},
            "spec": {"containers": [{"name": "app", "image": "app:1"}]}
        }))
        .expect("pod")
    }
    fn cfg(native: bool) -> InjectConfig {
        InjectConfig {
            image: "fencedlease:0.1.0".into(),
            image_pull_policy: "IfNotPresent".into(),
            native_sidecars: native,
        }
    }
    fn injected(p: &Pod, native: bool) -> Value {
        match inject(p, &cfg(native)) {
            Ok(Injection::Inject(v)) => *v,
            other => panic!("expected an injection, got {other:?}"),
        }
    }

    #[test]
    fn ordinary_container_on_old_servers() {
        let v = injected(&pod(json!({LEASE_ANNOTATION: "db"})), false);
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
        assert_eq!(cs[0]["volumeMounts"][0]["readOnly"], true);
        assert_eq!(v["spec"]["volumes"][0]["name"], VOLUME);
        // Hardened.
        let sc = &cs[1]["securityContext"];
        assert_eq!(sc["runAsNonRoot"], true);
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
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
        let v = injected(&pod(json!({LEASE_ANNOTATION: "db"})), true);
        assert_eq!(v["spec"]["containers"].as_array().map(Vec::len), Some(1));
        let ic = &v["spec"]["initContainers"][0];
        assert_eq!(ic["name"], CONTAINER);
        assert_eq!(ic["restartPolicy"], "Always");
    }

    #[test]
    fn idempotent_opt_out_and_untouched_without_annotation() {
        let once: Pod =
            serde_json::from_value(injected(&pod(json!({LEASE_ANNOTATION: "db"})), false))
                .expect("pod");
        assert_eq!(
            inject(&once, &cfg(false)),
            Ok(Injection::Skip("already injected"))
        );
        let native: Pod =
            serde_json::from_value(injected(&pod(json!({LEASE_ANNOTATION: "db"})), true))
                .expect("pod");
        assert_eq!(
            inject(&native, &cfg(true)),
            Ok(Injection::Skip("already injected"))
        );
        assert_eq!(
            inject(&pod(json!({})), &cfg(false)),
            Ok(Injection::Skip("no lease annotation"))
        );
        assert_eq!(
            inject(
                &pod(json!({LEASE_ANNOTATION: "db", INJECT_ANNOTATION: "false"})),
                &cfg(false)
            ),
            Ok(Injection::Skip("opted out"))
        );
    }

    #[test]
    fn host_network_pods_are_refused() {
        for (host_network, refused) in [(None, false), (Some(false), false), (Some(true), true)] {
            let spec = PodSpec {
                host_network,
                ..PodSpec::default()
            };
            let got = refuse_host_network(&spec);
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
        let host = |labels: Value, annotations: Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": "web-1", "labels": labels, "annotations": annotations},
                "spec": {"hostNetwork": true, "containers": [{"name": "app", "image": "app:1"}]}
            }))
            .expect("pod")
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
                let got = inject(&host(labels.clone(), annotations.clone()), &cfg(native));
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
            &pod(
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
            let err = inject(&pod(Value::Object(a)), &cfg(false)).expect_err("must refuse");
            assert!(err.contains(k), "{err}");
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
}
