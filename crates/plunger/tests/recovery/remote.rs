//! Releases installed in another cluster (`spec.kubeConfig`, SPEC §9): the storage read and written
//! there.

use super::*;

#[tokio::test]
async fn a_release_in_a_remote_cluster_is_recovered_there() -> Result<()> {
    let w = world("remote").await?;
    let (_remote, remote_ns) =
        stuck_in_a_remote_cluster(&w, &[(1, "superseded"), (2, "uninstalling")]).await?;

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 2 }
    );

    assert_eq!(
        secret_names(&remote_ns).await?,
        vec!["sh.helm.release.v1.web.v1"]
    );
    assert!(
        secret_names(&w.ns)
            .await?
            .contains(&"sh.helm.release.v1.web.v2".to_owned()),
        "the local decoy stays"
    );
    assert_let_go(&w.get("web").await?.unwrap());
    Ok(())
}

/// A release in a remote cluster deleted during its recovery: the history
/// handed to helm-controller is the newest revision of the storage there
/// (not the local decoy), written to the status here.
#[tokio::test]
async fn a_release_in_a_remote_cluster_deleted_during_its_recovery_is_handed_over_from_the_storage_there()
-> Result<()> {
    let w = world("remote-handover").await?;
    let (_remote, remote_ns) =
        stuck_in_a_remote_cluster(&w, &[(1, "superseded"), (3, "uninstalling")]).await?;
    let releases = w.ns.releases();
    let hc = w.hc.clone();
    let reconciler = w.reconciler_pausing(Step::Acquired, move || {
        let (releases, hc) = (releases.clone(), hc.clone());
        async move {
            releases
                .delete("web", &DeleteParams::default())
                .await
                .unwrap();
            assert_eq!(
                hc.handle("web").await.unwrap(),
                Handled::UninstallSkippedBecauseSuspended
            );
        }
        .boxed()
    });

    // The annotation meets the delete's new resourceVersion: the undo hands
    // the release over and lifts the suspension, keeping the fence.
    assert_eq!(
        reconciler.reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 3 }
    );

    let handed = w.ns.releases().get("web").await?;
    let history = &handed.data["status"]["history"];
    assert_eq!(history.as_array().map(Vec::len), Some(1), "{history}");
    assert_eq!(history[0]["version"], 3, "the remote revision: {history}");
    assert_eq!(history[0]["name"], "web");
    let view = ReleaseView::from_object(&handed);
    assert!(!view.suspend && view.has_fence());
    assert_handed_over(&w, "web", 3).await?;
    assert_eq!(
        secret_names(&remote_ns).await?,
        vec!["sh.helm.release.v1.web.v1", "sh.helm.release.v1.web.v3"],
        "nothing deleted there"
    );
    testkit::strip_fences(&w.ns).await?;
    Ok(())
}

#[tokio::test]
async fn a_remote_cluster_that_cannot_be_used_is_skipped_with_a_warning() -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::PostParams;
    let w = world("remote-bad").await?;
    let exec: Secret = serde_json::from_value(json!({
        "metadata": {"name": "exec-kubeconfig"},
        "stringData": {"value": "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://eks.example:443\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\nusers:\n- name: u\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n"},
    }))?;
    w.ns.secrets().create(&PostParams::default(), &exec).await?;
    for (name, secret) in [("missing", "no-such-secret"), ("exec", "exec-kubeconfig")] {
        w.ns.create_release(name, json!({"kubeConfig": {"secretRef": {"name": secret}}}))
            .await?;
        w.hc.handle(name).await?;
        w.ns.create_storage_secret(name, 1, "uninstalling").await?;
        w.ns.mark_stuck(name).await?;
        let before = w.get(name).await?.unwrap();

        let outcome = w.reconciler().reconcile(&w.ns.name, name).await;

        if name == "missing" {
            // It may yet be created, which wakes nothing: retried.
            let err = outcome.expect_err("a missing Secret is retried");
            assert_eq!(err.kind(), "read_kubeconfig", "{err}");
        } else {
            assert!(
                matches!(
                    &outcome,
                    Ok(Outcome::Skipped(SkipReason::RemoteClusterUnusable { .. }))
                ),
                "{name}: {outcome:?}"
            );
        }
        assert_eq!(
            w.get(name).await?.unwrap().metadata.resource_version,
            before.metadata.resource_version,
            "{name}"
        );
        let events = w.ns.events_for(name).await?;
        let expected = if name == "exec" {
            "exec plugin"
        } else {
            "does not exist"
        };
        assert!(
            events.iter().any(|e| e.reason == "RemoteClusterUnusable"
                && e.type_ == "Warning"
                && e.note.contains(expected)),
            "{name}: {events:?}"
        );
    }
    assert_eq!(w.storage_secret_count().await?, 2);
    Ok(())
}

