//! `make demo`: flux-plunger at work as a user runs it — installed as the
//! README installs it with Flux (the chart pushed to an OCI registry, pulled
//! by the real source-controller, installed by the real helm-controller; the
//! image pulled from the registry by the node's containerd) on a real node
//! (testkit's, inside `hack/node-sandbox.sh`), its controller pod beside the
//! releases it recovers — narrated, with the pods shown. It ends on its own (or on Ctrl-C) and leaves nothing running:
//! every server stops with this process, and the sandbox with it.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use e2e::{Observed, apply_as_flux_plunger, wait_gone, wait_stuck_saying, wait_until};
use real_node::OnNode;
use real_node::as_flux::{
    ACTION_TIMEOUT, NAME, install_as_the_readme_says, pushed_chart, ready_at_current_generation,
    wait_release,
};
use serde_json::json;
use testkit::control_plane::{AuthInfo, control_plane, tool};
use testkit::node::node;
use testkit::real_causes;
use testkit::real_helm_controller::{demo_configmap, helm_controller, selected_version};
use testkit::registry::registry;
use testkit::source_controller::source_controller;

struct Narrator {
    started: Instant,
    kubeconfig: PathBuf,
    namespace: String,
}

impl Narrator {
    fn say(&self, text: &str) {
        println!("\n[{:>5.1}s] {text}", self.started.elapsed().as_secs_f64());
    }

    /// Prints what `kubectl ARGS -n NAMESPACE` shows, indented.
    fn show(&self, args: &[&str]) {
        let output =
            std::process::Command::new(tool("kubectl").expect("make tools builds kubectl"))
                .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
                .args(["-n", &self.namespace])
                .args(args)
                .output();
        println!("  $ kubectl {} -n {}", args.join(" "), self.namespace);
        match output {
            Ok(out) => {
                let text = String::from_utf8_lossy(if out.status.success() {
                    &out.stdout
                } else {
                    &out.stderr
                })
                .to_string();
                for line in text.lines() {
                    println!("    {line}");
                }
            }
            Err(err) => println!("    (kubectl failed: {err})"),
        }
    }
}

/// Scales flux-plunger's Deployment to `replicas` and waits for the pods to
/// follow: a stop (its drain included) or a start.
async fn scale(on: &OnNode, replicas: i32) -> Result<()> {
    use k8s_openapi::api::apps::v1::Deployment;
    let deployments: kube::Api<Deployment> =
        kube::Api::namespaced(on.ns().client.clone(), &on.ns().name);
    deployments
        .patch_scale(
            &on.fullname,
            &Default::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"replicas": replicas}})),
        )
        .await?;
    if replicas > 0 {
        on.ready_pod(None).await?;
    } else {
        let selector = on.selector();
        testkit::eventually(
            real_node::POD_TIMEOUT,
            "flux-plunger's pods to go",
            || async {
                Ok(on
                    .pods()
                    .list(&kube::api::ListParams::default().labels(&selector))
                    .await?
                    .items
                    .is_empty())
            },
        )
        .await?;
    }
    Ok(())
}

