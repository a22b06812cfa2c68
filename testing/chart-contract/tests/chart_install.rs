//! The chart against a real kube-apiserver (the local control plane; no
//! kubelet, so no pod ever runs): it installs, the apiserver accepts every
//! object it renders, the RBAC it grants lets each identity do exactly its
//! job, and the pre-delete hook holds the uninstall until it has succeeded.

use anyhow::{Context, Result, bail};
use chart_contract::install::{Setup, succeeded};
use chart_contract::{Manifests, name};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, Role};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use plunger::names;
use serde_json::{Value, json};

fn not_found<T>(result: kube::Result<T>) -> bool {
    matches!(result, Err(kube::Error::Api(s)) if s.code == 404)
}

#[tokio::test]
async fn helm_install_creates_the_controller_s_objects_and_none_of_the_hook_s() -> Result<()> {
    let setup = Setup::new("chart-install").await?;
    setup.install(&[])?;
    let client = setup.ns.client.clone();
    let ns = &setup.ns.name;
    let fullname = setup.fullname();

    let deployment = Api::<Deployment>::namespaced(client.clone(), ns)
        .get(&fullname)
        .await?;
    let value = serde_json::to_value(&deployment)?;
    let pod = &value["spec"]["template"]["spec"];
    assert_eq!(pod["terminationGracePeriodSeconds"], 90);
    assert_eq!(
        pod["initContainers"][0]["restartPolicy"], "Always",
        "the apiserver kept the native sidecar"
    );
    assert_eq!(pod["serviceAccountName"], fullname.as_str());
    Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .get(&fullname)
        .await?;
    Api::<ClusterRole>::all(client.clone())
        .get(&fullname)
        .await?;
    Api::<Role>::namespaced(client.clone(), ns)
        .get(&fullname)
        .await?;
    // The admission guard: helm's discovery of this apiserver (1.36) finds
    // the API it needs.
    for (kind, plural) in [
        ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
        (
            "ValidatingAdmissionPolicyBinding",
            "validatingadmissionpolicybindings",
        ),
    ] {
        let resource = testkit::fixtures::vap_resource(kind, plural);
        Api::<kube::api::DynamicObject>::all_with(client.clone(), &resource)
            .get(&fullname)
            .await
            .with_context(|| format!("the chart's {kind}"))?;
    }

    let hook = format!("{fullname}-pre-delete");
    assert!(not_found(
        Api::<Job>::namespaced(client.clone(), ns).get(&hook).await
    ));
    assert!(not_found(
        Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .get(&hook)
            .await
    ));
    assert!(not_found(Api::<ClusterRole>::all(client).get(&hook).await));

    let list = setup.helm(&["list", "-o", "json"])?;
    let releases: Value = serde_json::from_slice(&list.stdout)?;
    assert_eq!(releases[0]["name"], setup.release());
    assert_eq!(releases[0]["status"], "deployed");
    Ok(())
}

#[tokio::test]
async fn the_apiserver_accepts_every_rendered_object_in_a_server_side_dry_run() -> Result<()> {
    let setup = Setup::new("chart-dry-run").await?;
    // With the admission guard: this control plane serves its API.
    let render = || setup.render();
    for render in [
        render(),
        // Everything but the ServiceMonitor and the PrometheusRule, whose
        // CRDs this control plane lacks; scoped to this namespace, which
        // kubectl applies to and which exists (the scope's Roles are in the
        // namespaces it names, the dashboard's ConfigMap in its own).
        render()
            .values("everything.yaml")
            .set("metrics.serviceMonitor.enabled=false")
            .set("metrics.prometheusRule.enabled=false")
            .set(&format!(
                "controller.watchNamespaces={{{0}}},controller.storageNamespaces={{{0}}},metrics.dashboard.namespace={0}",
                setup.ns.name
            )),
        render().values("shortest-grace-no-hook.yaml"),
    ] {
        let yaml = render.yaml()?;
        let count = Manifests::parse(&yaml)?.0.len();
        for mode in [
            &["apply", "--dry-run=server", "-o", "json"][..],
            &[
                "apply",
                "--server-side",
                "--field-manager=helm-controller",
                "--dry-run=server",
                "-o",
                "json",
            ][..],
        ] {
            let output = setup.kubectl_stdin(mode, &yaml)?;
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            succeeded(output, &format!("kubectl {mode:?}"))?;
            let accepted: Value = serde_json::from_str(&stdout)?;
            let items = accepted["items"].as_array().context("a List")?;
            assert_eq!(items.len(), count, "{mode:?}: every object accepted");
            for item in items {
                if item["kind"] == "Deployment" {
                    assert_eq!(
                        item["spec"]["template"]["spec"]["initContainers"][0]["restartPolicy"],
                        "Always"
                    );
                }
            }
        }
    }
    Ok(())
}

