#!/usr/bin/env bats
# `flux-plunger-sweep list`: what flux-plunger holds or probably left behind,
# in every namespace, as an operator sees it.

bats_require_minimum_version 1.5.0

setup() {
  load helpers
  new_namespace
}

teardown() {
  clear_namespace
}

# One release of each kind `list` tells apart, and two it does not show.
arrange() {
  release ours
  fence ours --suspend
  release shared
  fence shared --suspend
  apply_suspend_as shared migration
  release bare-fence
  fence bare-fence
  release doubled
  fence doubled
  add_finalizer doubled "$FENCE"
  release deleting
  add_finalizer deleting "$HC_FINALIZER"
  fence deleting
  delete_release deleting
  release uninstalled
  add_finalizer uninstalled "$HC_FINALIZER"
  fence uninstalled
  delete_release uninstalled
  helm_controller_handles_delete uninstalled
  # An older flux-plunger suspended through the shared client-side manager
  # and recorded the revision it reclaimed.
  release left-behind
  patch_suspend_as left-behind flux-client-side-apply
  k annotate helmrelease left-behind -n "$NS" --field-manager=flux-client-side-apply \
    flux-plunger.cozystack.io/last-processed-version=3 >/dev/null
  # Not shown: another manager's suspension, and a release with nothing.
  release foreign
  patch_suspend_as foreign kubectl-patch
  release plain
}

row() { printf '%-50s %6s %-20s %-12s %-11s %s\n' "$@"; }

@test "list shows fences, flux-plunger's suspensions and one an older flux-plunger probably left behind, as a table" {
  arrange

  run --separate-stderr sweep list

  expect_status 0
  expect_output <<EOF
$(row RELEASE FENCES SUSPENDED-BY TERMINATING UNINSTALLED FENCED-BY)
$(row "$NS/bare-fence" 1 - no - -)
$(row "$NS/deleting" 1 - yes no -)
$(row "$NS/doubled" 2 - no - -)
$(row "$NS/left-behind" 0 'left-behind?' no - -)
$(row "$NS/ours" 1 flux-plunger no - -)
$(row "$NS/shared" 1 flux-plunger+other no - -)
$(row "$NS/uninstalled" 1 - yes yes -)

left-behind?: suspended by another manager on a release flux-plunger recovered before, most likely by an older flux-plunger stopped mid-recovery. Confirm nothing else holds it, then \`flux resume helmrelease NAME -n NAMESPACE\`.
EOF
}

@test "list -o json gives the same rows as JSON" {
  arrange

  run --separate-stderr sweep list -o json

  expect_status 0
  entry() {
    printf '  {\n    "namespace": "%s",\n    "name": "%s",\n    "fences": %s,\n    "suspension": "%s",\n    "terminating": %s,\n    "uninstall_reached": %s,\n    "fenced_by": null\n  }' "$NS" "$@"
  }
  expect_output <<EOF
[
$(entry bare-fence 1 none false false),
$(entry deleting 1 none true false),
$(entry doubled 2 none false false),
$(entry left-behind 0 left-behind false false),
$(entry ours 1 ours false false),
$(entry shared 1 shared false false),
$(entry uninstalled 1 none true true)
]
EOF
}

@test "list with nothing of flux-plunger's left prints the header alone" {
  release plain
  release foreign
  patch_suspend_as foreign kubectl-patch

  run --separate-stderr sweep list

  expect_status 0
  expect_output <<EOF
$(row RELEASE FENCES SUSPENDED-BY TERMINATING UNINSTALLED FENCED-BY)
EOF
  run --separate-stderr sweep list -o json
  expect_status 0
  expect_output <<<"[]"
}

@test "list in the install's scope shows only the releases there (a scoped install's ServiceAccount may list nowhere else)" {
  release in-scope
  fence in-scope
  # The fence's label names the install that set it.
  k label helmrelease in-scope -n "$NS" team=a flux-plunger.cozystack.io/uninstall-fence=flux-system.flux-plunger >/dev/null
  release out-of-scope
  fence out-of-scope

  run --separate-stderr sweep list --watch-namespace "$NS" --watch-label-selector team=a

  expect_status 0
  expect_output <<EOF
$(row RELEASE FENCES SUSPENDED-BY TERMINATING UNINSTALLED FENCED-BY)
$(row "$NS/in-scope" 1 - no - flux-system.flux-plunger)
EOF
}
