//! The fixed names of SPEC §1. They are kept identical to the original Go
//! flux-plunger so that this one is a drop-in replacement: an older install's
//! fences, annotations and managedFields entries are read the same way.

/// API group of Flux's HelmRelease.
pub const HELMRELEASE_GROUP: &str = "helm.toolkit.fluxcd.io";
/// API version of the HelmRelease we act on.
pub(crate) const HELMRELEASE_VERSION: &str = "v2";
/// `apiVersion` as written in a request body.
pub const HELMRELEASE_API_VERSION: &str = "helm.toolkit.fluxcd.io/v2";
/// Kind of the object we act on.
pub const HELMRELEASE_KIND: &str = "HelmRelease";
/// Resource (plural) name of the HelmRelease.
pub const HELMRELEASE_PLURAL: &str = "helmreleases";

/// Our finalizer: it keeps a deleted HelmRelease until helm-controller has
/// handled the unsuspended generation, so its uninstall cannot be skipped.
pub const FENCE_FINALIZER: &str = "flux-plunger.cozystack.io/uninstall-fence";
/// A label that goes with the fence: written in the same apply as the fence
/// and given up with it, so that the drain and the pre-delete hook find the
/// fenced releases by a label selector instead of reading every HelmRelease
/// (finalizers cannot be selected server-side). Its value names the install
/// that set the fence (`crate::install::Install`).
pub const FENCE_LABEL: &str = "flux-plunger.cozystack.io/uninstall-fence";
/// The value of [`FENCE_LABEL`] every install wrote before the value named
/// one (and the original never wrote a label): such a fence is settled by
/// whichever install's scope holds the release.
pub const LEGACY_FENCE_LABEL_VALUE: &str = "held";
/// helm-controller's own finalizer; its removal means helm-controller has
/// finished handling the delete.
pub const HELM_CONTROLLER_FINALIZER: &str = "finalizers.fluxcd.io";
/// The newest storage revision we reclaimed, as a decimal string.
pub const PROCESSED_VERSION_ANNOTATION: &str = "flux-plunger.cozystack.io/last-processed-version";

/// The uid of the revision just below the one we reclaimed, as it was then
/// (empty when there was none). It tells that revision from one Helm created
/// later under the same number; older flux-plungers did not write it.
pub(crate) const PROCESSED_BELOW_UID_ANNOTATION: &str =
    "flux-plunger.cozystack.io/last-processed-below-uid";

/// Asks helm-controller to reconcile a release now: Flux controllers
/// reconcile again whenever this annotation's value changes (`flux reconcile`
/// writes it); helm-controller copies the value it handled to
/// `status.lastHandledReconcileAt`.
pub const RECONCILE_REQUESTED_AT_ANNOTATION: &str = "reconcile.fluxcd.io/requestedAt";
/// How a request of flux-plunger's value begins (the time follows), so that
/// flux-plunger knows its own request once helm-controller has handled it.
pub const RECONCILE_REQUEST_PREFIX: &str = "flux-plunger-uninstall-";

/// Every annotation flux-plunger may write on a HelmRelease. The chart's
/// admission guard lets flux-plunger's ServiceAccounts change these and no
/// other annotation (`chart/templates/_helpers.tpl`; the contract tests
/// compare the two lists).
pub const OWN_ANNOTATIONS: &[&str] = &[
    PROCESSED_VERSION_ANNOTATION,
    PROCESSED_BELOW_UID_ANNOTATION,
    RECONCILE_REQUESTED_AT_ANNOTATION,
];

/// Every label flux-plunger may write on a HelmRelease: the admission guard
/// lets it change no label but these, as for [`OWN_ANNOTATIONS`].
pub const OWN_LABELS: &[&str] = &[FENCE_LABEL];

/// Per-release opt-out: `disabled` keeps flux-plunger from starting a
/// recovery of this release (it still releases its own fence and suspension).
pub(crate) const RECOVER_ANNOTATION: &str = "flux-plunger.cozystack.io/recover";
/// The value of [`RECOVER_ANNOTATION`] that opts a release out.
pub(crate) const RECOVER_DISABLED: &str = "disabled";

/// The server-side-apply field manager whose `Apply` ownership of
/// `spec.suspend` is, by definition, our suspension.
pub const FIELD_MANAGER: &str = "flux-plunger";
/// A manager shared by several writers (migrations, operators' `kubectl
/// apply`): a suspension under it is never ours. We write the annotation under
/// it so that the annotation never makes a suspension look like ours.
pub const SHARED_FIELD_MANAGER: &str = "flux-client-side-apply";

/// The manager of the guarded JSON patches the controller and the drain fall
/// back on when an apply cannot give something up: a copy of the fence
/// another manager also lists, a suspension an apply conflicts on. A patch is
/// an `Update`, never an `Apply` of `flux-plunger`, so it can never make a
/// suspension look like ours.
pub const PATCH_FIELD_MANAGER: &str = "flux-plunger-patch";

/// The manager of the pre-delete sweep's guarded patches and its scale-down.
/// Never `flux-plunger`, whose `Apply` entries mean "our suspension".
pub const SWEEP_FIELD_MANAGER: &str = "flux-plunger-sweep";

/// Type of Helm's release storage Secrets.
pub const HELM_STORAGE_SECRET_TYPE: &str = "helm.sh/release.v1";
/// Label every Helm storage Secret carries with value `helm`.
pub const HELM_STORAGE_OWNER_LABEL: &str = "owner";
/// Label that names the release a storage Secret belongs to.
pub const HELM_STORAGE_NAME_LABEL: &str = "name";
/// Label with the revision number of a storage Secret.
pub const HELM_STORAGE_VERSION_LABEL: &str = "version";
/// Label with the release status of a storage revision.
pub const HELM_STORAGE_STATUS_LABEL: &str = "status";

/// The condition whose `False` status, with one of [`STUCK_MESSAGES`],
/// marks a release Helm storage may have left stuck.
pub const READY_CONDITION: &str = "Ready";
/// What helm-controller's `Ready` message says (in some words of it) when
/// Helm's storage stops it, in every spelling helm-controller v1.4–v1.6 and
/// Helm 3 and 4 write (SPEC §4.6): the message only selects the candidates;
/// the newest storage revision decides whether anything is reclaimed.
pub const STUCK_MESSAGES: &[&str] = &[
    // Its upgrade over a newest `uninstalling`, `uninstalled` or `unknown`
    // revision (the first pass after the history was cleared).
    "has no deployed releases",
    // Its install over a newest `uninstalled` revision, the following passes:
    // Helm 3 (helm-controller up to v1.4) and Helm 4 (from v1.5).
    "cannot re-use a name that is still in use",
    "cannot reuse a name that is still in use",
    // Its state machine over a revision its own history names, left
    // `uninstalling` or `unknown` by an uninstall that failed partway.
    "unable to determine state for release with status 'uninstalling'",
    "unable to determine state for release with status 'unknown'",
];

/// helm-controller's condition that says how its last Helm action ended,
/// and the reason it gives a Helm uninstall that ran.
pub const RELEASED_CONDITION: &str = "Released";
pub const UNINSTALL_SUCCEEDED_REASON: &str = "UninstallSucceeded";

/// The name Helm gives the storage Secret of `release` at `revision`.
pub fn storage_secret_name(release: &str, revision: u64) -> String {
    format!("sh.helm.release.v1.{release}.v{revision}")
}
