//! flux-plunger's admission guard in the local control plane: the chart's own
//! ServiceAccounts, ValidatingAdmissionPolicy and binding, rendered by helm
//! from `chart/` (never a copy), so that the suites run flux-plunger's
//! binaries and library under the real guard, as a cluster with the chart
//! installed would.
//!
//! The ServiceAccounts are granted `cluster-admin`: these suites are about
//! what flux-plunger does, and the guard is what holds it; the chart's own
//! RBAC is held to the binaries by `testing/chart-contract`.
//!
//! Most tests share one install per control plane ([`shared`]); a test whose
//! Lease or Deployment lives in its own namespace installs the chart there
//! ([`TestNamespace::guarded`]), since the guard allows flux-plunger only the
//! Lease and the Deployment of its own release namespace.

use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use kube::{Client, ResourceExt};
use serde::Deserialize;
use serde_json::Value;

use crate::TestNamespace;
use crate::control_plane::{
    AuthInfo, client_from_yaml, control_plane, create_unless_present, helm, workspace_root,
};
use crate::fixtures::vap_resource;

/// The release, and its namespace, of the install every test of a process
/// shares: `helm install flux-plunger ./chart -n flux-plunger`.
pub const SHARED_RELEASE: &str = "flux-plunger";

/// The Lease the guard is rendered for: the binaries' default
/// `--leader-election-lease-name`, which the tests keep.
pub const LEASE: &str = "flux-plunger";

/// The API the chart's guard needs, as `helm template --api-versions` takes
/// it: offline, helm knows no kinds and leaves the guard out without it.
pub const ADMISSION_POLICY_API: &str = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy";

/// How long the apiserver may take to enforce a new policy (it reloads them
/// about once a second).
const ENFORCED_WITHIN: Duration = Duration::from_secs(60);

/// The Secret a probe tries to delete (dry run) until the guard refuses it.
const PROBE_SECRET: &str = "admission-guard-probe";

/// The chart's identities of one release, held by the chart's guard.
#[derive(Clone)]
pub struct Guarded {
    /// The release namespace: the ServiceAccounts, the Lease and the
    /// Deployment the guard allows are here.
    pub namespace: String,
    /// The ServiceAccount of the controller and the drain.
    pub controller: String,
    /// The pre-delete hook's ServiceAccount.
    pub hook: String,
    /// The chart's Deployment, the only one the hook may scale.
    pub deployment: String,
    /// The leader Lease, the only one flux-plunger may write.
    pub lease: String,
    /// The ValidatingAdmissionPolicy (and its binding).
    pub policy: String,
    controller_token: String,
    hook_token: String,
}

static SHARED: OnceLock<Result<Guarded, String>> = OnceLock::new();

/// The install every test of this process shares (in namespace
/// [`SHARED_RELEASE`]), made on first use; its guard is enforced.
///
/// Safe to call from inside a tokio runtime: the install runs on its own
/// thread.
pub fn shared() -> Result<&'static Guarded> {
    let installed = SHARED.get_or_init(|| {
        std::thread::spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(async {
                    let admin = control_plane().client().await?;
                    create_unless_present(&Api::<Namespace>::all(admin.clone()), SHARED_RELEASE)
                        .await?;
                    Guarded::install(&admin, SHARED_RELEASE, SHARED_RELEASE).await
                })
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the guard's install thread panicked"))
        .and_then(|r| r)
        .map_err(|e| format!("{e:#}"))
    });
    installed
        .as_ref()
        .map_err(|e| anyhow::anyhow!("the admission guard was not installed: {e}"))
}

impl TestNamespace {
    /// The chart installed for release `<namespace>` in this namespace: its
    /// ServiceAccounts held by its guard, which allows them this namespace's
    /// Lease [`LEASE`] and Deployment [`Guarded::deployment`].
    pub async fn guarded(&self) -> Result<Guarded> {
        Guarded::install(&self.client, &self.name, &self.name).await
    }
}

impl Guarded {
    /// Renders the chart for `release` in `namespace`, creates its
    /// ServiceAccounts (granted `cluster-admin`), installs its admission
    /// policy and binding, and waits until the apiserver enforces them.
    pub async fn install(admin: &Client, namespace: &str, release: &str) -> Result<Self> {
        let version = admin.apiserver_version().await?.git_version;
        let objects = render(release, namespace, &version)?;
        let name_of = |kind: &str, hook: bool| -> Result<String> {
            objects
                .iter()
                .find(|o| {
                    o["kind"] == kind
                        && o["metadata"]["annotations"]["helm.sh/hook"].is_string() == hook
                })
                .and_then(|o| o["metadata"]["name"].as_str())
                .map(str::to_owned)
                .with_context(|| format!("the chart rendered no {kind} (hook: {hook})"))
        };
        let controller = name_of("ServiceAccount", false)?;
        let hook = name_of("ServiceAccount", true)?;
        let deployment = name_of("Deployment", false)?;
        let policy = name_of("ValidatingAdmissionPolicy", false)?;
        for object in objects.iter().filter(|o| o["kind"] != "Deployment") {
            apply(admin, namespace, object).await?;
        }
        let plane = control_plane();
        plane
            .grant_cluster_admin(admin, namespace, &[&controller, &hook])
            .await?;
        let guarded = Self {
            namespace: namespace.to_owned(),
            controller_token: plane
                .service_account_token(admin, namespace, &controller)
                .await?,
            hook_token: plane.service_account_token(admin, namespace, &hook).await?,
            controller,
            hook,
            deployment,
            lease: LEASE.to_owned(),
            policy,
        };
        wait_enforced(
            admin,
            &guarded.controller_client().await?,
            namespace,
            &guarded.policy,
        )
        .await?;
        Ok(guarded)
    }