#[tokio::test]
async fn a_kubeconfig_secret_that_cannot_be_read_is_retried_not_called_unusable() -> Result<()> {
    let w = world("remote-unreadable").await?;
    w.ns.create_release(
        "web",
        json!({"kubeConfig": {"secretRef": {"name": "remote-kubeconfig"}}}),
    )
    .await?;
    w.hc.handle("web").await?;
    w.ns.create_storage_secret("web", 1, "uninstalling").await?;
    w.ns.mark_stuck("web").await?;
    // flux-plunger's identity may read releases but, for now, no Secret: the
    // read fails, as it would while the apiserver is unreachable.
    let reconciler = reconciler_that_may_read_no_secret(&w).await?;
    let before = w.get("web").await?.unwrap();

    let err = reconciler
        .reconcile(&w.ns.name, "web")
        .await
        .expect_err("an unreadable Secret is an error, retried with backoff");

    assert_eq!(err.kind(), "read_kubeconfig", "{err}");
    assert_eq!(err.api_code(), Some(403), "{err}");
    assert_eq!(
        w.get("web").await?.unwrap().metadata.resource_version,
        before.metadata.resource_version,
        "nothing written"
    );
    assert!(
        w.ns.events_for("web")
            .await?
            .iter()
            .all(|e| e.reason != "RemoteClusterUnusable"),
        "not called unusable"
    );
    Ok(())
}

/// A reconciler acting as an identity that may read and patch releases and
/// record events, but read no Secret.
async fn reconciler_that_may_read_no_secret(w: &World) -> Result<Reconciler> {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    use kube::api::{Api, PostParams};
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "plunger"},
        "rules": [
            {"apiGroups": ["helm.toolkit.fluxcd.io"], "resources": ["helmreleases"], "verbs": ["get", "list", "patch"]},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        ],
    }))?;
    Api::<Role>::namespaced(w.client.clone(), &w.ns.name)
        .create(&PostParams::default(), &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "plunger"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "plunger"},
        "subjects": [{"kind": "ServiceAccount", "name": "plunger", "namespace": w.ns.name}],
    }))?;
    Api::<RoleBinding>::namespaced(w.client.clone(), &w.ns.name)
        .create(&PostParams::default(), &binding)
        .await?;
    let client = control_plane()
        .service_account_client(&w.client, &w.ns.name, "plunger")
        .await?;
    Ok(Reconciler::new(
        client.clone(),
        Events::new(client, "flux-plunger", None),
        Timings::default(),
    ))
}

/// A deleted release whose storage cannot be read has its failures
/// remembered (they count towards giving up); a tenant taking the fence off
/// makes it gone, and the pass that finds it gone forgets them, or the
/// controller would keep one entry for every such release ever deleted.
#[tokio::test]
async fn the_storage_failures_of_a_release_found_gone_are_forgotten() -> Result<()> {
    let w = world("remote-forgotten").await?;
    let _remote = deleted_in_a_remote_cluster(&w).await?;
    let reconciler = reconciler_that_may_read_no_secret(&w).await?;
    let err = reconciler
        .reconcile(&w.ns.name, "web")
        .await
        .expect_err("the kubeconfig Secret cannot be read");
    assert_eq!(err.kind(), "read_kubeconfig", "{err}");
    assert_eq!(reconciler.remembered_storage_failures(), 1);

    testkit::strip_fences(&w.ns).await?;
    assert!(
        w.get("web").await?.is_none(),
        "gone with its last finalizer"
    );

    assert_eq!(
        reconciler.reconcile(&w.ns.name, "web").await?,
        Outcome::Gone
    );
    assert_eq!(
        reconciler.remembered_storage_failures(),
        0,
        "forgotten once found gone"
    );
    Ok(())
}