#[tokio::test]
async fn a_server_side_apply_of_recreate_over_a_defaulted_rolling_update_is_refused_and_the_chart_s_strategy_is_not()
-> Result<()> {
    let setup = Setup::new("chart-strategy").await?;
    let manifests = setup.render().manifests()?;
    let chart_deployment = manifests.one("Deployment", false)?.clone();
    let deployments = Api::<Deployment>::namespaced(setup.ns.client.clone(), &setup.ns.name);
    let apply = PatchParams::apply("helm-controller").force();
    let deployment_name = name(&chart_deployment).to_owned();

    // An install from before the chart set a strategy: the apiserver
    // defaults a rollingUpdate block.
    let mut old = chart_deployment.clone();
    old["spec"].as_object_mut().unwrap().remove("strategy");
    let live = deployments
        .patch(&deployment_name, &apply, &Patch::Apply(&old))
        .await?;
    let strategy = serde_json::to_value(live.spec.unwrap().strategy)?;
    assert_eq!(
        strategy,
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}})
    );

    let mut recreate = chart_deployment.clone();
    recreate["spec"]["strategy"] = json!({"type": "Recreate"});
    match deployments
        .patch(&deployment_name, &apply, &Patch::Apply(&recreate))
        .await
    {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "{status:?}");
            assert!(
                status
                    .message
                    .contains("may not be specified when strategy `type` is 'Recreate'"),
                "{}",
                status.message
            );
        }
        other => bail!("Recreate over a defaulted rollingUpdate was not refused: {other:?}"),
    }

    let upgraded = deployments
        .patch(&deployment_name, &apply, &Patch::Apply(&chart_deployment))
        .await?;
    let strategy = serde_json::to_value(upgraded.spec.unwrap().strategy)?;
    assert_eq!(
        strategy,
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}})
    );
    Ok(())
}