async fn run() -> Result<()> {
    let started = Instant::now();
    println!(
        "flux-plunger demo: a real node (kubelet, containerd, controller-manager, scheduler) beside a local \
         control plane, Flux's real source- and helm-controller, an OCI registry, and flux-plunger installed \
         from it as the README says."
    );
    println!(
        "[{:>5.1}s] starting the control plane and the node (about a minute)",
        started.elapsed().as_secs_f64()
    );
    let plane = control_plane();
    node();
    let version = selected_version()?;
    println!(
        "[{:>5.1}s] starting helm-controller {version}, source-controller and the OCI registry",
        started.elapsed().as_secs_f64()
    );
    helm_controller();
    source_controller();
    let on = real_node::as_flux::on_node("demo").await?;
    let ns = on.ns();
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    plane.write_kubeconfig(&kubeconfig, &AuthInfo::AdminCertificate)?;
    let n = Narrator {
        started,
        kubeconfig: kubeconfig.clone(),
        namespace: ns.name.clone(),
    };
    n.say(&format!(
        "up: kube-apiserver at {}, node {} Ready, helm-controller {version}, the registry at {}; namespace {} \
         (kubeconfig {})",
        plane.server,
        testkit::node::NODE_NAME,
        registry().host,
        ns.name,
        kubeconfig.display()
    ));

    n.say("1. A HelmRelease `web` whose first install fails: one of its chart's values renders a ConfigMap key \
           the apiserver refuses. helm-controller remediates by uninstalling, and the HelmRelease asks Helm to keep \
           the history (`spec.uninstall.keepHistory`), so Helm's storage keeps revision 1 `uninstalled`. The user \
           fixes the value; helm-controller installs again and Helm refuses: the name is still in use. It stays so \
           on every try: the release is stuck.");
    real_causes::create_failing_release_from_registry(
        ns,
        "web",
        json!({ "uninstall": { "keepHistory": true } }),
    )
    .await?;
    let refused = real_causes::name_in_use();
    wait_stuck_saying(ns, "web", refused, false).await?;
    real_causes::fix_the_values(ns, "web").await?;
    wait_stuck_saying(ns, "web", refused, true).await?;
    n.show(&["get", "helmrelease", "web"]);
    n.show(&["get", "secrets", "-l", "owner=helm", "-L", "status"]);

    n.say("2. flux-plunger is installed as the README says: its chart `helm push`ed to the registry, an \
           OCIRepository the real source-controller pulls it from, and a HelmRelease (`chartRef`) the real \
           helm-controller installs. Its pod runs on the node, its image pulled by containerd from the registry by \
           digest: the controller, and the drain as a native sidecar.");
    let chart = pushed_chart(None)?;
    install_as_the_readme_says(&on, &chart, json!({})).await?;
    wait_release(
        &on,
        "the install",
        ACTION_TIMEOUT,
        ready_at_current_generation,
    )
    .await?;
    on.ready_pod(None).await?;
    n.show(&["get", "ocirepository", NAME]);
    n.show(&["get", "helmrelease", NAME]);
    n.show(&["get", "pods", "-o", "wide"]);
    n.say("   The controller reads the storage: the newest revision is `uninstalled` and nothing above it is live. \
           It suspends `web` together with its uninstall fence, records the revision, deletes that storage Secret \
           and lifts both; helm-controller then installs.");
    wait_until(ns, "web", "recovered and Ready=True", Observed::is_ready).await?;
    n.show(&["get", "helmrelease", "web"]);
    n.show(&["get", "secrets", "-l", "owner=helm", "-L", "status"]);
    n.show(&[
        "get",
        "events",
        "--field-selector",
        "involvedObject.name=web",
        "-o",
        "custom-columns=TYPE:.type,REASON:.reason,FROM:.reportingController",
    ]);

    n.say("3. The race flux-plunger exists for: a stuck release deleted while flux-plunger holds its short \
           suspension. flux-plunger is scaled to 0 (its pod stops, its drain releases what it held). A second \
           release, `api`, fails its install the same way, and an admission policy refuses the delete of its first \
           ConfigMap: helm-controller's uninstall remediation stops partway, Helm's storage and helm-controller's \
           history say `uninstalling`, and helm-controller cannot determine the release's state. The policy is \
           lifted; the release stays stuck. It is left as a flux-plunger that died in the middle of recovering it \
           leaves it: its suspension and its uninstall fence on the release (one server-side apply by manager \
           flux-plunger). Then the release is deleted.");
    scale(&on, 0).await?;
    n.show(&["get", "pods"]);
    let refusal = real_causes::refuse_deleting_the_kept_configmap(ns, "api").await?;
    real_causes::create_failing_release_from_registry(ns, "api", json!({})).await?;
    wait_stuck_saying(
        ns,
        "api",
        "unable to determine state for release with status 'uninstalling'",
        false,
    )
    .await?;
    refusal.lift().await?;
    n.show(&["get", "helmrelease", "api"]);
    n.show(&[
        "get",
        "secrets",
        "-l",
        "owner=helm,name=api",
        "-L",
        "status",
    ]);
    apply_as_flux_plunger(ns, "api", Some(true), true).await?;
    wait_until(
        ns,
        "api",
        "helm-controller saw the suspension",
        Observed::is_observed,
    )
    .await?;
    n.show(&[
        "get",
        "helmrelease",
        "api",
        "-o",
        "custom-columns=NAME:.metadata.name,SUSPEND:.spec.suspend,FINALIZERS:.metadata.finalizers",
    ]);
    ns.releases().delete("api", &Default::default()).await?;
    wait_until(
        ns,
        "api",
        "helm-controller handled the suspended delete",
        |o| !o.has_helm_controller_finalizer() && o.is_observed(),
    )
    .await?;
    n.say("   helm-controller handled the delete of the suspended release: it skipped the Helm uninstall and dropped \
           its finalizer. Without the fence the release would be gone now and its ConfigMap orphaned. The fence holds it:");
    n.show(&["get", "helmrelease", "api", "-o", "custom-columns=NAME:.metadata.name,SUSPEND:.spec.suspend,DELETING:.metadata.deletionTimestamp,FINALIZERS:.metadata.finalizers"]);
    n.show(&["get", "configmaps"]);

    n.say("4. flux-plunger is scaled back to 1. Its new pod finds the release being deleted under its own \
           suspension, with the `uninstalling` revision in helm-controller's history: it lifts the suspension and \
           keeps the fence; helm-controller handles the unsuspended generation and runs the Helm uninstall of that \
           revision; flux-plunger sees it reported and drops the fence.");
    scale(&on, 1).await?;
    n.show(&["get", "pods"]);
    wait_gone(ns, "api").await?;
    let left = demo_configmap(ns, "api").await?;
    n.show(&["get", "helmrelease"]);
    n.show(&["get", "configmaps"]);
    n.show(&["get", "secrets", "-l", "owner=helm,name=api"]);
    n.show(&[
        "get",
        "events",
        "--field-selector",
        "involvedObject.name=api",
        "-o",
        "custom-columns=TYPE:.type,REASON:.reason,FROM:.reportingController,MESSAGE:.message",
    ]);
    n.say(&format!(
        "   `api` is gone and its ConfigMap {}.",
        if left.is_none() {
            "was uninstalled with it"
        } else {
            "WAS LEFT BEHIND (unexpected)"
        }
    ));
    anyhow::ensure!(left.is_none(), "the ConfigMap of `api` was orphaned");

    n.say("5. flux-plunger's HelmRelease is deleted: helm-controller uninstalls it, its pre-delete hook Job first, \
           in a pod of its own: it scales the Deployment down, waits for the pod, releases any fence left.");
    ns.releases().delete(NAME, &Default::default()).await?;
    wait_release(&on, "the uninstall", ACTION_TIMEOUT, |r| r.is_none()).await?;
    n.show(&["get", "helmreleases,jobs,pods,leases"]);
    n.say("done: stopping helm-controller, the node and the control plane.");
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let result = tokio::select! {
        result = run() => result,
        _ = tokio::signal::ctrl_c() => {
            println!("\ninterrupted: stopping everything");
            return std::process::ExitCode::from(130);
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("demo failed: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
