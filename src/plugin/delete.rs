//! `kubectl fencedlease delete RESOURCE/NAME`: a person deletes a protected object the only way
//! anyone may (deletes are fenced): as the lease's holder. The command campaigns for the lease
//! under an identity of its own (asking the holder to hand it over with `--handover`), announces
//! the delete under the token it gets, deletes, and gives the lease back.

use std::process::ExitCode;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::discovery::{ApiResource, Discovery, Scope};
use kube::Client;
use tokio::sync::oneshot;

use super::{kube_err, PluginError};
use crate::api::{FencedLease, LEASE_LABEL};
use crate::lease::clock;
use crate::lease::elector::{Elector, ElectorConfig, LeaderState};
use crate::lease::rules::FencingToken;

/// How often the wait for the lease says what it waits for.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// `RESOURCE/NAME` split, with RESOURCE as kubectl takes it: a plural, singular or kind,
/// optionally with `.group` (`configmap/inventory`, `deployments.apps/web`).
pub(super) fn parse_target(target: &str) -> Result<(String, Option<String>, String), PluginError> {
    let bad = || PluginError::Target(target.to_string());
    let (resource, name) = target.split_once('/').ok_or_else(bad)?;
    if resource.is_empty() || name.is_empty() || name.contains('/') {
        return Err(bad());
    }
    let resource = resource.to_ascii_lowercase();
    let (resource, group) = match resource.split_once('.') {
        Some((r, g)) => (r.to_string(), Some(g.to_string())),
        None => (resource, None),
    };
    Ok((resource, group, name.to_string()))
}

/// Whether the API resource `ar` is the one `resource` (and `group`, if given) names.
pub(super) fn names(ar: &ApiResource, resource: &str, group: Option<&str>) -> bool {
    let kind = ar.kind.to_ascii_lowercase();
    let plural = ar.plural.to_ascii_lowercase();
    let singular_ok = resource == kind || resource == plural;
    singular_ok && group.is_none_or(|g| g == ar.group || (g == "core" && ar.group.is_empty()))
}

async fn resolve(
    client: &Client,
    resource: &str,
    group: Option<&str>,
) -> Result<ApiResource, PluginError> {
    let discovery = Discovery::new(client.clone())
        .run()
        .await
        .map_err(kube_err("discovering the API's resources"))?;
    let found = discovery
        .groups()
        .flat_map(|g| g.recommended_resources())
        .find(|(ar, caps)| caps.scope == Scope::Namespaced && names(ar, resource, group))
        .map(|(ar, _)| ar);
    found.ok_or_else(|| PluginError::UnknownResource(resource.to_string()))
}

/// The merge patch that announces the delete under `token` (the elector crate's stamp).
fn announcement(lease: &str, token: &FencingToken) -> serde_json::Value {
    let nanos = jiff::Timestamp::now().as_nanosecond();
    let id = format!(
        "{}-kubectl-{}-{nanos:x}",
        token.generation,
        std::process::id()
    );
    let mut meta = ObjectMeta::default();
    fencedlease_elector::stamp::announce_delete(&mut meta, lease, token, &id);
    serde_json::json!({ "metadata": meta })
}

/// Waits until the elector leads, saying every few seconds who holds the lease meanwhile.
async fn wait_to_lead(
    state: &mut tokio::sync::watch::Receiver<LeaderState>,
    leases: &Api<FencedLease>,
    lease: &str,
    what: &str,
    patience: Duration,
) -> Result<FencingToken, PluginError> {
    let deadline = clock::now() + patience;
    loop {
        if let Some(t) = state.borrow().leading_token(clock::now()) {
            return Ok(t.clone());
        }
        let next = (clock::now() + PROGRESS_EVERY).min(deadline);
        match tokio::time::timeout_at(clock::timer_for(next), state.changed()).await {
            Ok(Ok(())) => continue,
            Ok(Err(_)) => return Err(PluginError::NeverLed(what.to_string())),
            Err(_) if clock::now() >= deadline => {
                return Err(PluginError::NeverLed(what.to_string()))
            }
            Err(_) => {
                let holder = match leases.get_opt(lease).await {
                    Ok(Some(l)) => l.holder().unwrap_or("nobody").to_string(),
                    _ => "unknown".to_string(),
                };
                eprintln!("waiting to hold FencedLease {what} (held by {holder})");
            }
        }
    }
}

