//! The pre-delete hook (SPEC §8), step by step: stop the controller, wait
//! for its pods, release every fence, then look again while a pod may still
//! run, or remove the Lease when none is left. Every step's requests end
//! within the hook's budget, and the report says what each did.

use std::time::{Duration, Instant};

use backon::Retryable;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::error::describe;
use crate::install::Install;
use crate::names::SWEEP_FIELD_MANAGER;
use crate::release::api::list_every_fence;
use crate::release::view::ReleaseView;
use crate::scope::Scope;
use crate::sweep::plan::Budget;
use crate::sweep::{Refusals, Released, Uninstall, release_with_retry};
use crate::test_hooks::{SweepStep, pause_at};

/// The first wait before a step's failed request is sent again; it doubles
/// up to the longest.
const REQUEST_FIRST_WAIT: Duration = Duration::from_millis(500);
const REQUEST_LONGEST_WAIT: Duration = Duration::from_secs(10);
/// How often the controller's pods are listed while the hook waits for them.
const POD_POLL: Duration = Duration::from_millis(500);

/// Configuration of the pre-delete hook.
#[derive(Debug, Clone)]
pub struct HookConfig {
    pub namespace: String,
    pub deployment: String,
    pub pod_selector: String,
    pub lease: String,
    /// The releases whose fences this install's hook releases: the
    /// controller's scope.
    pub scope: Scope,
    /// The install whose fences these are: its own are released wherever
    /// they are in the scope's namespaces, another install's never.
    pub install: Install,
    /// Retries of every step end here (the hook's retry window).
    pub retry_window: Duration,
    /// How long to wait for the pods after scaling down.
    pub pod_wait: Duration,
    /// How long past the window a last attempt may still run: no request
    /// outlives the window plus this margin.
    pub finish_margin: Duration,
}

impl HookConfig {
    /// The budget of a run starting now.
    pub(crate) fn budget(&self) -> Budget {
        Budget::from_now(self.retry_window, self.finish_margin)
    }
}

/// How the hook ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HookReport {
    pub lines: Vec<String>,
    pub(crate) fenced: usize,
    pub(crate) released: usize,
    pub(super) without_uninstall: usize,
    pub success: bool,
}

impl HookReport {
    fn say(&mut self, line: String) {
        tracing::info!("{line}");
        self.lines.push(line);
    }
}

/// SPEC §8: the pre-delete hook.
pub async fn run_hook(client: &Client, config: &HookConfig) -> HookReport {
    let mut hook = Hook {
        client,
        config,
        budget: config.budget(),
        report: HookReport::default(),
    };
    // A step that ends the hook early has said why in the report, which
    // then does not claim success.
    let _: Result<(), Untouched> = hook.run().await;
    hook.report
}

/// The hook ended before it touched a fence.
struct Untouched;

/// One run of the hook.
struct Hook<'a> {
    client: &'a Client,
    config: &'a HookConfig,
    budget: Budget,
    report: HookReport,
}

