//! Releases installed in a remote cluster (`spec.kubeConfig.secretRef`):
//! their Helm storage lives there, so the storage is read and written with a
//! client built from the same kubeconfig Secret helm-controller reads.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::config::{
    AuthInfo, Cluster, Context, KubeConfigOptions, Kubeconfig, KubeconfigError, NamedAuthInfo,
    NamedCluster, NamedContext,
};
use kube::{Client, Config};

use crate::release::view::ReleaseView;

/// The kubeconfig in a Secret, found as helm-controller finds it: the key
/// named by the reference, else `value`, else `value.yaml`.
fn kubeconfig_bytes<'a>(
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

/// The kubeconfig reduced to what flux-plunger may use: the current
/// context's cluster and user, with inline credentials only.
///
/// The Secret is written by whoever can write the release's namespace, and
/// flux-plunger acts with its own identity, so nothing in it may make
/// flux-plunger read its own files (`tokenFile: <our ServiceAccount token>`
/// would send that token to the kubeconfig's `server`; `/dev/zero` would read
/// until the pod is killed), run a program, impersonate, route through a
/// proxy of the author's choosing or skip TLS verification. helm-controller
/// builds its remote client from the same inline fields and refuses the rest.
/// A field outside the ones allowed here is refused with its name, never
/// silently dropped, so the operator learns why; what is returned is rebuilt
/// from the allowed fields alone, so a field this code does not know cannot
/// reach the client either.
fn inline_only(kubeconfig: &Kubeconfig) -> Result<Kubeconfig, String> {
    let context_name = kubeconfig
        .current_context
        .as_deref()
        .filter(|name| !name.is_empty())
        .ok_or("it names no current-context")?;
    let context = kubeconfig
        .contexts
        .iter()
        .find(|c| c.name == context_name)
        .and_then(|c| c.context.as_ref())
        .ok_or_else(|| {
            format!("its current-context {context_name:?} is not one of its contexts")
        })?;
    let cluster = kubeconfig
        .clusters
        .iter()
        .find(|c| c.name == context.cluster)
        .and_then(|c| c.cluster.as_ref())
        .ok_or_else(|| {
            format!(
                "its cluster {:?} is not one of its clusters",
                context.cluster
            )
        })?;
    let user = match &context.user {
        None => None,
        Some(name) => Some(
            kubeconfig
                .auth_infos
                .iter()
                .find(|u| &u.name == name)
                .and_then(|u| u.auth_info.as_ref())
                .ok_or_else(|| format!("its user {name:?} is not one of its users"))?,
        ),
    };
    refuse_cluster_fields(&context.cluster, cluster)?;
    if let (Some(name), Some(user)) = (&context.user, user) {
        refuse_user_fields(name, user)?;
    }
    Ok(rebuilt(context_name, context, cluster, user))
}

/// The cluster fields that would make flux-plunger read a file, trust any
/// server, or send its traffic elsewhere.
fn refuse_cluster_fields(name: &str, cluster: &Cluster) -> Result<(), String> {
    let refused = [
        (
            cluster.certificate_authority.is_some(),
            "certificate-authority (a file path; use certificate-authority-data)",
        ),
        (
            cluster.insecure_skip_tls_verify == Some(true),
            "insecure-skip-tls-verify",
        ),
        (cluster.proxy_url.is_some(), "proxy-url"),
    ];
    first_refused(&format!("cluster {name:?}"), &refused)
}

/// The user fields that would make flux-plunger read a file, run a program
/// or act as somebody else.
fn refuse_user_fields(name: &str, user: &AuthInfo) -> Result<(), String> {
    let refused = [
        (
            user.exec.is_some(),
            "exec (an exec plugin, which flux-plunger cannot run)",
        ),
        (
            user.auth_provider.is_some(),
            "auth-provider (which flux-plunger cannot use)",
        ),
        (
            user.token_file.is_some(),
            "tokenFile (a file path; use token)",
        ),
        (
            user.client_certificate.is_some(),
            "client-certificate (a file path; use client-certificate-data)",
        ),
        (
            user.client_key.is_some(),
            "client-key (a file path; use client-key-data)",
        ),
        (
            user.impersonate.is_some()
                || user.impersonate_uid.is_some()
                || user.impersonate_groups.is_some()
                || user.impersonate_user_extra.is_some(),
            "impersonation (as, as-uid, as-groups, as-user-extra)",
        ),
    ];
    first_refused(&format!("user {name:?}"), &refused)
}