/// The kubeconfig Secret is the tenant's: whatever it names, flux-plunger
/// reads none of its own files and no credential of its own reaches the
/// tenant's server. The server here is an HTTPS listener trusted by the CA
/// the kubeconfig carries, as an attacker's server would be; the token file
/// stands for flux-plunger's ServiceAccount token on its own disk.
#[tokio::test]
async fn a_tenants_kubeconfig_gets_no_credential_of_ours_to_its_server() -> Result<()> {
    use base64::Engine;
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::PostParams;
    use testkit::token_trap::TokenTrap;
    let w = world("remote-trap").await?;
    let pki = control_plane().pki();
    let trap = TokenTrap::start(pki).await?;
    let files = tempfile::tempdir()?;
    let token_file = files.path().join("token");
    std::fs::write(&token_file, "our-service-account-token")?;
    let (cert_file, key_file) = (files.path().join("tls.crt"), files.path().join("tls.key"));
    std::fs::write(&cert_file, &pki.admin_cert_pem)?;
    std::fs::write(&key_file, &pki.admin_key_pem)?;
    let ca = base64::engine::general_purpose::STANDARD.encode(&pki.ca_cert_pem);
    let users = [
        (
            "token-file",
            format!("    tokenFile: {}\n", token_file.display()),
            "tokenFile",
        ),
        (
            "cert-files",
            format!(
                "    client-certificate: {}\n    client-key: {}\n",
                cert_file.display(),
                key_file.display()
            ),
            "client-certificate (",
        ),
        (
            "impersonates",
            "    token: tenant\n    as: system:serviceaccount:flux-plunger:flux-plunger\n"
                .to_owned(),
            "impersonation",
        ),
    ];
    for (name, user, refused) in &users {
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority-data: {ca}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\nusers:\n- name: u\n  user:\n{user}",
            trap.url()
        );
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": format!("{name}-kubeconfig")},
            "stringData": {"value": kubeconfig},
        }))?;
        w.ns.secrets()
            .create(&PostParams::default(), &secret)
            .await?;
        w.ns.create_release(
            name,
            json!({"kubeConfig": {"secretRef": {"name": format!("{name}-kubeconfig")}}}),
        )
        .await?;
        w.hc.handle(name).await?;
        w.ns.mark_stuck(name).await?;

        let outcome = w.reconciler().reconcile(&w.ns.name, name).await;

        assert!(
            matches!(
                &outcome,
                Ok(Outcome::Skipped(SkipReason::RemoteClusterUnusable { .. }))
            ),
            "{name}: {outcome:?}"
        );
        let events = w.ns.events_for(name).await?;
        assert!(
            events.iter().any(|e| e.reason == "RemoteClusterUnusable"
                && e.type_ == "Warning"
                && e.note.contains(refused)),
            "{name}: {events:?}"
        );
    }
    let caught = trap.caught();
    assert!(
        caught.authorization_headers().is_empty(),
        "a credential reached the tenant's server: {:?}",
        caught.authorization_headers()
    );
    assert_eq!(
        caught.connections, 0,
        "nothing dials the tenant's server: {caught:?}"
    );
    Ok(())
}

/// A remote release deleted while its kubeconfig Secret is briefly gone
/// (credentials rotated by Cluster API): one failed read lets nothing go.
/// The fence holds; once the Secret is back, the history is handed over
/// from the storage there.
#[tokio::test]
async fn a_kubeconfig_secret_gone_for_a_moment_holds_the_fence_of_a_deleted_release() -> Result<()>
{
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::PostParams;
    let w = world("remote-rotated").await?;
    let _remote = deleted_in_a_remote_cluster(&w).await?;
    let mut kubeconfig: Secret = w.ns.secrets().get("remote-kubeconfig").await?;
    w.ns.secrets()
        .delete("remote-kubeconfig", &DeleteParams::default())
        .await?;

    let held = w.reconciler().reconcile(&w.ns.name, "web").await?;

    assert!(matches!(held, Outcome::FenceHeld { .. }), "{held:?}");
    assert!(w.view("web").await?.has_fence());
    assert!(
        w.ns.events_for("web")
            .await?
            .iter()
            .all(|e| e.reason != "ReleasedWithoutUninstall")
    );
    kubeconfig.metadata = kube::api::ObjectMeta {
        name: Some("remote-kubeconfig".into()),
        ..Default::default()
    };
    w.ns.secrets()
        .create(&PostParams::default(), &kubeconfig)
        .await?;
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 2 }
    );
    testkit::strip_fences(&w.ns).await?;
    Ok(())
}

/// Release `web` of `w`, stuck in a remote cluster (v1 superseded, v2
/// uninstalling there), fenced by flux-plunger, then deleted: helm-controller
/// found nothing recorded to uninstall. Returns the remote cluster, running
/// while it lives.
async fn deleted_in_a_remote_cluster(w: &World) -> Result<testkit::ControlPlane> {
    let (remote, _remote_ns) =
        stuck_in_a_remote_cluster(w, &[(1, "superseded"), (2, "uninstalling")]).await?;
    w.ns.apply_as_flux_plunger("web", false).await?;
    w.delete("web").await?;
    assert_eq!(
        w.hc.handle("web").await?,
        Handled::NothingRecordedToUninstall
    );
    Ok(remote)
}
