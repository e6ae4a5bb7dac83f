//! Injection only adds, against the real API server: read back, an injected pod's spec is the
//! same pod's spec without injection (as the server stored it, defaults included) plus our
//! additions at the ends of the lists, and nothing else. Before 1.29 the sidecar is an ordinary
//! container (the last of `containers`); from 1.29 a native sidecar, the first of
//! `initContainers` (so that it starts before the pod's own init containers): the test follows
//! the server it runs against.

use fencedlease_testkit as common;

use std::time::Duration;

use common::procs::scratch_dir;
use common::webhook::Webhook;
use common::{client, ensure_crd, eventually, TestNamespace};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, PostParams};
use kube::Api;
use serde_json::{json, Value};

/// A pod with much of what users write, in the raw JSON they would send.
fn submitted(name: &str, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "shop"}, "annotations": annotations},
        "spec": {
            "initContainers": [{
                "name": "migrate", "image": "busybox", "command": ["true"],
                "env": [{"name": "PHASE", "value": "migrate"}],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }],
            "containers": [
                {
                    "name": "app", "image": "busybox", "command": ["sleep"], "args": ["3600"],
                    "workingDir": "/data",
                    "env": [
                        {"name": "MODE", "value": "primary"},
                        {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    ],
                    "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                    "resources": {"requests": {"cpu": "5m", "memory": "8Mi"}, "limits": {"memory": "32Mi"}},
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 7},
                    "lifecycle": {"preStop": {"exec": {"command": ["sleep", "1"]}}},
                    "securityContext": {"runAsUser": 1000, "readOnlyRootFilesystem": true},
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                },
                {"name": "helper", "image": "busybox", "command": ["sleep", "3600"]},
            ],
            "volumes": [{"name": "data", "emptyDir": {"sizeLimit": "10Mi"}}],
            "terminationGracePeriodSeconds": 3,
            // Never scheduled (the test node's scheduler would set nodeName on one pod and not
            // yet on the other): the test is about the stored spec, not running pods.
            "nodeSelector": {"fencedlease.io/nowhere": "true"},
        }
    })
}

/// Removes `n` trailing elements of the array `obj[key]`, checking each with `ours`; removes the
/// key too when that empties the array and `control` (the object without injection) lacks it.
fn strip_tail(
    obj: &mut Value,
    control: &Value,
    key: &str,
    n: usize,
    ours: impl Fn(&Value) -> bool,
) {
    let list = obj[key]
        .as_array_mut()
        .unwrap_or_else(|| panic!("{key} is not a list"));
    assert!(list.len() >= n, "{key}: fewer than {n}: {list:?}");
    for item in list.drain(list.len() - n..) {
        assert!(ours(&item), "{key}: not ours at the end: {item}");
    }
    assert!(!list.iter().any(&ours), "{key}: ours elsewhere: {list:?}");
    if list.is_empty() && control.get(key).is_none() {
        obj.as_object_mut().map(|o| o.remove(key));
    }
}

/// The injected pod's spec without what the webhook added (checking that it is at the ends).
fn without_injection(mut spec: Value, control: &Value, native: bool) -> Value {
    let named = |name: &'static str| move |v: &Value| v["name"] == name;
    if native {
        let inits = spec["initContainers"]
            .as_array_mut()
            .expect("initContainers");
        let first = inits.remove(0);
        assert!(named("fencedlease")(&first), "not ours first: {first}");
        assert!(!inits.iter().any(named("fencedlease")), "ours twice");
        if inits.is_empty() && control.get("initContainers").is_none() {
            spec.as_object_mut().map(|o| o.remove("initContainers"));
        }
    } else {
        strip_tail(&mut spec, control, "containers", 1, named("fencedlease"));
    }
    strip_tail(&mut spec, control, "volumes", 1, named("fencedlease-token"));
    let users = spec["containers"].as_array_mut().expect("containers");
    for (i, c) in users.iter_mut().enumerate() {
        let want = &control["containers"][i];
        let ours = |v: &Value| {
            v["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("FENCEDLEASE_"))
        };
        // FENCEDLEASE_URL, FENCEDLEASE_TOKEN_FILE, FENCEDLEASE_API_SECRET_FILE.
        strip_tail(c, want, "env", 3, ours);
        strip_tail(c, want, "volumeMounts", 1, named("fencedlease-token"));
    }
    spec
}

/// Since 1.22 each pod gets its own ServiceAccount token volume, `kube-api-access-<random>`:
/// the same name in every pod, so that two pods compare.
fn same_token_volume_name(v: &mut Value) {
    match v {
        Value::String(s) if s.starts_with("kube-api-access-") => *s = "kube-api-access-*".into(),
        Value::Array(items) => items.iter_mut().for_each(same_token_volume_name),
        Value::Object(members) => members.values_mut().for_each(same_token_volume_name),
        _ => {}
    }
}

/// Is `new` just `old` with things added (members, list elements), nothing changed or dropped?
fn only_additions(old: &Value, new: &Value) -> bool {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => o
            .iter()
            .all(|(k, v)| n.get(k).is_some_and(|now| only_additions(v, now))),
        (Value::Array(o), Value::Array(n)) => {
            let mut rest = n.iter();
            o.iter().all(|v| rest.any(|now| only_additions(v, now)))
        }
        _ => old == new,
    }
}

