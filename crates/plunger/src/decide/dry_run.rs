//! `--dry-run`: what a decision would have written, reported instead.

use super::{AfterHandOver, Decision};

/// `--dry-run`: a decision that would write is reported instead, with the
/// event it would record where that event reports what was found rather
/// than what was done; a held fence is still held (nothing is written to
/// hold it), its label left as it is.
pub(super) fn as_dry_run(decision: Decision) -> Decision {
    match decision {
        Decision::HoldFence { recheck, event, .. } => Decision::HoldFence {
            recheck,
            event,
            label_fence: false,
        },
        decision => match would_write(&decision) {
            Some(would) => Decision::DryRun {
                would,
                event: match decision {
                    Decision::DropFence { event } => event,
                    _ => None,
                },
            },
            None => decision,
        },
    }
}

/// What a decision would write, for `--dry-run`; `None` for no write.
fn would_write(decision: &Decision) -> Option<String> {
    match decision {
        Decision::Lift { keep_fence: true } => {
            Some("lift flux-plunger's suspension and keep the fence".to_owned())
        }
        Decision::Lift { keep_fence: false } => {
            Some("lift flux-plunger's suspension and the fence".to_owned())
        }
        Decision::DropFence { .. } => Some("remove the uninstall fence".to_owned()),
        Decision::HandOver { snapshot, then, .. } => Some(format!(
            "write revision {} ({}) to status.history for helm-controller's uninstall, then {}",
            snapshot.version,
            snapshot.full_name(),
            match then {
                AfterHandOver::Lift { .. } => "lift flux-plunger's suspension",
                AfterHandOver::RequestReconcile => "ask helm-controller to reconcile",
            }
        )),
        Decision::RequestReconcile => Some("ask helm-controller to reconcile".to_owned()),
        Decision::ReleaseWithoutUninstall { .. } => {
            Some("remove the uninstall fence without an uninstall".to_owned())
        }
        Decision::Nothing { .. }
        | Decision::HoldFence { .. }
        | Decision::Recover(_)
        | Decision::Skip { .. }
        | Decision::DryRun { .. } => None,
    }
}
