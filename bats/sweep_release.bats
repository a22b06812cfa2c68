#!/usr/bin/env bats
# `flux-plunger-sweep release NAMESPACE/NAME`: an operator lets go of one
# release, and is refused what would orphan it. Exit codes: 0 released or
# nothing to do, 1 refused, not found or not released, 2 a usage error.

bats_require_minimum_version 1.5.0

setup() {
  load helpers
  new_namespace
}

teardown() {
  clear_namespace
}

@test "release lifts a suspension flux-plunger alone holds and removes its fence" {
  release web
  add_finalizer web "$HC_FINALIZER"
  fence web --suspend

  run --separate-stderr sweep release "$NS/web"

  expect_status 0
  expect_output <<<"released $NS/web"
  expect_eq "suspension" "$(suspended web)" ""
  expect_eq "finalizers" "$(finalizers web)" "[\"$HC_FINALIZER\"]"
}

@test "release never lifts a co-owned suspension, and removes the fence" {
  release web
  fence web --suspend
  apply_suspend_as web migration

  run --separate-stderr sweep release "$NS/web"

  expect_status 0
  expect_output <<EOF
$NS/web: its suspension is held by another manager (alone or with flux-plunger) and is left as it is
released $NS/web
EOF
  expect_eq "suspension" "$(suspended web)" "true"
  expect_eq "owners" "$(suspend_owners web)" "flux-plunger/Apply migration/Apply"
  expect_eq "finalizers" "$(finalizers web)" ""
}

@test "release lifts a suspension flux-plunger alone holds when its fence is already gone" {
  release web
  fence web --suspend
  k patch helmrelease web -n "$NS" --type=merge -p '{"metadata":{"finalizers":null}}' >/dev/null

  run --separate-stderr sweep release "$NS/web"

  expect_status 0
  expect_output <<<"released $NS/web"
  expect_eq "suspension" "$(suspended web)" ""
}

@test "release refuses a deleted release helm-controller has not uninstalled, unless --without-uninstall" {
  release web
  add_finalizer web "$HC_FINALIZER"
  fence web --suspend
  delete_release web
  before=$(rv web)

  run --separate-stderr sweep release "$NS/web"

  expect_status 1
  expect_output <<<""
  expect_eq "stderr" "$stderr" "refusing: $NS/web is being deleted and helm-controller has not uninstalled it; releasing the fence now lets it go without the Helm uninstall. Wait for helm-controller, or pass --without-uninstall once you have confirmed the uninstall has run or is not wanted."
  expect_eq "nothing written" "$(rv web)" "$before"

  run --separate-stderr sweep release "$NS/web" --without-uninstall

  expect_status 0
  expect_output <<<"released $NS/web WITHOUT an uninstall, as asked"
  expect_eq "finalizers" "$(finalizers web)" "[\"$HC_FINALIZER\"]"
  expect_eq "suspension" "$(suspended web)" ""
}

@test "release lets a deleted release go once helm-controller has uninstalled it" {
  release web
  add_finalizer web "$HC_FINALIZER"
  fence web
  delete_release web
  helm_controller_handles_delete web

  run --separate-stderr sweep release "$NS/web"

  expect_status 0
  expect_output <<<"released $NS/web"
  release_gone web
}

@test "release of a release holding nothing of flux-plunger's writes nothing" {
  release web
  patch_suspend_as web kubectl-patch
  before=$(rv web)

  run --separate-stderr sweep release "$NS/web"

  expect_status 0
  expect_output <<<"$NS/web carries no flux-plunger fence and no suspension flux-plunger alone holds: nothing to do"
  expect_eq "nothing written" "$(rv web)" "$before"
}

@test "release of a release that does not exist exits 1" {
  run --separate-stderr sweep release "$NS/ghost"

  expect_status 1
  expect_output <<<""
  expect_eq "stderr" "$stderr" "HelmRelease $NS/ghost not found"
}

@test "release of something that is not NAMESPACE/NAME is a usage error" {
  run --separate-stderr sweep release web

  expect_status 2
  [[ "$stderr" == *'"web" is not NAMESPACE/NAME'* ]]
}

@test "release refused for good (403) ends at once with a one-line message, nothing written" {
  release web
  fence web --suspend
  before=$(rv web)
  hook_identity
  deny clusterrole helmreleases patch
  started=$SECONDS

  KUBECONFIG=$HOOK_KUBECONFIG run --separate-stderr sweep release "$NS/web"

  expect_status 1
  expect_output <<<""
  expect_eq "stderr" "$stderr" "NOT released $NS/web: helmreleases.helm.toolkit.fluxcd.io \"web\" is forbidden: User \"system:serviceaccount:$NS:$HOOK\" cannot patch resource \"helmreleases\" in API group \"helm.toolkit.fluxcd.io\" in the namespace \"$NS\" (403 Forbidden)"
  # Not retried for the 30 s window: no retry cures a refusal.
  (( SECONDS - started < 10 ))
  expect_eq "nothing written" "$(rv web)" "$before"
}

@test "release and list that cannot read say why in one line" {
  release web
  fence web --suspend
  hook_identity
  deny clusterrole helmreleases list
  deny clusterrole helmreleases get

  KUBECONFIG=$HOOK_KUBECONFIG run --separate-stderr sweep list

  expect_status 1
  expect_output <<<""
  expect_eq "list: stderr" "$stderr" "could not list HelmReleases: helmreleases.helm.toolkit.fluxcd.io is forbidden: User \"system:serviceaccount:$NS:$HOOK\" cannot list resource \"helmreleases\" in API group \"helm.toolkit.fluxcd.io\" at the cluster scope (403 Forbidden)"

  KUBECONFIG=$HOOK_KUBECONFIG run --separate-stderr sweep release "$NS/web"

  expect_status 1
  expect_output <<<""
  expect_eq "release: stderr" "$stderr" "could not read $NS/web: helmreleases.helm.toolkit.fluxcd.io \"web\" is forbidden: User \"system:serviceaccount:$NS:$HOOK\" cannot get resource \"helmreleases\" in API group \"helm.toolkit.fluxcd.io\" in the namespace \"$NS\" (403 Forbidden)"
}
