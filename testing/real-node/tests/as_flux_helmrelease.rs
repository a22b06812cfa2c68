//! The chart used as Flux users use it, as the README installs it: the chart
//! `helm push`ed to an OCI registry, an `OCIRepository` pulled by the real
//! source-controller, a HelmRelease with `chartRef` installed, upgraded and
//! deleted by the real helm-controller, its pods (their image pulled by the
//! node's containerd from the same registry, by digest) and its pre-delete
//! hook Job run by the node.
//!
//! A test binary of its own, run in a sandbox of its own (`make test-node`):
//! the real helm-controller reconciles every HelmRelease of its control
//! plane, so it must not meet the other node tests' hand-made releases. The
//! registry and source-controller run in this process, so in the sandbox's
//! network namespace, on the loopback the node's containerd pulls from.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams, PostParams};
use real_node::as_flux::{
    ACTION_TIMEOUT, EXAMPLE_DIGEST, EXAMPLE_NAMESPACE, EXAMPLE_REGISTRY, FencedBy, HeldDeletes,
    NAME, README_INSTALL, UNINSTALL_TIMEOUT, install_as_the_readme_says, installed_chart_version,
    objects_installing, pushed_chart, pushed_first_release, ready_at_current_generation, sources,
    wait_named, wait_release,
};
use real_node::{OnNode, Writers, fenced_releases, name_of, still_held};
use testkit::TestNamespace;
use testkit::real_causes;
use testkit::registry::registry;

/// How many deletes flux-plunger holds through a rollout.
const HELD: usize = 3;