/// Takes the lease of `target`'s object, announces the delete, deletes, gives the lease back.
pub(super) async fn delete(
    client: &Client,
    ns: &str,
    target: &str,
    handover: bool,
    patience: Duration,
) -> Result<ExitCode, PluginError> {
    let (resource, group, name) = parse_target(target)?;
    let ar = resolve(client, &resource, group.as_deref()).await?;
    let objects: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let object = objects
        .get(&name)
        .await
        .map_err(kube_err(format!("reading {} {ns}/{name}", ar.kind)))?;
    let Some(lease) = object
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LEASE_LABEL))
        .filter(|l| !l.is_empty())
    else {
        return Err(PluginError::NotProtected(format!(
            "{} {ns}/{name}",
            ar.kind
        )));
    };
    let lease = lease.clone();
    let identity = format!("kubectl-fencedlease-{}", std::process::id());
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), ns);
    let (elector, handle) = Elector::new(client.clone(), ElectorConfig::new(ns, &lease, &identity))
        .map_err(|e| PluginError::Elector(e.to_string()))?;
    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(elector.run(async {
        let _ = stopped.await;
    }));
    if handover {
        super::handover(client, &leases, ns, &lease, &identity).await?;
    }
    let what = format!("{ns}/{lease}");
    let mut state = handle.state.clone();
    let outcome = async {
        let token = wait_to_lead(&mut state, &leases, &lease, &what, patience).await?;
        eprintln!("holding FencedLease {what} as {identity} (token {token})");
        let patch = announcement(&lease, &token);
        objects
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_err(format!(
                "announcing the delete of {} {ns}/{name}",
                ar.kind
            )))?;
        objects
            .delete(&name, &DeleteParams::default())
            .await
            .map_err(kube_err(format!("deleting {} {ns}/{name}", ar.kind)))?;
        println!(
            "{} {ns}/{name} deleted under token {token} of FencedLease {what}",
            ar.kind
        );
        Ok(ExitCode::SUCCESS)
    }
    .await;
    // Shutting the elector down releases the lease: the candidates compete again.
    let _ = stop.send(());
    match running.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("giving FencedLease {what} back: {e}"),
        Err(e) => eprintln!("giving FencedLease {what} back: {e}"),
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_resource_slash_name_as_kubectl_takes_them() {
        let ok = |t: &str| parse_target(t).expect(t);
        assert_eq!(
            ok("configmap/inv"),
            ("configmap".into(), None, "inv".into())
        );
        assert_eq!(
            ok("Deployments.apps/web"),
            ("deployments".into(), Some("apps".into()), "web".into())
        );
        for bad in ["inv", "/inv", "configmap/", "a/b/c", ""] {
            assert!(
                matches!(parse_target(bad), Err(PluginError::Target(_))),
                "{bad}"
            );
        }
        let cm = ApiResource {
            group: String::new(),
            version: "v1".into(),
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            plural: "configmaps".into(),
        };
        for (r, g, want) in [
            ("configmap", None, true),
            ("configmaps", None, true),
            ("configmaps", Some("core"), true),
            ("configmaps", Some("apps"), false),
            ("secret", None, false),
        ] {
            assert_eq!(names(&cm, r, g), want, "{r} {g:?}");
        }
    }

    #[test]
    fn the_announcement_sets_the_intent_to_its_own_write_id_under_the_token() {
        let t = FencingToken {
            lease_uid: "u1".into(),
            generation: 4,
        };
        let p = announcement("db", &t);
        let a = &p["metadata"]["annotations"];
        assert_eq!(a["fencedlease.io/token"], "4");
        assert_eq!(a["fencedlease.io/lease-uid"], "u1");
        assert_eq!(
            a["fencedlease.io/delete-intent"],
            a["fencedlease.io/write-id"]
        );
        assert_eq!(p["metadata"]["labels"][LEASE_LABEL], "db");
    }
}
