//! One test's world: a namespace of its own on a control plane, the
//! simulated helm-controller acting in it, and flux-plunger's client. On the
//! shared control plane flux-plunger acts as the chart's ServiceAccount,
//! under the chart's admission guard ([`crate::guard`]); on a control plane
//! of a test's own (no chart there) it acts as the admin.

use anyhow::{Context as _, Result};
use kube::Client;
use kube::api::DynamicObject;
use plunger::events::Events;
use plunger::reconcile::Reconciler;
use plunger::release::view::ReleaseView;
use plunger::timings::Timings;
use serde_json::json;

use crate::control_plane::ControlPlane;
use crate::{Handled, SimulatedHelmController, TestNamespace, control_plane};

pub struct World {
    pub ns: TestNamespace,
    pub hc: SimulatedHelmController,
    /// The admin: the test's own arrangements.
    pub client: Client,
    /// flux-plunger's identity.
    pub flux_plunger: Client,
}

impl World {
    /// A namespace on the shared control plane, flux-plunger under the
    /// chart's admission guard.
    pub async fn create(prefix: &str) -> Result<Self> {
        let client = control_plane().client().await?;
        let flux_plunger = crate::guard::shared()?.controller_client().await?;
        Self::with(client, flux_plunger, prefix).await
    }

    /// A namespace on `plane`, a control plane of the test's own, where
    /// flux-plunger acts as the admin.
    pub async fn on(plane: &ControlPlane, prefix: &str) -> Result<Self> {
        let client = plane.client().await?;
        Self::with(client.clone(), client, prefix).await
    }

    async fn with(client: Client, flux_plunger: Client, prefix: &str) -> Result<Self> {
        let ns = TestNamespace::create(&client, prefix).await?;
        let hc = SimulatedHelmController::new(client.clone(), &ns.name);
        Ok(Self {
            ns,
            hc,
            client,
            flux_plunger,
        })
    }

    /// flux-plunger's reconciler, with the default timings.
    pub fn reconciler(&self) -> Reconciler {
        Reconciler::new(
            self.flux_plunger.clone(),
            Events::new(self.flux_plunger.clone(), "flux-plunger", None),
            Timings::default(),
        )
    }

    /// A release helm-controller installed, with its finalizer.
    pub async fn installed(&self, name: &str) -> Result<()> {
        self.ns.create_release(name, json!({})).await?;
        self.hc.install(name).await?;
        anyhow::ensure!(
            self.hc.handle(name).await? == Handled::AddedFinalizer,
            "helm-controller did not add its finalizer to {name}"
        );
        Ok(())
    }

    /// A release as helm-controller keeps it: installed, with its finalizer,
    /// stuck, with storage revisions of the given statuses.
    pub async fn stuck_release(
        &self,
        name: &str,
        revisions: &[(u64, &str)],
    ) -> Result<DynamicObject> {
        self.installed(name).await?;
        for (revision, status) in revisions {
            self.ns
                .create_storage_secret(name, *revision, status)
                .await?;
        }
        self.ns.mark_stuck(name).await
    }

    /// The release as it is now; `None` once it is gone.
    pub async fn find(&self, name: &str) -> Result<Option<ReleaseView>> {
        Ok(self
            .ns
            .releases()
            .get_opt(name)
            .await?
            .map(|object| ReleaseView::from_object(&object)))
    }

    /// The release as it is now, which must still exist.
    pub async fn view(&self, name: &str) -> Result<ReleaseView> {
        self.find(name)
            .await?
            .with_context(|| format!("release {name} is gone"))
    }
}