#[tokio::test]
async fn an_injected_pod_read_back_is_the_pod_as_submitted_plus_our_additions_only() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "injpatch").await;
    let dir = scratch_dir("injpatch");
    let wh = Webhook::start(&client, &dir, &ns.name).await;
    wh.register_mutating(&client, &ns.name).await;
    let pods: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns.name, &ApiResource::erase::<Pod>(&()));
    let create = |name: String, annotations: Value| {
        let pods = pods.clone();
        async move {
            let obj: DynamicObject =
                serde_json::from_value(submitted(&name, annotations)).expect("pod literal");
            pods.create(&PostParams::default(), &obj).await
        }
    };
    let lease = json!({"fencedlease.io/lease": "shop"});
    let is_injected = |p: &DynamicObject| {
        ["containers", "initContainers"].iter().any(|list| {
            p.data["spec"][*list]
                .as_array()
                .is_some_and(|cs| cs.iter().any(|c| c["name"] == "fencedlease"))
        })
    };
    let native = common::server_minor(&client).await >= 29;
    eventually(
        Duration::from_secs(20),
        "the mutating webhook to be in effect",
        || async {
            let name = format!("probe-{:06x}", common::rand_u32() & 0x00ff_ffff);
            let p = create(name, lease.clone()).await.ok()?;
            is_injected(&p).then_some(())
        },
    )
    .await;

    // The same pod twice: without the lease annotation (left alone) and with it (injected).
    let control = create("control".into(), json!({}))
        .await
        .expect("create control");
    assert!(!is_injected(&control));
    create("injected".into(), lease.clone())
        .await
        .expect("create injected");
    let injected = pods
        .get("injected")
        .await
        .expect("read back the injected pod");
    assert!(is_injected(&injected), "{}", injected.data);
    let control = pods
        .get("control")
        .await
        .expect("read back the control pod");

    // What the server stored for the control is what was submitted plus its defaults.
    let sent = submitted("control", json!({}));
    assert!(
        only_additions(&sent["spec"], &control.data["spec"]),
        "the server changed the submitted spec:\n{}\n{}",
        sent["spec"],
        control.data["spec"]
    );
    // The injected pod is exactly that plus our additions, at the ends of the lists.
    let spec = injected.data["spec"].clone();
    let ours = if native {
        &spec["initContainers"][0]
    } else {
        spec["containers"]
            .as_array()
            .and_then(|l| l.last())
            .expect("containers")
    };
    assert_eq!(ours["name"], "fencedlease");
    if native {
        assert_eq!(ours["restartPolicy"], "Always", "a native sidecar: {ours}");
    }
    assert_eq!(
        spec["containers"][0]["env"][2],
        json!({"name": "FENCEDLEASE_URL", "value": "http://127.0.0.1:8787"})
    );
    let mut control_spec = control.data["spec"].clone();
    same_token_volume_name(&mut control_spec);
    let mut stripped = without_injection(spec.clone(), &control_spec, native);
    same_token_volume_name(&mut stripped);
    assert_eq!(
        stripped, control_spec,
        "the injected pod's spec differs from the control's beyond our additions"
    );
}
