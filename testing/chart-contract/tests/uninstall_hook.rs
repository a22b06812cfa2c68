//! `helm uninstall` of the chart with its pre-delete hook carried out for
//! real. No kubelet runs on the local control plane, so a small harness plays
//! it for the hook Job: it runs `flux-plunger-sweep` with the Job's container
//! args and env, under a token of the Job's ServiceAccount (TokenRequest),
//! then writes the Job's status as the Job controller would: `Complete` after
//! exit 0, `Failed` otherwise. helm (v3.22, `waitForJob`) waits for exactly
//! that: a `Complete` or a `Failed` condition that is `True`.

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use chart_contract::check_uses_exactly_what_is_granted;
use chart_contract::install::Setup;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::{Job, JobCondition, JobStatus};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use plunger::names::{
    FENCE_FINALIZER, FIELD_MANAGER, HELM_CONTROLLER_FINALIZER, HELMRELEASE_API_VERSION,
    HELMRELEASE_KIND,
};
use plunger::release::view::ReleaseView;
use serde_json::{Value, json};
use testkit::audit;
use testkit::control_plane::workspace_binary;
use testkit::{TestNamespace, control_plane};

/// What the harness saw of the hook's one run.
struct HookRun {
    status: ExitStatus,
    stdout: String,
}

/// Plays the kubelet and the Job controller for the chart's hook Job: waits
/// for helm to create it, runs its container, and marks it finished.
async fn run_hook_job(setup: &Setup, test_env: &[(&str, &str)]) -> Result<HookRun> {
    let ns = &setup.ns.name;
    let admin = setup.ns.client.clone();
    let jobs: Api<Job> = Api::namespaced(admin.clone(), ns);
    let name = format!("{}-pre-delete", setup.fullname());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let job = loop {
        if let Some(job) = jobs.get_opt(&name).await? {
            break job;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "helm did not create the hook Job {name}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let pod = job
        .spec
        .context("Job spec")?
        .template
        .spec
        .context("pod spec")?;
    let [container] = pod.containers.as_slice() else {
        bail!("the hook's pod has {} containers", pod.containers.len());
    };
    ensure!(
        container.command.as_deref() == Some(&["flux-plunger-sweep".to_owned()][..]),
        "the hook runs {:?}",
        container.command
    );

    // The token the kubelet would mount for the pod's ServiceAccount.
    let account = pod
        .service_account_name
        .context("the hook names no ServiceAccount")?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    control_plane()
        .write_service_account_kubeconfig(&admin, ns, &account, &kubeconfig)
        .await?;

    let mut command = tokio::process::Command::new(workspace_binary("flux-plunger-sweep")?);
    command
        .args(container.args.iter().flatten())
        .env_clear()
        .env("KUBECONFIG", &kubeconfig)
        .envs(test_env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(value), _) => value.clone(),
            (None, Some(from)) => {
                let path = from
                    .field_ref
                    .as_ref()
                    .map(|f| f.field_path.as_str())
                    .with_context(|| format!("{}: only fieldRef is played here", var.name))?;
                match path {
                    "metadata.namespace" => ns.clone(),
                    "metadata.name" => format!("{name}-harness"),
                    other => bail!("{}: fieldPath {other} is not played here", var.name),
                }
            }
            (None, None) => String::new(),
        };
        command.env(&var.name, value);
    }
    let output = tokio::time::timeout(Duration::from_secs(240), command.output())
        .await
        .context("the hook ran past its Job's deadline")??;
    let stdout = String::from_utf8(output.stdout)?;
    eprintln!(
        "hook stdout:\n{stdout}\nhook stderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let now = Some(Time(k8s_openapi::jiff::Timestamp::now()));
    let condition = |type_: &str, reason: Option<&str>| JobCondition {
        type_: type_.to_owned(),
        status: "True".to_owned(),
        reason: reason.map(str::to_owned),
        last_probe_time: now.clone(),
        last_transition_time: now.clone(),
        ..Default::default()
    };
    // The Job controller's order: the apiserver refuses Complete without
    // SuccessCriteriaMet, and Failed comes after FailureTarget.
    let status = if output.status.success() {
        JobStatus {
            start_time: now.clone(),
            completion_time: now.clone(),
            succeeded: Some(1),
            conditions: Some(vec![
                condition("SuccessCriteriaMet", None),
                condition("Complete", None),
            ]),
            ..Default::default()
        }
    } else {
        JobStatus {
            start_time: now.clone(),
            failed: Some(1),
            conditions: Some(vec![
                condition("FailureTarget", Some("BackoffLimitExceeded")),
                condition("Failed", Some("BackoffLimitExceeded")),
            ]),
            ..Default::default()
        }
    };
    jobs.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": status })),
    )
    .await?;
    Ok(HookRun {
        status: output.status,
        stdout,
    })
}