#[test]
fn the_readme_shows_the_install_the_node_tier_applies() {
    let readme = include_str!("../../../README.md");
    assert!(
        readme.contains(&format!("```yaml\n{README_INSTALL}```")),
        "README.md's install with Flux is not docs/install-with-flux.yaml verbatim"
    );
    for example in [EXAMPLE_REGISTRY, EXAMPLE_NAMESPACE, EXAMPLE_DIGEST] {
        assert!(
            README_INSTALL.contains(example),
            "docs/install-with-flux.yaml no longer says {example:?}: the test fills it in"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_as_a_flux_helmrelease_installs_upgrades_and_uninstalls_on_the_node() -> Result<()>
{
    with_the_component("node-flux", install_upgrade_and_delete).await
}

/// Runs `test` with a namespace of its own on the node, where flux-plunger's
/// HelmRelease is to be (helm- and source-controller started), on this
/// binary's turn; after a failure, removes the component.
async fn with_the_component(
    prefix: &str,
    test: impl AsyncFnOnce(&OnNode) -> Result<()>,
) -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let on = real_node::as_flux::on_node(prefix).await?;
    let outcome = test(&on).await;
    if outcome.is_err() {
        remove_after_a_failure(&on).await;
    }
    outcome
}

/// A cluster-wide flux-plunger left running would act on the next tests'
/// fences: lets helm-controller uninstall it before the test fails.
async fn remove_after_a_failure(on: &OnNode) {
    let _ = on.ns().releases().delete(NAME, &Default::default()).await;
    let _ = wait_release(
        on,
        "the release to go after a failure",
        ACTION_TIMEOUT,
        |r| r.is_none(),
    )
    .await;
}

/// `replicas: 2` as helm-controller installs it: the standby is ready while
/// it waits (or helm-controller's wait for the Deployment would time out and
/// remediate), serves `/metrics` with `flux_plunger_leader 0`; the leader's
/// pod deleted, another pod leads within the Lease's duration (the standby,
/// or the pod the Deployment starts in the leader's place: whichever asks
/// first once the old leader's drain hands the Lease over) and recovers a
/// release made stuck meanwhile by its real cause, and the audit log shows
/// one writer at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_installed_by_helm_controller_are_ready_and_the_standby_takes_over()
-> Result<()> {
    with_the_component("node-standby", standby_takes_over).await
}

/// The pod's `ip:8080`, where it serves `/metrics`.
fn metrics_address(pod: &Pod) -> Result<String> {
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("the pod has no IP")?;
    Ok(format!("{ip}:8080"))
}

async fn standby_takes_over(on: &OnNode) -> Result<()> {
    let ns = on.ns();
    let chart = pushed_chart(None)?;
    install_as_the_readme_says(
        on,
        &chart,
        serde_json::json!({"replicas": 2, "podDisruptionBudget": {"enabled": true}}),
    )
    .await?;
    wait_release(
        on,
        "the install of two replicas",
        ACTION_TIMEOUT,
        ready_at_current_generation,
    )
    .await?;

    let pods = on
        .pods()
        .list(&ListParams::default().labels(&on.selector()))
        .await?
        .items;
    ensure!(
        pods.len() == 2 && pods.iter().all(real_node::is_ready),
        "not two ready pods: {}",
        on.pods_summary().await
    );
    let leader_name = on.lease_holder().await?.context("no leader")?;
    let (leader, standby): (Vec<Pod>, Vec<Pod>) =
        pods.into_iter().partition(|p| name_of(p) == leader_name);
    let (leader, standby) = (
        leader
            .first()
            .context("the leader is not one of the pods")?,
        standby.first().context("no standby")?,
    );
    real_node::metrics_with(&metrics_address(leader)?, "flux_plunger_leader 1").await?;
    real_node::metrics_with(&metrics_address(standby)?, "flux_plunger_leader 0").await?;

    // The leader's pod goes; a release gets stuck meanwhile.
    let offset = testkit::audit::mark();
    on.pods().delete(&leader_name, &Default::default()).await?;
    const STUCK: &str = "stuck-meanwhile";
    real_causes::create_failing_release_from_registry(
        ns,
        STUCK,
        serde_json::json!({"uninstall": {"keepHistory": true}}),
    )
    .await?;
    // The standby, or the pod the Deployment starts in the leader's place,
    // whichever asks first once the old leader's drain handed the Lease over.
    let new_leader = wait_for_a_new_leader(on, &leader_name).await?;
    eprintln!(
        "the Lease went from {leader_name} to {new_leader} (the standby: {})",
        name_of(standby)
    );
    let refused = real_causes::name_in_use();
    wait_named(
        on,
        STUCK,
        "stuck: the name still in use",
        ACTION_TIMEOUT,
        |r| ready_message(r).is_some_and(|m| m.contains(refused)),
    )
    .await?;
    real_causes::fix_the_values(ns, STUCK).await?;
    wait_named(
        on,
        STUCK,
        "recovered and installed",
        ACTION_TIMEOUT,
        ready_at_current_generation,
    )
    .await?;

    let writers = Writers::read(offset, &on.controller_user(), &leader_name, &new_leader)?;
    writers.check_single_writer()?;
    let lease_duration = plunger::timings::Timings::from_grace_period(
        plunger::timings::DEFAULT_GRACE_PERIOD_SECONDS,
    )?
    .lease_duration;
    let handover = writers.handover()?;
    ensure!(
        handover <= k8s_openapi::jiff::SignedDuration::try_from(lease_duration)?,
        "the standby took the Lease {handover:#} after the leader's last Lease write (the Lease lasts {lease_duration:?})"
    );
    // The new leader recovered the release: the storage Secret's delete is its.
    ensure!(
        writers
            .new
            .iter()
            .any(|r| r.resource() == "secrets" && r.verb == "delete" && r.succeeded()),
        "the new leader deleted no storage Secret"
    );

    // The component goes as the first test's does: helm-controller uninstalls.
    ns.releases().delete(NAME, &Default::default()).await?;
    wait_release(on, "the release to go", real_node::POD_TIMEOUT * 2, |r| {
        r.is_none()
    })
    .await?;
    Ok(())
}

/// Waits until the Lease names a pod other than `old`, and returns it.
async fn wait_for_a_new_leader(on: &OnNode, old: &str) -> Result<String> {
    let deadline = Instant::now() + real_node::POD_TIMEOUT;
    loop {
        match on.lease_holder().await? {
            Some(holder) if holder != old => return Ok(holder),
            holder => ensure!(
                Instant::now() < deadline,
                "no new leader: the Lease names {holder:?}\npods:\n{}",
                on.pods_summary().await
            ),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `X.Y.Z` -> `X.Y.(Z+1)`: the version of the chart published as an upgrade.
fn next_patch_version(version: &str) -> Result<String> {
    let (rest, patch) = version
        .rsplit_once('.')
        .context("the chart's version is not X.Y.Z")?;
    Ok(format!("{rest}.{}", patch.parse::<u64>()? + 1))
}

/// Every pod of the controller's ServiceAccount since `offset`, taken in the
/// order of their first write: each one's first write reached the apiserver
/// after the one before it sent its last request (the audit log's view of
/// the Lease: never two writers).
fn check_one_writer_at_a_time(offset: u64, user: &str) -> Result<()> {
    let mut pods: Vec<(String, Vec<testkit::audit::AuditedRequest>)> =
        real_node::requests_by_pod(offset, user)?
            .into_iter()
            .filter(|(_, requests)| requests.iter().any(|r| r.is_write()))
            .collect();
    let first_write = |requests: &[testkit::audit::AuditedRequest]| {
        requests
            .iter()
            .filter(|r| r.is_write())
            .map(|r| r.received_at)
            .min()
    };
    pods.sort_by_key(|(_, requests)| first_write(requests));
    ensure!(
        pods.len() >= 2,
        "fewer than two pods wrote during the rollout"
    );
    for pair in pods.windows(2) {
        let [(old, old_requests), (new, new_requests)] = pair else {
            unreachable!("windows of two")
        };
        let writers = Writers {
            old: old_requests.clone(),
            new: new_requests.clone(),
        };
        writers
            .check_single_writer()
            .with_context(|| format!("from pod {old} to pod {new}"))?;
    }
    Ok(())
}

/// The `Ready` condition's message.
fn ready_message(release: Option<&DynamicObject>) -> Option<&str> {
    release?.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")?["message"]
        .as_str()
}

async fn install_upgrade_and_delete(on: &OnNode) -> Result<()> {
    let ns = on.ns();
    // Deletes flux-plunger is to hold through the rollout: their uninstall
    // is refused until after it.
    let held = HeldDeletes::create(on, HELD, FencedBy::Today).await?;
    let chart = pushed_chart(None)?;
    // The README's values as they are: G = 90.
    install_as_the_readme_says(on, &chart, serde_json::json!({})).await?;
    wait_release(
        on,
        "the install",
        ACTION_TIMEOUT,
        ready_at_current_generation,
    )
    .await?;
    ensure!(
        installed_chart_version(&ns.releases().get(NAME).await?)
            .is_some_and(|v| v.starts_with(&chart.tag)),
        "helm-controller installed another chart version than {}",
        chart.tag
    );
    let first = on.ready_pod(None).await?;
    on.wait_lease_held_by(&name_of(&first)).await?;
    // The pod's image came from the registry: the node's containerd fetched
    // its manifest by digest (nothing imported it).
    let pulled = format!("GET /v2/flux-plunger/manifests/{}", on.node.image.digest);
    ensure!(
        std::fs::read_to_string(&registry().log)?.contains(&pulled),
        "the registry's log has no {pulled:?}: containerd did not pull the image from it"
    );
    let grace = |pod: &k8s_openapi::api::core::v1::Pod| {
        pod.spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds)
    };
    ensure!(
        grace(&first) == Some(90),
        "the pod's grace period is {:?}",
        grace(&first)
    );
    held.wait_held(on).await?;

    // Fences of live releases when the upgrade starts: none may be stranded
    // by the rollout (the old pod's drain or the new leader releases each).
    let fences = TestNamespace::create(&ns.client, "node-flux-fences").await?;
    let created = testkit::audit::mark();
    let fenced = fenced_releases(&fences, 10).await?;

    // An upgrade as a user publishes one: a new chart version pushed to the
    // registry, the OCIRepository moved to it, and a value changed (G 90 ->
    // 120: a new pod template), rolled out by helm-controller's upgrade (a
    // server-side apply with Helm 4), the strategy kept.
    let offset = testkit::audit::mark();
    let next = pushed_chart(Some(&next_patch_version(&chart.tag)?))?;
    sources(on)
        .patch(
            NAME,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"ref": {"tag": next.tag}}})),
        )
        .await?;
    ns.releases()
        .patch(
            NAME,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"spec": {"values": {"shutdownGracePeriodSeconds": 120}}}),
            ),
        )
        .await?;
    wait_release(
        on,
        "the upgrade to the new chart version",
        ACTION_TIMEOUT,
        |r| {
            ready_at_current_generation(r)
                && r.and_then(installed_chart_version)
                    .is_some_and(|v| v.starts_with(&next.tag))
        },
    )
    .await?;
    let second = on.ready_pod(Some(&name_of(&first))).await?;
    ensure!(
        grace(&second) == Some(120),
        "after the upgrade the pod's grace period is {:?}",
        grace(&second)
    );
    on.wait_lease_held_by(&name_of(&second)).await?;
    let left = still_held(&fences).await?;
    ensure!(
        left.is_empty(),
        "fences left after the upgrade: {left:?}; their writes since they were created:\n{}",
        real_node::trail(created, &fences.name, &left)?
    );
    // The deletes held before the rollout are held after it, by the new
    // leader, until their uninstall can run; then each is uninstalled.
    held.check_still_held(on).await?;
    let held_count = held.names.len();
    held.let_uninstall(on).await?;
    // One writer at a time across the rollout, whatever pods it went
    // through (the two changes may reach helm-controller as two upgrades).
    check_one_writer_at_a_time(offset, &on.controller_user())?;
    let writers = Writers::read(
        offset,
        &on.controller_user(),
        &name_of(&first),
        &name_of(&second),
    )?;
    eprintln!(
        "upgrade {} -> {} with {} fences of live releases and {held_count} of held deletes, none lost: \
         the Lease went from {} to {} after {:#}",
        chart.tag,
        next.tag,
        fenced.len(),
        name_of(&first),
        name_of(&second),
        writers.handover()?
    );
    let deployments: Api<Deployment> = Api::namespaced(ns.client.clone(), &ns.name);
    let deployment = deployments.get(NAME).await?;
    let strategy = deployment
        .spec
        .as_ref()
        .and_then(|s| s.strategy.as_ref())
        .context("strategy")?;
    let rolling = strategy.rolling_update.as_ref().context("rollingUpdate")?;
    ensure!(
        strategy.type_.as_deref() == Some("RollingUpdate")
            && rolling.max_surge
                == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(0)),
        "the strategy after the upgrade: {strategy:?}"
    );

    // Delete: helm-controller uninstalls, the pre-delete hook Job first.
    ns.releases().delete(NAME, &Default::default()).await?;
    wait_release(on, "the release to go", real_node::POD_TIMEOUT * 2, |r| {
        r.is_none()
    })
    .await?;
    // As helm-controller reports it (its events are recorded apart from the
    // release's last write, so they may come a moment after it went).
    testkit::eventually(
        ACTION_TIMEOUT,
        "helm-controller's UninstallSucceeded event",
        || async {
            Ok(ns
                .events_for(NAME)
                .await?
                .iter()
                .any(|e| e.reason == "UninstallSucceeded"))
        },
    )
    .await?;
    // The hook ran to completion inside helm-controller's uninstall timeout
    // (and its own deadline), and the uninstall went on after it.
    let hook = on.completed_hook_job().await?;
    let status = hook.status.as_ref().context("the hook's status")?;
    let (started, completed) = (
        status.start_time.as_ref().context("started")?.0,
        status.completion_time.as_ref().context("completed")?.0,
    );
    let took = std::time::Duration::try_from(completed - started)?;
    let deadline = hook
        .spec
        .as_ref()
        .and_then(|s| s.active_deadline_seconds)
        .context("the hook's deadline")?;
    ensure!(
        took.as_secs() < deadline as u64 && took < std::time::Duration::from_secs(300),
        "the hook took {took:?} (its deadline {deadline} s, the uninstall timeout {UNINSTALL_TIMEOUT})"
    );
    // The component goes cleanly: nothing of the chart but the hook's Job,
    // kept for its report until its TTL, and the hook's own objects.
    ensure!(
        deployments.get_opt(NAME).await?.is_none(),
        "the Deployment is left"
    );
    ensure!(on.lease().await?.is_none(), "the Lease is left");
    ensure!(
        on.pods()
            .list(&kube::api::ListParams::default().labels(&on.selector()))
            .await?
            .items
            .is_empty(),
        "controller pods are left"
    );
    let service_accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(ns.client.clone(), &ns.name);
    ensure!(
        service_accounts.get_opt(NAME).await?.is_none(),
        "the controller's ServiceAccount is left"
    );
    let cluster_roles: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(ns.client.clone());
    ensure!(
        cluster_roles.get_opt(NAME).await?.is_none(),
        "the controller's ClusterRole is left"
    );
    let policies: Api<DynamicObject> = Api::all_with(
        ns.client.clone(),
        &kube::api::ApiResource {
            group: "admissionregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "admissionregistration.k8s.io/v1".into(),
            kind: "ValidatingAdmissionPolicy".into(),
            plural: "validatingadmissionpolicies".into(),
        },
    );
    ensure!(
        policies.get_opt(NAME).await?.is_none(),
        "the admission guard is left"
    );
    Ok(())
}

