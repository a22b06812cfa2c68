//! The guarded JSON patch that lets go where an apply cannot: a fence
//! another manager also lists.

use crate::release::view::ReleaseView;

/// What a guarded JSON patch must write to give up our hold on a release.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct GuardedPatch {
    /// Remove `spec.suspend`.
    pub(crate) lift_suspension: bool,
    /// Remove the fence at these indices of `metadata.finalizers`.
    pub(crate) fence_indices: Vec<usize>,
    /// Remove the fence's label: it goes with the last copy of the fence.
    pub(crate) remove_label: bool,
}

impl GuardedPatch {
    /// Nothing for a patch to write.
    pub(crate) fn is_empty(&self) -> bool {
        !self.lift_suspension && self.fence_indices.is_empty()
    }
}

/// After our apply gave up the fence and returned `written`: the copies of
/// the fence still listed are held by another manager (a backup restore, a
/// hand edit, a re-applied manifest), and `metadata.finalizers` is a set, so
/// giving up our claim cannot remove them. The fence is flux-plunger's
/// wherever it is: remove every copy by the guarded patch.
pub(crate) fn fence_left_after_give_up(written: &ReleaseView) -> GuardedPatch {
    let fence_indices = written.fence_indices();
    GuardedPatch {
        lift_suspension: false,
        remove_label: written.fence_labelled() && !fence_indices.is_empty(),
        fence_indices,
    }
}

/// Our apply giving up the suspension (and, unless `keep_fence`, the fence)
/// was refused by a field-manager conflict: the fence is listed twice and
/// another manager owns the duplicated entry, so every apply naming the fence
/// is refused. The guarded patch does the same without an apply: it
/// lifts the suspension where flux-plunger alone holds it (a co-owner's
/// suspension is never removed) and, unless the fence is kept, removes every
/// copy of it; when the fence is kept, every copy stays.
pub(crate) fn let_go_without_apply(release: &ReleaseView, keep_fence: bool) -> GuardedPatch {
    let fence_indices = if keep_fence {
        Vec::new()
    } else {
        release.fence_indices()
    };
    GuardedPatch {
        lift_suspension: release.suspend && release.suspend_owned_by_us_alone(),
        remove_label: release.fence_labelled() && !fence_indices.is_empty(),
        fence_indices,
    }
}