/// A release in another namespace that flux-plunger holds mid-recovery:
/// helm-controller's finalizer, flux-plunger's suspension and fence.
async fn held_release(apps: &TestNamespace, name: &str) -> Result<()> {
    apps.create_release(name, json!({})).await?;
    apps.releases()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": [HELM_CONTROLLER_FINALIZER]}})),
        )
        .await?;
    apps.releases()
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(json!({
                "apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
                "metadata": {"name": name, "finalizers": [FENCE_FINALIZER]},
                "spec": {"suspend": true},
            })),
        )
        .await?;
    Ok(())
}

/// Refuses every HelmRelease write in `apps` (a real admission refusal) and
/// returns once the refusal is in force (`web` cannot be patched).
async fn refuse_writes(apps: &TestNamespace) -> Result<testkit::Refusal> {
    let refusal = apps
        .refuse(
            "no-patch",
            json!({"apiGroups": ["helm.toolkit.fluxcd.io"], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": ["helmreleases"]}),
            "false",
            "test: every HelmRelease write is refused",
        )
        .await?;
    testkit::eventually(
        Duration::from_secs(30),
        "the admission policy refuses HelmRelease writes",
        || {
            let releases = apps.releases();
            async move {
                let params = PatchParams {
                    dry_run: true,
                    ..Default::default()
                };
                let probe = Patch::Merge(json!({"metadata": {"labels": {"probe": "1"}}}));
                Ok(releases.patch("web", &params, &probe).await.is_err())
            }
        },
    )
    .await?;
    Ok(refusal)
}

/// The controller's leader Lease, as a running controller leaves it.
async fn leader_lease(setup: &Setup) -> Result<()> {
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": setup.fullname()},
        "spec": {"holderIdentity": format!("{}-7d9f-abcde", setup.fullname()), "leaseDurationSeconds": 27},
    }))?;
    Api::<Lease>::namespaced(setup.ns.client.clone(), &setup.ns.name)
        .create(&PostParams::default(), &lease)
        .await?;
    Ok(())
}

