//! Releases installed in a remote cluster (`spec.kubeConfig.secretRef`):
//! their Helm storage lives there, so the storage is read and written with a
//! client built from the same kubeconfig Secret helm-controller reads.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::release::view::ReleaseView;

/// The kubeconfig in a Secret, found as helm-controller finds it: the key
/// named by the reference, else `value`, else `value.yaml`.
pub fn kubeconfig_bytes<'a>(
    data: &'a BTreeMap<String, ByteString>,
    key: Option<&str>,
) -> Result<&'a [u8], String> {
    match key {
        Some(key) => data
            .get(key)
            .map(|v| v.0.as_slice())
            .ok_or_else(|| format!("has no {key:?} key")),
        None => data
            .get("value")
            .or_else(|| data.get("value.yaml"))
            .map(|v| v.0.as_slice())
            .ok_or_else(|| "has neither a \"value\" nor a \"value.yaml\" key".to_owned()),
    }
}

/// Refuses what flux-plunger cannot use: credentials that run a program
/// (exec plugins, auth providers) — the image has none of those programs.
pub fn check_usable(kubeconfig: &Kubeconfig) -> Result<(), String> {
    for user in &kubeconfig.auth_infos {
        if let Some(auth) = &user.auth_info {
            if auth.exec.is_some() {
                return Err(format!(
                    "user {:?} authenticates with an exec plugin, which flux-plunger cannot run",
                    user.name
                ));
            }
            if auth.auth_provider.is_some() {
                return Err(format!(
                    "user {:?} authenticates with an auth provider, which flux-plunger cannot use",
                    user.name
                ));
            }
        }
    }
    Ok(())
}

/// Why there is no client for a release's remote cluster.
#[derive(Debug)]
pub enum RemoteError {
    /// The kubeconfig Secret could not be read (the apiserver did not
    /// answer, or refused): retried with backoff like any failed read.
    Unreadable(kube::Error),
    /// The kubeconfig Secret is not there (yet): Cluster API and other
    /// provisioners create it after the release, and its creation wakes no
    /// watch of ours, so a recovery is retried with backoff, with a warning.
    Missing(kube::Error),
    /// The Secret is there and wrong: nothing changes until someone fixes
    /// it (an edit of the release wakes it), so the release is skipped with
    /// a warning.
    Unusable(String),
}

/// A client for the cluster the release is installed in.
pub async fn storage_client(local: &Client, release: &ReleaseView) -> Result<Client, RemoteError> {
    let Some(reference) = &release.kube_config_secret else {
        return Err(RemoteError::Unusable("spec.kubeConfig has no secretRef (a configMapRef for cloud workload identity is not supported)".to_owned()));
    };
    let secrets: Api<Secret> = Api::namespaced(local.clone(), &release.namespace);
    let secret = match secrets.get(&reference.name).await {
        Ok(secret) => secret,
        Err(err) if crate::error::is_api_code(&err, 404) => return Err(RemoteError::Missing(err)),
        Err(err) => return Err(RemoteError::Unreadable(err)),
    };
    usable_client(release, reference, secret)
        .await
        .map_err(RemoteError::Unusable)
}

/// A client from the kubeconfig in `secret`, or why it cannot be used.
async fn usable_client(
    release: &ReleaseView,
    reference: &crate::release::view::KubeConfigSecretRef,
    secret: Secret,
) -> Result<Client, String> {
    let data = secret.data.unwrap_or_default();
    let bytes = kubeconfig_bytes(&data, reference.key.as_deref()).map_err(|e| {
        format!(
            "the kubeconfig Secret {}/{} {e}",
            release.namespace, reference.name
        )
    })?;
    let text = std::str::from_utf8(bytes).map_err(|_| {
        format!(
            "the kubeconfig in Secret {}/{} is not text",
            release.namespace, reference.name
        )
    })?;
    let kubeconfig = Kubeconfig::from_yaml(text).map_err(|e| {
        format!(
            "the kubeconfig in Secret {}/{} is invalid: {e}",
            release.namespace, reference.name
        )
    })?;
    check_usable(&kubeconfig)?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| {
            format!(
                "the kubeconfig in Secret {}/{} cannot be used: {e}",
                release.namespace, reference.name
            )
        })?;
    crate::client::bounded(config, crate::timings::REQUEST_TIMEOUT)
        .map_err(|e| format!("no client for the remote cluster: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, ByteString> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
            .collect()
    }

    #[test]
    fn the_kubeconfig_key_is_chosen_as_helm_controller_chooses_it() {
        let both = data(&[("value", "a"), ("value.yaml", "b"), ("custom", "c")]);
        assert_eq!(kubeconfig_bytes(&both, None).unwrap(), b"a");
        assert_eq!(kubeconfig_bytes(&both, Some("custom")).unwrap(), b"c");
        assert_eq!(
            kubeconfig_bytes(&data(&[("value.yaml", "b")]), None).unwrap(),
            b"b"
        );
        assert!(
            kubeconfig_bytes(&data(&[("other", "x")]), None)
                .unwrap_err()
                .contains("neither")
        );
        assert!(
            kubeconfig_bytes(&both, Some("missing"))
                .unwrap_err()
                .contains("\"missing\"")
        );
    }

    #[test]
    fn credentials_that_run_a_program_are_refused() {
        let exec = Kubeconfig::from_yaml(
            "apiVersion: v1\nkind: Config\nusers:\n- name: eks\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n",
        )
        .unwrap();
        assert!(check_usable(&exec).unwrap_err().contains("exec plugin"));
        let token = Kubeconfig::from_yaml(
            "apiVersion: v1\nkind: Config\nusers:\n- name: t\n  user:\n    token: abc\n",
        )
        .unwrap();
        assert!(check_usable(&token).is_ok());
    }
}
