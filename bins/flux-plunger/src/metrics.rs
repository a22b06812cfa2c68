//! Prometheus metrics, served as text on `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use plunger::reconcile::{Counted, Outcome};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

/// Every metric flux-plunger exports.
pub struct Metrics {
    pub registry: Registry,
    /// Recovery attempts by how they ended.
    pub recoveries: Family<ResultLabel, Counter>,
    /// What was done for the uninstall of releases deleted with an empty
    /// history, by result.
    pub uninstall_handovers: Family<ResultLabel, Counter>,
    /// Reconciles that failed, by the step that failed.
    pub errors: Family<KindLabel, Counter>,
    /// Reconcile duration.
    pub reconcile_duration: Histogram,
    /// Releases carrying our fence, as the watch last saw them.
    pub fences_held: Gauge,
    /// Releases under our suspension, as the watch last saw them.
    pub suspensions_held: Gauge,
    /// 1 while this process holds the leader Lease.
    pub leader: Gauge,
    /// `UninstallFenceHeld` warnings raised: a delete held by the fence past
    /// its threshold (SPEC §5e). A counter, so that an alert sees them
    /// between scrapes and across the pods that led.
    pub uninstall_fence_held_warnings: Counter,
    /// Fences of this install found on HelmReleases when this process's watch
    /// first synced as the leader: what the previous leader's drain (or its
    /// crash) left. No fence survives a complete drain but those of deletes
    /// still waiting for their uninstall.
    pub fences_inherited: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        // flux-plunger's own metrics under its prefix; the process metrics
        // under the names every Prometheus client gives them.
        let mut registry = Registry::default();
        registry.register_collector(Box::new(crate::process::ProcessCollector));
        let ours = registry.sub_registry_with_prefix("flux_plunger");
        let recoveries = Family::<ResultLabel, Counter>::default();
        let uninstall_handovers = Family::<ResultLabel, Counter>::default();
        let errors = Family::<KindLabel, Counter>::default();
        let reconcile_duration = Histogram::new([
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ]);
        let fences_held = Gauge::default();
        let suspensions_held = Gauge::default();
        let leader = Gauge::default();
        let uninstall_fence_held_warnings = Counter::default();
        let fences_inherited = Counter::default();
        ours.register(
            "recoveries",
            "Recovery attempts of stuck HelmReleases, by result",
            recoveries.clone(),
        );
        ours.register(
            "uninstall_handovers",
            "Steps that bring a HelmRelease deleted with an empty history to helm-controller's uninstall, by result",
            uninstall_handovers.clone(),
        );
        ours.register(
            "reconcile_errors",
            "Reconciles that failed, by the step that failed",
            errors.clone(),
        );
        ours.register(
            "reconcile_duration_seconds",
            "Time spent in one reconcile",
            reconcile_duration.clone(),
        );
        ours.register(
            "fences_held",
            "HelmReleases carrying flux-plunger's uninstall fence",
            fences_held.clone(),
        );
        ours.register(
            "suspensions_held",
            "HelmReleases suspended by flux-plunger",
            suspensions_held.clone(),
        );
        ours.register(
            "leader",
            "1 while this process holds the leader Lease",
            leader.clone(),
        );
        ours.register(
            "uninstall_fence_held_warnings",
            "UninstallFenceHeld warnings raised: deletes held by the uninstall fence past the threshold",
            uninstall_fence_held_warnings.clone(),
        );
        ours.register(
            "fences_inherited",
            "Fences of this install found when this process's watch first synced as the leader, left by the previous leader's drain or crash",
            fences_inherited.clone(),
        );
        Self {
            registry,
            recoveries,
            uninstall_handovers,
            errors,
            reconcile_duration,
            fences_held,
            suspensions_held,
            leader,
            uninstall_fence_held_warnings,
            fences_inherited,
        }
    }
}

impl Metrics {
    /// Counts a reconcile's outcome.
    pub fn observe(&self, outcome: &Outcome) {
        let (counter, result) = match outcome.counted() {
            None => return,
            Some(Counted::FenceHeldWarning) => {
                self.uninstall_fence_held_warnings.inc();
                return;
            }
            Some(Counted::UninstallHandover(result)) => (&self.uninstall_handovers, result),
            Some(Counted::Recovery(result)) => (&self.recoveries, result),
        };
        counter
            .get_or_create(&ResultLabel {
                result: result.to_owned(),
            })
            .inc();
    }

    /// Counts a failed reconcile.
    pub fn observe_error(&self, kind: &str) {
        self.errors
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// Counts the fences the leader found at its watch's first sync.
    pub fn observe_inherited_fences(&self, fences: u64) {
        self.fences_inherited.inc_by(fences);
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_holds_ours_under_our_prefix_and_the_process_metrics_under_theirs() {
        let page = Metrics::default().encode();
        for name in [
            "flux_plunger_leader 0",
            "# TYPE flux_plunger_fences_held gauge",
            "# TYPE process_cpu_seconds counter",
            "# TYPE process_resident_memory_bytes gauge",
            "# TYPE process_open_fds gauge",
            "# TYPE process_start_time_seconds gauge",
        ] {
            assert!(page.lines().any(|l| l == name), "{name} in:\n{page}");
        }
        assert!(
            page.lines()
                .any(|l| l.starts_with("process_cpu_seconds_total ")),
            "{page}"
        );
        assert!(page.ends_with("# EOF\n"), "one page, one end");
    }

    /// The counters the chart's alerts read (chart/templates/prometheusrule.yaml)
    /// are on every page from the start, at 0, and count what they say.
    #[test]
    fn fence_held_warnings_and_inherited_fences_are_counted() {
        use std::time::Duration;
        let metrics = Metrics::default();
        let page = metrics.encode();
        for line in [
            "flux_plunger_uninstall_fence_held_warnings_total 0",
            "flux_plunger_fences_inherited_total 0",
        ] {
            assert!(page.lines().any(|l| l == line), "{line} in:\n{page}");
        }
        let held = |warned| Outcome::FenceHeld {
            recheck: Duration::from_secs(60),
            warned,
        };
        metrics.observe(&held(false));
        metrics.observe(&held(true));
        metrics.observe(&held(true));
        metrics.observe_inherited_fences(0);
        metrics.observe_inherited_fences(3);
        let page = metrics.encode();
        for line in [
            "flux_plunger_uninstall_fence_held_warnings_total 2",
            "flux_plunger_fences_inherited_total 3",
        ] {
            assert!(page.lines().any(|l| l == line), "{line} in:\n{page}");
        }
        // A held fence is neither a recovery nor a hand-over.
        assert!(!page.contains("flux_plunger_recoveries_total{"), "{page}");
        assert!(
            !page.contains("flux_plunger_uninstall_handovers_total{"),
            "{page}"
        );
    }
}