async fn view(apps: &TestNamespace, name: &str) -> Result<ReleaseView> {
    Ok(ReleaseView::from_object(&apps.releases().get(name).await?))
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

#[tokio::test]
async fn helm_uninstall_runs_the_sweep_as_its_hook_and_finishes_with_no_fence_or_lease_left()
-> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let setup = Setup::new("uninstall-hook").await?;
    setup.install(&[])?;
    // The hook runs under the chart's admission guard.
    setup.wait_for_guard().await?;
    let apps = TestNamespace::create(&setup.ns.client, "uninstall-apps").await?;
    held_release(&apps, "web").await?;
    leader_lease(&setup).await?;
    let (ns, fullname, release) = (&setup.ns.name, setup.fullname(), setup.release());
    let hook_name = format!("{fullname}-pre-delete");
    let hook_user = audit::service_account_user(ns, &hook_name);
    // The release's first writes are refused, until the hook has read it again
    // to retry: the retry is part of every real uninstall's possibilities,
    // and needs its own permission (`get`).
    let refusal = refuse_writes(&apps).await?;
    let lifter = tokio::spawn({
        let hook_user = hook_user.clone();
        async move {
            testkit::eventually(
                Duration::from_secs(60),
                "the hook reads the release again to retry",
                || {
                    let hook_user = hook_user.clone();
                    async move {
                        Ok(audit::requests_by(&hook_user)?.iter().any(|r| {
                            r.permission.verb == "get" && r.permission.resource == "helmreleases"
                        }))
                    }
                },
            )
            .await?;
            refusal.lift().await
        }
    });

    let uninstall = tokio::process::Command::from(setup.helm_command(&[
        "uninstall",
        release,
        "--timeout",
        "120s",
    ])?)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true)
    .spawn()?;
    let hook = run_hook_job(&setup, &[]).await?;
    let helm = tokio::time::timeout(Duration::from_secs(120), uninstall.wait_with_output())
        .await
        .context("helm uninstall did not end")??;
    lifter.await??;

    assert!(hook.status.success(), "{:?}", hook.status);
    assert_eq!(
        lines(&hook.stdout),
        vec![
            format!("scaled Deployment {ns}/{fullname} to 0"),
            format!("released {}/web", apps.name),
            "released 1 of 1 fenced HelmReleases, 0 without an uninstall".to_owned(),
            format!("removed the leader Lease {ns}/{fullname}"),
            "every fence was released".to_owned(),
        ]
    );
    assert!(
        helm.status.success(),
        "{}",
        String::from_utf8_lossy(&helm.stderr)
    );
    assert_eq!(
        String::from_utf8(helm.stdout)?,
        format!("release \"{release}\" uninstalled\n")
    );
    let web = view(&apps, "web").await?;
    assert!(!web.suspend, "the suspension was lifted");
    assert_eq!(web.finalizers, vec![HELM_CONTROLLER_FINALIZER]);

    let client = setup.ns.client.clone();
    assert_eq!(
        Api::<Lease>::namespaced(client.clone(), ns)
            .get_opt(&fullname)
            .await?,
        None,
        "the leader Lease went with the last pod"
    );
    assert!(
        Api::<Deployment>::namespaced(client.clone(), ns)
            .get_opt(&fullname)
            .await?
            .is_none(),
        "helm deleted the chart's objects once the hook had succeeded"
    );
    // Hook objects: the identity goes once every hook succeeded, the Job
    // stays (before-hook-creation only) so that its report can be read.
    assert!(
        Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .get_opt(&hook_name)
            .await?
            .is_none()
    );
    assert!(
        Api::<ClusterRole>::all(client.clone())
            .get_opt(&hook_name)
            .await?
            .is_none()
    );
    assert!(
        Api::<Job>::namespaced(client, ns)
            .get_opt(&hook_name)
            .await?
            .is_some()
    );
    let list = setup.helm(&["list", "--all", "-o", "json"])?;
    assert_eq!(serde_json::from_slice::<Value>(&list.stdout)?, json!([]));

    // The hook used every permission its roles grant, and was refused none:
    // dropping any one rule (or verb) refuses a request this run needs.
    check_uses_exactly_what_is_granted(&hook_user, &setup.render().manifests()?, true, 0)?;
    Ok(())
}

#[tokio::test]
async fn helm_uninstall_fails_while_the_sweep_cannot_remove_a_fence() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let setup = Setup::new("uninstall-hook-fails").await?;
    setup.install(&[])?;
    let apps = TestNamespace::create(&setup.ns.client, "uninstall-held").await?;
    held_release(&apps, "web").await?;
    let refusal = refuse_writes(&apps).await?;
    let (ns, fullname, release) = (&setup.ns.name, setup.fullname(), setup.release());

    let uninstall = tokio::process::Command::from(setup.helm_command(&[
        "uninstall",
        release,
        "--timeout",
        "120s",
    ])?)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true)
    .spawn()?;
    // A short retry window (test builds only) instead of the real 180 s.
    let hook = run_hook_job(
        &setup,
        &[("FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS", "2")],
    )
    .await?;
    let helm = tokio::time::timeout(Duration::from_secs(120), uninstall.wait_with_output())
        .await
        .context("helm uninstall did not end")??;

    let held = view(&apps, "web").await;
    // Leave no fence to the next cluster-wide test, whatever is asserted below.
    refusal.lift().await?;
    testkit::eventually(
        Duration::from_secs(30),
        "the fence is stripped once writes are allowed again",
        || {
            let apps = &apps;
            async move { Ok(testkit::strip_fences(apps).await.is_ok()) }
        },
    )
    .await?;
    let held = held?;

    assert!(held.suspended_by_us(), "the suspension is still in place");
    assert_eq!(
        held.finalizers,
        vec![HELM_CONTROLLER_FINALIZER, FENCE_FINALIZER]
    );
    let (hook_code, hook_lines, helm_code, helm_stderr) = (
        hook.status.code(),
        lines(&hook.stdout),
        helm.status.code(),
        String::from_utf8_lossy(&helm.stderr).into_owned(),
    );

    assert_eq!(hook_code, Some(1));
    assert_eq!(
        hook_lines,
        vec![
            format!("scaled Deployment {ns}/{fullname} to 0"),
            format!(
                "NOT released {}/web: helmreleases.helm.toolkit.fluxcd.io \"web\" is forbidden: ValidatingAdmissionPolicy '{0}-no-patch' with binding '{0}-no-patch' denied request: test: every HelmRelease write is refused (422 Invalid)",
                apps.name
            ),
            "released 0 of 1 fenced HelmReleases, 0 without an uninstall".to_owned(),
            "failing the hook so that helm-controller retries the uninstall (hook included) instead of stranding a fence".to_owned(),
        ]
    );
    assert_eq!(helm_code, Some(1));
    assert!(
        helm_stderr.contains(&format!(
            "job {fullname}-pre-delete failed: BackoffLimitExceeded"
        )),
        "{helm_stderr}"
    );
    // Helm stopped at the hook: nothing of the chart was deleted.
    let list = setup.helm(&["list", "--all", "-o", "json"])?;
    let releases: Value = serde_json::from_slice(&list.stdout)?;
    assert_eq!(releases[0]["status"], "uninstalling", "{releases}");
    let deployment = Api::<Deployment>::namespaced(setup.ns.client.clone(), ns)
        .get(&fullname)
        .await?;
    assert_eq!(
        deployment.spec.context("spec")?.replicas,
        Some(0),
        "stopped by the hook"
    );
    // helm deletes the hooks before a failed one by their hook-succeeded
    // policy: the next attempt creates the hook's identity again.
    let hook_name = format!("{fullname}-pre-delete");
    assert!(
        Api::<ServiceAccount>::namespaced(setup.ns.client.clone(), ns)
            .get_opt(&hook_name)
            .await?
            .is_none()
    );
    assert!(
        Api::<Job>::namespaced(setup.ns.client.clone(), ns)
            .get_opt(&hook_name)
            .await?
            .is_some(),
        "the failed Job stays with its report"
    );
    Ok(())
}