fn first_refused(whose: &str, refused: &[(bool, &str)]) -> Result<(), String> {
    match refused.iter().find(|(set, _)| *set) {
        Some((_, field)) => Err(format!(
            "its {whose} sets {field}, which flux-plunger refuses: only inline credentials are used"
        )),
        None => Ok(()),
    }
}

fn rebuilt(
    context_name: &str,
    context: &Context,
    cluster: &Cluster,
    user: Option<&AuthInfo>,
) -> Kubeconfig {
    const NAME: &str = "remote";
    let cluster = Cluster {
        server: cluster.server.clone(),
        certificate_authority_data: cluster.certificate_authority_data.clone(),
        tls_server_name: cluster.tls_server_name.clone(),
        disable_compression: cluster.disable_compression,
        ..Cluster::default()
    };
    let user = user.map(|user| AuthInfo {
        username: user.username.clone(),
        password: user.password.clone(),
        token: user.token.clone(),
        client_certificate_data: user.client_certificate_data.clone(),
        client_key_data: user.client_key_data.clone(),
        ..AuthInfo::default()
    });
    Kubeconfig {
        clusters: vec![NamedCluster {
            name: NAME.to_owned(),
            cluster: Some(cluster),
            ..NamedCluster::default()
        }],
        auth_infos: user
            .map(|user| NamedAuthInfo {
                name: NAME.to_owned(),
                auth_info: Some(user),
                ..NamedAuthInfo::default()
            })
            .into_iter()
            .collect(),
        contexts: vec![NamedContext {
            name: context_name.to_owned(),
            context: Some(Context {
                cluster: NAME.to_owned(),
                user: context.user.as_ref().map(|_| NAME.to_owned()),
                namespace: context.namespace.clone(),
                ..Context::default()
            }),
            ..NamedContext::default()
        }],
        current_context: Some(context_name.to_owned()),
        ..Kubeconfig::default()
    }
}

/// Why there is no client for a release's remote cluster.
#[derive(Debug)]
pub(crate) enum RemoteError {
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
pub(crate) async fn storage_client(
    local: &Client,
    release: &ReleaseView,
) -> Result<Client, RemoteError> {
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
            "the kubeconfig in Secret {}/{} is not valid YAML{}",
            release.namespace,
            reference.name,
            where_unparsable(&e)
        )
    })?;
    let kubeconfig = inline_only(&kubeconfig).map_err(|e| {
        format!(
            "the kubeconfig in Secret {}/{} cannot be used: {e}",
            release.namespace, reference.name
        )
    })?;
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

