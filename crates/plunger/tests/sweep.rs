//! The sweep's library against a real apiserver (SPEC §8): what a release
//! that changes under the sweep, or an apiserver that never answers, does to
//! it. The binary itself is exercised as a process by the bats suite.

use std::time::{Duration, Instant};

use anyhow::Result;
use kube::api::{DeleteParams, Patch, PatchParams};
use plunger::install::Install;
use plunger::names::{
    FENCE_FINALIZER, FIELD_MANAGER, HELM_CONTROLLER_FINALIZER, HELMRELEASE_API_VERSION,
    HELMRELEASE_KIND,
};
use plunger::release::view::ReleaseView;
use plunger::scope::Scope;
use plunger::sweep::hook::{HookConfig, run_hook};
use plunger::sweep::plan::Budget;
use plunger::sweep::{NotReleased, Refusals, Released, Uninstall, release_with_retry};
use serde_json::json;
use testkit::{TestNamespace, audit, control_plane};

async fn namespace(prefix: &str) -> Result<TestNamespace> {
    TestNamespace::create(&control_plane().client().await?, prefix).await
}

/// The sweep's client: the chart's pre-delete hook ServiceAccount, under the
/// chart's admission guard.
async fn hook() -> Result<kube::Client> {
    testkit::guard::shared()?.hook_client().await
}

/// A release created with the finalizer helm-controller puts on every
/// release it reconciles.
async fn with_helm_controller_finalizer(ns: &TestNamespace, name: &str) -> Result<()> {
    ns.create_release(name, json!({})).await?;
    ns.releases()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": [HELM_CONTROLLER_FINALIZER]}})),
        )
        .await?;
    Ok(())
}

/// A release holding flux-plunger's suspension and fence, as a recovery
/// that stopped midway leaves it; helm-controller's finalizer first.
async fn held(ns: &TestNamespace, name: &str, suspend: bool) -> Result<ReleaseView> {
    with_helm_controller_finalizer(ns, name).await?;
    let mut body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
        "metadata": {"name": name, "finalizers": [FENCE_FINALIZER]}});
    if suspend {
        body["spec"] = json!({"suspend": true});
    }
    let object = ns
        .releases()
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(body),
        )
        .await?;
    Ok(ReleaseView::from_object(&object))
}

async fn view(ns: &TestNamespace, name: &str) -> Result<ReleaseView> {
    Ok(ReleaseView::from_object(&ns.releases().get(name).await?))
}

fn budget(retries: Duration) -> Budget {
    Budget::from_now(retries, Duration::from_secs(10))
}

/// (verb, response code) of every request of the hook's ServiceAccount on
/// the release since `offset` of the audit log, in order. Only the hook's:
/// another test of this binary, listing every fence of the cluster at the
/// same time, reads this release too (its fence has no label).
fn audited_requests(ns: &str, name: &str, offset: u64) -> Result<Vec<(String, u16)>> {
    let hook_user = testkit::guard::shared()?.hook_user();
    Ok(audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.resource() == "helmreleases" && r.user == hook_user)
        .filter(|r| r.namespace.as_deref() == Some(ns) && r.name == name)
        .map(|r| (r.verb, r.code))
        .collect())
}

#[tokio::test]
async fn a_release_that_changed_after_its_read_is_read_again_and_then_released() -> Result<()> {
    let ns = namespace("sweep-conflict").await?;
    let stale = held(&ns, "web", true).await?;
    // Someone writes between the sweep's listing and its patch.
    ns.releases()
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "payments"}}})),
        )
        .await?;
    let offset = audit::mark();

    let released = release_with_retry(
        &hook().await?,
        stale,
        budget(Duration::from_secs(10)),
        Uninstall::MaySkip,
        Refusals::Retry,
    )
    .await?;

    // Read before the checks below add reads of their own.
    let mut requests = Vec::new();
    testkit::eventually(
        Duration::from_secs(10),
        "the requests reach the audit log",
        || {
            let read = audited_requests(&ns.name, "web", offset);
            if let Ok(read) = &read {
                requests.clone_from(read);
            }
            async move { Ok(read?.len() >= 3) }
        },
    )
    .await?;
    assert_eq!(
        requests,
        vec![
            ("patch".to_owned(), 422),
            ("get".to_owned(), 200),
            ("patch".to_owned(), 200)
        ],
        "the stale patch is refused by its resourceVersion test, the release read again, the new patch lands"
    );
    assert_eq!(
        released,
        Released {
            without_uninstall: false
        }
    );
    let now = ns.releases().get("web").await?;
    assert_eq!(
        now.metadata.finalizers,
        Some(vec![HELM_CONTROLLER_FINALIZER.to_owned()])
    );
    assert_eq!(now.data["spec"].get("suspend"), None);
    assert_eq!(
        now.metadata.labels.unwrap_or_default().get("team").cloned(),
        Some("payments".to_owned()),
        "the write in between is kept"
    );
    Ok(())
}

