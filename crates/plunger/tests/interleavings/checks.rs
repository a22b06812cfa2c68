//! The invariants, checked on a settled run.

use std::collections::BTreeSet;

use anyhow::Result;
use kube::api::DynamicObject;
use plunger::names::FIELD_MANAGER;
use plunger::release::view::ReleaseView;
use testkit::{Handled, SimulatedHelmController, TestNamespace};

use super::NAME;
use super::actors::Acted;
use super::scenario::Scenario;

/// The invariants, on the settled world, read directly.
pub async fn check(
    scenario: &Scenario,
    ns: &TestNamespace,
    hc: &SimulatedHelmController,
    acted: &Acted,
    secrets_before: &BTreeSet<String>,
    stuck_secret: &str,
    violations: &mut Vec<String>,
) -> Result<()> {
    let foreign_suspended = acted.foreign_owned == Some(true);
    let secrets_after = secret_names(ns).await?;
    // helm-controller's uninstall purges the release's storage (what it
    // listed then, not what was gone before).
    let purged = hc.purged.lock().unwrap().clone();
    for lost in secrets_before.difference(&secrets_after) {
        if lost != stuck_secret && !purged.contains(lost) {
            violations.push(format!(
                "storage Secret {lost} was deleted; only {stuck_secret} may be"
            ));
        }
    }
    let release = ns.releases().get_opt(NAME).await?;
    let decisions = hc.decisions_for(NAME);
    let resources = hc.resources_exist(NAME).await?;
    // Nothing installed at the start (a newest `uninstalled`): nothing may
    // appear, and nothing is there to keep or to uninstall.
    if !scenario.installed() && resources {
        violations.push("objects appeared for a release with nothing installed".to_owned());
    }
    let kept = |resources: bool| resources || !scenario.installed();
    if scenario.delete.is_some() {
        if let Some(object) = &release {
            violations.push(format!(
                "left Terminating after helm-controller answered ({decisions:?}): {}",
                describe(Some(object))
            ));
        }
        if foreign_suspended {
            if !kept(resources) {
                violations.push(format!(
                    "suspended by another manager, then deleted: its resources must stay, but were uninstalled ({decisions:?})"
                ));
            }
        } else if acted.held_at_delete
            && scenario.installed()
            && (!decisions.contains(&Handled::Uninstalled) || resources)
        {
            violations.push(format!(
                "deleted under flux-plunger's fence or suspension, no foreign one, but not uninstalled: decisions {decisions:?}, resources left: {resources}"
            ));
        }
    } else {
        let Some(object) = &release else {
            violations.push("a release nobody deleted is gone".to_owned());
            return Ok(());
        };
        let view = ReleaseView::from_object(object);
        if view.has_fence() {
            violations.push(format!(
                "our fence is left on a live, settled release: {}",
                describe(Some(object))
            ));
        }
        if we_own_suspend_or_finalizers(object) {
            violations.push(format!(
                "flux-plunger still owns spec.suspend or finalizers of a live, settled release: {}",
                describe(Some(object))
            ));
        }
        if view.suspend && !foreign_suspended {
            violations.push(format!(
                "suspended, and no other manager suspended it: {}",
                describe(Some(object))
            ));
        }
        if !kept(resources) {
            violations.push("a live release lost its resources".to_owned());
        }
    }
    Ok(())
}

/// The namespace's Secrets by name, as a set to compare before and after.
pub async fn secret_names(ns: &TestNamespace) -> Result<BTreeSet<String>> {
    Ok(ns.secret_names().await?.into_iter().collect())
}

/// Whether `manager` owns `spec.suspend` in any managedFields entry.
pub fn owns_suspend(object: &DynamicObject, manager: &str) -> bool {
    object.metadata.managed_fields.iter().flatten().any(|e| {
        e.manager.as_deref() == Some(manager)
            && e.fields_v1
                .as_ref()
                .is_some_and(|f| f.0.pointer("/f:spec/f:suspend").is_some())
    })
}

fn we_own_suspend_or_finalizers(object: &DynamicObject) -> bool {
    object.metadata.managed_fields.iter().flatten().any(|e| {
        e.manager.as_deref() == Some(FIELD_MANAGER)
            && e.fields_v1.as_ref().is_some_and(|f| {
                f.0.pointer("/f:spec/f:suspend").is_some()
                    || f.0.pointer("/f:metadata/f:finalizers").is_some()
            })
    })
}

pub fn describe(object: Option<&DynamicObject>) -> String {
    let Some(object) = object else {
        return "gone".to_owned();
    };
    let view = ReleaseView::from_object(object);
    let owners: Vec<String> = object
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .map(|e| {
            format!(
                "{}/{}",
                e.manager.as_deref().unwrap_or("?"),
                e.operation.as_deref().unwrap_or("?")
            )
        })
        .collect();
    format!(
        "terminating {}, suspend {}, finalizers {:?}, generation {:?}, observed {:?}, managers {owners:?}",
        view.terminating, view.suspend, view.finalizers, view.generation, view.observed_generation
    )
}