/// Where the YAML parser stopped, and nothing of its message: that quotes
/// the lines around the fault and any value it did not expect, which are the
/// kubeconfig's credentials, and the description goes to an Event, the logs
/// and Flux's notifications.
fn where_unparsable(error: &KubeconfigError) -> String {
    match error {
        KubeconfigError::Parse(parse) => parse
            .location()
            .map(|at| format!(" (line {}, column {})", at.line(), at.column()))
            .unwrap_or_default(),
        _ => String::new(),
    }
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

    /// A kubeconfig of one cluster, one user and a context naming both,
    /// with `cluster` and `user` as the YAML of their fields.
    fn kubeconfig(cluster: &str, user: &str) -> Kubeconfig {
        Kubeconfig::from_yaml(&format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://remote.example:6443\n{cluster}contexts:\n- name: ctx\n  context: {{cluster: c, user: u, namespace: apps}}\ncurrent-context: ctx\nusers:\n- name: u\n  user:\n    token: abc\n{user}"
        ))
        .unwrap()
    }

    #[test]
    fn inline_credentials_are_kept_and_nothing_else_reaches_the_client() {
        let inline = kubeconfig(
            "    certificate-authority-data: Q0E=\n    tls-server-name: api.remote\n    disable-compression: true\n",
            "    client-certificate-data: Q0VSVA==\n    client-key-data: S0VZ\n    username: u\n    password: p\n",
        );
        let kept = inline_only(&inline).unwrap();
        let cluster = kept.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(
            cluster.server.as_deref(),
            Some("https://remote.example:6443")
        );
        assert_eq!(cluster.certificate_authority_data.as_deref(), Some("Q0E="));
        assert_eq!(cluster.tls_server_name.as_deref(), Some("api.remote"));
        assert_eq!(cluster.disable_compression, Some(true));
        // Every credential of the user, each as it was (the secret ones are
        // only readable as the kubeconfig writes them).
        let user = &serde_json::to_value(&kept).unwrap()["users"][0]["user"];
        assert_eq!(
            user,
            &serde_json::json!({
                "token": "abc", "client-key-data": "S0VZ", "client-certificate-data": "Q0VSVA==",
                "username": "u", "password": "p",
            })
        );
        assert_eq!(kept.current_context.as_deref(), Some("ctx"));
        assert_eq!(kept.contexts[0].name, "ctx");
        let context = kept.contexts[0].context.as_ref().unwrap();
        assert_eq!(context.namespace.as_deref(), Some("apps"));
        // The context names the cluster and the user kept, under their new names.
        assert_eq!(context.cluster, kept.clusters[0].name);
        assert_eq!(context.user.as_ref(), Some(&kept.auth_infos[0].name));
    }

    #[test]
    fn every_field_that_reads_a_file_runs_a_program_or_redirects_is_refused_by_name() {
        let cases = [
            (
                "",
                "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n",
                "tokenFile",
            ),
            (
                "",
                "    client-certificate: /etc/cert\n",
                "client-certificate (",
            ),
            ("", "    client-key: /etc/key\n", "client-key ("),
            ("", "    as: system:admin\n", "impersonation"),
            ("", "    as-groups: [system:masters]\n", "impersonation"),
            (
                "",
                "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n",
                "exec",
            ),
            ("", "    auth-provider:\n      name: gcp\n", "auth-provider"),
            (
                "    certificate-authority: /etc/ca.crt\n",
                "",
                "certificate-authority (",
            ),
            (
                "    insecure-skip-tls-verify: true\n",
                "",
                "insecure-skip-tls-verify",
            ),
            ("    proxy-url: http://127.0.0.1:3128\n", "", "proxy-url"),
        ];
        for (cluster, user, field) in cases {
            let why = inline_only(&kubeconfig(cluster, user)).unwrap_err();
            assert!(
                why.contains(field) && why.contains("refuses"),
                "{field}: {why}"
            );
        }
    }

    #[tokio::test]
    async fn a_kubeconfig_that_does_not_parse_is_described_without_its_text() {
        // The description goes to a Warning Event anyone who may view the
        // release reads, to the logs and to Flux's notifications: the YAML
        // parser's own message quotes the lines around the fault, and a
        // value it did not expect, which are the kubeconfig's credentials.
        let release = ReleaseView {
            namespace: "apps".into(),
            ..Default::default()
        };
        let reference = crate::release::view::KubeConfigSecretRef {
            name: "remote".into(),
            key: None,
        };
        for (text, at) in [
            (
                "users:\n- name: u\n  user:\n    token: s3cr3t-old-token\n    token: s3cr3t-new-token\n",
                "(line 5, column 5)",
            ),
            ("users: s3cr3t-token\n", "(line 1, column 8)"),
            (
                "users:\n- name: u\n  user: {token: s3cr3t-token\n",
                "(line 3, column 9)",
            ),
        ] {
            let secret = Secret {
                data: Some(data(&[("value", text)])),
                ..Default::default()
            };
            let err = usable_client(&release, &reference, secret)
                .await
                .map(|_| ())
                .unwrap_err();
            assert!(!err.contains("s3cr3t"), "{err}");
            assert_eq!(
                err,
                format!("the kubeconfig in Secret apps/remote is not valid YAML {at}"),
                "where the parser stopped, and nothing of what it read"
            );
        }
    }

    #[test]
    fn a_kubeconfig_that_names_no_usable_context_is_refused() {
        let none = Kubeconfig::from_yaml("apiVersion: v1\nkind: Config\n").unwrap();
        assert!(inline_only(&none).unwrap_err().contains("current-context"));
        let mut dangling = kubeconfig("", "");
        dangling.current_context = Some("other".into());
        assert!(inline_only(&dangling).unwrap_err().contains("\"other\""));
        let mut no_cluster = kubeconfig("", "");
        no_cluster.clusters.clear();
        assert!(
            inline_only(&no_cluster)
                .unwrap_err()
                .contains("cluster \"c\"")
        );
    }
}