#[tokio::test]
async fn release_refuses_a_release_found_deleted_and_not_uninstalled_when_it_reads_again()
-> Result<()> {
    let ns = namespace("sweep-refuse").await?;
    let live = held(&ns, "web", false).await?;
    // Deleted between the operator's read and the patch; helm-controller has
    // not run the uninstall (its finalizer is still there).
    ns.releases()
        .delete("web", &DeleteParams::default())
        .await?;

    let result = release_with_retry(
        &hook().await?,
        live,
        budget(Duration::from_secs(10)),
        Uninstall::MustNotSkip,
        Refusals::Retry,
    )
    .await;

    assert!(
        matches!(result, Err(NotReleased::WouldSkipUninstall)),
        "{result:?}"
    );
    let now = view(&ns, "web").await?;
    assert!(now.terminating);
    assert_eq!(
        now.finalizers,
        vec![HELM_CONTROLLER_FINALIZER, FENCE_FINALIZER],
        "the fence still holds the release for its uninstall"
    );
    testkit::strip_fences(&ns).await?;
    Ok(())
}

/// The drain's and the sweep's listing reads every page: five releases
/// listed two at a time are all found (among every other test's releases).
#[tokio::test]
async fn the_cluster_wide_listing_follows_every_page() -> Result<()> {
    let ns = namespace("list-pages").await?;
    let names = ["a", "b", "c", "d", "e"];
    for name in names {
        ns.create_release(name, json!({})).await?;
    }

    // A listing that never ends (a continue token followed forever) fails
    // here rather than hanging the suite.
    let mut listed = tokio::time::timeout(
        Duration::from_secs(30),
        plunger::release::api::list_in_pages(&ns.client, &Scope::default(), 2, |release| {
            (release.namespace == ns.name).then_some(release.name)
        }),
    )
    .await??;

    listed.sort();
    assert_eq!(listed, names);
    Ok(())
}

#[tokio::test]
async fn a_suspension_flux_plunger_alone_holds_is_lifted_even_without_a_fence() -> Result<()> {
    let ns = namespace("sweep-bare-suspension").await?;
    held(&ns, "web", true).await?;
    // The fence alone was removed by hand, the suspension is still ours.
    ns.releases()
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": [HELM_CONTROLLER_FINALIZER]}})),
        )
        .await?;
    let before = view(&ns, "web").await?;
    assert!(before.suspended_by_us() && !before.has_fence());

    let released = release_with_retry(
        &hook().await?,
        before,
        budget(Duration::from_secs(10)),
        Uninstall::MustNotSkip,
        Refusals::Retry,
    )
    .await?;

    assert_eq!(
        released,
        Released {
            without_uninstall: false
        }
    );
    let now = view(&ns, "web").await?;
    assert!(!now.suspend, "the suspension was lifted");
    assert_eq!(now.finalizers, vec![HELM_CONTROLLER_FINALIZER]);
    Ok(())
}

/// An apiserver that accepts connections and never answers: a request to it
/// hangs until the client gives up, and kube's client sets no read timeout.
async fn black_hole() -> Result<(String, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    Ok((url, task))
}

#[tokio::test]
async fn a_hook_whose_apiserver_never_answers_ends_at_its_window_plus_the_finish_margin()
-> Result<()> {
    let (url, server) = black_hole().await?;
    let client = kube::Client::try_from(kube::Config::new(url.parse()?))?;
    let config = HookConfig {
        namespace: "flux-system".into(),
        deployment: "flux-plunger".into(),
        pod_selector: "app.kubernetes.io/name=flux-plunger".into(),
        lease: "flux-plunger".into(),
        scope: Scope::default(),
        install: Install::legacy(),
        retry_window: Duration::from_secs(1),
        pod_wait: Duration::from_secs(100),
        finish_margin: Duration::from_secs(2),
    };
    let started = Instant::now();

    let report = run_hook(&client, &config).await;

    let took = started.elapsed();
    server.abort();
    assert!(
        // Not the pod wait (100 s), nor a client timeout: the window and the
        // margin; the upper bound leaves room for a loaded CI machine.
        took >= Duration::from_secs(3) && took < Duration::from_secs(5),
        "the one pending read is given up at window + margin: {took:?}"
    );
    assert!(!report.success);
    assert_eq!(
        report.lines,
        vec![
            "could not read Deployment flux-system/flux-plunger: ServiceError: no answer from the apiserver before the sweep's time ran out; no fence was touched"
        ]
    );
    Ok(())
}