impl Hook<'_> {
    /// The steps in order; [`Untouched`] ends the run early.
    async fn run(&mut self) -> Result<(), Untouched> {
        self.stop_controller().await?;
        let pod_may_run = self.wait_for_pods().await;
        self.release_all().await?;
        let fences_after = if pod_may_run {
            self.recheck().await
        } else {
            self.remove_lease().await;
            false
        };
        self.report.success = self.report.released == self.report.fenced && !fences_after;
        Ok(())
    }

    /// Scales the controller's Deployment to 0, so that no new pod sets a
    /// fence behind the sweep.
    async fn stop_controller(&mut self) -> Result<(), Untouched> {
        let config = self.config;
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &config.namespace);
        let target = format!("{}/{}", config.namespace, config.deployment);
        let deployment = match retry(self.budget, "reading the Deployment", || {
            deployments.get_opt(&config.deployment)
        })
        .await
        {
            Ok(found) => found,
            Err(err) => {
                return Err(self.end_untouched(format!(
                    "could not read Deployment {target}: {}",
                    describe(&err)
                )));
            }
        };
        if deployment.is_none() {
            self.report
                .say(format!("no Deployment {target}: nothing to stop"));
            return Ok(());
        }
        let scale = Patch::Merge(json!({"spec": {"replicas": 0}}));
        let params = PatchParams {
            field_manager: Some(SWEEP_FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        pause_at(SweepStep::BeforeScaleDown.name()).await;
        match retry(self.budget, "scaling the Deployment to 0", || {
            deployments.patch_scale(&config.deployment, &params, &scale)
        })
        .await
        {
            Ok(_) => {
                pause_at(SweepStep::ScaledDown.name()).await;
                self.report.say(format!("scaled Deployment {target} to 0"));
                Ok(())
            }
            Err(err) => Err(self.end_untouched(format!(
                "could not scale Deployment {target} to 0: {}",
                describe(&err)
            ))),
        }
    }

    /// Waits for the controller's pods to go, at most the pod wait and never
    /// past the window; whether one may still run.
    async fn wait_for_pods(&mut self) -> bool {
        let config = self.config;
        match self.pods_left_after_wait().await {
            Ok(names) => {
                for pod in &names {
                    self.report.say(format!(
                        "pod {}/{pod} is still there after the wait (stuck Terminating on a NotReady node?): going on; it may still set fences",
                        config.namespace
                    ));
                }
                !names.is_empty()
            }
            Err(err) => {
                self.report.say(format!(
                    "could not list the flux-plunger pods ({}): {}; going on as if one may still run",
                    config.pod_selector,
                    describe(&err)
                ));
                true
            }
        }
    }

    /// The controller's pods listed once none is left or the wait is over.
    /// Until a listing succeeds nothing is known: a pod may run.
    async fn pods_left_after_wait(&self) -> kube::Result<Vec<String>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.config.namespace);
        let wait_end = (Instant::now() + self.config.pod_wait).min(self.budget.retry_until);
        let selector = ListParams::default().labels(&self.config.pod_selector);
        loop {
            let remaining: kube::Result<Vec<String>> = self
                .budget
                .bounded(pods.list(&selector))
                .await
                .map(|list| list.items.iter().map(|p| p.name_any()).collect());
            if let Err(err) = &remaining {
                tracing::warn!(error = %describe(err), "listing flux-plunger pods failed; retrying");
            }
            if matches!(&remaining, Ok(names) if names.is_empty()) || Instant::now() >= wait_end {
                return remaining;
            }
            tokio::time::sleep(POD_POLL).await;
        }
    }

    /// Lets go of every fence of the install's, then sums up.
    async fn release_all(&mut self) -> Result<(), Untouched> {
        let (client, budget) = (self.client, self.budget);
        let (scope, install) = (&self.config.scope, &self.config.install);
        let fenced = match retry(budget, "listing fenced HelmReleases", || {
            list_every_fence(client, scope, install)
        })
        .await
        {
            Ok(fenced) => fenced,
            Err(err) => {
                return Err(
                    self.end_untouched(format!("could not list HelmReleases: {}", describe(&err)))
                );
            }
        };
        self.report.fenced = fenced.len();
        for release in fenced {
            let key = release.key();
            match release_with_retry(client, release, budget, Uninstall::MaySkip, Refusals::Retry)
                .await
            {
                Ok(Released {
                    without_uninstall: false,
                }) => {
                    self.report.released += 1;
                    self.report.say(format!("released {key}"));
                }
                Ok(Released {
                    without_uninstall: true,
                }) => {
                    self.report.released += 1;
                    self.report.without_uninstall += 1;
                    self.report.say(format!(
                        "released {key} WITHOUT an uninstall: it was being deleted and helm-controller had not uninstalled it; its resources may be left"
                    ));
                }
                Err(err) => self.report.say(format!("NOT released {key}: {err}")),
            }
        }
        let summary = format!(
            "released {} of {} fenced HelmReleases, {} without an uninstall",
            self.report.released, self.report.fenced, self.report.without_uninstall
        );
        self.report.say(summary);
        Ok(())
    }

    /// A pod that may still run may have set fences meanwhile: lists them
    /// once more; whether any is (or may be) there.
    async fn recheck(&mut self) -> bool {
        match self
            .budget
            .bounded(list_every_fence(
                self.client,
                &self.config.scope,
                &self.config.install,
            ))
            .await
        {
            Ok(again) if again.is_empty() => false,
            Ok(again) => {
                let names: Vec<String> = again.iter().map(ReleaseView::key).collect();
                self.report.say(format!(
                    "fences found after the sweep while a flux-plunger pod may still run: {}",
                    names.join(", ")
                ));
                true
            }
            Err(err) => {
                self.report.say(format!(
                    "could not list again while a flux-plunger pod may still run: {}",
                    describe(&err)
                ));
                true
            }
        }
    }

    /// No flux-plunger pod is left to hold the leader Lease: it goes with
    /// the chart. One that cannot be removed is only reported in the log: no
    /// pod is left to renew it, so it is inert.
    async fn remove_lease(&mut self) {
        let config = self.config;
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &config.namespace);
        pause_at(SweepStep::BeforeLeaseDelete.name()).await;
        match self
            .budget
            .bounded(leases.delete(&config.lease, &DeleteParams::default()))
            .await
        {
            Ok(_) => {
                pause_at(SweepStep::LeaseDeleted.name()).await;
                self.report.say(format!(
                    "removed the leader Lease {}/{}",
                    config.namespace, config.lease
                ))
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(err) => {
                tracing::warn!(error = %describe(&err), "could not remove the leader Lease; it is inert")
            }
        }
    }

    /// Ends the hook before any fence was touched, saying why.
    fn end_untouched(&mut self, why: String) -> Untouched {
        self.report.say(format!("{why}; no fence was touched"));
        Untouched
    }
}

/// Sends one of a step's requests until it is answered, waiting longer
/// after each failure, until the budget's retries end; it is always sent
/// once.
async fn retry<T, Fut>(
    budget: Budget,
    what: &str,
    mut request: impl FnMut() -> Fut,
) -> kube::Result<T>
where
    Fut: Future<Output = kube::Result<T>>,
{
    (|| budget.bounded(request()))
        .retry(budget.backoff(REQUEST_FIRST_WAIT, REQUEST_LONGEST_WAIT))
        .notify(|err, delay| {
            tracing::warn!(error = %describe(err), retry_in = ?delay, "{what} failed; retrying")
        })
        .await
}