/// An install of the first release (its chart and image rebuilt from its
/// commit, `make first-release`) upgraded by helm-controller to today's chart
/// and image, with deletes the first release holds: today's controller holds
/// them on — labelling the fences the first release set without a label —
/// until their uninstall can run, and then lets each go; one writer at a time
/// across the rollout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_from_the_first_release_holds_every_delete_it_held() -> Result<()> {
    with_the_component("node-first", upgrade_from_the_first_release).await
}

/// The image of the pod's controller container.
fn controller_image(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()?
        .containers
        .iter()
        .find(|c| c.name == real_node::CONTROLLER)?
        .image
        .as_deref()
}

/// The Helm revision of the newest release helm-controller recorded.
fn installed_revision(release: &DynamicObject) -> Option<i64> {
    release.data["status"]["history"][0]["version"].as_i64()
}

fn fence_label(release: &DynamicObject) -> Option<&str> {
    release
        .metadata
        .labels
        .as_ref()?
        .get(plunger::names::FENCE_LABEL)
        .map(String::as_str)
}

async fn upgrade_from_the_first_release(on: &OnNode) -> Result<()> {
    let ns = on.ns();
    let first = pushed_first_release()?;
    let held = HeldDeletes::create(on, HELD, FencedBy::FirstRelease).await?;
    let (source, release) = objects_installing(on, &first.chart, &first.image)?;
    sources(on).create(&PostParams::default(), &source).await?;
    ns.releases()
        .create(&PostParams::default(), &release)
        .await?;
    wait_release(
        on,
        "the first release's install",
        ACTION_TIMEOUT,
        ready_at_current_generation,
    )
    .await?;
    let old = on.ready_pod(None).await?;
    ensure!(
        controller_image(&old).is_some_and(|i| i.ends_with(&first.image.digest)),
        "the first release's pod runs {:?}, not {}",
        controller_image(&old),
        first.image.reference()
    );
    on.wait_lease_held_by(&name_of(&old)).await?;
    held.wait_held(on).await?;
    for name in &held.names {
        let release = ns.releases().get(name).await?;
        ensure!(
            fence_label(&release).is_none(),
            "{name}'s fence has a label before the upgrade: {:?}",
            release.metadata.labels
        );
    }

    // The upgrade as a user of the first release makes it: today's chart
    // pushed, the OCIRepository moved to it, the image's digest changed.
    let offset = testkit::audit::mark();
    let today = pushed_chart(None)?;
    sources(on)
        .patch(
            NAME,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"spec": {"url": today.url, "ref": {"tag": today.tag}}}),
            ),
        )
        .await?;
    ns.releases()
        .patch(
            NAME,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"values": {"image": {
                "repository": on.node.image.repository,
                "digest": on.node.image.digest,
            }}}})),
        )
        .await?;
    wait_release(on, "the upgrade to today's chart", ACTION_TIMEOUT, |r| {
        ready_at_current_generation(r) && r.and_then(installed_revision).is_some_and(|v| v >= 2)
    })
    .await?;
    let new = on.ready_pod(Some(&name_of(&old))).await?;
    ensure!(
        controller_image(&new).is_some_and(|i| i.ends_with(&on.node.image.digest)),
        "after the upgrade the pod runs {:?}, not today's image",
        controller_image(&new)
    );
    on.wait_lease_held_by(&name_of(&new)).await?;

    // Every delete the first release held is held by today's controller,
    // which labels the fence it took over.
    held.check_still_held(on).await?;
    for name in &held.names {
        wait_named(on, name, "its fence labelled", ACTION_TIMEOUT, |r| {
            r.and_then(fence_label).is_some()
        })
        .await?;
    }
    held.check_still_held(on).await?;
    check_one_writer_at_a_time(offset, &on.controller_user())?;
    let handover = Writers::read(
        offset,
        &on.controller_user(),
        &name_of(&old),
        &name_of(&new),
    )?
    .handover()?;
    eprintln!(
        "upgrade from the first release {} to {} with {HELD} deletes held, none let go: the Lease went from {} to {} after {handover:#}",
        first.chart.tag,
        today.tag,
        name_of(&old),
        name_of(&new),
    );
    held.let_uninstall(on).await?;

    ns.releases().delete(NAME, &Default::default()).await?;
    wait_release(on, "the release to go", real_node::POD_TIMEOUT * 2, |r| {
        r.is_none()
    })
    .await?;
    Ok(())
}