#[tokio::test]
async fn the_hook_finds_labelled_fences_and_older_unlabelled_ones_and_releases_the_label_with_the_fence()
-> Result<()> {
    let ns = namespace("sweep-labels").await?;
    ns.create_release("labelled", json!({})).await?;
    ns.apply_as_flux_plunger("labelled", true).await?;
    // An older flux-plunger's fence, without the label.
    held(&ns, "older", true).await?;
    // Unfenced, with the finalizer helm-controller puts on every release.
    with_helm_controller_finalizer(&ns, "free").await?;
    let only_here = Scope {
        namespaces: vec![ns.name.clone()],
        label_selector: None,
    };

    assert_eq!(
        plunger::release::api::list_unlabelled_fences(&ns.client, &only_here).await?,
        [(ns.name.clone(), "older".to_owned())],
        "only the unlabelled release carrying the fence is read one by one"
    );
    let mut found: Vec<String> =
        plunger::release::api::list_every_fence(&ns.client, &Scope::default(), &Install::legacy())
            .await?
            .into_iter()
            .filter(|r| r.namespace == ns.name)
            .map(|r| r.name)
            .collect();
    found.sort();
    assert_eq!(found, ["labelled", "older"]);

    let labelled = view(&ns, "labelled").await?;
    assert!(labelled.fence_labelled());
    release_with_retry(
        &ns.client,
        labelled,
        budget(Duration::from_secs(5)),
        Uninstall::MaySkip,
        Refusals::Retry,
    )
    .await?;
    let after = view(&ns, "labelled").await?;
    assert!(
        !after.has_fence() && !after.fence_labelled() && !after.suspend,
        "{after:?}"
    );
    Ok(())
}

#[tokio::test]
async fn the_hook_lists_its_own_fences_outside_its_selector_and_never_another_installs()
-> Result<()> {
    let ns = namespace("sweep-own").await?;
    let own = Install::from_lease("flux-system", "flux-plunger-a");
    let labelled = |name: &'static str, tenant: &'static str| {
        let ns = &ns;
        async move {
            ns.releases()
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"labels": {"tenant": tenant}}})),
                )
                .await
        }
    };
    // Fenced by this install, then relabelled out of its selector.
    ns.create_release("relabelled", json!({})).await?;
    ns.apply_as_install("relabelled", true, own.fence_label_value())
        .await?;
    labelled("relabelled", "b").await?;
    // Fenced by this install, in its selector.
    ns.create_release("in-scope", json!({})).await?;
    ns.apply_as_install("in-scope", false, own.fence_label_value())
        .await?;
    labelled("in-scope", "a").await?;
    // Fenced before the label named an install: this install's only in its scope.
    ns.create_release("legacy-in", json!({})).await?;
    ns.apply_as_flux_plunger("legacy-in", false).await?;
    labelled("legacy-in", "a").await?;
    ns.create_release("legacy-out", json!({})).await?;
    ns.apply_as_flux_plunger("legacy-out", false).await?;
    // In its selector, fenced by another install side by side.
    ns.create_release("theirs", json!({})).await?;
    ns.apply_as_install("theirs", true, "flux-system.flux-plunger-b")
        .await?;
    labelled("theirs", "a").await?;
    let scope = Scope {
        namespaces: vec![ns.name.clone()],
        label_selector: Some("tenant=a".into()),
    };

    let mut found: Vec<String> = plunger::release::api::list_every_fence(&ns.client, &scope, &own)
        .await?
        .into_iter()
        .map(|r| r.name)
        .collect();
    found.sort();
    testkit::strip_fences(&ns).await?;

    assert_eq!(found, ["in-scope", "legacy-in", "relabelled"]);
    Ok(())
}