/// Whether the ServiceAccount `namespace/account` may do `verb` on
/// `group`/`resource`, asked of the apiserver's RBAC authorizer.
async fn may(
    client: &kube::Client,
    (namespace, account): (&str, &str),
    verb: &str,
    group: &str,
    resource: &str,
    in_namespace: Option<&str>,
) -> Result<bool> {
    let (resource, subresource) = match resource.split_once('/') {
        Some((r, s)) => (r, Some(s.to_owned())),
        None => (resource, None),
    };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!("system:serviceaccount:{namespace}:{account}")),
            groups: Some(vec![
                "system:serviceaccounts".to_owned(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".to_owned(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.to_owned()),
                group: Some(group.to_owned()),
                resource: Some(resource.to_owned()),
                subresource,
                namespace: in_namespace.map(str::to_owned),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await?;
    Ok(answer.status.context("no status")?.allowed)
}

/// Checks each (verb, group, resource, namespace) against `allowed`.
async fn check(
    client: &kube::Client,
    account: (&str, &str),
    cases: &[(&str, &str, &str, Option<&str>)],
    allowed: bool,
) -> Result<()> {
    for (verb, group, resource, namespace) in cases {
        assert_eq!(
            may(client, account, verb, group, resource, *namespace).await?,
            allowed,
            "{}: {verb} {group}/{resource} in {namespace:?} should be {}",
            account.1,
            if allowed { "allowed" } else { "denied" }
        );
    }
    Ok(())
}

#[tokio::test]
async fn the_chart_s_rbac_lets_the_controller_and_the_hook_do_exactly_their_jobs() -> Result<()> {
    let setup = Setup::new("chart-rbac").await?;
    setup.install(&[])?;
    // The hook's RBAC exists only while the hook runs: create it from the
    // chart's own templates.
    let mut render = setup.render();
    for template in [
        "hook-serviceaccount.yaml",
        "hook-clusterrole.yaml",
        "hook-clusterrolebinding.yaml",
        "hook-role.yaml",
        "hook-rolebinding.yaml",
    ] {
        render = render
            .arg("--show-only")
            .arg(format!("templates/{template}"));
    }
    succeeded(
        setup.kubectl_stdin(&["apply"], &render.yaml()?)?,
        "kubectl apply of the hook's RBAC",
    )?;

    let admin = setup.ns.client.clone();
    let ns = setup.ns.name.as_str();
    let other = Some("another-namespace");
    let here = Some(ns);
    let hr = names::HELMRELEASE_GROUP;
    let hrs = names::HELMRELEASE_PLURAL;

    let controller = setup.fullname();
    let controller = (ns, controller.as_str());
    check(
        &admin,
        controller,
        &[
            ("get", hr, hrs, other),
            ("list", hr, hrs, None),
            ("watch", hr, hrs, None),
            ("patch", hr, hrs, other),
            ("get", "", "secrets", other),
            ("list", "", "secrets", other),
            ("delete", "", "secrets", other),
            ("create", "events.k8s.io", "events", other),
            ("patch", "events.k8s.io", "events", other),
            ("get", "coordination.k8s.io", "leases", here),
            ("create", "coordination.k8s.io", "leases", here),
            ("update", "coordination.k8s.io", "leases", here),
        ],
        true,
    )
    .await?;
    check(
        &admin,
        controller,
        &[
            ("watch", "", "secrets", None),
            ("create", "", "events", other),
            ("watch", "", "secrets", other),
            ("update", hr, hrs, other),
            ("delete", hr, hrs, other),
            ("create", hr, hrs, other),
            ("create", "", "secrets", other),
            ("get", "coordination.k8s.io", "leases", other),
            ("delete", "coordination.k8s.io", "leases", here),
            ("list", "", "pods", here),
            ("get", "apps", "deployments", here),
        ],
        false,
    )
    .await?;

    let hook = format!("{}-pre-delete", setup.fullname());
    let hook = (ns, hook.as_str());
    check(
        &admin,
        hook,
        &[
            ("get", hr, hrs, other),
            ("list", hr, hrs, None),
            ("patch", hr, hrs, other),
            ("get", "apps", "deployments", here),
            ("patch", "apps", "deployments/scale", here),
            ("list", "", "pods", here),
            ("delete", "coordination.k8s.io", "leases", here),
        ],
        true,
    )
    .await?;
    check(
        &admin,
        hook,
        &[
            ("watch", hr, hrs, None),
            ("update", hr, hrs, other),
            ("delete", hr, hrs, other),
            ("patch", "apps", "deployments", here),
            ("update", "apps", "deployments/scale", here),
            ("watch", "", "pods", here),
            ("get", "coordination.k8s.io", "leases", here),
            ("delete", "apps", "deployments", here),
            ("get", "apps", "deployments", other),
            ("list", "", "pods", other),
            ("list", "", "secrets", here),
            ("create", "coordination.k8s.io", "leases", here),
        ],
        false,
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn an_uninstall_waits_for_the_hook_and_fails_while_it_has_not_succeeded() -> Result<()> {
    let setup = Setup::new("chart-uninstall").await?;
    setup.install(&[])?;
    // No kubelet: the hook Job never completes, so Helm gives up waiting.
    let output = setup.helm(&["uninstall", setup.release(), "--timeout", "5s"])?;
    assert!(
        !output.status.success(),
        "the uninstall went ahead without the hook"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("timed out waiting for the condition"),
        "{stderr}"
    );
    // Helm stopped in the pre-delete stage: the release is left uninstalling.
    let list = setup.helm(&["list", "--all", "-o", "json"])?;
    let releases: Value = serde_json::from_slice(&list.stdout)?;
    assert_eq!(releases[0]["status"], "uninstalling", "{releases}");

    let client = setup.ns.client.clone();
    let ns = &setup.ns.name;
    let fullname = setup.fullname();
    let hook = format!("{fullname}-pre-delete");
    // Nothing of the release was deleted before the hook succeeded.
    Api::<Deployment>::namespaced(client.clone(), ns)
        .get(&fullname)
        .await?;
    // The Job stays for its report (before-hook-creation only) ...
    let job = Api::<Job>::namespaced(client.clone(), ns)
        .get(&hook)
        .await?;
    let spec = job.spec.context("Job spec")?;
    assert_eq!(spec.active_deadline_seconds, Some(240));
    assert_eq!(spec.backoff_limit, Some(0));
    // ... and ran as the hook's own ServiceAccount, which Helm created first.
    assert_eq!(
        spec.template.spec.context("pod spec")?.service_account_name,
        Some(hook.clone())
    );
    Ok(())
}

/// An upgrade that drops a watched namespace where the install still holds
/// its fence is refused, naming the release: the install's access there goes
/// with the upgrade (its Roles, the guard's scope), and nothing could settle
/// that fence any more. Another install's fence there does not count; once
/// the fence is released the same upgrade goes through.
#[tokio::test]
async fn an_upgrade_that_would_strand_the_install_s_fences_is_refused_naming_them() -> Result<()> {
    let setup = Setup::new("chart-narrow").await?;
    let dropped = testkit::TestNamespace::create(&setup.ns.client, "chart-narrow-dropped").await?;
    let chart = chart_contract::chart_dir().display().to_string();
    let scope =
        |namespaces: &[&str]| format!("controller.watchNamespaces={{{}}}", namespaces.join(","));
    setup.install(&["--set", &scope(&[&setup.ns.name, &dropped.name])])?;
    let deployment = Api::<Deployment>::namespaced(setup.ns.client.clone(), &setup.ns.name)
        .get(&setup.fullname())
        .await?;
    let install = deployment
        .metadata
        .annotations
        .unwrap_or_default()
        .get("flux-plunger.cozystack.io/install")
        .cloned()
        .context("the Deployment names its install")?;
    dropped.create_release("held", json!({})).await?;
    dropped.apply_as_install("held", false, &install).await?;
    // Labelled as every install labelled its fences before the label named one.
    dropped.create_release("legacy", json!({})).await?;
    dropped.apply_as_flux_plunger("legacy", false).await?;
    dropped.create_release("theirs", json!({})).await?;
    dropped
        .apply_as_install("theirs", false, "elsewhere.flux-plunger")
        .await?;
    let narrow = |setup: &Setup| {
        setup.helm(&[
            "upgrade",
            setup.release(),
            chart.as_str(),
            "--set",
            &scope(&[&setup.ns.name]),
        ])
    };

    let refused = narrow(&setup)?;
    let stderr = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(!refused.status.success(), "the upgrade went through");
    assert!(
        stderr.contains(&format!("{}/held", dropped.name))
            && stderr.contains(&format!("{}/legacy", dropped.name))
            && !stderr.contains("theirs")
            && stderr.contains("flux-plunger-sweep release"),
        "{stderr}"
    );

    testkit::strip_fences(&dropped).await?;
    succeeded(narrow(&setup)?, "helm upgrade once the fence is gone")?;
    Ok(())
}