    /// The username the apiserver (and its audit log) gives the controller.
    pub fn controller_user(&self) -> String {
        crate::audit::service_account_user(&self.namespace, &self.controller)
    }

    /// The username of the pre-delete hook.
    pub fn hook_user(&self) -> String {
        crate::audit::service_account_user(&self.namespace, &self.hook)
    }

    /// A client acting as the controller, new for the calling runtime.
    pub async fn controller_client(&self) -> Result<Client> {
        client_from_yaml(&self.controller_kubeconfig()).await
    }

    /// A client acting as the pre-delete hook.
    pub async fn hook_client(&self) -> Result<Client> {
        client_from_yaml(&self.hook_kubeconfig()).await
    }

    /// A kubeconfig document acting as the controller (the drain too).
    pub fn controller_kubeconfig(&self) -> String {
        control_plane().kubeconfig_yaml(&AuthInfo::Token(self.controller_token.clone()))
    }

    /// A kubeconfig document acting as the pre-delete hook.
    pub fn hook_kubeconfig(&self) -> String {
        control_plane().kubeconfig_yaml(&AuthInfo::Token(self.hook_token.clone()))
    }

    /// Writes [`Guarded::controller_kubeconfig`] at `path`, for a process.
    pub fn write_controller_kubeconfig(&self, path: &Path) -> Result<()> {
        Ok(std::fs::write(path, self.controller_kubeconfig())?)
    }

    /// Writes [`Guarded::hook_kubeconfig`] at `path`, for a process.
    pub fn write_hook_kubeconfig(&self, path: &Path) -> Result<()> {
        Ok(std::fs::write(path, self.hook_kubeconfig())?)
    }
}

/// Waits until the apiserver enforces the guard `policy`: until it refuses,
/// by that policy, `flux_plunger`'s (dry-run) delete of an ordinary Secret in
/// `namespace`, which it lets through before (a dry run deletes nothing).
/// `admin` creates that Secret.
pub async fn wait_enforced(
    admin: &Client,
    flux_plunger: &Client,
    namespace: &str,
    policy: &str,
) -> Result<()> {
    create_unless_present(
        &Api::<Secret>::namespaced(admin.clone(), namespace),
        PROBE_SECRET,
    )
    .await?;
    let as_flux_plunger: Api<Secret> = Api::namespaced(flux_plunger.clone(), namespace);
    let dry_run = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    let deadline = Instant::now() + ENFORCED_WITHIN;
    loop {
        match as_flux_plunger.delete(PROBE_SECRET, &dry_run).await {
            Err(kube::Error::Api(s)) if is_refused_by(&s, policy) => return Ok(()),
            Ok(_) => {}
            Err(e) => bail!("probing the admission guard: {e:?}"),
        }
        if Instant::now() > deadline {
            bail!(
                "the apiserver did not enforce ValidatingAdmissionPolicy {policy} within {ENFORCED_WITHIN:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether the apiserver refused a request by the policy `policy`.
pub fn is_refused_by(status: &kube::core::Status, policy: &str) -> bool {
    status.code == 403
        && status
            .message
            .contains(&format!("ValidatingAdmissionPolicy '{policy}'"))
}

/// The chart's ServiceAccounts, Deployment, admission policy and binding for
/// `release` in `namespace`, rendered for the apiserver's version.
fn render(release: &str, namespace: &str, kube_version: &str) -> Result<Vec<Value>> {
    let templates = [
        "serviceaccount.yaml",
        "hook-serviceaccount.yaml",
        "deployment.yaml",
        "admission-policy.yaml",
        "admission-policy-binding.yaml",
    ];
    let mut command = helm()?;
    command
        .arg("template")
        .arg(release)
        .arg(workspace_root().join("chart"))
        .args(["--namespace", namespace, "--kube-version", kube_version])
        // What the apiserver's discovery tells helm install.
        .args(["--api-versions", ADMISSION_POLICY_API])
        .args(["--set", &format!("leaderElection.leaseName={LEASE}")]);
    for template in templates {
        command.args(["--show-only", &format!("templates/{template}")]);
    }
    let output = command.output().context("running helm template")?;
    if !output.status.success() {
        bail!(
            "helm template of the admission guard failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let mut objects = Vec::new();
    for document in serde_yaml::Deserializer::from_str(std::str::from_utf8(&output.stdout)?) {
        let value = Value::deserialize(document)?;
        if !value.is_null() {
            objects.push(value);
        }
    }
    Ok(objects)
}

/// Creates or updates `object` as the admin (server-side apply).
async fn apply(admin: &Client, namespace: &str, object: &Value) -> Result<()> {
    let object: DynamicObject = serde_json::from_value(object.clone())?;
    let kind = object
        .types
        .as_ref()
        .map(|t| t.kind.clone())
        .context("a rendered object without a kind")?;
    let api: Api<DynamicObject> = match kind.as_str() {
        "ServiceAccount" => Api::namespaced_with(
            admin.clone(),
            namespace,
            &ApiResource::erase::<k8s_openapi::api::core::v1::ServiceAccount>(&()),
        ),
        "ValidatingAdmissionPolicy" => Api::all_with(
            admin.clone(),
            &vap_resource(&kind, "validatingadmissionpolicies"),
        ),
        "ValidatingAdmissionPolicyBinding" => Api::all_with(
            admin.clone(),
            &vap_resource(&kind, "validatingadmissionpolicybindings"),
        ),
        other => bail!("the guard's render holds an unexpected {other}"),
    };
    api.patch(
        &object.name_any(),
        &PatchParams::apply("testkit").force(),
        &Patch::Apply(&object),
    )
    .await
    .with_context(|| format!("installing {kind} {}", object.name_any()))?;
    Ok(())
}
