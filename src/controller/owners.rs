//! Owner references: what the operator creates at run time is owned by an object the chart
//! installs, so that uninstalling removes it too.

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Api, Client};

/// An owner reference to the Service `name` in `namespace`, if it exists: the webhook Service
/// owns what the operator creates at run time (the certificate Secret, the election lease), so
/// that uninstalling removes those too.
pub(super) async fn service_owner(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<OwnerReference>, kube::Error> {
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    Ok(services.get_opt(name).await?.and_then(|svc| {
        svc.metadata.uid.map(|uid| OwnerReference {
            api_version: "v1".into(),
            kind: "Service".into(),
            name: name.to_string(),
            uid,
            ..OwnerReference::default()
        })
    }))
}