#[tokio::test]
async fn two_installs_side_by_side_each_release_only_the_fences_in_their_own_scope() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let first = Setup::new("tenant-a-system").await?;
    let second = Setup::new("tenant-b-system").await?;
    let apps_a = TestNamespace::create(&first.ns.client, "tenant-a").await?;
    let apps_b = TestNamespace::create(&first.ns.client, "tenant-b").await?;
    first.install(&[
        "--set",
        &format!("controller.watchNamespaces={{{}}}", apps_a.name),
    ])?;
    second.install(&[
        "--set",
        &format!("controller.watchNamespaces={{{}}}", apps_b.name),
    ])?;
    held_release(&apps_a, "web").await?;
    held_release(&apps_b, "web").await?;

    let uninstall = tokio::process::Command::from(first.helm_command(&[
        "uninstall",
        first.release(),
        "--timeout",
        "120s",
    ])?)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true)
    .spawn()?;
    let hook = run_hook_job(&first, &[]).await?;
    let helm = tokio::time::timeout(Duration::from_secs(120), uninstall.wait_with_output())
        .await
        .context("helm uninstall did not end")??;
    let other_tenant = view(&apps_b, "web").await?;
    // The second install is still there, holding its release: leave no fence
    // or Deployment to the next cluster-wide test, whatever is asserted below.
    testkit::strip_fences(&apps_b).await?;
    chart_contract::install::succeeded(
        second.helm(&["uninstall", second.release(), "--no-hooks"])?,
        "helm uninstall of the second install",
    )?;

    assert!(hook.status.success(), "{:?}", hook.status);
    assert_eq!(
        lines(&hook.stdout),
        vec![
            format!(
                "scaled Deployment {}/{} to 0",
                first.ns.name,
                first.fullname()
            ),
            format!("released {}/web", apps_a.name),
            "released 1 of 1 fenced HelmReleases, 0 without an uninstall".to_owned(),
            "every fence was released".to_owned(),
        ]
    );
    assert!(
        helm.status.success(),
        "{}",
        String::from_utf8_lossy(&helm.stderr)
    );
    let released = view(&apps_a, "web").await?;
    assert!(
        !released.suspend,
        "the first tenant's suspension was lifted"
    );
    assert_eq!(released.finalizers, vec![HELM_CONTROLLER_FINALIZER]);
    assert!(
        other_tenant.suspended_by_us(),
        "the second install's suspension is still held"
    );
    assert_eq!(
        other_tenant.finalizers,
        vec![HELM_CONTROLLER_FINALIZER, FENCE_FINALIZER],
        "the second install's fence is still held"
    );
    Ok(())
}
