//! `make demo`: flux-plunger at work beside Flux's real helm-controller, on a
//! local control plane, narrated. It ends on its own (or on Ctrl-C) and leaves
//! nothing running: every server stops with this process.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use e2e::{
    FluxPlunger, Observed, apply_as_flux_plunger, install, make_stuck, wait_gone, wait_until,
};
use testkit::TestNamespace;
use testkit::control_plane::{AuthInfo, control_plane, tool};
use testkit::real_helm_controller::{demo_configmap, helm_controller, selected_version};

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

async fn run() -> Result<()> {
    let started = Instant::now();
    println!(
        "flux-plunger demo: a local control plane, Flux's real helm-controller, flux-plunger."
    );
    let plane = control_plane();
    let version = selected_version()?;
    helm_controller();
    let client = plane.client().await?;
    let ns = TestNamespace::create(&client, "demo").await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    plane.write_kubeconfig(&kubeconfig, &AuthInfo::AdminCertificate)?;
    let n = Narrator {
        started,
        kubeconfig: kubeconfig.clone(),
        namespace: ns.name.clone(),
    };
    n.say(&format!(
        "up: kube-apiserver at {}, helm-controller {version}; namespace {} (kubeconfig {})",
        plane.server,
        ns.name,
        kubeconfig.display()
    ));

    n.say("1. A HelmRelease `web` is installed and upgraded by the real helm-controller; then its newest Helm \
           storage revision is left `uninstalling` (as an interrupted uninstall leaves it) and its values change. \
           Helm refuses the upgrade: the release is stuck.");
    make_stuck(&ns, "web").await?;
    n.show(&["get", "helmrelease", "web"]);
    n.show(&["get", "secrets", "-l", "owner=helm", "-L", "status"]);

    n.say("2. flux-plunger starts. It suspends `web` together with its uninstall fence, records the revision, \
           deletes the newest storage Secret and lifts both; helm-controller then upgrades.");
    let flux_plunger = FluxPlunger::start(&ns).await?;
    wait_until(&ns, "web", "recovered and Ready=True", Observed::is_ready).await?;
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
    drop(flux_plunger);

    n.say("3. The race flux-plunger exists for: a delete that lands while it holds its short suspension. \
           Here a flux-plunger stopped in the middle of recovering `api`: its suspension and its uninstall fence \
           are on the release (one server-side apply by manager flux-plunger), and the release is deleted meanwhile.");
    install(&ns, "api", "hello").await?;
    apply_as_flux_plunger(&ns, "api", Some(true), true).await?;
    wait_until(
        &ns,
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
        &ns,
        "api",
        "helm-controller handled the suspended delete",
        |o| !o.has_helm_controller_finalizer() && o.is_observed(),
    )
    .await?;
    n.say("   helm-controller handled the delete of the suspended release: it skipped the Helm uninstall and dropped \
           its finalizer. Without the fence the release would be gone now and its ConfigMap orphaned. The fence holds it:");
    n.show(&["get", "helmrelease", "api", "-o", "custom-columns=NAME:.metadata.name,SUSPEND:.spec.suspend,DELETING:.metadata.deletionTimestamp,FINALIZERS:.metadata.finalizers"]);
    n.show(&["get", "configmaps"]);

    n.say("4. flux-plunger starts again: it lifts its suspension and keeps the fence; helm-controller now handles the \
           unsuspended generation and runs the Helm uninstall; flux-plunger sees helm-controller's finalizer gone and \
           the generation observed, and drops the fence.");
    let flux_plunger = FluxPlunger::start(&ns).await?;
    wait_gone(&ns, "api").await?;
    let left = demo_configmap(&ns, "api").await?;
    n.show(&["get", "helmrelease"]);
    n.show(&["get", "configmaps"]);
    n.say(&format!(
        "   `api` is gone and its ConfigMap {}.",
        if left.is_none() {
            "was uninstalled with it"
        } else {
            "WAS LEFT BEHIND (unexpected)"
        }
    ));
    if left.is_some() {
        for line in flux_plunger
            .log_text()
            .lines()
            .filter(|l| l.contains("api"))
        {
            println!("    flux-plunger: {line}");
        }
    }
    drop(flux_plunger);
    anyhow::ensure!(left.is_none(), "the ConfigMap of `api` was orphaned");
    n.say("done: stopping flux-plunger, helm-controller and the control plane.");
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let result = tokio::select! {
        result = run() => result,
        _ = tokio::signal::ctrl_c() => {
            println!("\ninterrupted: stopping everything");
            Ok(())
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
